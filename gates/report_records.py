"""What the report reads of a run directory (run.json, measure/, results/, verdicts/, serve/,
search.json, sensitivity/), as `RunRecords`: one row per format (and the baseline, and a search's
trials and held-out gate) with its measurements, metric values, verdict, gates, looks, tails and
serve check. gates.report makes the report of them.

Each record is read through its one class (run.json: RunRecord, a verdict: VerdictRecord, a
measurement: MeasurementRecord, a results manifest: ResultsManifest, a serve record: ServeRecord,
the calibration set's manifest: CalibrationManifest), so one that is damaged, of another kind or
of a schema version this quantgate does not read is refused in one line. search.json, the
sensitivity and the measure stage's bounds are read through the report's own models of them
(gates.report_model, `Record.of_record`). A run directory written by an earlier 0.x quantgate is
not read: run it again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantgate import evalsets
from quantgate.calibration.manifest import CalibrationManifest
from quantgate.core.artifacts import MANIFEST, read_json
from quantgate.core.errors import InputError
from quantgate.core.ids import GateId
from quantgate.core.metrics import METRICS
from quantgate.core.rundir import BASELINE, RunDir
from quantgate.core.stagecache import stored_value
from quantgate.evalsets.results import ResultsManifest
from quantgate.evalsets.serve_record import ServedSummary, ServeRecord
from quantgate.gates.report_model import (
    HELD_OUT,
    TRIAL,
    Bound,
    BoundsInputs,
    Calibration,
    ClassVerdict,
    EvalSet,
    FailedUnitEntry,
    GateRecord,
    MetricEntry,
    PlotAxes,
    Policy,
    Profile,
    Record,
    RowRecord,
    RunRecords,
    SearchInfo,
    SearchRecord,
    Sensitivity,
    Sequential,
    Serving,
    SplitItems,
    Tail,
)
from quantgate.gates.run_record import BASELINE_FAILED, RunRecord
from quantgate.gates.verdict_record import VerdictRecord
from quantgate.quantize.measure.record import MeasurementRecord
from quantgate.quantize.measure.stage import stage_measurement


def column_higher_is_better(column: str) -> bool:
    """Which way a metric column ('SET METRIC') is better, from the metrics table (a metric this
    version does not know: lower, like a divergence)."""
    known = METRICS.get(GateId.parse(column).check)
    return known.higher_is_better if known is not None else False


# ---- the measure stage's value ----------------------------------------------------------------------

class ProfileBounds(Record):
    """The decode-step lower bounds on one hardware profile, as the measure stage stores them
    (quantize.measure.stage.measure_and_bound): what the report reads of them."""

    batch1_ms: float
    batch32_ms: float
    context_tokens: int
    kv_bytes_per_element: float


class MeasureBounds(Record):
    """The measure stage's value as far as its bounds go (its measurement is a MeasurementRecord)."""

    bounds: dict[str, ProfileBounds]


@dataclass(frozen=True)
class Measured:
    """A checkpoint's measure stage: its measurement, and its decode-step bounds per hardware profile."""

    measurement: MeasurementRecord
    bounds: dict[str, ProfileBounds]


def _measured(path: Path) -> Measured | None:
    """The measure stage's value stored at `path` (None: not measured)."""
    value = stored_value(path)
    if value is None:
        return None
    measurement = stage_measurement(value, str(path))
    return Measured(measurement, MeasureBounds.of_record(value, f"{path}: value").bounds)


# ---- the run ------------------------------------------------------------------------------------------

