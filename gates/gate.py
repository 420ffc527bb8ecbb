"""`quantgate gate`: one candidate against its baseline, from results directories, for CI
systems that run the stages themselves. The same gates as `quantgate run`: metrics with
intervals, size (when the checkpoint is at hand), integrity (smoke check and evaluation
finite, calibration overlap when the calibration set is at hand)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gates.artifacts import MANIFEST, read_json
from gates.errors import InputError
from gates.policy import PRECISION_CLASSES, precision_class
from gates.verdict import judge


def _checkpoint_manifest(checkpoint: Path | None) -> dict[str, Any] | None:
    if checkpoint is None or not (checkpoint / MANIFEST).is_file():
        return None
    manifest = read_json(checkpoint / MANIFEST)
    return manifest if manifest.get("kind") == "quantized-checkpoint" else None


def gate_results(baseline: Path, candidate: Path, policy_spec: str | Path, *, checkpoint: Path | None = None,
                 calibration_dir: Path | None = None, precision: str | None = None, ledger: Path | None = None) -> dict[str, Any]:
    """The verdict record (as the pipeline writes it); appended to `ledger` when given."""
    import calibration
    import evalsets
    from gates.pipeline import item_records, load_gate_policy, overlap_summary, record_verdict, verdict_record
    from quantize.accounting import measure
    from quantize.presets import get_preset

    baseline_results = evalsets.load_results(baseline)
    candidate_results = evalsets.load_results(candidate)
    specs = list(baseline_results.manifest["sets"])
    missing = [spec for spec in specs if spec not in candidate_results.manifest["sets"]]
    if missing:
        raise InputError(f"the candidate's results hold no {', '.join(missing)}; evaluate it on the baseline's sets")
    policy = load_gate_policy(policy_spec, specs)

    if checkpoint is None:
        named = Path(candidate_results.manifest["model"]["path"])
        checkpoint = named if named.is_dir() else None
    elif not checkpoint.is_dir():
        raise InputError(f"checkpoint {checkpoint} is not a directory")
    manifest = _checkpoint_manifest(checkpoint)
    fmt = manifest["format"] if manifest else (checkpoint.name if checkpoint else Path(candidate).name)
    if precision is None:
        if manifest is None:
            raise InputError("cannot tell the candidate's format: give --precision 8bit or 4bit (or --checkpoint of a quantgate checkpoint)")
        precision = precision_class(get_preset(manifest["format"]))
    elif precision not in PRECISION_CLASSES:
        raise InputError(f"--precision must be one of {', '.join(PRECISION_CLASSES)}, got {precision!r}")

    measurement = None
    if checkpoint is not None:
        baseline_dir = Path(baseline_results.manifest["model"]["path"])
        measurement = measure(checkpoint, baseline_dir if baseline_dir.is_dir() else None).to_json()
    if calibration_dir is None and manifest is not None and Path(manifest["calibration"]["path"]).is_dir():
        calibration_dir = Path(manifest["calibration"]["path"])
    overlap = overlap_summary(calibration.load(calibration_dir), specs) if calibration_dir is not None else None

    candidate_items = item_records(candidate_results)
    verdict = judge(item_records(baseline_results), candidate_items, policy, precision,
                    measurement=measurement, smoke=(manifest or {}).get("smoke"), overlap=overlap)
    record = verdict_record(fmt, verdict, precision=precision, policy=policy, checkpoint=checkpoint,
                            baseline_results=baseline_results, candidate_results=candidate_results)
    if ledger is not None:
        if checkpoint is None:
            raise InputError("--ledger needs the checkpoint (--checkpoint): a ledger record names the weights it approves")
        record_verdict(ledger, record)
    return record
