"""What the report reads of a run directory (run.json, measure/, results/, verdicts/, sequential/,
serve/, search.json, sensitivity/), as `RunRecords`: one row per format (and the baseline, and a
search's trials and held-out gate) with its measurements, metric values, verdict, gates, looks,
tails and serve check. gates.report makes the report of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantgate import evalsets
from quantgate.calibration.manifest import CalibrationManifest
from quantgate.core.artifacts import MANIFEST, read_json
from quantgate.core.errors import InputError
from quantgate.core.ids import GateId
from quantgate.core.metrics import METRICS
from quantgate.core.rundir import BASELINE, RUN_KIND, RunDir
from quantgate.core.stagecache import stored_value
from quantgate.evalsets.results import ResultsManifest
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.gates.report_model import HELD_OUT, TRIAL, RunRecords
from quantgate.gates.verdict_record import read_gates
from quantgate.quantize.measure.record import MeasurementRecord
from quantgate.quantize.measure.stage import stage_measurement


def column_higher_is_better(column: str) -> bool:
    """Which way a metric column ('SET METRIC') is better, from the metrics table (a metric this
    version does not know: lower, like a divergence)."""
    known = METRICS.get(GateId.parse(column).check)
    return known.higher_is_better if known is not None else False


def records(run_dir: Path) -> RunRecords:
    """The report's input from a run directory's artifacts."""
    layout = RunDir(Path(run_dir))
    run = _run_record(layout)
    search = _search_record(layout, run)
    names = list(run["formats"]) + _search_names(search)  # the formats, then the search's trials and its held-out gate
    verdicts = _verdicts(layout, names)
    columns: list[str] = []  # every metric gate, in policy order (a format that failed to quantize has none)
    for verdict in verdicts.values():
        columns += [gate for gate in verdict["metrics"] if GateId.parse(gate).on_golden_set and gate not in columns]
    baseline_results = _results(layout.results(BASELINE))
    baseline_measured = stored_value(layout.measure(BASELINE)) or {}
    baseline = _row("baseline", _measurement(layout.measure(BASELINE), baseline_measured or None), baseline_measured,
                    baseline_results, verdict=None, columns=columns)
    baseline_served = stored_value(layout.serve(BASELINE))
    baseline["serving"] = None if baseline_served is None else \
        ServeRecord.from_json(baseline_served, f"{layout.serve(BASELINE)}: value").summary().to_json()
    sequential = {name: _sequential(verdicts[name], stored_value(layout.sequential(name))) for name in names}
    rows = [baseline]
    for name in names:
        # a held-out gate judged its trial's checkpoint: measured once, under the trial's name
        checkpoint = name if name in run["formats"] else str(verdicts[name].get("checkpoint_name") or name.split("@")[0])
        measured = stored_value(layout.measure(checkpoint))
        row = _row(name, _measurement(layout.measure(checkpoint), measured), measured, _results(layout.results(name)),
                   verdict=verdicts[name], columns=columns, sequential=sequential[name])
        if search is not None and name not in run["formats"]:
            row["search"] = _search_info(search, checkpoint, verdicts[name])
        rows.append(row)
    plot = dict(run["plot"])
    if plot.get("y") not in columns and columns:
        plot.update(y=columns[0], higher_is_better=column_higher_is_better(columns[0]))
    bounds = baseline_measured.get("bounds")  # the measure stage's value as stored (stagecache.stored_value)
    any_bounds = next(iter(bounds.values()), None) if isinstance(bounds, dict) else None
    calibration_file = layout.calibration / MANIFEST
    calibration = CalibrationManifest.read(calibration_file) if calibration_file.is_file() else None
    return RunRecords.from_records({
        "model": run["plan"]["model"],
        "model_path": run["model"],
        "policy": _policy(run, verdicts),
        "hardware": [{"name": name} for name in run["hardware"]],
        "metric_columns": columns,
        "plot": plot,
        "rows": rows,
        "evalsets": _evalsets(baseline_results, _looks(run, sequential)),
        "calibration": None if calibration is None else {
            "samples": calibration.samples, "seq_len": calibration.seq_len, "fingerprint": calibration.fingerprint,
            "source": calibration.config.source},
        "bounds_inputs": any_bounds,
        "confidence": run.get("confidence", 0.95),
        "ledger": run.get("ledger"),
        # the search's record (search.json) and its layer groups' sensitivity; None without a search
        "search": search,
        "sensitivity": None if search is None else _sensitivity(layout),
    })


def _run_record(layout: RunDir) -> dict[str, Any]:
    if not layout.run_file.is_file():
        raise InputError(f"{layout.root} is not a quantgate run directory (no run.json)")
    run: dict[str, Any] = read_json(layout.run_file)
    if run.get("kind") != RUN_KIND:
        raise InputError(f"{layout.run_file} is not the record of a quantgate run")
    return run


def _results(directory: Path) -> ResultsManifest | None:
    """The results manifest of `directory`, or None where it holds none (not evaluated)."""
    path = directory / MANIFEST
    return ResultsManifest.read(path) if path.is_file() else None


def _measurement(path: Path, measured: dict[str, Any] | None) -> MeasurementRecord | None:
    """The measurement in the measure stage's value stored at `path` (None: not measured)."""
    return None if measured is None else stage_measurement(measured, str(path))


