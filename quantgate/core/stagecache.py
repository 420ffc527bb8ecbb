"""The stage cache of a run directory: a stage's artifact is reused when it was made from the
same inputs (its key) and still verifies, else made again, atomically, over what is there.

A directory artifact (calibration set, checkpoint, results) gets a record in `stages/`, written
after the artifact is in place: its key, the sha256 of its manifest, or the failure these inputs
gave. A JSON artifact (measurement, overlap, verdict) carries its key inside, next to its value.
The cache knows no stage; it tells a `StageReporter` when each stage begins and how it ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

from quantgate.core.artifacts import MANIFEST, read_json, sha256_file, write_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.rundir import RunDir

T = TypeVar("T")
Status = Literal["done", "reused", "failed", "skipped"]


class StageReporter(Protocol):
    """Who hears of each stage: `begin` before it runs, `end` with how it went."""

    def begin(self, label: str) -> None: ...

    def end(self, kind: str, label: str, status: Status, seconds: float, detail: str = "") -> None: ...


@dataclass(frozen=True)
class Cached(Generic[T]):
    """A directory stage's artifact (None when the stage failed for these inputs) and its record."""

    value: T | None
    record: dict[str, Any]

    @property
    def failed(self) -> str | None:
        """What went wrong with these inputs (now or on an earlier run), or None."""
        failure = self.record.get("failed")
        return str(failure) if failure else None

    @property
    def manifest_sha256(self) -> str:
        return str(self.record["manifest_sha256"])


def stored_value(path: Path) -> dict[str, Any] | None:
    """The value of a keyed JSON artifact, or None when there is none."""
    if not path.is_file():
        return None
    value: dict[str, Any] = read_json(path)["value"]
    return value


def _stored(path: Path, key: str) -> dict[str, Any] | None:
    """A JSON artifact's value if it is there, readable and made with `key`."""
    if not path.is_file():
        return None
    try:
        stored = read_json(path)
    except (OSError, ValueError):
        return None
    if isinstance(stored, dict) and stored.get("key") == key:
        value: dict[str, Any] = stored["value"]
        return value
    return None


class StageCache:
    """Runs the stages of one run directory through their keys; see the module docstring."""

    def __init__(self, run_dir: RunDir, reporter: StageReporter) -> None:
        self.run_dir = run_dir
        self.reporter = reporter

    def begin(self, label: str) -> float:
        """Announce a stage the cache does not run itself; returns its start for `finish`."""
        self.reporter.begin(label)
        return time.perf_counter()

    def finish(self, kind: str, label: str, status: Status, started: float, detail: str = "") -> None:
        self.reporter.end(kind, label, status, time.perf_counter() - started, detail)

    def directory(
        self,
        *,
        kind: str,
        name: str,
        label: str,
        key: str,
        artifact: Path,
        load: Callable[[Path], T | None],
        produce: Callable[[], T],
        failures: tuple[type[Exception], ...] = (),
    ) -> Cached[T]:
        """Reuse `artifact` when its stage record has this key and the artifact still verifies;
        else produce it (atomically, over whatever is there) and then write the record. An
        error in `failures` is recorded as this stage's outcome for these inputs (value None)."""
        started = self.begin(label)
        record_path = self.run_dir.stage_record(name)
        record = read_json(record_path) if record_path.is_file() else None
        if record and record.get("key") == key:
            if record.get("failed"):
                self.finish(kind, label, "reused", started, f"failed before with these inputs: {record['failed']}")
                return Cached(None, record)
            value = self._reusable(artifact, record, load)
            if value is not None:
                self.finish(kind, label, "reused", started)
                return Cached(value, record)
        try:
            produced = produce()
        except failures as error:
            record = {"stage": name, "key": key, "failed": " ".join(str(error).split())}
            write_json(record_path, record)
            self.finish(kind, label, "failed", started, record["failed"])
            return Cached(None, record)
        record = {"stage": name, "key": key, "artifact": self.run_dir.relative(artifact),
                  "manifest_sha256": sha256_file(artifact / MANIFEST), "seconds": round(time.perf_counter() - started, 3)}
        write_json(record_path, record)
        self.finish(kind, label, "done", started)
        return Cached(produced, record)

    @staticmethod
    def _reusable(artifact: Path, record: dict[str, Any], load: Callable[[Path], T | None]) -> T | None:
        """The artifact, loaded, if its manifest is the one recorded and it still verifies."""
        manifest = artifact / MANIFEST
        if not manifest.is_file() or sha256_file(manifest) != record.get("manifest_sha256"):
            return None
        try:
            return load(artifact)
        except (IntegrityError, InputError):
            return None  # damaged since: made again

    def json(self, *, kind: str, label: str, path: Path, key: str, produce: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The value stored at `path` when it was made with `key`; else `produce()`, stored with its key."""
        started = self.begin(label)
        stored = _stored(path, key)
        if stored is not None:
            self.finish(kind, label, "reused", started)
            return stored
        value = produce()
        write_json(path, {"key": key, "value": value})
        self.finish(kind, label, "done", started)
        return value
