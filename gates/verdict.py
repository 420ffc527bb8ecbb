"""Verdicts: compare a candidate's per-item results with its baseline's, metric by metric,
under a policy, with paired bootstrap intervals; approve only when every gate passes.

Thin over two pure parts: `gates.stats` (the intervals) and `gates.policy.decide` (the rule).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

import numpy as np

from quantgate.core.errors import InputError
from quantgate.core.ids import INTEGRITY, SERVING, SIZE, GateId, SetRef
from quantgate.core.metrics import METRICS, Metric, Statistic
from quantgate.evalsets.serve_record import Agreement, ServeRecord
from quantgate.evalsets.served import FAILED
from quantgate.gates import stats
from quantgate.gates.policy import LoadedPolicy, MetricGate, Outcome, Statistics
from quantgate.gates.sequential import decide_at_look, detectable_regression
from quantgate.gates.verdict_record import GateRecord, OverlapSummary, SmokeCheck, Status, read_gates
from quantgate.quantize.measure.record import MeasurementRecord

Records = list[dict[str, Any]]  # per-item records of one set (docs/evaluate.md, items.json)

# Where a text set's per-item record keeps the numerator of each ratio-of-sums metric.
_NUMERATORS = {"kl_divergence": "kl_sum", "top1_agreement": "top1_matches", "top_prob_change_mean": "top_prob_change_sum"}


@dataclass(frozen=True)
class Look:
    """Where a metric gate is judged: the `index`-th of `looks` planned looks (1-based), at
    `confidence`; the last look is the set's ceiling. A fixed-size test is one final look."""

    index: int = 1
    looks: int = 1
    confidence: float = 0.95
    min_items: int = 1

    @property
    def final(self) -> bool:
        return self.index >= self.looks


@dataclass(frozen=True)
class GateResult:
    gate: str  # "hellaswag@v1 acc_norm"
    outcome: Outcome
    # unrounded: difference in points, change in percent, or the value itself; None when not evaluated
    estimate: float | None
    low: float | None
    high: float | None
    limit: float
    unit: str
    reason: str
    # metric gates: the items and the look that decided it, its interval's confidence
    items: int | None = None
    look: int | None = None
    looks: int | None = None
    confidence: float | None = None
    # "interval" (it lies wholly on one side of the limit), "ceiling" (the fixed-size rule at the
    # last look), "exact" (size and integrity: one exact number), "not evaluated" (fail fast)
    decided_by: str = "exact"
    half_width: float | None = None  # of the interval, in the gate's unit
    detectable: float | None = None  # smallest difference from the limit found with 80% power here
    # a decided metric gate: the share of resamples of its items on which its own rule (statistic,
    # interval, confidence, look, limit) decides the same (gates.stats.verdict_stability), with the
    # resamples, inner resamples and seed it was computed from; None where it does not apply (size,
    # integrity and serving gates are exact numbers; not evaluated, undecided; verdicts from before it)
    stability: float | None = None
    stability_resamples: int | None = None
    stability_inner_resamples: int | None = None
    stability_seed: int | None = None

    def record(self) -> GateRecord:
        """The gate as a verdict records it."""
        return GateRecord(**asdict(self))

    def as_dict(self) -> dict[str, Any]:
        """The gate's JSON (its record's)."""
        return self.record().to_json()

    @classmethod
    def from_record(cls, record: GateRecord) -> GateResult:
        return cls(**dict(record))

    @classmethod
    def from_dict(cls, entry: dict[str, Any], where: str = "a gate") -> GateResult:
        """A gate as `as_dict` wrote it (a stored sequential stage), read through its record at
        `where`; a field it predates takes its default."""
        return cls.from_record(read_gates([entry], where)[0])


@dataclass(frozen=True)
class Verdict:
    """Every gate on one checkpoint. Quality (integrity, size, golden sets in the reference
    numerics) and serving (on the device class its serve record names) are separate evidence:
    `status` is approved (both pass), blocked (quality does not), or pending (quality passes and
    serving evidence that approves it is missing: no usable path on this class, a serve that
    failed, or a class whose engine disagrees, which blocks that class only)."""

    approved: bool
    gates: list[GateResult] = field(default_factory=list)
    quality_passed: bool = False  # every gate but the serving ones passed, every metric gate of the policy among them

    @property
    def serving(self) -> Status | None:
        """This class's serving status: approved, blocked or pending; None where the policy gates no serving."""
        serving = [gate for gate in self.gates if GateId.parse(gate.gate).scope == SERVING]
        if not serving:
            return None
        if all(gate.outcome is Outcome.passed for gate in serving):
            return APPROVED
        return BLOCKED if any(gate.outcome is Outcome.failed for gate in serving) else PENDING

    @property
    def status(self) -> Status:
        if self.approved:
            return APPROVED
        return PENDING if self.quality_passed and self.serving in (PENDING, BLOCKED) else BLOCKED

    @property
    def reasons(self) -> list[str]:
        """Why it is blocked: the gates that blocked it first, then those left not evaluated."""
        blocking = [gate for gate in self.gates if gate.outcome is not Outcome.passed]
        return [gate.reason for gate in sorted(blocking, key=lambda gate: gate.outcome is Outcome.not_evaluated)]


