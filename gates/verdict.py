"""Verdicts: compare a candidate's per-item results with its baseline's, metric by metric,
under a policy, with paired bootstrap intervals; approve only when every gate passes.

Thin over two pure parts: `gates.stats` (the intervals) and `gates.policy.decide` (the rule).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gates import stats
from gates.policy import LoadedPolicy, MetricGate, Outcome, Statistics, decide
from quantgate.core.errors import InputError
from quantgate.core.ids import INTEGRITY, SIZE, GateId, SetRef
from quantgate.core.metrics import METRICS, Metric, Statistic
from quantize.measure.causes import UNEXPLAINED_CAUSES

Records = list[dict[str, Any]]  # per-item records of one set (docs/evaluate.md, items.json)

# Where a text set's per-item record keeps the numerator of each ratio-of-sums metric.
_NUMERATORS = {"kl_divergence": "kl_sum", "top1_agreement": "top1_matches"}


@dataclass(frozen=True)
class GateResult:
    gate: str  # "hellaswag@v1 acc_norm"
    outcome: Outcome
    estimate: float  # unrounded: difference in points, change in percent, or the value itself
    low: float
    high: float
    limit: float
    unit: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome.value}


@dataclass(frozen=True)
class Verdict:
    approved: bool
    gates: list[GateResult] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [gate.reason for gate in self.gates if gate.outcome is not Outcome.passed]


def blocked_verdict(reason: str) -> Verdict:
    """The verdict on a checkpoint that failed its own checks (it does not load, or its logits
    are NaN/Inf): one failed integrity gate, nothing measured, nothing to deploy."""
    failure = GateResult(gate=str(GateId(INTEGRITY, "loads")), outcome=Outcome.failed, estimate=0.0, low=0.0, high=0.0, limit=1.0,
                         unit="", reason=f"integrity: {reason}")
    return Verdict(False, [failure])


def _aligned(baseline: Records, candidate: Records, spec: str) -> tuple[Records, Records]:
    by_id = {item["id"]: item for item in candidate}
    if len(by_id) != len(candidate) or sorted(by_id) != sorted(item["id"] for item in baseline):
        raise InputError(f"{spec}: baseline and candidate results cover different items (evaluate both with the same --limit)")
    return baseline, [by_id[item["id"]] for item in baseline]


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
    raise InputError(f"no gate rule for metric {metric.name!r}")


def _limit(gate: MetricGate, precision: str) -> float:
    threshold = gate.threshold(precision)
    return -threshold if gate.kind == "max_drop_points" else threshold


def _describe(name: str, metric: Metric, outcome: Outcome, *, estimate: float, low: float, high: float, limit: float) -> str:
    def number(value: float) -> str:
        return f"{value:+.2f}" if metric.is_change else f"{value:.4f}"

    suffix = f" {metric.unit}" if metric.unit == "points" else metric.unit
    observed = f"{name} {metric.name} {number(estimate)}{suffix} [{number(low)}, {number(high)}]"
    if outcome is Outcome.failed:
        word = "is below" if metric.higher_is_better and not metric.is_change else "exceeds"
        return f"{observed} {word} {number(limit)}{suffix}"
    if outcome is Outcome.insufficient:
        return f"{observed}: insufficient evidence, the interval reaches past {number(limit)}{suffix} by more than the policy allows"
    return f"{observed} within {number(limit)}{suffix}"


def _metric_gate(spec: str, metric: Metric, gate: MetricGate, items: tuple[Records, Records], *,
                 settings: Statistics, precision: str) -> GateResult:
    """One metric of one set: the estimate and its paired-bootstrap interval, against the limit."""
    baseline, candidate = items
    interval = stats.paired_bootstrap(_statistic(metric, baseline, candidate), len(baseline), resamples=settings.resamples,
                                      confidence=settings.confidence, seed=settings.seed)
    estimate, low, high = interval.estimate * metric.scale, interval.low * metric.scale, interval.high * metric.scale
    limit = _limit(gate, precision)
    name = SetRef.parse(spec).name
    if not math.isfinite(estimate):
        # NaN compares false both ways, so it would slip through `decide`: a candidate
        # whose numbers are not finite fails, and says so.
        outcome, reason = Outcome.failed, f"{name} {metric.name} is {estimate} (NaN or Inf logits or losses)"
    else:
        outcome = decide(estimate, low, high, limit=limit, margin=gate.margin, higher_is_better=metric.higher_is_better)
        reason = _describe(name, metric, outcome, estimate=estimate, low=low, high=high, limit=limit)
    return GateResult(gate=str(GateId(spec, metric.name)), outcome=outcome, estimate=estimate, low=low, high=high,
                      limit=limit, unit=metric.unit, reason=reason)


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
        results += [_metric_gate(spec, _gated(metric), gate, items, settings=policy.policy.statistics, precision=precision)
                    for metric, gate in gates.items()]
    return Verdict(all(result.outcome is Outcome.passed for result in results), results)


# ---- the size and integrity gates -----------------------------------------------------------

def _single(scope: str, check: str, passed: bool, *, value: float, limit: float, unit: str, reason: str) -> GateResult:
    """A gate on one exact number (no interval: low = estimate = high)."""
    return GateResult(gate=str(GateId(scope, check)), outcome=Outcome.passed if passed else Outcome.failed,
                      estimate=value, low=value, high=value, limit=limit, unit=unit, reason=reason)


def size_gates(measurement: dict[str, Any], policy: LoadedPolicy) -> list[GateResult]:
    """From `quantgate measure --json` of the candidate (measured against the baseline):
    bits per weight of the quantized layers against the format's exact figure, and bytes the
    accounting cannot explain (the explanation lines whose cause is storage departing from the
    format, or bytes measure cannot place; `quantize.measure.causes`). Exact comparisons, no rounding."""
    rules = policy.policy.size
    results = []
    bits = measurement["quantized_linear"]["bits_per_weight"]
    measured, exact = bits.get("measured"), bits.get("exact")
    if measured is not None and exact is not None:
        excess = measured - exact
        ok = excess <= rules.max_bits_per_weight_excess
        results.append(_single(
            SIZE, "bits_per_weight", ok, value=excess, limit=rules.max_bits_per_weight_excess, unit="bits",
            reason=f"size: quantized layers store {measured:.4f} bits per weight, the format's exact figure is {exact:.4f} "
            f"({excess:+.4f}, {'within' if ok else 'exceeds'} the tolerance {rules.max_bits_per_weight_excess})"))
    if rules.forbid_unexplained_bytes:
        lines = [line for line in measurement["explanation"]["lines"]
                 if line["cause"] in UNEXPLAINED_CAUSES and (line["bytes"] or 0) > 0]
        extra = sum(line["bytes"] for line in lines)
        if lines:
            details = "; ".join(f"{line['detail']} ({line['bytes']:,.0f} B)" for line in lines[:3])
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


def _finite_logits(smoke: dict[str, Any] | None, candidate_items: dict[str, Records] | None) -> GateResult:
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


def integrity_gates(policy: LoadedPolicy, smoke: dict[str, Any] | None, overlap: dict[str, Any] | None,
                    candidate_items: dict[str, Records] | None = None) -> list[GateResult]:
    """The checkpoint loads and its logits are finite (the quantize stage's smoke check where it
    ran, and every number of the candidate's evaluation), and its calibration set shares few
    n-grams with the golden sets."""
    rules = policy.policy.integrity
    results = []
    if rules.require_finite_logits:
        results.append(_finite_logits(smoke, candidate_items))
    if overlap is not None:
        share = overlap["share"]
        ok = share <= rules.max_calibration_overlap
        results.append(_single(
            INTEGRITY, "calibration_overlap", ok, value=share, limit=rules.max_calibration_overlap, unit="",
            reason=f"integrity: {overlap['shared_ngrams']} of the calibration set's {overlap['candidate_ngrams']} "
            f"{overlap['n']}-grams occur in the golden sets ({share:.2%}, "
            f"{'within' if ok else 'exceeds'} {rules.max_calibration_overlap:.2%})"))
    return results


def judge(baseline_items: dict[str, Records], candidate_items: dict[str, Records], policy: LoadedPolicy,
          precision: str, *, measurement: dict[str, Any] | None = None, smoke: dict[str, Any] | None = None,
          overlap: dict[str, Any] | None = None) -> Verdict:
    """Every gate of the policy: metrics against the baseline, then size (when the candidate was
    measured) and integrity. Approved only when every gate passes."""
    results = integrity_gates(policy, smoke, overlap, candidate_items)
    if measurement is not None:
        results += size_gates(measurement, policy)
    results += compare(baseline_items, candidate_items, policy, precision).gates
    return Verdict(all(result.outcome is Outcome.passed for result in results), results)
