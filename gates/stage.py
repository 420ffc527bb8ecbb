"""`quantgate gate`: one candidate against its baseline, from results directories, for CI
systems that run the stages themselves. The same gates as `quantgate run`: metrics with
intervals, size (when the checkpoint is at hand), integrity (smoke check and evaluation
finite, calibration overlap when the calibration set is at hand)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from quantgate import calibration, evalsets
from quantgate.calibration import CalibrationSet
from quantgate.core.artifacts import MANIFEST, read_json, sha256_file, sibling_lock
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.formats import PRECISION_CLASSES
from quantgate.core.ids import SetRef
from quantgate.core.metrics import GATEABLE
from quantgate.core.models import checkpoint_files, weight_file_hashes
from quantgate.evalsets import EvaluationResults, GoldenSet, SetResults
from quantgate.evalsets.evaluate import refuse_other_numerics
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.evalsets.served import ServeCheckConfig, load_record
from quantgate.evalsets.sets import all_names, scored_metrics
from quantgate.gates import keys, signing
from quantgate.gates import ledger as ledger_module
from quantgate.gates.ledger_record import LedgerRecord
from quantgate.gates.policy import LoadedPolicy, load_policy
from quantgate.gates.verdict import Records, ServingEvidence, Verdict, judge, tails
from quantgate.gates.verdict_record import (
    BaselineRef,
    CheckpointRef,
    EvalSetRef,
    MetricSummary,
    OverlapSummary,
    PolicyIdentity,
    VerdictRecord,
)
from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.presets import get_preset


def valid_metrics(set_specs: list[str]) -> dict[str, list[str]]:
    """Golden set name -> the metrics a policy may gate on it (those with a gate rule)."""
    metrics = {}
    for spec in set_specs:
        golden = evalsets.load(spec)
        metrics[golden.name] = [name for name in scored_metrics(golden.kind) if name in GATEABLE]
    return metrics


def _narrow_options(sets: list[str]) -> str:
    return " ".join(f"--narrow-policy {name}" for name in sets)


def load_gate_policy(spec: str | Path, set_specs: list[str], narrow_to: list[str] | None = None,
                     narrow_hint: Callable[[list[str]], str] = _narrow_options) -> LoadedPolicy:
    """The policy, validated against every known golden set's metrics, narrowed to `narrow_to`
    when given, and then checked against the sets that will be evaluated: it may gate only
    those. A gate is never skipped silently: the refusal names both ways out (`narrow_hint`
    says how the caller narrows a policy to the sets it keeps)."""
    known = list(dict.fromkeys([*all_names(), *set_specs]))
    policy = load_policy(spec, valid_metrics(known))
    if narrow_to is not None:
        policy = policy.narrowed(narrow_to)
    names = {SetRef.parse(spec).name for spec in set_specs} | set(set_specs)
    missing = [name for name in policy.policy.metrics if name not in names]
    if missing:
        kept = [key for key in policy.policy.metrics if key not in missing]
        narrow = narrow_hint(kept) if kept else "nothing would be left to gate"
        raise InputError(f"policy {policy.label} gates {', '.join(missing)}, which is not evaluated here (sets: "
                         f"{', '.join(set_specs)}): evaluate {'it' if len(missing) == 1 else 'them'} too, or narrow the policy "
                         f"to the sets evaluated ({narrow}; every verdict and the ledger record it as narrowed)")
    return policy


def item_records(results: EvaluationResults) -> dict[str, Records]:
    """Set spec -> per-item records of one results directory. A text set's records evaluated
    against a baseline also carry, in memory only, their per-token values
    (`record["token_values"]`: {"kl": array, "top_prob_change": array}) for the tail gates."""
    records = {}
    for spec in results.manifest.sets:
        items = results.items(spec)["items"]
        values = results.token_values(spec)
        if values:
            start = 0
            for item in items:
                stop = start + int(item["tokens"])
                item["token_values"] = {name: array[start:stop] for name, array in values.items()}
                start = stop
        records[spec] = cast(Records, items)  # evalsets.ItemRecord: per-item records, as Records holds them
    return records


def golden_texts(goldens: list[GoldenSet]) -> list[str]:
    """Every string an item of these golden sets holds (query, choices, text, context, ...): what
    a calibration set must not leak. The whole sets, not only the items a limit evaluates."""
    texts: list[str] = []
    for golden in goldens:
        for item in golden.items():
            for key, value in item.items():
                if key in ("id", "meta"):
                    continue
                if isinstance(value, str):
                    texts.append(value)
                elif isinstance(value, list):
                    texts.extend(text for text in value if isinstance(text, str))
    return texts


def overlap_summary(calibration_set: CalibrationSet, goldens: list[GoldenSet]) -> OverlapSummary:
    result = calibration.ngram_overlap(calibration_set.texts(), golden_texts(goldens))
    return OverlapSummary(n=result.n, candidate_ngrams=result.candidate_ngrams, shared_ngrams=result.shared_ngrams,
                          share=result.share, against=[golden.spec for golden in goldens])


def verdict_record(fmt: str, verdict: Verdict, *, precision: str, policy: LoadedPolicy, checkpoint: Path | None,
                   baseline_results: EvaluationResults, candidate_results: EvaluationResults | None,
                   weights: dict[str, str] | None = None) -> VerdictRecord:
    """A verdict as written to verdicts/<format>.json and (with every file of the checkpoint) the
    ledger. `weights`: the weight files' sha256s where the caller holds them verified (the
    checkpoint's manifest): the files hashed now must hold them, else the checkpoint changed while
    it was gated."""
    sets = baseline_results.manifest.sets
    return VerdictRecord(
        kind="verdict",
        format=fmt,
        precision=precision,
        checkpoint=None if checkpoint is None else checkpoint_ref(Path(checkpoint), fmt, weights),
        baseline=BaselineRef(model=baseline_results.manifest.model.path, weights_sha256=baseline_results.manifest.model.weights_sha256),
        policy=PolicyIdentity(**policy.identity),
        evalsets=[_evalset(spec, entry) for spec, entry in sorted(sets.items())],
        metrics={gate.gate: MetricSummary(outcome=gate.outcome, estimate=gate.estimate, low=gate.low, high=gate.high, limit=gate.limit,
                                          unit=gate.unit) for gate in verdict.gates},
        gates=[gate.record() for gate in verdict.gates],
        # approved, pending (quality passed, serving evidence that approves it missing) or blocked
        verdict=verdict.status,
        quality="passed" if verdict.quality_passed else "blocked",
        reasons=verdict.reasons,
        results=None if candidate_results is None else str(Path(candidate_results.path).resolve()),
    )


def checkpoint_ref(checkpoint: Path, fmt: str, weights: dict[str, str] | None = None) -> CheckpointRef:
    """The checkpoint as a verdict names it: every file by sha256 (what verify matches and the
    signature covers) and the weight files among them (what the report and the search read)."""
    files = checkpoint_files(checkpoint)
    hashed = weight_file_hashes(files)
    if weights is not None and weights != hashed:
        raise IntegrityError(f"checkpoint {checkpoint}: its weight files are not those its manifest holds "
                             f"({signing.describe_changes(weights, hashed)}): it changed while it was gated; quantize it again")
    return CheckpointRef(path=str(Path(checkpoint).resolve()), format=fmt, weights=hashed, files=files)


def _evalset(spec: str, entry: SetResults) -> EvalSetRef:
    """A verdict's record of one golden set the candidate was evaluated on."""
    ref = SetRef.parse(spec)
    return EvalSetRef(name=ref.name, version=ref.tag, sha256=entry.sha256, limit=entry.limit, items=entry.items)


