"""The paired bootstrap on inputs with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gates.stats import mean_difference, paired_bootstrap, ratio_of_sums, relative_perplexity_change
from quantgate.core.errors import InputError


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


def test_bad_inputs_are_errors() -> None:
    with pytest.raises(InputError):
        mean_difference(np.ones(3), np.ones(4))
    with pytest.raises(InputError):
        paired_bootstrap(lambda index: index.mean(-1), 0)
    with pytest.raises(InputError):
        paired_bootstrap(lambda index: index.mean(-1), 5, confidence=1.0)