def _verdicts(layout: RunDir, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each verdict, its gates read through their record (GateRecord): a damaged one is refused."""
    stored = {name: stored_value(layout.verdict(name)) for name in names}
    missing = [name for name, verdict in stored.items() if verdict is None]
    if missing:
        raise InputError(f"the run in {layout.root} has no verdict yet for {', '.join(missing)}: run it to the end first")
    return {name: {**verdict, "gates": [gate.to_json() for gate in read_gates(verdict.get("gates") or [], f"{layout.verdict(name)}: value")]}
            for name, verdict in stored.items() if verdict is not None}


def _looks(run: dict[str, Any], sequential: dict[str, dict[str, Any] | None]) -> dict[str, list[int]]:
    """Each set's looks (item counts, the last its ceiling): the run's record, else any format's."""
    looks: dict[str, list[int]] = dict(run.get("looks") or {})
    for entry in sequential.values():
        for spec, counts in ((entry or {}).get("looks") or {}).items():
            looks.setdefault(spec, list(counts))
    return looks


def _evalsets(baseline_results: ResultsManifest | None, looks: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The baseline's results: each set at its first look (`items`); `looks` as the run planned them."""
    return [{"spec": spec, "items": entry.items, "limit": entry.limit, "sha256": entry.sha256,
             "size": _set_size(spec), "looks": list(looks.get(spec) or [])}
            for spec, entry in (baseline_results.sets.items() if baseline_results is not None else ())]


def _metrics(results: ResultsManifest | None, verdict: dict[str, Any] | None, columns: list[str]) -> dict[str, dict[str, Any]]:
    """Per metric column the row's value, and where a gate judged it, its difference or value with the interval."""
    metrics: dict[str, dict[str, Any]] = {}
    for column in columns:
        gate_id = GateId.parse(column)
        facts = METRICS.get(gate_id.check)  # None: a metric newer than this table (a value, not a change)
        in_set = results.sets.get(gate_id.scope) if results is not None else None
        value = in_set.metrics.get(gate_id.check) if in_set is not None else None
        gate = (verdict or {}).get("metrics", {}).get(column)
        if verdict is None and results is not None and value is None and facts is not None:
            value = facts.baseline_value  # the baseline against itself (agreement metrics)
        entry: dict[str, Any] = {"value": value}
        if gate is not None:
            if facts is not None and facts.is_change:
                entry.update(difference=gate["estimate"], low=gate["low"], high=gate["high"], unit=gate["unit"])
            else:
                entry.update(value=gate["estimate"], low=gate["low"], high=gate["high"], unit=gate["unit"])
            entry["outcome"] = gate["outcome"]
        metrics[column] = entry
    return metrics


def _row(name: str, measurement: MeasurementRecord | None, measured: dict[str, Any] | None, results: ResultsManifest | None,
         verdict: dict[str, Any] | None, columns: list[str], sequential: dict[str, Any] | None = None) -> dict[str, Any]:
    """`measurement`: the measurement in the measure stage's value `measured` (whose bounds the row shows)."""
    metrics = _metrics(results, verdict, columns)
    kl = next((entry["value"] for column, entry in metrics.items() if GateId.parse(column).check == "kl_divergence"), None)
    if kl is None and results is not None:
        kl = next((entry.metrics["kl_divergence"] for entry in results.sets.values() if "kl_divergence" in entry.metrics), None)
    return {
        "format": name,
        "bytes": measurement.totals.file_bytes if measurement else None,
        "bits_per_weight_layers": measurement.quantized_linear.bits_per_weight.measured if measurement else None,
        "bits_per_parameter": measurement.whole_model.bits_per_parameter.measured if measurement else None,
        # the baseline is measured on its own; each format against it
        "ratio_to_baseline": None if not measurement else 1.0 if verdict is None else
        measurement.baseline.ratio_total if measurement.baseline is not None else None,
        "bounds": (measured or {}).get("bounds") or {},
        "metrics": metrics,
        "kl_divergence": kl,
        "verdict": "baseline" if verdict is None else verdict["verdict"],
        "reasons": [] if verdict is None else verdict["reasons"],
        # every gate with its numbers (GateResult.as_dict), and the sets fail fast left out;
        # verdict records from before either was written have neither
        "gates": [] if verdict is None else list(verdict.get("gates") or []),
        "not_evaluated": {} if verdict is None else dict(verdict.get("not_evaluated") or {}),
        # its looks: per set the looks planned and the items evaluated (`items`), what stopped them;
        # None for the baseline, a format that failed to quantize, and verdicts from before looks
        "sequential": sequential,
        # per text set the per-token KL's tails with bootstrap intervals, gated or not
        "tails": {} if verdict is None else dict(verdict.get("tails") or {}),
        # a search's trial or held-out gate: its role, split, items, mix (set by `records`); None otherwise
        "search": None,
        # its serve check (ServeRecord.summary, evalsets.serve_record): served by vLLM or not, the agreement with
        # what was gated, decode tokens/s and the bound; None where the run had no serve stage
        "serving": None if verdict is None else verdict.get("serving") or None,
        # per device class: approved, pending (with the command that attests it) or blocked
        "classes": {} if verdict is None else dict(verdict.get("classes") or {}),
    }


def _sequential(verdict: dict[str, Any], artifact: dict[str, Any] | None) -> dict[str, Any] | None:
    """A format's looks: the verdict's `sequential` record, else (a verdict written before it
    recorded them) its sequential stage's value, in the same shape. A format with no results of
    its own (it failed to quantize) has none: a sequential artifact left there is another run's."""
    if isinstance(verdict.get("sequential"), dict):
        return dict(verdict["sequential"])
    if artifact is None or verdict.get("results") is None or not isinstance(artifact.get("depths"), dict):
        return None
    return {"looks": artifact.get("looks") or {}, "items": artifact["depths"], "error_control": artifact.get("error_control"),
            "confidence": artifact.get("confidence"), "blocked_by": artifact.get("blocked_by"),
            "not_evaluated": dict(verdict.get("not_evaluated") or {}), "trace": artifact.get("trace") or []}


def _policy(run: dict[str, Any], verdicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run's policy identity, narrowed (`narrowed_to`, `dropped`) where the run's record or
    any verdict says so."""
    policy = {key: run["policy"][key] for key in ("name", "version", "sha256")}
    sources = [run["policy"], *(verdict.get("policy") or {} for verdict in verdicts.values())]
    narrowed = next((source for source in sources if source.get("narrowed_to") is not None), None)
    if narrowed is not None:
        policy.update(narrowed_to=list(narrowed["narrowed_to"]), dropped=list(narrowed.get("dropped") or []))
    return policy


def _search_record(layout: RunDir, run: dict[str, Any]) -> dict[str, Any] | None:
    """search.json of a run whose plan has a search (a record another plan left is not this run's)."""
    if (run.get("plan") or {}).get("search") is None or not layout.search_file.is_file():
        return None
    record: dict[str, Any] = read_json(layout.search_file)
    return record


def _search_names(search: dict[str, Any] | None) -> list[str]:
    """The verdicts a search left: each trial's, then the chosen trial's held-out gate's."""
    if search is None:
        return []
    names = [str(trial["name"]) for trial in search.get("trials") or []]
    return names + ([f"{search['chosen']}@held-out"] if search.get("chosen") and search.get("held_out") else [])


def _search_info(search: dict[str, Any], checkpoint: str, verdict: dict[str, Any]) -> dict[str, Any]:
    """A search row's `search`: its role, by the split its verdict was reached on (only a
    held-out verdict can approve; any other split is a trial's), and its trial's allocation."""
    trial: dict[str, Any] = next((entry for entry in search.get("trials") or [] if entry.get("name") == checkpoint), {})
    return {"role": HELD_OUT if verdict.get("split") == "held-out" else TRIAL, "checkpoint": checkpoint,
            "split": verdict.get("split"), "split_items": dict(verdict.get("split_items") or {}),
            "groups_by_format": dict(trial.get("groups_by_format") or {}), "groups": (search.get("space") or {}).get("groups"),
            "budget_ratio": trial.get("budget_ratio"), "predicted_cost": trial.get("predicted_cost"),
            "chosen": checkpoint == search.get("chosen")}


def _sensitivity(layout: RunDir) -> dict[str, Any] | None:
    """The chart's data from sensitivity/sensitivity.json (quantize.sensitivity's report; read
    here, not through that module, which imports torch): the method, the unit, each group's
    scores, the rank check's Spearman rho per format where it ran."""
    path = layout.sensitivity() / "sensitivity.json"
    if not path.is_file():
        return None
    data = read_json(path)
    validation = (data.get("validation") or {}).get("formats") or {}
    return {**data, "spearman": {fmt: entry.get("spearman") for fmt, entry in validation.items() if isinstance(entry, dict)}}


def _set_size(spec: str) -> int | None:
    try:
        return evalsets.load(spec).size
    except InputError:
        return None
