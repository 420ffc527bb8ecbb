"""Status lines and progress bars on stderr (stdout stays for results): the one console and the
one progress bar every stage shows its work with."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

stderr = Console(stderr=True)


class ItemsPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.2f} items/s" if speed else "- items/s", style="progress.data.speed")


def progress_bar(*, items_per_second: bool = False) -> Progress:
    """A transient bar: description, bar, done of total, elapsed time and time left; with
    `items_per_second` (the evaluator) also the rate."""
    columns: list[ProgressColumn] = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    if items_per_second:
        columns.append(ItemsPerSecond())
    columns += [TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    return Progress(*columns, console=stderr, transient=True)
