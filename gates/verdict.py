"""Verdicts: compare a candidate's per-item results with its baseline's, metric by metric,
under a policy, with paired bootstrap intervals; approve only when every gate passes.

Thin over two pure parts: `gates.stats` (the intervals) and `gates.policy.decide` (the rule).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gates import stats
from gates.errors import InputError
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
            outcome = decide(estimate, low, high, limit, gate.margin, higher_is_better)
            results.append(GateResult(f"{spec} {metric}", outcome, estimate, low, high, limit, unit,
                                      _describe(spec, metric, estimate, low, high, limit, unit, outcome)))
    return Verdict(all(result.outcome is Outcome.passed for result in results), results)
