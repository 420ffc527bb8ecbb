"""The paired bootstrap on inputs with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quantgate.core.errors import InputError
from quantgate.gates.stats import mean_difference, paired_bootstrap, ratio_of_sums, relative_perplexity_change, token_quantile


def test_identical_models_have_a_zero_width_interval_at_zero() -> None:
    correct = np.array([1, 0, 1, 1, 0, 1, 0, 1])
    interval = paired_bootstrap(mean_difference(correct, correct), len(correct))
    assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0)


def test_point_estimate_is_the_exact_unrounded_difference() -> None:
    baseline = np.array([1, 1, 1, 0, 1, 1, 0, 1, 1, 1])  # 0.8
    candidate = np.array([1, 1, 0, 0, 1, 1, 0, 1, 1, 0])  # 0.6
    interval = paired_bootstrap(mean_difference(baseline, candidate), 10, seed=3)
    assert interval.estimate == pytest.approx(-0.2, abs=1e-15)
    assert interval.low <= interval.estimate <= interval.high
    assert interval.high <= 0.0  # the candidate never wins an item, so no resample favours it


def test_same_seed_same_interval_other_seed_other_interval() -> None:
    rng = np.random.default_rng(0)
    baseline, candidate = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    first = paired_bootstrap(mean_difference(baseline, candidate), 200, seed=7)
    again = paired_bootstrap(mean_difference(baseline, candidate), 200, seed=7)
    other = paired_bootstrap(mean_difference(baseline, candidate), 200, seed=8)
    assert (first.low, first.high) == (again.low, again.high)
    assert (first.low, first.high) != (other.low, other.high)


def test_interval_narrows_with_more_items() -> None:
    rng = np.random.default_rng(1)
    widths = []
    for items in (50, 2000):
        baseline = rng.integers(0, 2, items)
        flips = rng.random(items) < 0.1
        candidate = np.where(flips, 1 - baseline, baseline)
        interval = paired_bootstrap(mean_difference(baseline, candidate), items)
        widths.append(interval.high - interval.low)
    assert widths[1] < widths[0] / 3


def test_relative_perplexity_change_is_a_ratio_of_sums() -> None:
    baseline_nll, tokens = np.array([2.0, 4.0]), np.array([1.0, 3.0])
    candidate_nll = np.array([2.0, 4.4])
    interval = paired_bootstrap(relative_perplexity_change(baseline_nll, tokens, candidate_nll, tokens), 2)
    assert interval.estimate == pytest.approx(math.exp(6.4 / 4) / math.exp(6.0 / 4) - 1)


def test_ratio_of_sums_for_agreement() -> None:
    agreements, positions = np.array([9, 10]), np.array([10, 10])
    assert paired_bootstrap(ratio_of_sums(agreements, positions), 2).estimate == pytest.approx(0.95)


def test_token_quantile_known_answers_on_tiny_inputs() -> None:
    # tokens 1..10 over three items; inverted CDF: the smallest value with a share >= q at or below it
    items = [np.array([3.0, 1.0, 2.0]), np.array([10.0, 4.0]), np.array([5.0, 9.0, 6.0, 8.0, 7.0])]
    identity = np.arange(3)[None, :]
    for q, expected in ((0.5, 5.0), (0.9, 9.0), (0.91, 10.0), (0.99, 10.0), (1.0, 10.0), (0.01, 1.0), (0.0, 1.0), (0.1, 1.0),
                        (0.11, 2.0)):
        assert token_quantile(items, q)(identity)[0] == expected, q
    # resamples: item 0 twice and item 1 (1, 1, 2, 2, 3, 3, 4, 10): the median is 2, the p90 10
    # (cumulative weight 7 of 8 is below 0.9 x 8 = 7.2); item 2 alone: its own median 7
    resamples = np.array([[0, 0, 1], [2, 2, 2], [1, 1, 1]])
    assert token_quantile(items, 0.5)(resamples).tolist() == [2.0, 7.0, 4.0]
    assert token_quantile(items, 0.9)(resamples).tolist() == [10.0, 9.0, 10.0]
    assert token_quantile(items, 0.0)(resamples).tolist() == [1.0, 5.0, 4.0]  # a weightless token is never the minimum


def test_token_quantile_point_estimate_is_the_metric_evaluate_reports() -> None:
    from quantgate.evalsets import agreement

    rng = np.random.default_rng(4)
    items = [rng.exponential(0.05, size=rng.integers(1, 60)).astype(np.float32) for _ in range(40)]
    items[7][3] = 2.5  # one far-off token
    every = np.concatenate(items)
    for q in (0.0, 0.01, 0.5, 0.9, 0.99, 0.999, 1.0, 1 / 3):
        interval = paired_bootstrap(token_quantile(items, q), len(items), resamples=200)
        assert interval.estimate == agreement.quantile(every, q) == float(np.quantile(every, q, method="inverted_cdf"))
    assert paired_bootstrap(token_quantile(items, 1.0), len(items), resamples=200).estimate == pytest.approx(2.5)


def test_token_quantile_weights_equal_the_plain_quantile_of_the_repeated_tokens() -> None:
    rng = np.random.default_rng(5)
    items = [rng.normal(size=rng.integers(1, 9)) for _ in range(12)]
    index = rng.integers(0, 12, size=(300, 12))
    for q in (0.01, 0.37, 0.5, 0.99, 1.0):
        expected = [np.quantile(np.concatenate([items[i] for i in row]), q, method="inverted_cdf") for row in index]
        assert token_quantile(items, q)(index).tolist() == expected


def test_token_quantile_chunks_resamples_and_nan_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantgate.gates import stats

    rng = np.random.default_rng(6)
    items = [rng.normal(size=5) for _ in range(10)]
    index = rng.integers(0, 10, size=(50, 10))
    whole = token_quantile(items, 0.9)(index)
    monkeypatch.setattr(stats, "_WEIGHTS_AT_ONCE", 120)  # two resamples at a time
    assert token_quantile(items, 0.9)(index).tolist() == whole.tolist()
    items[3][0] = np.nan
    assert np.isnan(token_quantile(items, 0.5)(index)).all()
    with pytest.raises(InputError):
        token_quantile(items, 1.5)
    with pytest.raises(InputError):
        token_quantile([np.array([])], 0.5)


def test_ratio_of_sums_for_the_mean_top_prob_change() -> None:
    # Δp summed per item, over the positions: (-0.2 - 0.1 + 0.0) / (10 + 20 + 10) tokens
    sums, tokens = np.array([-0.2, -0.1, 0.0]), np.array([10, 20, 10])
    assert paired_bootstrap(ratio_of_sums(sums, tokens), 3).estimate == pytest.approx(-0.3 / 40)


def test_bad_inputs_are_errors() -> None:
    with pytest.raises(InputError):
        mean_difference(np.ones(3), np.ones(4))
    with pytest.raises(InputError):
        paired_bootstrap(lambda index: index.mean(-1), 0)
    with pytest.raises(InputError):
        paired_bootstrap(lambda index: index.mean(-1), 5, confidence=1.0)