APPROVED: Final = "approved"
PENDING: Final = "pending"
BLOCKED: Final = "blocked"


def passes_here(record: Mapping[str, Any]) -> bool:
    """Whether a verdict record's checkpoint passes on the evidence a run has: approved, or its
    quality passed and serving is pending here (no usable path on this class, not checked, a
    serve that failed); not where this class's engine disagrees (blocked here)."""
    if record.get("verdict") == APPROVED:
        return True
    classes = record.get("classes") or {}
    return record.get("verdict") == PENDING and all(entry.get("status") != BLOCKED for entry in classes.values())


def blocked_verdict(reason: str) -> Verdict:
    """The verdict on a checkpoint that failed its own checks (it does not load, or its logits
    are NaN/Inf): one failed integrity gate, nothing measured, nothing to deploy."""
    failure = GateResult(gate=str(GateId(INTEGRITY, "loads")), outcome=Outcome.failed, estimate=0.0, low=0.0, high=0.0, limit=1.0,
                         unit="", reason=f"integrity: {reason}")
    return Verdict(False, [failure])


def lost_verdict(reason: str) -> Verdict:
    """The verdict on a candidate whose work the cluster lost (its task's retries spent, its node
    gone): blocked for this run, its gates not evaluated; nothing about the checkpoint is claimed."""
    lost = GateResult(gate=str(GateId(INTEGRITY, "loads")), outcome=Outcome.not_evaluated, estimate=None, low=None, high=None,
                      limit=1.0, unit="", reason=f"not evaluated: {reason}; a run started again does it again")
    return Verdict(False, [lost])


def _aligned(baseline: Records, candidate: Records, spec: str) -> tuple[Records, Records]:
    by_id = {item["id"]: item for item in candidate}
    if len(by_id) != len(candidate) or sorted(by_id) != sorted(item["id"] for item in baseline):
        raise InputError(f"{spec}: baseline and candidate results cover different items (evaluate both with the same --limit)")
    return baseline, [by_id[item["id"]] for item in baseline]


def gate_records(spec: str, baseline: Records, candidate: Records) -> tuple[Records, Records]:
    """The two sides' records of one set, paired item by item (the candidate's in the baseline's
    order); records that cover different items are refused."""
    return _aligned(baseline, candidate, spec)


def _series(items: Records, key: str, sign: float = 1.0) -> np.ndarray:
    return np.array([sign * item[key] for item in items], dtype=float)


def _statistic(metric: Metric, baseline: Records, candidate: Records) -> stats.Statistic:
    """The paired statistic of `metric.statistic` over the items' records."""
    if metric.statistic is Statistic.mean_difference:
        scores = [np.array([item["metrics"][metric.name] for item in items], dtype=float) for items in (baseline, candidate)]
        return stats.mean_difference(*scores)
    if metric.statistic is Statistic.perplexity_change:
        if "nll" in baseline[0]:  # text sets: Σ nll / Σ tokens
            return stats.relative_perplexity_change(_series(baseline, "nll"), _series(baseline, "tokens"),
                                                    _series(candidate, "nll"), _series(candidate, "tokens"))
        ones = np.ones(len(baseline))  # last-word sets: one target a item
        return stats.relative_perplexity_change(_series(baseline, "loglikelihood", -1.0), ones,
                                                _series(candidate, "loglikelihood", -1.0), ones)
    if metric.statistic is Statistic.ratio_of_sums:
        key = _NUMERATORS[metric.name]
        if key not in candidate[0]:
            raise InputError(f"candidate results have no {metric.name}: evaluate the candidate with --baseline-results")
        return stats.ratio_of_sums(_series(candidate, key), _series(candidate, "tokens"))
    if metric.statistic is Statistic.token_quantile and metric.tokens is not None and metric.quantile is not None:
        # text sets: the per-token values the results loader attaches to each item (in memory)
        if any(metric.tokens not in (item.get("token_values") or {}) for item in candidate):
            raise InputError(f"candidate results have no per-token values for {metric.name}: "
                             "evaluate the candidate with --baseline-results")
        values = [np.asarray(item["token_values"][metric.tokens], dtype=float) for item in candidate]
        wrong = next((item for item, array in zip(candidate, values, strict=True) if array.size != item["tokens"]), None)
        if wrong is not None:
            raise InputError(f"candidate item {wrong['id']} has {np.asarray(wrong['token_values'][metric.tokens]).size} "
                             f"per-token values for {wrong['tokens']} tokens")
        return stats.token_quantile(values, metric.quantile)
    raise InputError(f"no gate rule for metric {metric.name!r}")


