"""What a run decides from its verdicts, beyond each verdict: which checkpoints may be deployed,
the format recommended per hardware profile and on the machine that served them, and which are
on the size-against-quality front. The report renders these decisions; it makes none of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quantgate.gates.report_model import TRIAL, RowRecord, SearchRole


def search_role(row: RowRecord) -> SearchRole | None:
    """TRIAL, HELD_OUT, or None for the baseline and a uniform format."""
    return row.search.role if row.search is not None else None


def deployable(row: RowRecord) -> bool:
    """Approved by a verdict that can approve it: a format's own, or the search's held-out gate;
    never a trial's verdict on the search split (reached on the items that selected it)."""
    return row.verdict == "approved" and search_role(row) != TRIAL


def recommendation(rows: Sequence[RowRecord], profile: str) -> str | None:
    """The approved format with the lowest batch-1 decode bound on `profile`, or None. A mixed
    checkpoint counts by its held-out verdict (row `<trial>@held-out`) only, never by a trial's."""
    approved = [row for row in rows if deployable(row) and profile in row.bounds]
    if not approved:
        return None
    return min(approved, key=lambda row: row.bounds[profile].batch1_ms).format


def decode_rate(row: RowRecord) -> float | None:
    """The row's measured vLLM decode tokens/s at batch 1 (median of runs), None where not served."""
    serving = row.serving
    entry = serving.throughput.get("1") if serving is not None and serving.served else None
    return None if entry is None else entry.tokens_per_s


@dataclass(frozen=True)
class MeasuredDecision:
    """On the machine the serve stage ran on: the deployable row vLLM decodes fastest at batch 1
    (None: none was served), the baseline's rate, and the deployable rows slower than it."""

    best: RowRecord | None
    baseline_tokens_per_s: float | None
    slower_than_baseline: list[RowRecord]
    device: str | None


def measured_recommendation(rows: Sequence[RowRecord]) -> MeasuredDecision | None:
    """The deployable format vLLM decodes fastest at batch 1 where the serve stage measured it
    (measured tokens/s, median of runs); None without serve checks."""
    baseline = next((row for row in rows if row.verdict == "baseline"), None)
    measured = [row for row in rows if deployable(row) and decode_rate(row) is not None]
    base_rate = None if baseline is None else decode_rate(baseline)
    if not measured and base_rate is None:
        return None
    best = max(measured, key=lambda row: decode_rate(row) or 0.0) if measured else None
    where = best or baseline
    return MeasuredDecision(
        best=best, baseline_tokens_per_s=base_rate,
        slower_than_baseline=[row for row in measured if base_rate is not None and (decode_rate(row) or 0.0) < base_rate],
        device=where.serving.device if where is not None and where.serving is not None else None)


def pareto_front(points: list[tuple[float, float, str]], higher_is_better: bool = True) -> list[tuple[float, float, str]]:
    """Points (size, quality, label) not beaten by another that is no larger and no worse."""
    sign = 1.0 if higher_is_better else -1.0
    front, best = [], float("-inf")
    for size, quality, label in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if sign * quality > best:
            front.append((size, quality, label))
            best = sign * quality
    return front
