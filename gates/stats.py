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
# ... and on a table of counts below each sorted position (tokens x items) of at most this many entries
_TABLE_AT_MOST = 20_000_000


def token_quantile(values_per_item: list[np.ndarray], q: float) -> Statistic:
    """The q-quantile of the per-token values of the resampled items, the candidate's alone (an
    item drawn twice counts its tokens twice): e.g. the 99th percentile of per-token KL.

    One rule for the point estimate and every resample, the inverted empirical CDF of
    `evalsets.agreement.quantile` (numpy's method="inverted_cdf"): with per-token weights w
    (how often the token's item was drawn) and the values sorted, the smallest value whose
    cumulative weight reaches q * Σ w. With every weight 1 (the actual items) this is exactly
    np.quantile(values, q, method="inverted_cdf"); q = 1 is the maximum. Values are sorted
    once; each resample costs a binary search over the sorted tokens, log2(tokens) steps of one
    dot product over the items (a nested bootstrap runs it on tens of thousands of resamples),
    or, past `_TABLE_AT_MOST`, one cumulative sum over the tokens. NaN anywhere gives NaN."""
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
    # below[p, i]: how many of item i's tokens sit at sorted positions 0..p; a resample's
    # cumulative weight at p is then draws . below[p], and the quantile's position is found by a
    # binary search over p (log2(tokens) steps of `items` each) instead of a cumulative sum over
    # every token; where that table would be too large, the cumulative sum it is
    table = values.size * items <= _TABLE_AT_MOST
    below = _counts_below(sorted_owner, items, counts) if table and not has_nan else None

    def statistic(index: np.ndarray) -> np.ndarray:
        index = np.atleast_2d(index)
        resamples = index.shape[0]
        if has_nan:
            return np.full(resamples, np.nan)
        result = np.empty(resamples)
        rows = max(1, _WEIGHTS_AT_ONCE // (items if below is not None else values.size))
        for start in range(0, resamples, rows):
            chunk = index[start : start + rows]
            count = chunk.shape[0]
            offsets = (chunk + items * np.arange(count)[:, None]).ravel()
            draws = np.bincount(offsets, minlength=count * items).reshape(count, items).astype(counts)  # per item
            if below is not None:
                result[start : start + count] = sorted_values[_first_reaching(below, draws, q)]
                continue
            cumulative = np.cumsum(draws[:, sorted_owner], axis=1, dtype=counts)  # per token, in sorted order
            for row, weights in enumerate(cumulative):
                target = q * float(weights[-1])
                # the first position whose cumulative weight reaches q * Σ w (q = 0: the first with any weight)
                at = np.searchsorted(weights, target, side="left") if q > 0 else np.searchsorted(weights, 0, side="right")
                result[start + row] = sorted_values[at]
        return result

    return statistic


def _counts_below(sorted_owner: np.ndarray, items: int, dtype: type) -> np.ndarray:
    """[tokens, items]: at row p, how many of each item's tokens are at sorted positions 0..p."""
    widest = int(np.bincount(sorted_owner, minlength=items).max()) if sorted_owner.size else 0
    kind = np.int16 if widest < 2**15 else dtype
    below: np.ndarray = np.zeros((sorted_owner.size, items), dtype=kind)
    below[np.arange(sorted_owner.size), sorted_owner] = 1
    return np.cumsum(below, axis=0, dtype=kind)


def _first_reaching(below: np.ndarray, draws: np.ndarray, q: float) -> np.ndarray:
    """Per resample (a row of `draws`, how often each item was drawn): the first sorted position
    whose cumulative weight reaches q x the total (q = 0: the first with any weight), by binary
    search; the same position as np.searchsorted on the cumulative weights."""
    weights = draws.astype(np.int64)
    target = q * (weights @ below[-1].astype(np.int64)).astype(np.float64)  # q x the resample's tokens
    low, high = np.zeros(len(draws), dtype=np.int64), np.full(len(draws), below.shape[0] - 1, dtype=np.int64)
    while bool((low < high).any()):
        middle = (low + high) // 2
        reached = np.einsum("ri,ri->r", below[middle], weights, dtype=np.int64)
        enough = reached >= target if q > 0 else reached > 0
        high, low = np.where(enough, middle, high), np.where(enough, low, middle + 1)
    return low


def _paired(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if first.shape != second.shape or first.ndim != 1:
        raise InputError(f"paired series must be 1-D and of equal length, got {first.shape} and {second.shape}")
    return first, second


# ---- verdict stability: does a resample of the items decide the same? -------------------------

STABILITY_RESAMPLES = 200  # outer resamples: the share's standard error is at most 0.035 (0.021 near 0.9)
STABILITY_INNER_RESAMPLES = 400  # each outer resample's own interval, from this many inner resamples
STABILITY_BAR = 0.9  # below it a decided verdict is flagged unstable (docs/gates.md, "Verdict stability")

# nested_intervals draws at most this many (outer, inner, item) indices at a time
_NESTED_AT_ONCE = 4_000_000


@dataclass(frozen=True)
class Stability:
    share: float  # the share of resamples whose own decision is the gate's
    resamples: int
    inner_resamples: int
    seed: int


def nested_intervals(statistic: Statistic, items: int, *, resamples: int = STABILITY_RESAMPLES,
                     inner_resamples: int = STABILITY_INNER_RESAMPLES, confidence: float = DEFAULT_CONFIDENCE,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A nested paired bootstrap: `resamples` resamples of the items with replacement (the outer
    ones), and for each the statistic's estimate on it and its percentile interval at `confidence`
    from `inner_resamples` resamples of that resample (as `paired_bootstrap` makes the interval on
    the actual items). Returns (estimates, lows, highs), each of shape [resamples].

    Vectorized: an inner resample of an outer one is the outer row read at inner indices, so a
    chunk of outer rows and all their inner draws go through `statistic` as one [rows, items]
    index array."""
    if items < 1:
        raise InputError("a nested bootstrap needs at least one item")
    if not 0 < confidence < 1:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1 or inner_resamples < 1:
        raise InputError(f"resamples must be at least 1, got {resamples} outer and {inner_resamples} inner")
    generator = np.random.default_rng(seed)
    outer = generator.integers(0, items, size=(resamples, items))
    estimates = np.asarray(statistic(outer), dtype=np.float64)
    lows, highs = np.empty(resamples), np.empty(resamples)
    tail = (1 - confidence) / 2
    chunk = max(1, _NESTED_AT_ONCE // (inner_resamples * items))
    for start in range(0, resamples, chunk):
        rows = outer[start : start + chunk]
        count = rows.shape[0]
        inner = generator.integers(0, items, size=(count, inner_resamples, items))
        composed = rows[np.arange(count)[:, None, None], inner]  # [count, inner, items]: indices of the actual items
        values = np.asarray(statistic(composed.reshape(count * inner_resamples, items)), dtype=np.float64)
        ends = np.quantile(values.reshape(count, inner_resamples), [tail, 1 - tail], axis=1)
        lows[start : start + count], highs[start : start + count] = ends[0], ends[1]
    return estimates, lows, highs


def verdict_stability(statistic: Statistic, items: int, decide: Callable[[float, float, float], object], outcome: object, *,
                      confidence: float, resamples: int = STABILITY_RESAMPLES,
                      inner_resamples: int = STABILITY_INNER_RESAMPLES, seed: int = 0) -> Stability:
    """The share of `resamples` resamples of the items on which the gate's own rule, `decide`
    (estimate, low, high) -> outcome, applied to the resample's estimate and its own interval at
    the same `confidence` (`nested_intervals`), gives `outcome`, the gate's decision on the actual
    items. 1.0: every resample decides the same; near 0.5: the items sit on the limit, and which
    way the gate went was a coin's throw. `decide` sees unrounded numbers in the statistic's units."""
    estimates, lows, highs = nested_intervals(statistic, items, resamples=resamples, inner_resamples=inner_resamples,
                                              confidence=confidence, seed=seed)
    same = sum(decide(float(e), float(lo), float(hi)) == outcome for e, lo, hi in zip(estimates, lows, highs, strict=True))
    return Stability(share=same / resamples, resamples=resamples, inner_resamples=inner_resamples, seed=seed)