def _limit(gate: MetricGate, precision: str) -> float:
    threshold = gate.threshold(precision)
    return -threshold if gate.kind == "max_drop_points" else threshold


def _describe(name: str, metric: Metric, outcome: Outcome, *, estimate: float, low: float, high: float, limit: float,
              margin: float = 0.0, items: int | None = None) -> str:
    def number(value: float) -> str:
        return f"{value:+.2f}" if metric.is_change else f"{value:.4f}"

    suffix = f" {metric.unit}" if metric.unit == "points" else metric.unit
    observed = f"{name} {metric.name} {number(estimate)}{suffix} [{number(low)}, {number(high)}]"
    if outcome is Outcome.failed:
        word = "is below" if metric.higher_is_better and not metric.is_change else "exceeds"
        return f"{observed} {word} {number(limit)}{suffix}"
    if outcome is Outcome.insufficient:
        after = f" after {items} items" if items is not None else ""
        past = "by more than the policy's margin" if margin else "at the ceiling"
        return f"{observed}: insufficient evidence{after}, the interval reaches past {number(limit)}{suffix} {past}"
    if outcome is Outcome.undecided:
        return f"{observed}: undecided, the interval reaches across {number(limit)}{suffix}"
    return f"{observed} within {number(limit)}{suffix}"


def metric_gate(spec: str, metric: Metric, gate: MetricGate, items: tuple[Records, Records], *,
                settings: Statistics, precision: str, look: Look | None = None) -> GateResult:
    """One metric of one set at one look: the estimate and its paired-bootstrap interval at the
    look's confidence, against the limit. Before the last look the outcome may be `undecided`
    (evaluate more items); at the last look it never is."""
    look = look or Look(confidence=settings.confidence)
    baseline, candidate = items
    statistic = _statistic(metric, baseline, candidate)
    interval = stats.paired_bootstrap(statistic, len(baseline), resamples=settings.resamples, confidence=look.confidence,
                                      seed=settings.seed)
    estimate, low, high = interval.estimate * metric.scale, interval.low * metric.scale, interval.high * metric.scale
    limit = _limit(gate, precision)
    name = SetRef.parse(spec).name
    min_items = gate.min_items or look.min_items
    decided_by = "interval"
    if not all(math.isfinite(value) for value in (estimate, low, high)):
        # NaN compares false both ways, so it would slip through `decide`: a candidate
        # whose numbers (or its interval's) are not finite fails, and says so.
        outcome, reason = Outcome.failed, f"{name} {metric.name} is {estimate} [{low}, {high}] (NaN or Inf logits or losses)"
        decided_by = "exact"
    else:
        # compared in the statistic's own units (a 0/1 difference, not points): -6/120 and -5/100
        # are then the same double, so an estimate or interval end on the limit touches it
        # exactly, as the rule says, instead of landing either side of it by a rounding of x100
        raw_limit, raw_margin = limit / metric.scale, gate.undecided_margin / metric.scale

        def rule(estimate: float, low: float, high: float) -> Outcome | None:
            """The gate's decision at this look on any (estimate, interval): the items', or a resample's."""
            if not all(math.isfinite(value) for value in (estimate, low, high)):
                return Outcome.failed
            return decide_at_look(estimate, low, high, limit=raw_limit, margin=raw_margin, higher_is_better=metric.higher_is_better,
                                  final=look.final, items=len(baseline), min_items=min_items)

        decided = rule(interval.estimate, interval.low, interval.high)
        outcome = Outcome.undecided if decided is None else decided
        raw_low, raw_high = interval.low, interval.high
        wholly = ((raw_low >= raw_limit or raw_high < raw_limit) if metric.higher_is_better
                  else (raw_high <= raw_limit or raw_low > raw_limit))
        if decided is None:
            decided_by = "undecided"
        elif not wholly or len(baseline) < min_items:
            decided_by = "ceiling"
        reason = _describe(name, metric, outcome, estimate=estimate, low=low, high=high, limit=limit, margin=gate.undecided_margin,
                           items=len(baseline))
        if outcome is Outcome.insufficient and len(baseline) < min_items:
            reason = (f"{name} {metric.name}: insufficient evidence, {len(baseline)} items evaluated, "
                      f"the policy decides no gate on fewer than {min_items}")
    half_width = (high - low) / 2 if math.isfinite(high - low) else None
    result = GateResult(gate=str(GateId(spec, metric.name)), outcome=outcome, estimate=estimate, low=low, high=high,
                        limit=limit, unit=metric.unit, reason=reason, items=len(baseline), look=look.index, looks=look.looks,
                        confidence=look.confidence, decided_by=decided_by, half_width=half_width,
                        detectable=None if half_width is None else detectable_regression(half_width, look.confidence))
    if decided_by not in ("interval", "ceiling"):  # undecided (no outcome yet), or a non-finite number (exact)
        return result
    # decided: how often a resample of these items would have decided the same, by the same rule
    stable = stats.verdict_stability(statistic, len(baseline), rule, outcome, confidence=look.confidence, seed=settings.seed)
    return replace(result, stability=stable.share, stability_resamples=stable.resamples,
                   stability_inner_resamples=stable.inner_resamples, stability_seed=stable.seed)


