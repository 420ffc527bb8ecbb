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
from quantgate.core.errors import InputError
from gates.policy import LoadedPolicy, MetricGate, Outcome, decide

ACCURACY_METRICS = ("acc", "acc_norm", "exact_match")


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


def _aligned(baseline: list[dict[str, Any]], candidate: list[dict[str, Any]], spec: str) -> tuple[list[dict], list[dict]]:
    by_id = {item["id"]: item for item in candidate}
    if len(by_id) != len(candidate) or sorted(by_id) != sorted(item["id"] for item in baseline):
        raise InputError(f"{spec}: baseline and candidate results cover different items (evaluate both with the same --limit)")
    return baseline, [by_id[item["id"]] for item in baseline]


def _statistic(metric: str, baseline: list[dict], candidate: list[dict]) -> tuple[stats.Statistic, float, str, bool]:
    """(statistic, scale to display units, unit, higher_is_better) for one metric."""
    if metric in ACCURACY_METRICS:
        values = lambda items: np.array([item["metrics"][metric] for item in items], dtype=float)  # noqa: E731
        return stats.mean_difference(values(baseline), values(candidate)), 100.0, "points", True
    if metric == "perplexity":
        if "nll" in baseline[0]:  # text sets: Σ nll / Σ tokens
            nll = lambda items: np.array([item["nll"] for item in items], dtype=float)  # noqa: E731
            tokens = lambda items: np.array([item["tokens"] for item in items], dtype=float)  # noqa: E731
            return stats.relative_perplexity_change(nll(baseline), tokens(baseline), nll(candidate), tokens(candidate)), 100.0, "%", False
        nll = lambda items: np.array([-item["loglikelihood"] for item in items], dtype=float)  # noqa: E731
        ones = np.ones(len(baseline))
        return stats.relative_perplexity_change(nll(baseline), ones, nll(candidate), ones), 100.0, "%", False
    if metric in ("kl_divergence", "top1_agreement"):
        if "kl_sum" not in candidate[0]:
            raise InputError(f"candidate results have no {metric}: evaluate the candidate with --baseline-results")
        key = "kl_sum" if metric == "kl_divergence" else "top1_matches"
        numerator = np.array([item[key] for item in candidate], dtype=float)
        positions = np.array([item["tokens"] for item in candidate], dtype=float)
        return stats.ratio_of_sums(numerator, positions), 1.0, "", metric == "top1_agreement"
    raise InputError(f"no gate rule for metric {metric!r}")


def _limit(gate: MetricGate, precision: str) -> float:
    threshold = gate.threshold(precision)
    return -threshold if gate.kind == "max_drop_points" else threshold


def _describe(spec: str, metric: str, estimate: float, low: float, high: float, limit: float, unit: str, outcome: Outcome) -> str:
    name = spec.split("@")[0]
    signed = unit in ("points", "%")
    number = (lambda v: f"{v:+.2f}") if signed else (lambda v: f"{v:.4f}")
    suffix = f" {unit}" if unit == "points" else unit
    observed = f"{name} {metric} {number(estimate)}{suffix} [{number(low)}, {number(high)}]"
    if outcome is Outcome.failed:
        word = "exceeds" if unit else ("exceeds" if metric == "kl_divergence" else "is below")
        return f"{observed} {word} {number(limit)}{suffix}"
    if outcome is Outcome.insufficient:
        return f"{observed}: insufficient evidence, the interval reaches past {number(limit)}{suffix} by more than the policy allows"
    return f"{observed} within {number(limit)}{suffix}"


def compare(baseline_items: dict[str, list[dict]], candidate_items: dict[str, list[dict]],
            policy: LoadedPolicy, precision: str) -> Verdict:
    """`*_items`: set spec ("arc-easy@v1") -> per-item records (docs/evaluate.md, items.json)."""
    settings = policy.policy.statistics
    results: list[GateResult] = []
    for set_name, gates in policy.policy.metrics.items():
        spec = next((s for s in candidate_items if s == set_name or s.split("@")[0] == set_name), None)
        if spec is None or spec not in baseline_items:
            raise InputError(f"policy gates {set_name}, but the results hold no {set_name} for both models")
        baseline, candidate = _aligned(baseline_items[spec], candidate_items[spec], spec)
        for metric, gate in gates.items():
            statistic, scale, unit, higher_is_better = _statistic(metric, baseline, candidate)
            interval = stats.paired_bootstrap(statistic, len(baseline), resamples=settings.resamples,
                                              confidence=settings.confidence, seed=settings.seed)
            estimate, low, high = interval.estimate * scale, interval.low * scale, interval.high * scale
            limit = _limit(gate, precision)
            if not math.isfinite(estimate):
                # NaN compares false both ways, so it would slip through `decide`: a candidate
                # whose numbers are not finite fails, and says so.
                results.append(GateResult(f"{spec} {metric}", Outcome.failed, estimate, low, high, limit, unit,
                                          f"{spec.split('@')[0]} {metric} is {estimate} (NaN or Inf logits or losses)"))
                continue
            outcome = decide(estimate, low, high, limit, gate.margin, higher_is_better)
            results.append(GateResult(f"{spec} {metric}", outcome, estimate, low, high, limit, unit,
                                      _describe(spec, metric, estimate, low, high, limit, unit, outcome)))
    return Verdict(all(result.outcome is Outcome.passed for result in results), results)


