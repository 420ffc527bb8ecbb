"""Status lines and progress bars on stderr (stdout stays for results): the one console and the
one progress bar every stage shows its work with."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

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
    # no redirection of sys.stdout/sys.stderr through the bar: what other libraries print while it
    # runs goes where `library_output` sends it, not onto the terminal above the bar. Off where
    # stderr is neither a terminal nor a notebook (a pipe, a CI log): a transient bar there draws
    # nothing but leaves an empty line when it stops (measured: 23 of a first `make demo`'s 159 lines)
    return Progress(*columns, console=stderr, transient=True, redirect_stdout=False, redirect_stderr=False,
                    disable=not (stderr.is_terminal or stderr.is_jupyter))


_terminal: TextIO | None = None  # the process's stderr as it was before any `library_output`
_redirects = 0  # how many `library_output` redirects are active (they nest: the run's, then a unit's)


def _real(stream: object) -> bool:
    """Whether `stream` is a file with a descriptor (a terminal, a pipe, a file), not a test's capture."""
    fileno = getattr(stream, "fileno", None)
    try:
        return fileno is not None and isinstance(fileno(), int)
    except (OSError, ValueError):
        return False


def tail(log: Path, lines: int = 8) -> list[str]:
    """The last `lines` lines of a log (none when it is absent)."""
    try:
        with open(log, "rb") as stream:
            stream.seek(0, os.SEEK_END)
            stream.seek(max(0, stream.tell() - 64 * 1024))
            return stream.read().decode("utf-8", errors="replace").splitlines()[-lines:]
    except OSError:
        return []


@contextlib.contextmanager
def library_output(log: Path, enabled: bool = True) -> Iterator[None]:
    """While a run works, what other libraries print (llmcompressor's per-layer lines, weight
    loading bars, transformers and torch warnings, C libraries writing to the descriptors) goes to
    `log`, appended, and quantgate's own console (stage lines, progress bars) keeps the terminal.
    Done on the descriptors 1 and 2 themselves, since much of it bypasses Python's streams. Only
    where stdout and stderr are real files: under a test's captured streams nothing changes.
    Nested (a unit's own log inside the run's), the inner one restores the outer one's descriptors
    and leaves quantgate's console on the terminal until the outermost one ends."""
    global _terminal, _redirects
    if not enabled or not _real(sys.stdout) or not _real(sys.stderr):
        yield
        return
    if _terminal is None:
        _terminal = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stderr.file = _terminal
    _redirects += 1
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        _redirects -= 1
        os.close(target)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        if _redirects == 0:  # the outermost one: the console back to whatever sys.stderr is
            stderr.file = None  # type: ignore[assignment]  # rich's Console.file takes None: sys.stderr