def ledger_entry(record: VerdictRecord) -> LedgerRecord:
    """The ledger's copy of a verdict, with the verdict's own hash: a rerun that reaches the
    same verdict on the same bytes finds it there and appends nothing."""
    return LedgerRecord.of_verdict(record)


def record_verdict(ledger: Path, record: VerdictRecord, signing_key: Path | None = None,
                   serving: ServeCheckConfig | None = None, baseline_results: Path | None = None) -> bool:
    """Append the verdict to the ledger, signed, unless the ledger holds it already signed by this
    key; True if appended.

    Every record is signed (gates/signing.py): with `signing_key` (a PEM private key, checked
    first: a bad one is an InputError), else with the user's own key, made on first use
    (gates/keys.py). An approval also writes `<checkpoint>/model.sig`; any other verdict takes
    away a model.sig quantgate wrote into that checkpoint before (so model-signing alone no longer
    accepts what the ledger does not approve). `serving`: the serve check's settings the run gated
    with, and `baseline_results`: the run's baseline results directory, carried in the record (the
    settings, and the sha256 of the candidate's and the baseline's results manifests) so that its
    signature covers them: gates/attest.py reads them there. A verdict the ledger holds only
    unsigned, or signed by another key, is appended again, signed; one it holds signed by this key
    has its model.sig put back if the checkpoint lost it. A verdict a later record on the same
    files superseded stays as it is (the newest decides).
    The public key that signed is added to the trust file beside the ledger (keys.beside), the
    file the deploy side's `quantgate verify --trust` reads."""
    key = keys.signing_key(signing_key)
    with sibling_lock(ledger):  # runs and `quantgate gate` may share a ledger: one read-and-append at a time
        appended = _record_verdict(ledger, record, key, serving, _results_sha256(record, baseline_results))
    keys.trust(keys.beside(ledger), key)
    return appended