def records(run_dir: Path) -> RunRecords:
    """The report's input from a run directory's artifacts."""
    layout = RunDir(Path(run_dir))
    run = _run_record(layout)
    # no baseline, no verdict: the run says so (run.json's status), and the report shows what failed
    no_verdict = run.status == BASELINE_FAILED
    search = None if no_verdict else _search_record(layout, run)
    names = [] if no_verdict else run.formats + _search_names(search)  # the formats, then the search's trials and its held-out gate
    verdicts = _verdicts(layout, names)
    columns: list[str] = []  # every metric gate, in policy order (a format that failed to quantize has none)
    for verdict in verdicts.values():
        columns += [gate for gate in verdict.metrics if GateId.parse(gate).on_golden_set and gate not in columns]
    baseline_results = _results(layout.results(BASELINE))
    baseline_measured = _measured(layout.measure(BASELINE))
    baseline_served = stored_value(layout.serve(BASELINE))
    served = None if baseline_served is None else \
        ServeRecord.from_json(baseline_served, f"{layout.serve(BASELINE)}: value").summary()
    rows = [_row("baseline", baseline_measured, baseline_results, verdict=None, columns=columns,
                 serving=_serving(served, layout.serve(BASELINE)))]
    for name in names:
        verdict = verdicts[name]
        # a held-out gate judged its trial's checkpoint: measured once, under the trial's name
        checkpoint = name if name in run.formats else verdict.checkpoint_name or name.split("@")[0]
        where = f"{layout.verdict(name)}: value"
        rows.append(_row(name, _measured(layout.measure(checkpoint)), _results(layout.results(name)), verdict=verdict, columns=columns,
                         serving=_serving(verdict.serving, where),
                         search=_search_info(search, checkpoint, verdict, where) if search is not None and name not in run.formats else None))
    plot = PlotAxes(x=run.plot.x, y=run.plot.y, higher_is_better=run.plot.higher_is_better)
    if plot.y not in columns and columns:
        plot = PlotAxes(x=run.plot.x, y=columns[0], higher_is_better=column_higher_is_better(columns[0]))
    any_bounds = next(iter(baseline_measured.bounds.values()), None) if baseline_measured is not None else None
    calibration_file = layout.calibration / MANIFEST
    calibration = CalibrationManifest.read(calibration_file) if calibration_file.is_file() else None
    return RunRecords(
        model=run.plan.model,
        model_path=run.model,
        policy=_policy(run, verdicts),
        hardware=[Profile(name=name) for name in run.hardware],
        metric_columns=columns,
        plot=plot,
        rows=rows,
        evalsets=_evalsets(baseline_results, run.looks),
        calibration=None if calibration is None else Calibration(
            samples=calibration.samples, seq_len=calibration.seq_len, fingerprint=calibration.fingerprint,
            source=calibration.config.source),
        bounds_inputs=None if any_bounds is None else BoundsInputs(context_tokens=any_bounds.context_tokens,
                                                                   kv_bytes_per_element=any_bounds.kv_bytes_per_element),
        confidence=run.confidence,
        ledger=run.ledger,
        # the search's record (search.json) and its layer groups' sensitivity; None without a search
        search=search,
        sensitivity=None if search is None else _sensitivity(layout),
        failed_units=[FailedUnitEntry.model_validate(unit.model_dump(mode="json")) for unit in run.failed_units],
        no_verdict=_no_verdict(run) if no_verdict else None,
    )


def _no_verdict(run: RunRecord) -> str:
    """Why a run whose baseline failed has no verdict: the baseline's failed unit, by its reason."""
    baseline = next((unit.reason for unit in run.failed_units if unit.unit.endswith(" baseline")), "its baseline failed")
    return (f"no format was judged: every verdict is paired with the baseline, and {baseline}; "
            "the same command runs it again")


def _run_record(layout: RunDir) -> RunRecord:
    if not layout.run_file.is_file():
        raise InputError(f"{layout.root} is not a quantgate run directory (no run.json)")
    return RunRecord.read(layout.run_file)


def _results(directory: Path) -> ResultsManifest | None:
    """The results manifest of `directory`, or None where it holds none (not evaluated)."""
    path = directory / MANIFEST
    return ResultsManifest.read(path) if path.is_file() else None


def _verdicts(layout: RunDir, names: list[str]) -> dict[str, VerdictRecord]:
    """Each verdict, read through its record (VerdictRecord): a damaged one is refused."""
    stored = {name: stored_value(layout.verdict(name)) for name in names}
    missing = [name for name, verdict in stored.items() if verdict is None]
    if missing:
        raise InputError(f"the run in {layout.root} has no verdict yet for {', '.join(missing)}: run it to the end first")
    return {name: VerdictRecord.from_json(verdict, f"{layout.verdict(name)}: value") for name, verdict in stored.items()}


def _evalsets(baseline_results: ResultsManifest | None, looks: dict[str, list[int]]) -> list[EvalSet]:
    """The baseline's results: each set at its first look (`items`); `looks` as the run planned them."""
    return [EvalSet(spec=spec, items=entry.items, limit=entry.limit, sha256=entry.sha256, size=_set_size(spec),
                    looks=list(looks.get(spec) or []))
            for spec, entry in (baseline_results.sets.items() if baseline_results is not None else ())]


