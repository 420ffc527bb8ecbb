"""Paired bootstrap confidence intervals for the difference between a candidate and its
baseline, item by item (Efron & Tibshirani, 1993, ch. 13; the paired design follows
Koehn, 2004, for comparing two systems on the same test items).

Resampling picks the same item indices for both models, so per-item correlation between
them (most items are easy or hard for both) narrows the interval, as it should.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from quantgate.core.errors import InputError

DEFAULT_RESAMPLES = 2000
DEFAULT_CONFIDENCE = 0.95

# A statistic maps resampled item indices (shape [R, n]) to one value per resample ([R]);
# with the identity indices (shape [1, n]) it gives the point estimate.
Statistic = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Interval:
    estimate: float  # the statistic on the actual items, unrounded
    low: float
    high: float
    confidence: float
    resamples: int
    items: int
    seed: int


def paired_bootstrap(statistic: Statistic, items: int, *, resamples: int = DEFAULT_RESAMPLES,
                     confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Interval:
    """Percentile interval of `statistic` over `resamples` paired resamples of `items` items."""
    if items < 1:
        raise InputError("a paired bootstrap needs at least one item")
    if not 0 < confidence < 1:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise InputError(f"resamples must be at least 1, got {resamples}")
    estimate = float(statistic(np.arange(items)[None, :])[0])
    generator = np.random.default_rng(seed)
    values = np.empty(resamples)
    chunk = max(1, 2_000_000 // items)  # bound memory: at most ~2M indices at a time
    for start in range(0, resamples, chunk):
        count = min(chunk, resamples - start)
        values[start : start + count] = statistic(generator.integers(0, items, size=(count, items)))
    tail = (1 - confidence) / 2
    low, high = np.quantile(values, [tail, 1 - tail])
    return Interval(estimate=estimate, low=float(low), high=float(high), confidence=confidence, resamples=resamples,
                    items=items, seed=seed)


def mean_difference(baseline: np.ndarray, candidate: np.ndarray) -> Statistic:
    """candidate mean − baseline mean (e.g. accuracy: per-item 0/1 correctness), as
    (Σ candidate − Σ baseline) / n: for 0/1 scores the sums are exact, so a difference of k items
    in n is the one double nearest k/n (what a bound of k/n points is compared with)."""
    baseline, candidate = _paired(baseline, candidate)
    return lambda index: (candidate[index].sum(axis=-1) - baseline[index].sum(axis=-1)) / index.shape[-1]


def relative_perplexity_change(baseline_nll: np.ndarray, baseline_tokens: np.ndarray,
                               candidate_nll: np.ndarray, candidate_tokens: np.ndarray) -> Statistic:
    """candidate perplexity / baseline perplexity − 1, perplexity = exp(Σ nll / Σ tokens) over
    the resampled items (a ratio of sums, not a mean of per-item perplexities)."""
    baseline_nll, candidate_nll = _paired(baseline_nll, candidate_nll)
    baseline_tokens, candidate_tokens = _paired(baseline_tokens, candidate_tokens)

    def statistic(index: np.ndarray) -> np.ndarray:
        baseline_rate = baseline_nll[index].sum(axis=-1) / baseline_tokens[index].sum(axis=-1)
        candidate_rate = candidate_nll[index].sum(axis=-1) / candidate_tokens[index].sum(axis=-1)
        change: np.ndarray = np.expm1(candidate_rate - baseline_rate)
        return change

    return statistic


def ratio_of_sums(numerator: np.ndarray, denominator: np.ndarray) -> Statistic:
    """Σ numerator / Σ denominator over resampled items (e.g. top-1 agreements / positions)."""
    numerator, denominator = _paired(numerator, denominator)
    return lambda index: numerator[index].sum(axis=-1) / denominator[index].sum(axis=-1)


# token_quantile works on at most this many (resample, token) weights at a time
_WEIGHTS_AT_ONCE = 4_000_000


def token_quantile(values_per_item: list[np.ndarray], q: float) -> Statistic:
    """The q-quantile of the per-token values of the resampled items, the candidate's alone (an
    item drawn twice counts its tokens twice): e.g. the 99th percentile of per-token KL.

    One rule for the point estimate and every resample, the inverted empirical CDF of
    `evalsets.agreement.quantile` (numpy's method="inverted_cdf"): with per-token weights w
    (how often the token's item was drawn) and the values sorted, the smallest value whose
    cumulative weight reaches q * Σ w. With every weight 1 (the actual items) this is exactly
    np.quantile(values, q, method="inverted_cdf"); q = 1 is the maximum. Values are sorted
    once; each resample costs one cumulative sum over the tokens. NaN anywhere gives NaN."""
    if not 0 <= q <= 1:
        raise InputError(f"a quantile must be in [0, 1], got {q}")
    arrays = [np.asarray(values, dtype=np.float64).ravel() for values in values_per_item]
    if not arrays or sum(array.size for array in arrays) == 0:
        raise InputError("a per-token quantile needs at least one token")
    values = np.concatenate(arrays)
    owner = np.repeat(np.arange(len(arrays)), [array.size for array in arrays])
    order = np.argsort(values, kind="stable")
    sorted_values, sorted_owner = values[order], owner[order]
    has_nan = bool(np.isnan(values).any())
    items = len(arrays)
    # a resample's total weight is at most items x the longest item's tokens
    counts = np.int32 if items * max(array.size for array in arrays) < 2**31 else np.int64

    def statistic(index: np.ndarray) -> np.ndarray:
        index = np.atleast_2d(index)
        resamples = index.shape[0]
        if has_nan:
            return np.full(resamples, np.nan)
        result = np.empty(resamples)
        rows = max(1, _WEIGHTS_AT_ONCE // values.size)
        for start in range(0, resamples, rows):
            chunk = index[start : start + rows]
            count = chunk.shape[0]
            offsets = (chunk + items * np.arange(count)[:, None]).ravel()
            draws = np.bincount(offsets, minlength=count * items).reshape(count, items).astype(counts)  # per item
            cumulative = np.cumsum(draws[:, sorted_owner], axis=1, dtype=counts)  # per token, in sorted order
            for row, weights in enumerate(cumulative):
                target = q * float(weights[-1])
                # the first position whose cumulative weight reaches q * Σ w (q = 0: the first with any weight)
                at = np.searchsorted(weights, target, side="left") if q > 0 else np.searchsorted(weights, 0, side="right")
                result[start + row] = sorted_values[at]
        return result

    return statistic


def _paired(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if first.shape != second.shape or first.ndim != 1:
        raise InputError(f"paired series must be 1-D and of equal length, got {first.shape} and {second.shape}")
    return first, second