def _results_sha256(record: VerdictRecord, baseline_results: Path | None) -> dict[str, str]:
    """The sha256 of the results manifests a verdict was reached on (each manifest hashes its files)."""
    found = {}
    for role, folder in (("candidate", Path(record.results) if record.results else None), ("baseline", baseline_results)):
        if folder is not None and (folder / MANIFEST).is_file():
            found[role] = sha256_file(folder / MANIFEST)
    return found


def _record_verdict(ledger: Path, record: VerdictRecord, key: signing.Key, serving: ServeCheckConfig | None,
                    results: dict[str, str]) -> bool:
    entry = ledger_entry(record)
    if serving is not None:
        entry = entry.with_fields(serving_settings=serving.model_dump(mode="json"))
    if results:
        entry = entry.with_fields(results_sha256=results)
    try:
        existing = ledger_module.read(ledger)
    except ledger_module.LedgerTampered as error:
        raise ledger_module.LedgerTampered(f"{error}; refusing to append to it (restore it, or name another ledger)") from error
    same = [old for old in existing if old.verdict_sha256 == entry.verdict_sha256]
    checkpoint = Path(record.checkpoint.path) if record.checkpoint is not None else None
    # a search trial's approval (on the search split) deploys nothing: signed in the ledger, no model.sig
    approval = record.verdict == "approved" and record.split != "search" and checkpoint is not None
    if same and _superseded(existing, same[-1]):
        return False  # the ledger holds this verdict, and a later one on these weights decides
    if approval and checkpoint is not None:
        if any(signing.restore(checkpoint, old, key) for old in reversed(same)):
            return False
    elif any(signing.check(old, {key.fingerprint: key}).problem is None for old in same):
        return False
    if not approval and checkpoint is not None:
        signing.withdraw(checkpoint)  # its newest verdict approves nothing
    ledger_module.append(ledger, entry, key, model_sig=checkpoint if approval else None, records=existing)
    return True


def _superseded(existing: list[LedgerRecord], old: LedgerRecord) -> bool:
    """Whether a record after `old` judges the same files (the newest record decides)."""
    later = existing[next(index for index, record in enumerate(existing) if record is old) + 1:]
    if old.files is not None:
        return any(ledger_module.matches(record, old.files) for record in later)
    return any(record.weights == old.weights for record in later)


def _checkpoint_manifest(checkpoint: Path | None) -> dict[str, Any] | None:
    if checkpoint is None or not (checkpoint / MANIFEST).is_file():
        return None
    manifest = read_json(checkpoint / MANIFEST)
    return manifest if manifest.get("kind") == "quantized-checkpoint" else None


def _check_serve_records(served: ServeRecord | None, reference: ServeRecord | None, candidate: EvaluationResults,
                         baseline: EvaluationResults) -> None:
    """`--served` must be the serve record of these candidate results (compared on them), and
    `--served-baseline` one of the baseline model these baseline results were computed on."""
    if served is not None and served.gated is not None and served.gated.results_sha256 != sha256_file(candidate.path / MANIFEST):
        raise InputError(f"--served: that serve record compared other results ({served.gated.results}), not {candidate.path}")
    if reference is not None and reference.gated is not None and \
            reference.gated.weights_sha256 != baseline.manifest.model.weights_sha256:
        raise InputError("--served-baseline: that serve record is of another model than the baseline these results were computed on")