def not_evaluated(spec: str, metric: str, unit: str, limit: float, why: str, last: GateResult | None = None) -> GateResult:
    """A gate that fail fast left undecided: it blocks (nothing was shown), with why. `last`: its
    last look, where its set was evaluated before the candidate was blocked (its items and
    interval are kept, for the record; none of it decided anything)."""
    if last is None:
        return GateResult(gate=str(GateId(spec, metric)), outcome=Outcome.not_evaluated, estimate=None, low=None,
                          high=None, limit=limit, unit=unit, reason=f"{SetRef.parse(spec).name} {metric}: not evaluated ({why})",
                          items=0, decided_by="not evaluated")
    return replace(last, outcome=Outcome.not_evaluated, decided_by="not evaluated",
                   reason=f"{SetRef.parse(spec).name} {metric}: not decided ({why}; at its last look: {last.reason})")


def _gated(name: str) -> Metric:
    known = METRICS.get(name)
    if known is None or not known.gateable:
        raise InputError(f"no gate rule for metric {name!r}")
    return known


def compare(baseline_items: dict[str, Records], candidate_items: dict[str, Records],
            policy: LoadedPolicy, precision: str) -> Verdict:
    """`*_items`: set spec ("arc-easy@v1") -> per-item records (docs/evaluate.md, items.json)."""
    results: list[GateResult] = []
    for set_name, gates in policy.policy.metrics.items():
        wanted = SetRef.parse(set_name)
        spec = next((s for s in candidate_items if wanted.matches(SetRef.parse(s))), None)
        if spec is None or spec not in baseline_items:
            raise InputError(f"policy gates {set_name}, but the results hold no {set_name} for both models")
        items = _aligned(baseline_items[spec], candidate_items[spec], spec)
        # one look, the last: always decided
        look = Look(confidence=policy.policy.statistics.confidence, min_items=policy.policy.sequential.min_items)
        results += [metric_gate(spec, _gated(metric), gate, items, settings=policy.policy.statistics, precision=precision, look=look)
                    for metric, gate in gates.items()]
    return Verdict(all(result.outcome is Outcome.passed for result in results), results)


# ---- the tails, reported ----------------------------------------------------------------------

# The per-token figures every text set reports against its baseline, gated or not.
TAIL_METRICS = ("kl_divergence", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "top_prob_change_mean",
                "top_prob_change_p01")


