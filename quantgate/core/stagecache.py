"""The stage cache of a run directory: a stage's artifact is reused when it was made from the
same inputs (its key) and still verifies, else made again, atomically, over what is there.

A directory artifact (calibration set, checkpoint, results) gets a record in `stages/`, written
after the artifact is in place: its key, the sha256 of its manifest, or the failure these inputs
gave. A JSON artifact (measurement, overlap, verdict) carries its key inside, next to its value
and the value's sha256 (canonical JSON). Nothing whose bytes changed is trusted: a directory
artifact whose manifest or files no longer match, a JSON artifact whose value no longer matches
its sha256, an unreadable record: each is made again.
The cache knows no stage; it tells a `StageReporter` when each stage begins and how it ended.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, Protocol, TypedDict, TypeVar, cast

from pydantic import JsonValue

from quantgate.core.artifacts import MANIFEST, read_json, sha256_file, sha256_json, write_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.rundir import RunDir

T = TypeVar("T")
# A keyed JSON artifact's value: a JSON object of the stage's own type (a TypedDict, or a
# record's JSON), which the cache stores and hands back without reading a field of it.
V = TypeVar("V", bound=Mapping[str, object])
Status = Literal["done", "reused", "failed", "skipped"]


class StageReporter(Protocol):
    """Who hears of each stage: `begin` before it runs, `end` with how it went."""

    def begin(self, label: str) -> None: ...

    def end(self, kind: str, label: str, status: Status, seconds: float, detail: str = "") -> None: ...


class StageRecord(TypedDict, total=False):
    """A directory stage's record in `stages/` (`StageCache.directory`): its key, and the artifact
    it made with the sha256 of its manifest and the seconds it took, or the failure these inputs
    gave. `lost` is never written: a unit the cluster lost for good, held in memory only."""

    stage: str
    key: str
    artifact: str
    manifest_sha256: str
    seconds: float
    failed: str
    lost: str


@dataclass(frozen=True)
class Cached(Generic[T]):
    """A directory stage's artifact (None when the stage failed for these inputs) and its record."""

    value: T | None
    record: StageRecord

    @property
    def failed(self) -> str | None:
        """What went wrong with these inputs (now or on an earlier run), or None."""
        failure = self.record.get("failed")
        return str(failure) if failure else None

    @property
    def manifest_sha256(self) -> str:
        return str(self.record["manifest_sha256"])


VALUE_SHA256 = "value_sha256"  # a keyed JSON artifact's field: the sha256 of its value's canonical JSON


def stored_value(path: Path) -> dict[str, JsonValue] | None:
    """The value of a keyed JSON artifact, or None when there is none; IntegrityError when its
    value no longer matches the sha256 stored with it (an artifact made before it carried one
    is read as it is). The JSON as it reads: its reader checks it (MeasurementRecord, ServeRecord...)."""
    if not path.is_file():
        return None
    stored = read_json(path)
    value: dict[str, JsonValue] = stored["value"]
    if VALUE_SHA256 in stored and stored[VALUE_SHA256] != sha256_json(value):
        raise IntegrityError(f"{path}: its value does not match its sha256 (changed since it was written)")
    return value


def _stored(path: Path, key: str) -> dict[str, JsonValue] | None:
    """A JSON artifact's value if it is there, readable, made with `key` and unchanged since."""
    if not path.is_file():
        return None
    try:
        stored = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("value"), dict):
        return None
    value: dict[str, JsonValue] = stored["value"]
    return value if stored.get(VALUE_SHA256) == sha256_json(value) else None


def _record(path: Path) -> StageRecord | None:
    """A directory stage's record, or None when there is none or it cannot be read as one."""
    try:
        record = read_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return None
    # as written: every use compares a field with what it expects (a damaged one: made again)
    return cast(StageRecord, record) if isinstance(record, dict) else None


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
        record = _record(record_path)
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
            failure = " ".join(str(error).split())
            record = {"stage": name, "key": key, "failed": failure}
            write_json(record_path, record)
            self.finish(kind, label, "failed", started, failure)
            return Cached(None, record)
        record = {"stage": name, "key": key, "artifact": self.run_dir.relative(artifact),
                  "manifest_sha256": sha256_file(artifact / MANIFEST), "seconds": round(time.perf_counter() - started, 3)}
        write_json(record_path, record)
        self.finish(kind, label, "done", started)
        return Cached(produced, record)

    @staticmethod
    def _reusable(artifact: Path, record: StageRecord, load: Callable[[Path], T | None]) -> T | None:
        """The artifact, loaded, if its manifest is the one recorded and it still verifies."""
        manifest = artifact / MANIFEST
        try:
            if not manifest.is_file() or sha256_file(manifest) != record.get("manifest_sha256"):
                return None
            return load(artifact)
        except (IntegrityError, InputError, OSError, ValueError, KeyError):
            return None  # damaged since: made again

    def json(self, *, kind: str, label: str, path: Path, key: str, produce: Callable[[], V],
             reuse: Callable[[dict[str, JsonValue]], bool] | None = None) -> V:
        """The value stored at `path` when it was made with `key`; else `produce()`, stored with its key.
        What is stored under `key` is what `produce` returned for the same inputs (the key names
        them all, the stage's version among them) and its bytes still match their sha256: it is
        handed back as the stage's type. `reuse`: False for a stored value that depends on more than
        its key (a serve check pending on this moment's free memory): made again."""
        started = self.begin(label)
        stored = _stored(path, key)
        if stored is not None and (reuse is None or reuse(stored)):
            self.finish(kind, label, "reused", started)
            return cast(V, stored)
        value = produce()
        # hashed as it reads back (a tuple reads as a list, an int key as a string)
        readback = json.loads(json.dumps(value, ensure_ascii=False))
        write_json(path, {"key": key, "value": value, VALUE_SHA256: sha256_json(readback)})
        self.finish(kind, label, "done", started)
        return value
