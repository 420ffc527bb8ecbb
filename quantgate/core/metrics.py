"""The metrics quantgate measures, as one table: what each is in, which way is better, and
which paired statistic a gate compares it with. Verdicts, the pipeline and the report read it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from quantgate.core.errors import InputError, did_you_mean


class Statistic(str, Enum):
    """How a candidate's per-item records are compared with the baseline's."""

    mean_difference = "mean_difference"  # candidate - baseline of a per-item 0/1 score
    perplexity_change = "perplexity_change"  # exp(Σ nll_c / Σ n) / exp(Σ nll_b / Σ n) - 1
    ratio_of_sums = "ratio_of_sums"  # Σ per-item value / Σ positions, the candidate's alone


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str  # what a gate's estimate is in: "points", "%", or "" (the value itself)
    higher_is_better: bool
    statistic: Statistic | None  # None: reported, never gated
    scale: float = 1.0  # statistic -> display units (a 0..1 difference is x100 points)
    # agreement metrics: the value of the baseline against itself (the report's baseline row)
    baseline_value: float | None = None

    @property
    def gateable(self) -> bool:
        return self.statistic is not None

    @property
    def is_change(self) -> bool:
        """Whether a gate's estimate is a signed change against the baseline (points, percent),
        not the candidate's own value (an agreement with the baseline)."""
        return self.statistic in (Statistic.mean_difference, Statistic.perplexity_change)


METRICS: dict[str, Metric] = {
    metric.name: metric
    for metric in (
        Metric("acc", "points", True, Statistic.mean_difference, 100.0),
        Metric("acc_norm", "points", True, Statistic.mean_difference, 100.0),
        Metric("exact_match", "points", True, Statistic.mean_difference, 100.0),
        Metric("perplexity", "%", False, Statistic.perplexity_change, 100.0),
        Metric("kl_divergence", "", False, Statistic.ratio_of_sums, baseline_value=0.0),
        Metric("top1_agreement", "", True, Statistic.ratio_of_sums, baseline_value=1.0),
        Metric("bits_per_byte", "", False, None),
    )
}
GATEABLE = tuple(name for name, metric in METRICS.items() if metric.gateable)


def metric(name: str) -> Metric:
    """The metric called `name`; an unknown name is one InputError line listing the known ones."""
    if name not in METRICS:
        valid = list(METRICS)
        raise InputError(f"unknown metric {name!r}{did_you_mean(name, valid)}; known: {', '.join(valid)}")
    return METRICS[name]
