"""Sequential evaluation, the decision part: at which item counts a set is looked at, the
confidence of each look's interval, and whether a look decides a gate.

Error control is a Bonferroni split of the policy's error rate over a set's planned looks: with
K looks, each look's interval has confidence 1 - (1 - c) / K. A gate can pass at any look, so
the chance of a false approval is at most the sum over looks of each look's one-sided error,
(1 - c) / 2 in all (Bonferroni's inequality, which needs no assumption about how the looks'
estimates are correlated). Why this and not a group-sequential boundary: docs/gates.md.

The bound holds as far as each look's interval keeps its nominal coverage. The percentile
bootstrap falls short of it in the far tail on small samples, worst where few items differ
between the two models; tests/test_sequential.py measures the rate the rule actually achieves.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist

from quantgate.gates.policy import Outcome, decide


def schedule(looks: Sequence[int], ceiling: int) -> list[int]:
    """The item counts a set is looked at: the planned looks below its ceiling, then the ceiling."""
    if ceiling < 1:
        raise ValueError(f"a set's ceiling must be at least one item, got {ceiling}")
    return [n for n in looks if n < ceiling] + [ceiling]


def look_confidence(confidence: float, looks: int) -> float:
    """Bonferroni: each of `looks` intervals at 1 - (1 - confidence) / looks."""
    return 1.0 - (1.0 - confidence) / max(1, looks)


def critical_value(confidence: float, looks: int = 1) -> float:
    """z_{1 - a/2K}: the normal quantile that bounds each of `looks` two-sided intervals when the
    confidence is split over them (a = 1 - confidence, K = looks)."""
    return NormalDist().inv_cdf(1 - (1 - look_confidence(confidence, looks)) / 2)


def decide_at_look(estimate: float, low: float, high: float, *, limit: float, margin: float, higher_is_better: bool,
                   final: bool, items: int, min_items: int) -> Outcome | None:
    """The outcome of one gate at one look, or None while it is undecided (evaluate more items).

    Before the last look a gate is decided only when its interval lies wholly on one side of the
    limit (pass or fail) and at least `min_items` items were evaluated. At the last look (the
    ceiling) the fixed-size rule decides what is still open (`gates.policy.decide`), except that
    a gate below `min_items` is insufficient evidence.
    """
    if items >= min_items:
        if higher_is_better:
            if low >= limit:
                return Outcome.passed
            if high < limit:
                return Outcome.failed
        else:
            if high <= limit:
                return Outcome.passed
            if low > limit:
                return Outcome.failed
    if not final:
        return None
    if items < min_items:
        return Outcome.insufficient
    return decide(estimate, low, high, limit=limit, margin=margin, higher_is_better=higher_is_better)


def detectable_regression(half_width: float, confidence: float, power: float = 0.8) -> float:
    """The smallest true difference from the limit that an interval of this half-width finds
    with probability `power`: (z_{1-a/2} + z_power) * se, se = half_width / z_{1-a/2} (the usual
    minimum detectable effect of a two-sided test, normal approximation)."""
    z = critical_value(confidence)
    return half_width * (z + NormalDist().inv_cdf(power)) / z
