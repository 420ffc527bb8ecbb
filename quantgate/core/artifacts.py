"""Artifacts on disk: atomic directory and file writes, sha256 of files and trees,
canonical JSON for fingerprints, and the provenance every manifest carries."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, BinaryIO

from quantgate.core.errors import InputError, IntegrityError, OutputExistsError

MANIFEST = "manifest.json"

# Libraries whose versions change numbers; recorded in every manifest.
TRACKED_LIBRARIES = (
    "quantgate",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "datasets",
    "llmcompressor",
    "compressed-tensors",
    "lm-eval",
)

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: the same value always gives the same bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_json(value: Any) -> str:
    return sha256_bytes(canonical_json(value).encode("utf-8"))


def sha256_tree(root: Path) -> str:
    """One hash over every file under `root`: relative paths and contents, in sorted order."""
    entries = [
        [path.relative_to(root).as_posix(), sha256_file(path)]
        for path in sorted(root.rglob("*"))
        if path.is_file()
    ]
    return sha256_json(entries)


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` except the manifest, keyed by relative path."""
    return {
        path.relative_to(root).as_posix(): sha256_file(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def verify_files(root: Path, expected: dict[str, str], what: str) -> None:
    """Raise IntegrityError naming the first file that is missing, changed, or outside `root`."""
    base = root.resolve()
    for relative, digest in sorted(expected.items()):
        path = (base / relative).resolve()
        if not path.is_relative_to(base):
            raise IntegrityError(f"{what}: manifest names a file outside {root}: {relative}")
        if not path.is_file():
            raise IntegrityError(f"{what}: {relative} is missing from {root}")
        if sha256_file(path) != digest:
            raise IntegrityError(f"{what}: {relative} does not match its manifest sha256")


@contextlib.contextmanager
def atomic_file(path: Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """Yield a binary stream on a temporary sibling of `path`; on success it replaces `path`
    in one rename, so a reader sees the old file or the new one, never half of it. `durable`:
    fsync before the rename (a record whose loss a crash must not cause, the ledger)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            yield stream
            if durable:
                stream.flush()
                os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically: a temporary sibling, then rename over the target."""
    with atomic_file(path) as stream:
        stream.write((json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))


def read_yaml(path: Path, what: str) -> Any:
    """Parse a YAML file; a file that cannot be read or parsed is one InputError line naming `what`."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise InputError(f"{what} {path}: cannot read it as YAML (invalid YAML: {_first_line(error)})") from error
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{what} {path}: cannot read it as YAML ({_first_line(error)})") from error


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success rename it into place.

    On any error the temporary directory (and any parent directories this call created)
    is removed and an existing `final` is left untouched. With `overwrite`, an existing
    `final` is replaced only after the new one is complete.
    """
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise OutputExistsError(f"{final} already exists (pass --overwrite to replace it)")
    created_parents = []
    parent = final.parent
    while not parent.exists():
        created_parents.append(parent)
        parent = parent.parent
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    os.chmod(temporary, 0o755)  # mkdtemp makes 0700; a published artifact is meant to be read
    try:
        yield temporary
        if final.exists():
            retired = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            final.rename(retired)
            temporary.rename(final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            temporary.rename(final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        for directory in created_parents:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


# What atomic_file and atomic_directory leave when their process is killed mid-write: a staging
# sibling (`.NAME.partial-XXXX`) or a replaced artifact not yet removed (`.NAME.old-XXXX`).
_TEMPORARY = re.compile(r"^\..+\.(partial|old)-[A-Za-z0-9_]+$")


def remove_temporaries(root: Path) -> list[Path]:
    """Remove every staging or retired sibling under `root` that a killed writer left behind.
    Only for a directory no writer is using now (a run directory under its lock, after its
    tasks ended). Returns what was removed."""
    found = [path for path in Path(root).rglob(".*") if _TEMPORARY.match(path.name)]
    removed = []
    for path in sorted(found, key=lambda item: len(item.parts)):  # outermost first; inner ones go with it
        if not path.exists() and not path.is_symlink():
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in TRACKED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def peak_memory_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


def provenance(stopwatch: Stopwatch) -> dict[str, Any]:
    """What made an artifact and what it cost: versions, machine, wall time, peak memory."""
    return {
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "libraries": library_versions(),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        },
        "wall_seconds": round(stopwatch.seconds, 3),
        "peak_memory_bytes": peak_memory_bytes(),
    }