def _metrics(results: ResultsManifest | None, verdict: VerdictRecord | None, columns: list[str]) -> dict[str, MetricEntry]:
    """Per metric column the row's value, and where a gate judged it, its difference or value with the interval."""
    metrics: dict[str, MetricEntry] = {}
    for column in columns:
        gate_id = GateId.parse(column)
        facts = METRICS.get(gate_id.check)  # None: a metric newer than this table (a value, not a change)
        in_set = results.sets.get(gate_id.scope) if results is not None else None
        value = in_set.metrics.get(gate_id.check) if in_set is not None else None
        gate = verdict.metrics.get(column) if verdict is not None else None
        if verdict is None and results is not None and value is None and facts is not None:
            value = facts.baseline_value  # the baseline against itself (agreement metrics)
        if gate is None:
            metrics[column] = MetricEntry(value=value)
        elif facts is not None and facts.is_change:
            metrics[column] = MetricEntry(value=value, difference=gate.estimate, low=gate.low, high=gate.high, unit=gate.unit,
                                          outcome=gate.outcome.value)
        else:
            metrics[column] = MetricEntry(value=gate.estimate, low=gate.low, high=gate.high, unit=gate.unit,
                                          outcome=gate.outcome.value)
    return metrics


def _row(name: str, measured: Measured | None, results: ResultsManifest | None, verdict: VerdictRecord | None,
         columns: list[str], serving: Serving | None, search: SearchInfo | None = None) -> RowRecord:
    """The baseline (`verdict` None) or a candidate: what its measure stage (`measured`), its
    results and its verdict say; `serving`: its serve check; `search`: a search row's role."""
    measurement = measured.measurement if measured is not None else None
    metrics = _metrics(results, verdict, columns)
    kl = next((entry.value for column, entry in metrics.items() if GateId.parse(column).check == "kl_divergence"), None)
    if kl is None and results is not None:
        kl = next((entry.metrics["kl_divergence"] for entry in results.sets.values() if "kl_divergence" in entry.metrics), None)
    where = name if verdict is None else f"the verdict on {name}"
    return RowRecord(
        format=name,
        bytes=measurement.totals.file_bytes if measurement else None,
        bits_per_weight_layers=measurement.quantized_linear.bits_per_weight.measured if measurement else None,
        bits_per_parameter=measurement.whole_model.bits_per_parameter.measured if measurement else None,
        # the baseline is measured on its own; each format against it
        ratio_to_baseline=None if not measurement else 1.0 if verdict is None else
        measurement.baseline.ratio_total if measurement.baseline is not None else None,
        bounds={} if measured is None else {profile: Bound(batch1_ms=entry.batch1_ms, batch32_ms=entry.batch32_ms)
                                            for profile, entry in measured.bounds.items()},
        metrics=metrics,
        kl_divergence=kl,
        verdict="baseline" if verdict is None else verdict.verdict,
        reasons=[] if verdict is None else verdict.reasons,
        # every gate with its numbers (GateResult.as_dict), and the sets fail fast left out
        gates=[] if verdict is None else [GateRecord.of_record(gate.to_json(), f"{where}: gates") for gate in verdict.gates],
        not_evaluated={} if verdict is None else dict(verdict.not_evaluated or {}),
        # its looks: per set the looks planned and the items evaluated (`items`), what stopped them;
        # None for the baseline and a format blocked before its looks (it failed to quantize)
        sequential=None if verdict is None else _sequential(verdict, where),
        # per text set the per-token KL's tails with bootstrap intervals, gated or not
        tails={} if verdict is None else {
            spec: {metric: Tail.of_record(tail.to_json(), f"{where}: tails") for metric, tail in entries.items()}
            for spec, entries in (verdict.tails or {}).items()},
        # a search's trial or held-out gate: its role, split, items, mix; None otherwise
        search=search,
        # its serve check (ServeRecord.summary, evalsets.serve_record): served by vLLM or not, the agreement with
        # what was gated, decode tokens/s and the bound; None where the run had no serve stage
        serving=serving,
        # per device class: approved, pending (with the command that attests it) or blocked
        classes={} if verdict is None else {
            device_class: ClassVerdict.of_record(entry.to_json(), f"{where}: classes")
            for device_class, entry in (verdict.classes or {}).items()},
    )


