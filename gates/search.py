"""The mixed-precision search's decisions, as pure functions: which byte budget to try next
(bisection on the gates' verdicts), which trial the search chooses, and what its record says.
The pipeline (`quantgate.pipeline.search`) runs the trials; docs/search.md explains the rule.

A trial is judged on the search split (the plan's own items); the trial chosen is judged once
more, on held-out items no trial saw, and only that verdict can approve it: a search that keeps
the trial that passed its gates has selected on those gates' items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tried:
    """One trial: the budget it was allocated under, the bytes it stores, its verdict."""

    name: str
    budget: int  # total tensor bytes the allocation was allowed
    bytes: int  # total tensor bytes the allocation gives it (what its size gate holds it to)
    approved: bool
    blocked_by: str | None = None  # the first reason it was blocked
    trial: bool = True  # False: a uniform format the search mixes, judged on the same items (a known point)


def next_budget(lo: int, ceiling: int, tried: list[Tried], *, resolution: int) -> int | None:
    """The next budget to try, or None when the search is done.

    `tried` holds the trials so far and the uniform formats the search mixes (judged on the same
    items: known points). With no pass at or below `ceiling` (the plan's byte ceiling, or the
    largest uniform format), the ceiling is tried first: if nothing passes there, nothing smaller
    is expected to (the predicted cost only grows as the budget shrinks). After a pass, bisect
    between the largest budget that failed below it (or `lo`, the smallest uniform format, which
    failed) and the smallest that passed; stop when they are within `resolution` bytes."""
    passed = [trial.budget for trial in tried if trial.approved and trial.budget <= ceiling]
    if not passed:
        return None if any(trial.trial and trial.budget == ceiling for trial in tried) else ceiling
    top = min(passed)
    bottom = max([trial.budget for trial in tried if not trial.approved and trial.budget < top], default=lo)
    if top - bottom <= resolution:
        return None
    return (top + bottom) // 2


def chosen(tried: list[Tried]) -> Tried | None:
    """The smallest approved trial (by the bytes it stores), or None."""
    approved = [trial for trial in tried if trial.approved and trial.trial]
    return min(approved, key=lambda trial: (trial.bytes, trial.name)) if approved else None


def conclusion(tried: list[Tried], held_out: dict[str, Any] | None, baseline_bytes: int) -> str:
    """One sentence: what the search found, or why it found nothing."""
    pick = chosen(tried)
    trials = [trial for trial in tried if trial.trial]
    if pick is None:
        if not trials:
            return "no trial ran"
        last = trials[-1]
        return (f"no trial passed on the search split; the last, {last.name} at {last.bytes / baseline_bytes:.3f}x, "
                f"was blocked by {last.blocked_by}")
    ratio = f"{pick.bytes / baseline_bytes:.3f}x the baseline's bytes"
    if held_out is None:
        return f"{pick.name} ({ratio}) passed on the search split; its held-out gate has not run"
    if held_out["verdict"] == "approved":
        return f"{pick.name} ({ratio}) is approved on held-out items the search never saw"
    if held_out["verdict"] == "pending":
        return (f"{pick.name} ({ratio}) passes the quality gates on held-out items the search never saw; "
                f"serving is pending: {'; '.join(held_out.get('reasons') or []) or 'no serving evidence'}")
    reasons = "; ".join(held_out.get("reasons") or []) or "no reason recorded"
    return f"{pick.name} ({ratio}) passed on the search split but is blocked on the held-out items: {reasons}"