# ---- the size and integrity gates -----------------------------------------------------------

# Explanation lines of `quantize.accounting` that are storage departing from the format, or
# bytes it cannot place: each byte of these blocks under `forbid_unexplained_bytes`.
UNEXPLAINED_CAUSES = ("wide_scales", "unaccounted_tensors", "wider_than_baseline", "tied_lm_head_stored",
                      "unknown_format_layers", "unexplained")


def _single(gate: str, passed: bool, value: float, limit: float, unit: str, reason: str) -> GateResult:
    return GateResult(gate, Outcome.passed if passed else Outcome.failed, value, value, value, limit, unit, reason)


def size_gates(measurement: dict[str, Any], policy: LoadedPolicy) -> list[GateResult]:
    """From `quantgate measure --json` of the candidate (measured against the baseline):
    bits per weight of the quantized layers against the format's exact figure, and bytes the
    accounting cannot explain. Exact comparisons, no rounding."""
    rules = policy.policy.size
    results = []
    bits = measurement["quantized_linear"]["bits_per_weight"]
    measured, exact = bits.get("measured"), bits.get("exact")
    if measured is not None and exact is not None:
        excess = measured - exact
        ok = excess <= rules.max_bits_per_weight_excess
        results.append(_single(
            "size bits_per_weight", ok, excess, rules.max_bits_per_weight_excess, "bits",
            f"size: quantized layers store {measured:.4f} bits per weight, the format's exact figure is {exact:.4f} "
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
        results.append(_single("size unexplained_bytes", not lines, float(extra), 0.0, "bytes", reason))
    return results


def non_finite(items_by_set: dict[str, list[dict[str, Any]]]) -> str | None:
    """The first per-item number that is NaN or Inf, described; None when all are finite."""
    for spec, items in items_by_set.items():
        for item in items:
            values = {**{k: v for k, v in item.items() if k != "metrics"}, **(item.get("metrics") or {})}
            for key, value in values.items():
                if isinstance(value, float) and not math.isfinite(value):
                    return f"{spec.split('@')[0]} item {item.get('id')} has {key} {value}"
    return None


def integrity_gates(policy: LoadedPolicy, smoke: dict[str, Any] | None, overlap: dict[str, Any] | None,
                    candidate_items: dict[str, list[dict[str, Any]]] | None = None) -> list[GateResult]:
    """The checkpoint loads and its logits are finite (the quantize stage's smoke check where it
    ran, and every number of the candidate's evaluation), and its calibration set shares few
    n-grams with the golden sets."""
    rules = policy.policy.integrity
    results = []
    if rules.require_finite_logits:
        problem = non_finite(candidate_items) if candidate_items is not None else None
        if problem is not None:
            results.append(_single("integrity finite_logits", False, 0.0, 1.0, "",
                                   f"integrity: NaN or Inf in the evaluation: {problem}"))
        elif smoke is not None and not smoke.get("logits_finite"):
            results.append(_single("integrity finite_logits", False, 0.0, 1.0, "",
                                   f"integrity: {smoke.get('error') or 'the smoke check found NaN or Inf logits'}"))
        elif smoke is None and candidate_items is None:
            results.append(_single("integrity finite_logits", False, 0.0, 1.0, "",
                                   "integrity: neither a smoke check nor an evaluation of this checkpoint is recorded"))
        else:
            where = " and ".join(part for part, present in (("on the smoke prompt", smoke is not None),
                                                            ("on every evaluated item", candidate_items is not None)) if present)
            results.append(_single("integrity finite_logits", True, 1.0, 1.0, "",
                                   f"integrity: the checkpoint loads and its logits are finite {where}"))
    if overlap is not None:
        share = overlap["share"]
        ok = share <= rules.max_calibration_overlap
        results.append(_single(
            "integrity calibration_overlap", ok, share, rules.max_calibration_overlap, "",
            f"integrity: {overlap['shared_ngrams']} of the calibration set's {overlap['candidate_ngrams']} "
            f"{overlap['n']}-grams occur in the golden sets ({share:.2%}, "
            f"{'within' if ok else 'exceeds'} {rules.max_calibration_overlap:.2%})"))
    return results


def judge(baseline_items: dict[str, list[dict]], candidate_items: dict[str, list[dict]], policy: LoadedPolicy,
          precision: str, *, measurement: dict[str, Any] | None = None, smoke: dict[str, Any] | None = None,
          overlap: dict[str, Any] | None = None) -> Verdict:
    """Every gate of the policy: metrics against the baseline, then size (when the candidate was
    measured) and integrity. Approved only when every gate passes."""
    results = integrity_gates(policy, smoke, overlap, candidate_items)
    if measurement is not None:
        results += size_gates(measurement, policy)
    results += compare(baseline_items, candidate_items, policy, precision).gates
    return Verdict(all(result.outcome is Outcome.passed for result in results), results)