def _sequential(verdict: VerdictRecord, where: str) -> Sequential | None:
    """A verdict's record of its looks; each look's entry of its trace (kept as JSON by the
    report) with its keys in the order the stored verdict has them (sorted, as every record is written)."""
    if verdict.sequential is None:
        return None
    looks = verdict.sequential.to_json()
    looks["trace"] = [dict(sorted(entry.items())) for entry in looks["trace"]]
    return Sequential.of_record(looks, f"{where}: sequential")


def _serving(summary: ServedSummary | None, where: Path | str) -> Serving | None:
    """A serve check as the report reads it (ServedSummary: what a verdict keeps of a serve record)."""
    return None if summary is None else Serving.of_record(summary.to_json(), f"{where}: serving")


def _policy(run: RunRecord, verdicts: dict[str, VerdictRecord]) -> Policy:
    """The run's policy identity, narrowed (`narrowed_to`, `dropped`) where the run's record or
    any verdict says so."""
    identity = run.policy
    sources = [identity, *(verdict.policy for verdict in verdicts.values())]
    narrowed = next((source for source in sources if source.narrowed_to is not None), None)
    if narrowed is None or narrowed.narrowed_to is None:
        return Policy(name=identity.name, version=identity.version, sha256=identity.sha256)
    return Policy(name=identity.name, version=identity.version, sha256=identity.sha256,
                  narrowed_to=list(narrowed.narrowed_to), dropped=list(narrowed.dropped or []))


# ---- a search -----------------------------------------------------------------------------------------

def _search_record(layout: RunDir, run: RunRecord) -> SearchRecord | None:
    """search.json of a run whose plan has a search (a record another plan left is not this run's)."""
    if run.plan.search is None or not layout.search_file.is_file():
        return None
    return SearchRecord.of_record(read_json(layout.search_file), str(layout.search_file))


def _search_names(search: SearchRecord | None) -> list[str]:
    """The verdicts a search left: each trial's, then the chosen trial's held-out gate's."""
    if search is None:
        return []
    names = [trial.name for trial in search.trials]
    return names + ([f"{search.chosen}@held-out"] if search.chosen and search.held_out else [])


def _search_info(search: SearchRecord, checkpoint: str, verdict: VerdictRecord, where: str) -> SearchInfo:
    """A search row's `search`: its role, by the split its verdict was reached on (only a
    held-out verdict can approve; any other split is a trial's), and its trial's allocation."""
    trial = next((entry for entry in search.trials if entry.name == checkpoint), None)
    return SearchInfo(role=HELD_OUT if verdict.split == "held-out" else TRIAL, checkpoint=checkpoint, split=verdict.split,
                      split_items={spec: SplitItems.of_record(items.to_json(), f"{where}: split_items")
                                   for spec, items in (verdict.split_items or {}).items()},
                      groups_by_format=dict(trial.groups_by_format) if trial is not None else {}, groups=search.space.groups,
                      budget_ratio=trial.budget_ratio if trial is not None else None,
                      predicted_cost=trial.predicted_cost if trial is not None else None,
                      chosen=checkpoint == search.chosen)


class FormatCheck(Record):
    """The rank check of one format (quantize.sensitivity.FormatCheck): what the chart reads of it."""

    spearman: float | None


class SensitivityValidation(Record):
    formats: dict[str, FormatCheck]


class SensitivityFile(Record):
    """sensitivity.json's rank check (quantize.sensitivity.SensitivityReport's `validation`)."""

    validation: SensitivityValidation | None


def _sensitivity(layout: RunDir) -> Sensitivity | None:
    """The chart's data from sensitivity/sensitivity.json (quantize.sensitivity's report; read
    here, not through that module, which imports torch): the method, the unit, each group's
    scores, the rank check's Spearman rho per format where it ran."""
    path = layout.sensitivity() / "sensitivity.json"
    if not path.is_file():
        return None
    data = read_json(path)
    checked = SensitivityFile.of_record(data, str(path)).validation
    sensitivity = Sensitivity.of_record(data, str(path))
    return sensitivity.model_copy(update={
        "spearman": {} if checked is None else {fmt: entry.spearman for fmt, entry in checked.formats.items()}})


def _set_size(spec: str) -> int | None:
    try:
        return evalsets.load(spec).size
    except InputError:
        return None
