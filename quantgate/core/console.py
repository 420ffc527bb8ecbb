"""Progress bars and status lines on stderr (stdout stays for results)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")

stderr = Console(stderr=True)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=stderr,
        transient=True,
    )


def track(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    with progress_bar() as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
