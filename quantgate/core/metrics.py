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
    # the q-quantile of a per-token series over every position of the items, the candidate's
    # alone (inverted CDF: the smallest value with at least a share q of positions at or below it)
    token_quantile = "token_quantile"


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str  # what a gate's estimate is in: "points", "%", or "" (the value itself)
    higher_is_better: bool
    statistic: Statistic | None  # None: reported, never gated
    scale: float = 1.0  # statistic -> display units (a 0..1 difference is x100 points)
    # agreement metrics: the value of the baseline against itself (the report's baseline row)
    baseline_value: float | None = None
    # token_quantile metrics: which quantile of which per-token series (TextRun.token_values)
    quantile: float | None = None
    tokens: str | None = None

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
        # the tails of the per-token KL and the change in the probability of the baseline's top
        # token (Δp = q(t) - p(t)), as llama.cpp's perplexity tool reports them (docs/evaluate.md)
        Metric("kl_median", "", False, Statistic.token_quantile, baseline_value=0.0, quantile=0.5, tokens="kl"),
        Metric("kl_p90", "", False, Statistic.token_quantile, baseline_value=0.0, quantile=0.9, tokens="kl"),
        Metric("kl_p99", "", False, Statistic.token_quantile, baseline_value=0.0, quantile=0.99, tokens="kl"),
        Metric("kl_p999", "", False, Statistic.token_quantile, baseline_value=0.0, quantile=0.999, tokens="kl"),
        Metric("kl_max", "", False, Statistic.token_quantile, baseline_value=0.0, quantile=1.0, tokens="kl"),
        Metric("top_prob_change_mean", "", True, Statistic.ratio_of_sums, baseline_value=0.0),
        Metric("top_prob_change_p01", "", True, Statistic.token_quantile, baseline_value=0.0, quantile=0.01,
               tokens="top_prob_change"),
    )
}
GATEABLE = tuple(name for name, metric in METRICS.items() if metric.gateable)
TOKEN_QUANTILES = tuple(name for name, metric in METRICS.items() if metric.statistic is Statistic.token_quantile)


def metric(name: str) -> Metric:
    """The metric called `name`; an unknown name is one InputError line listing the known ones."""
    if name not in METRICS:
        valid = list(METRICS)
        raise InputError(f"unknown metric {name!r}{did_you_mean(name, valid)}; known: {', '.join(valid)}")
    return METRICS[name]