def gate_results(baseline: Path, candidate: Path, policy_spec: str | Path, *, checkpoint: Path | None = None,
                 calibration_dir: Path | None = None, precision: str | None = None, ledger: Path | None = None,
                 narrow_to: list[str] | None = None, served: Path | None = None, served_baseline: Path | None = None,
                 signing_key: Path | None = None) -> VerdictRecord:
    """The verdict record (as the pipeline writes it); appended to `ledger` when given, signed
    with `signing_key`, else the user's own key (record_verdict). The
    results are judged as they are (one look at the items they hold: a fixed-size test). A
    policy that gates serving judges the serve records `served` (the candidate's) and
    `served_baseline` (the baseline's: the bound's base); without them its serving gate blocks."""
    if signing_key is not None and ledger is None:
        raise InputError("--signing-key signs the ledger's record of a verdict: give --ledger too")
    if ledger is not None:
        keys.signing_key(signing_key)  # a bad key is refused before any work (the user's own is made now)
    baseline_results = evalsets.load_results(baseline)
    candidate_results = evalsets.load_results(candidate)
    specs = list(baseline_results.manifest.sets)
    missing = [spec for spec in specs if spec not in candidate_results.manifest.sets]
    if missing:
        raise InputError(f"the candidate's results hold no {', '.join(missing)}; evaluate it on the baseline's sets")
    for spec in specs:
        refuse_other_numerics(baseline_results.record(spec)["settings"], candidate_results.record(spec)["settings"], spec)
    policy = load_gate_policy(policy_spec, specs, narrow_to)

    if checkpoint is None:
        named = Path(candidate_results.manifest.model.path)
        checkpoint = named if named.is_dir() else None
    elif not checkpoint.is_dir():
        raise InputError(f"checkpoint {checkpoint} is not a directory")
    manifest = _checkpoint_manifest(checkpoint)
    fmt = manifest["format"] if manifest else (checkpoint.name if checkpoint else Path(candidate).name)
    if precision is None:
        if manifest is None:
            raise InputError(f"cannot tell the candidate's format: give --precision {' or '.join(PRECISION_CLASSES)} "
                             "(or --checkpoint of a quantgate checkpoint)")
        precision = get_preset(manifest["format"]).precision
    elif precision not in PRECISION_CLASSES:
        raise InputError(f"--precision must be one of {', '.join(PRECISION_CLASSES)}, got {precision!r}")

    measurement = None
    if checkpoint is not None:
        baseline_dir = Path(baseline_results.manifest.model.path)
        measurement = measure(checkpoint, baseline_dir if baseline_dir.is_dir() else None).record()
    if calibration_dir is None and manifest is not None and Path(manifest["calibration"]["path"]).is_dir():
        calibration_dir = Path(manifest["calibration"]["path"])
    overlap = overlap_summary(calibration.load(calibration_dir), [evalsets.load(spec) for spec in specs]) if calibration_dir is not None else None

    candidate_items = item_records(candidate_results)
    served_record, reference_record = (None if path is None else load_record(path) for path in (served, served_baseline))
    _check_serve_records(served_record, reference_record, candidate_results, baseline_results)
    serving = ServingEvidence(served_record, reference_record) if policy.policy.serving is not None else None
    verdict = judge(item_records(baseline_results), candidate_items, policy, precision,
                    measurement=measurement, smoke=(manifest or {}).get("smoke"), overlap=overlap, serving=serving)
    record = verdict_record(fmt, verdict, precision=precision, policy=policy, checkpoint=checkpoint,
                            baseline_results=baseline_results, candidate_results=candidate_results)
    record = record.with_fields(tails=tails(candidate_items, policy.policy.statistics))
    if ledger is not None:
        if checkpoint is None:
            raise InputError("--ledger needs the checkpoint (--checkpoint): a ledger record names the weights it approves")
        record_verdict(ledger, record, signing_key)
    return record
