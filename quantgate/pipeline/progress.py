"""What a run shows and keeps of its stages: one status line per stage on stderr with the run's
elapsed time and an estimate of what is left, and the list of stage statuses run.json records."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from quantgate.core.console import stderr
from quantgate.core.stagecache import Status

# Relative cost of each stage kind, for the run's time estimate (measured on the demo: quantizing
# a format and evaluating a model take minutes, the rest seconds).
STAGE_WEIGHT = {"calibration": 1.0, "overlap": 0.2, "measure": 0.1, "quantize": 10.0, "evaluate": 8.0, "gate": 0.2, "report": 0.2,
                "sensitivity": 2.0, "serve": 3.0}
_COLOUR = {"done": "green", "reused": "cyan", "failed": "red", "skipped": "yellow"}


@dataclass
class StageStatus:
    stage: str  # "quantize gptq-int4"
    status: str  # "done", "reused", "failed" or "skipped"
    seconds: float
    detail: str = ""
    where: str = ""  # the node it ran on (a Ray task), empty when it ran in the driver


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """One status line per stage on stderr: the stage and format, the run's elapsed time and
    an estimate of what is left; inside an evaluation its own bar shows items per second."""

    def __init__(self, planned: list[str], show: bool) -> None:
        self.planned = planned  # stage kinds in order
        self.show = show
        self.started = time.perf_counter()
        self.weight_done = 0.0
        self.seconds_done = 0.0
        self.position = 0

    def _estimate(self) -> str:
        remaining = sum(STAGE_WEIGHT[kind] for kind in self.planned[self.position:])
        if self.weight_done < STAGE_WEIGHT["quantize"] / 2:
            return "estimate after the first long stage"
        return f"~{clock(self.seconds_done / self.weight_done * remaining)} left (estimate)"

    def begin(self, label: str) -> None:
        if self.show:
            elapsed = time.perf_counter() - self.started
            stderr.print(f"[bold][{self.position + 1}/{len(self.planned)}][/bold] {label}   "
                         f"[dim]run {clock(elapsed)}, {self._estimate()}[/dim]", highlight=False)

    def end(self, kind: str, status: StageStatus) -> None:
        if status.status == "done":
            self.weight_done += STAGE_WEIGHT[kind]
            self.seconds_done += status.seconds
        self.position += 1
        if self.show:
            colour = _COLOUR[status.status]
            detail = f"  {status.detail}" if status.detail else ""
            where = f" on {status.where}" if status.where else ""
            stderr.print(f"      [{colour}]{status.status}[/{colour}] {status.stage} in {status.seconds:.1f} s{where}{detail}",
                         highlight=False)


class StageLog:
    """The stage cache's reporter for a run: shows each stage's line and keeps its status. Stages
    of several formats may run at once (a concurrent executor): each line names its stage, and
    `where(label)` says where a stage's task ran."""

    def __init__(self, planned: list[str], show: bool, where: Callable[[str], str] | None = None) -> None:
        self.progress = Progress(planned, show)
        self.stages: list[StageStatus] = []
        self.where = where or (lambda label: "")
        self.lock = threading.Lock()

    def begin(self, label: str) -> None:
        with self.lock:
            self.progress.begin(label)

    def end(self, kind: str, label: str, status: Status, seconds: float, detail: str = "") -> None:
        with self.lock:
            entry = StageStatus(label, status, seconds, detail, self.where(label) if status == "done" else "")
            self.stages.append(entry)
            self.progress.end(kind, entry)

    def amend(self, label: str, detail: str, done: bool) -> None:
        """Add what a stage did after its line was shown (the gate's ledger append) to the status
        of its latest stage of this label; `done`: it changed something, so a reused stage counts
        as done."""
        with self.lock:
            entry = next(stage for stage in reversed(self.stages) if stage.stage == label)
            entry.detail = detail
            if entry.status == "reused" and done:
                entry.status = "done"