def tails(candidate_items: dict[str, Records], settings: Statistics) -> dict[str, dict[str, dict[str, float]]]:
    """Set spec -> each tail metric of the text sets evaluated against the baseline: its value
    and a bootstrap interval over items at the policy's confidence (`statistics`), for the
    report and the verdict record whether or not a policy gates it."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    for spec, items in candidate_items.items():
        if not items or "token_values" not in items[0]:
            continue
        result[spec] = {}
        for name in TAIL_METRICS:
            interval = stats.paired_bootstrap(_statistic(METRICS[name], items, items), len(items), resamples=settings.resamples,
                                              confidence=settings.confidence, seed=settings.seed)
            result[spec][name] = {"estimate": interval.estimate, "low": interval.low, "high": interval.high,
                                  "confidence": settings.confidence, "items": len(items)}
    return result


# ---- the size and integrity gates -----------------------------------------------------------

def _single(scope: str, check: str, passed: bool, *, value: float, limit: float, unit: str, reason: str) -> GateResult:
    """A gate on one exact number (no interval: low = estimate = high)."""
    return GateResult(gate=str(GateId(scope, check)), outcome=Outcome.passed if passed else Outcome.failed,
                      estimate=value, low=value, high=value, limit=limit, unit=unit, reason=reason)


def allocation_gate(measurement: MeasurementRecord, allocation: dict[str, int]) -> GateResult:
    """A mixed-precision checkpoint against the allocation it was made from: every linear layer
    stores exactly the bytes the allocation gave it (its format's bytes for that layer, measured
    on the format's uniform checkpoint), and no other layer is there. Exact, to the byte."""
    measured = {layer.name: layer.bytes for layer in measurement.linear_layers}
    differing = sorted(name for name in set(measured) | set(allocation) if measured.get(name) != allocation.get(name))
    total_measured = sum(measured.get(name, 0) for name in allocation)
    total_allocated = sum(allocation.values())
    if differing:
        first = differing[0]
        reason = (f"size: {len(differing)} linear layer(s) differ from the allocation, {first} stores "
                  f"{measured.get(first, 0):,} bytes against {allocation.get(first, 0):,} allocated")
    else:
        reason = f"size: every linear layer stores the bytes its allocation gave it ({total_allocated:,} bytes in all)"
    return _single(SIZE, "allocation_bytes", not differing, value=float(total_measured - total_allocated), limit=0.0,
                   unit="bytes", reason=reason)


def size_gates(measurement: MeasurementRecord, policy: LoadedPolicy, allocation: dict[str, int] | None = None) -> list[GateResult]:
    """From `quantgate measure --json` of the candidate (measured against the baseline):
    bits per weight of the quantized layers against the format's exact figure, and bytes the
    accounting cannot explain (the explanation lines whose cause is storage departing from the
    format, or bytes measure cannot place; `quantize.measure.causes`), and for a mixed-precision
    checkpoint its bytes per layer against its `allocation`. Exact comparisons, no rounding."""
    rules = policy.policy.size
    results = [] if allocation is None else [allocation_gate(measurement, allocation)]
    bits = measurement.quantized_linear.bits_per_weight
    measured, exact = bits.measured, bits.exact
    if measured is not None and exact is not None:
        excess = measured - exact
        ok = excess <= rules.max_bits_per_weight_excess
        results.append(_single(
            SIZE, "bits_per_weight", ok, value=excess, limit=rules.max_bits_per_weight_excess, unit="bits",
            reason=f"size: quantized layers store {measured:.4f} bits per weight, the format's exact figure is {exact:.4f} "
            f"({excess:+.4f}, {'within' if ok else 'exceeds'} the tolerance {rules.max_bits_per_weight_excess})"))
    if rules.forbid_unexplained_bytes:
        lines = [line for line in measurement.explanation.lines if line.cause.is_unexplained and line.bytes > 0]
        extra = sum(line.bytes for line in lines)
        if lines:
            details = "; ".join(f"{line.detail} ({line.bytes:,.0f} B)" for line in lines[:3])
            more = f"; and {len(lines) - 3} more" if len(lines) > 3 else ""
            reason = f"size: {extra:,.0f} bytes the format does not explain: {details}{more}"
        else:
            reason = "size: every byte is explained by the format"
        results.append(_single(SIZE, "unexplained_bytes", not lines, value=float(extra), limit=0.0, unit="bytes", reason=reason))
    return results


def non_finite(items_by_set: dict[str, Records]) -> str | None:
    """The first per-item number that is NaN or Inf, described; None when all are finite."""
    for spec, items in items_by_set.items():
        for item in items:
            values = {**{k: v for k, v in item.items() if k != "metrics"}, **(item.get("metrics") or {})}
            for key, value in values.items():
                if isinstance(value, float) and not math.isfinite(value):
                    return f"{SetRef.parse(spec).name} item {item.get('id')} has {key} {value}"
    return None


def _finite_logits(smoke: SmokeCheck | None, candidate_items: dict[str, Records] | None) -> GateResult:
    problem = non_finite(candidate_items) if candidate_items is not None else None
    if problem is not None:
        reason = f"integrity: NaN or Inf in the evaluation: {problem}"
    elif smoke is not None and not smoke.get("logits_finite"):
        reason = f"integrity: {smoke.get('error') or 'the smoke check found NaN or Inf logits'}"
    elif smoke is None and candidate_items is None:
        reason = "integrity: neither a smoke check nor an evaluation of this checkpoint is recorded"
    else:
        where = " and ".join(part for part, present in (("on the smoke prompt", smoke is not None),
                                                        ("on every evaluated item", candidate_items is not None)) if present)
        return _single(INTEGRITY, "finite_logits", True, value=1.0, limit=1.0, unit="",
                       reason=f"integrity: the checkpoint loads and its logits are finite {where}")
    return _single(INTEGRITY, "finite_logits", False, value=0.0, limit=1.0, unit="", reason=reason)


def integrity_gates(policy: LoadedPolicy, smoke: SmokeCheck | None, overlap: OverlapSummary | None,
                    candidate_items: dict[str, Records] | None = None) -> list[GateResult]:
    """The checkpoint loads and its logits are finite (the quantize stage's smoke check where it
    ran, and every number of the candidate's evaluation), and its calibration set shares few
    n-grams with the golden sets."""
    rules = policy.policy.integrity
    results = []
    if rules.require_finite_logits:
        results.append(_finite_logits(smoke, candidate_items))
    if overlap is not None:
        share = overlap.share
        ok = share <= rules.max_calibration_overlap
        results.append(_single(
            INTEGRITY, "calibration_overlap", ok, value=share, limit=rules.max_calibration_overlap, unit="",
            reason=f"integrity: {overlap.shared_ngrams} of the calibration set's {overlap.candidate_ngrams} "
            f"{overlap.n}-grams occur in the golden sets ({share:.2%}, "
            f"{'within' if ok else 'exceeds'} {rules.max_calibration_overlap:.2%})"))
    return results


# ---- the serving gates (docs/serving.md, "The serving gate") -----------------------------------

@dataclass(frozen=True)
class ServingEvidence:
    """A candidate's serve record (evalsets.served) and the baseline's, whose served-vs-gated
    difference (BF16-vs-FP32 compute alone) is the base of the bound. None: not checked."""

    record: ServeRecord | None
    reference: ServeRecord | None


def _serving_undecided(check: str, limit: float, unit: str, reason: str) -> GateResult:
    """A serving gate the evidence at hand cannot decide: pending (missing evidence, never a
    failed checkpoint)."""
    return GateResult(gate=str(GateId(SERVING, check)), outcome=Outcome.not_evaluated, estimate=None, low=None, high=None,
                      limit=limit, unit=unit, reason=f"serving: {reason}", decided_by=PENDING)


def serving_gates(policy: LoadedPolicy, evidence: ServingEvidence) -> list[GateResult]:
    """The policy's serving gates: the serving engine loads the checkpoint, and its per-token
    log-probabilities of the gated tokens differ from the gated ones (mean and p99 |difference|)
    by no more than the baseline's own served-vs-gated difference plus the policy's margins.
    Fail closed: a check that was not made leaves serving pending (never approved), with why; a
    record of a class with no usable path, or of a serve that failed, is pending too."""
    rules = policy.policy.serving
    if rules is None:
        return []
    record = evidence.record
    if record is None:
        return [_serving_undecided("loads", 1.0, "", "not checked (no serve record: run the serve stage, or "
                                                     "`quantgate gate --served`)")]
    if record.status in (PENDING, FAILED):
        where = record.device_class or "this machine"
        return [_serving_undecided("loads", 1.0, "", f"pending on {where}: {record.reason}")]
    if not record.served:
        return [_single(SERVING, "loads", not rules.require_loads, value=0.0, limit=1.0, unit="", reason=f"serving: {record.reason}")]
    engine = record.engine
    results = [_single(SERVING, "loads", True, value=1.0, limit=1.0, unit="",
                       reason=f"serving: vLLM {engine.get('version', '?')} ({engine.get('engine', '?')}) loads it "
                              f"({record.dtype} on {record.device})")]
    gated = record.gated
    if gated is not None and not gated.weights_match:
        results.append(_single(SERVING, "weights", False, value=0.0, limit=1.0, unit="",
                               reason="serving: the served checkpoint's weights or config are not those its gated results "
                                      f"were computed on ({gated.results})"))
    return results + _agreement_gates(policy, record, record.agreement, evidence.reference)


def _agreement_gates(policy: LoadedPolicy, record: ServeRecord, measured: Agreement | None,
                     reference: ServeRecord | None) -> list[GateResult]:
    """The three agreement gates (mean and p99 |difference|, NLL change) on `measured`: the
    agreement of what a serve record's engine served (its own, or its engine default's) with what
    was gated, against the baseline's own plus the policy's margins."""
    rules = policy.policy.serving
    assert rules is not None
    base = _reference(record, reference, rules.max_baseline_mean_logprob_difference)
    quantized = bool(record.quantized_activations)
    checks = [("mean_logprob_difference", "mean_abs_logprob_difference", rules.mean_logprob_difference_margin.for_record(quantized)),
              ("p99_logprob_difference", "p99_abs_logprob_difference", rules.p99_logprob_difference_margin.for_record(quantized)),
              ("nll_change", "nll_change", rules.nll_increase_margin)]
    results = []
    for check, key, margin in checks:
        if measured is None:
            why = record.not_compared or "no gated text-set results to compare with"
            results.append(_serving_undecided(check, margin, "nats", f"agreement not measured: {why}"))
        elif isinstance(base, str):
            results.append(_serving_undecided(check, margin, "nats", f"no bound: {base}"))
        else:
            results.append(_serving_check(check, measured, getattr(base, key), margin, quantized))
    return results


# ---- gate what serves (docs/serving.md, "Gating what serves") ---------------------------------

SERVED, ENGINE_DEFAULT = "served", "engine_default"


@dataclass(frozen=True)
class ServedNumerics:
    """Numerics a device class's engine computes that differ from the gated ones beyond the
    agreement bound: what the serve stage served (`served`, under the settings it ran with), or
    what the engine's default settings would serve there (`engine_default`: INT4 as W4A8 on an AMX
    CPU). Its golden sets, evaluated through the engine under `settings`, are that class's quality
    evidence for those numerics."""

    which: str
    device_class: str
    settings: dict[str, str]
    served_as: dict[str, str]  # scheme asked for -> scheme the engine computes under `settings`
    why: str  # the agreement gate it failed


def differing_numerics(policy: LoadedPolicy, evidence: ServingEvidence) -> list[ServedNumerics]:
    """The served numerics of a serve record that the agreement gates find beyond their bound:
    the serve stage's own (a disagreeing serve), and its engine default's where the record measured
    one. None where the policy gates no serving, nothing was served, or no bound exists."""
    record = evidence.record
    if policy.policy.serving is None or record is None or not record.served:
        return []
    device_class = record.device_class or "unknown"
    found = []
    own = [gate for gate in _agreement_gates(policy, record, record.agreement, evidence.reference)
           if gate.outcome is Outcome.failed]
    if own:
        found.append(ServedNumerics(SERVED, device_class, dict(record.engine_settings or {}),
                                    {entry.scheme: entry.served_as for entry in record.schemes or []}, own[0].reason))
    default = record.engine_default
    if default is not None and default.served and default.agreement is not None:
        failed = [gate for gate in _agreement_gates(policy, record, default.agreement, evidence.reference)
                  if gate.outcome is Outcome.failed]
        if failed:
            found.append(ServedNumerics(ENGINE_DEFAULT, device_class, dict(default.settings), dict(default.served_as), failed[0].reason))
    return found


def served_quality_gates(baseline_items: dict[str, Records], served_items: dict[str, Records], policy: LoadedPolicy,
                         precision: str) -> list[GateResult]:
    """The policy's metric gates on the sets the serving engine evaluated (multiple-choice,
    last-word and generation sets: text sets are scored in the reference numerics only, and the
    agreement gates judge them as served), each served result paired item by item with the
    baseline's, at one look: its last, always decided."""
    results: list[GateResult] = []
    look = Look(confidence=policy.policy.statistics.confidence, min_items=policy.policy.sequential.min_items)
    for set_name, gates in policy.policy.metrics.items():
        wanted = SetRef.parse(set_name)
        spec = next((s for s in served_items if wanted.matches(SetRef.parse(s))), None)
        if spec is None:
            continue
        if spec not in baseline_items:
            raise InputError(f"{spec}: served results with no baseline results on the same set")
        items = _aligned(baseline_items[spec], served_items[spec], spec)
        results += [metric_gate(spec, _gated(metric), gate, items, settings=policy.policy.statistics, precision=precision, look=look)
                    for metric, gate in gates.items()]
    return results


def _reference(record: ServeRecord, reference: ServeRecord | None, ceiling: float) -> Agreement | str:
    """The baseline's agreement, the base of every bound; or why there is none: the baseline not
    served or not compared, served by another engine or compared on another text set than the
    candidate, or itself served otherwise than gated (above `ceiling`)."""
    if reference is None or not reference.served:
        return f"the baseline was not served ({(reference.reason if reference else None) or 'no serve record of it'})"
    base = reference.agreement
    measured = record.agreement
    if base is None:
        return f"the baseline's served-vs-gated difference is unknown ({reference.not_compared or 'not compared'})"
    if reference.engine != record.engine:
        return f"the baseline was served by {reference.engine}, the candidate by {record.engine}"
    if reference.device_class != record.device_class:  # another class's kernels: another compute difference
        return f"the baseline was served on {reference.device_class}, the candidate on {record.device_class}"
    if measured is not None and base.evalset != measured.evalset:
        return f"the baseline was compared on {base.evalset}, the candidate on {measured.evalset}"
    if not base.mean_abs_logprob_difference <= ceiling:
        return (f"the baseline itself is served otherwise than gated (mean |difference| {base.mean_abs_logprob_difference:.3f} "
                f"nats a token, above {ceiling:g}): no bound built on it means anything")
    return base


def _serving_check(check: str, measured: Agreement, floor: float, margin: float, quantized: bool) -> GateResult:
    """One agreement gate: the measured value against the baseline's own (`floor`) plus `margin`."""
    limit = floor + margin
    where = f"{measured.positions:,} tokens of {measured.evalset}"
    if check == "nll_change":
        value = measured.nll_change
        ok = value <= limit
        reason = (f"serving: served NLL {measured.nll_served:.4f} against gated {measured.nll_gated:.4f} nats a token "
                  f"({value:+.4f}, {where}), {'within' if ok else 'beyond'} the bound {limit:+.4f} (the baseline's own "
                  f"{floor:+.4f} + {margin:g})")
    else:
        stat = check.split("_")[0]
        value = measured.mean_abs_logprob_difference if stat == "mean" else measured.p99_abs_logprob_difference
        ok = value <= limit
        kind = "quantized activations" if quantized else "weight-only"
        reason = (f"serving: served log-probs differ from gated by {value:.3f} nats a token ({stat} |difference|, {where}), "
                  f"{'within' if ok else 'beyond'} the bound {limit:.3f} (the baseline's own {floor:.3f} + {margin:g}, {kind})")
    return _single(SERVING, check, ok, value=value, limit=limit, unit="nats", reason=reason)


def judge(baseline_items: dict[str, Records], candidate_items: dict[str, Records] | None, policy: LoadedPolicy,
          precision: str, *, measurement: MeasurementRecord | None = None, smoke: SmokeCheck | None = None,
          overlap: OverlapSummary | None = None, metric_gates: list[GateResult] | None = None,
          allocation: dict[str, int] | None = None, serving: ServingEvidence | None = None) -> Verdict:
    """Every gate of the policy: integrity, size (when the candidate was measured), serving (where
    the policy gates it; with no `serving` evidence its gate blocks: not checked), then the metrics against the baseline: `metric_gates` where sequential evaluation decided
    them already, else one look at the items the results hold. Approved only when every gate passes."""
    results = integrity_gates(policy, smoke, overlap, candidate_items)
    if measurement is not None:
        results += size_gates(measurement, policy, allocation)
    results += serving_gates(policy, serving or ServingEvidence(None, None))
    if metric_gates is not None:
        results += metric_gates
    elif candidate_items is not None:
        results += compare(baseline_items, candidate_items, policy, precision).gates
    # fail closed: every metric gate of the policy must be there, decided, exactly once
    wanted = sorted((SetRef.parse(key).name, metric) for key, gates in policy.policy.metrics.items() for metric in gates)
    ids = [GateId.parse(result.gate) for result in results]
    present = sorted((SetRef.parse(gate.scope).name, gate.check) for gate in ids if gate.on_golden_set)
    if present != wanted and (metric_gates is not None or candidate_items is not None):
        raise InputError(f"the verdict holds metric gates {present}, the policy gates {wanted}: refusing to judge")
    quality = bool(wanted) and present == wanted and all(result.outcome is Outcome.passed for result in results
                                                         if GateId.parse(result.gate).scope != SERVING)
    approved = quality and all(result.outcome is Outcome.passed for result in results)
    return Verdict(approved, results, quality_passed=quality)
