"""Artifacts on disk: atomic directory and file writes, sha256 of files and trees,
canonical JSON for fingerprints, and the provenance every manifest carries."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypedDict

from quantgate.core.errors import InputError, IntegrityError, OutputExistsError

if TYPE_CHECKING:
    from pydantic import JsonValue

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
    if not isinstance(expected, dict):
        raise IntegrityError(f"{what}: its manifest's files table is not a mapping of names to sha256s")
    for relative, digest in sorted(expected.items()):
        try:  # a name no file can have (a NUL, too long, not text) is a damaged manifest, not a crash
            path = (base / relative).resolve()
            if not path.is_relative_to(base):
                raise IntegrityError(f"{what}: manifest names a file outside {root}: {relative!r}")
            if not path.is_file():
                raise IntegrityError(f"{what}: {relative} is missing from {root}")
            if sha256_file(path) != digest:
                raise IntegrityError(f"{what}: {relative} does not match its manifest sha256")
        except (OSError, ValueError, TypeError) as error:
            raise IntegrityError(f"{what}: manifest names a file that cannot be read: {relative!r} ({error})") from error


# Testing hooks of the crash campaign (benchmarks/kill_campaign.py), inert unless set: the
# atomic writes of a process are numbered from 1, in the order they publish.
FAULT_KILL_AT_WRITE = "QUANTGATE_FAULT_KILL_AT_WRITE"  # N, or N:REGEX: SIGKILL this process inside that write
FAULT_WRITE_LOG = "QUANTGATE_FAULT_WRITE_LOG"  # a file: each atomic write appends "N<TAB>path" to it
_writes = {"count": 0, "matched": 0}
# Set in a unit's child process (quantgate.pipeline.executor.run_forked): the pid of the run it works for.
UNIT_OF_RUN = "QUANTGATE_UNIT_OF_RUN"
_writes_lock = threading.Lock()


def _fault_point(target: Path, staged: Path) -> None:
    """The testing hook of the atomic writers, called once a write is staged and before it is
    renamed into place: numbers the write, logs it (`$QUANTGATE_FAULT_WRITE_LOG`), and when it
    is the one `$QUANTGATE_FAULT_KILL_AT_WRITE` names (`N`: the N-th atomic write of this
    process; `N:REGEX`: the N-th whose target path matches REGEX), cuts the staged bytes to
    half (a file's, or the largest file a directory's write made) and SIGKILLs this process: a
    crash inside a write, whose staging sibling is all it leaves. Inert when neither is set."""
    kill_at, log = os.environ.get(FAULT_KILL_AT_WRITE), os.environ.get(FAULT_WRITE_LOG)
    if not kill_at and not log:
        return
    wanted, _, pattern = (kill_at or "0").partition(":")
    matches = bool(pattern) and re.search(pattern, str(target)) is not None
    with _writes_lock:
        _writes["count"] += 1
        _writes["matched"] += matches
        number = _writes["count"]
        due = int(wanted) == _writes["matched"] and matches if pattern else int(wanted) == number
    if log:
        with open(log, "a", encoding="utf-8") as stream:
            stream.write(f"{number}\t{target}\n")
    if due:
        # only bytes this write made: a file hard-linked from a published artifact (results share
        # the evaluation cache's) is not being written, and cutting it would damage that artifact
        files = [staged] if staged.is_file() else sorted((path for path in staged.rglob("*") if path.is_file() and path.stat().st_nlink == 1),
                                                         key=lambda path: path.stat().st_size)
        if files:
            os.truncate(files[-1], files[-1].stat().st_size // 2)
        run = os.environ.get(UNIT_OF_RUN)
        if run:  # a unit's child process: the run it works for dies inside this write too, as a one-process run would
            os.kill(int(run), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def _host_tag() -> str:
    """Eight hex digits naming this machine (its hostname and boot): a pid means something only
    on the machine, and in the boot, it was given on (a cache home may be shared by the nodes of
    a cluster, or by containers)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return sha256_bytes(f"{platform.node()}/{boot}".encode())[:8]


def _writer() -> str:
    """`PID-HOST`: who writes a staging sibling (see `_host_tag`)."""
    return f"{os.getpid()}-{_host_tag()}"


def _staging_prefix(path: Path) -> str:
    """`.NAME.partial-PID-HOST-`: a staging sibling names the process writing it and its machine,
    so that one a dead process left can be told from one a live process is writing
    (`remove_temporaries(only_stale=True)`)."""
    return f".{path.name}.partial-{_writer()}-"


@contextlib.contextmanager
def atomic_file(path: Path, *, durable: bool = False, mode: int = 0o644) -> Iterator[BinaryIO]:
    """Yield a binary stream on a temporary sibling of `path`; on success it replaces `path`
    in one rename, so a reader sees the old file or the new one, never half of it. `durable`:
    fsync before the rename (a record whose loss a crash must not cause, the ledger), and the
    directory after it.

    Testing hook: `$QUANTGATE_FAULT_KILL_AT_WRITE=N` kills the process inside the N-th atomic
    write (file or directory) after half its bytes, before the rename (`_fault_point`). `mode`:
    the file's permissions (0o600 for a private key: mkstemp makes it 0600 from its creation)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=_staging_prefix(path), dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            yield stream
            stream.flush()
            if durable:
                os.fsync(stream.fileno())
        os.chmod(temporary, mode)  # mkstemp makes 0600; artifacts are meant to be shared (0644 by default)
        _fault_point(path, Path(temporary))
        os.replace(temporary, path)
        if durable:
            _fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` survive a power loss (where the filesystem allows)."""
    with contextlib.suppress(OSError):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically: a temporary sibling, then rename over the target."""
    with atomic_file(path) as stream:
        stream.write((json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))


# Nodes a YAML document may stand for once its aliases are expanded: a configuration file holds
# hundreds; a "billion laughs" document (aliases of aliases) stands for billions in a few lines,
# and whatever walks the result (validation, hashing) would never finish.
YAML_NODES_MAX = 1_000_000


def read_yaml(path: Path, what: str) -> Any:
    """Parse a YAML file; a file that cannot be read or parsed is one InputError line naming `what`:
    invalid YAML, bytes that are not UTF-8, a directory, nesting too deep for the parser's
    recursion, an integer too long to convert (Python's 4300-digit limit), an alias that contains
    itself, or aliases that expand to more than YAML_NODES_MAX nodes."""
    import yaml

    try:
        loader = yaml.SafeLoader(Path(path).read_text(encoding="utf-8"))
        try:
            node = loader.get_single_node()
            if node is not None:
                _expanded_nodes(node, {}, set())
                _no_key_twice(node, set())
            return loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as error:
        raise InputError(f"{what} {path}: cannot read it as YAML (invalid YAML: {_first_line(error)})") from error
    except _AliasError as error:
        raise InputError(f"{what} {path}: cannot read it as YAML ({error})") from error
    except _KeyTwice as error:  # YAML says keys are unique; PyYAML keeps the last one without a word
        raise InputError(f"{what} {path}: {error}: remove one") from error
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        raise InputError(f"{what} {path}: cannot read it as YAML ({_first_line(error)})") from error
    except RecursionError as error:
        raise InputError(f"{what} {path}: cannot read it as YAML (nested too deeply)") from error


class _AliasError(Exception):
    pass


class _KeyTwice(Exception):
    pass


def _scalar(node: Any) -> object:
    """A scalar key node's value as the safe loader constructs it (its text where it cannot)."""
    import yaml

    try:
        value = yaml.SafeLoader("").construct_object(node)
        return value if isinstance(value, (str, int, float, bool)) or value is None else node.value
    except (yaml.YAMLError, ValueError, OverflowError):
        return node.value


def _no_key_twice(node: Any, seen: set[int]) -> None:
    """_KeyTwice for a mapping anywhere in `node` that gives one key twice ("`policy` is given twice
    (lines 3 and 9)"): a second `policy:` line would otherwise change what a run gates under
    without a word. Merge keys (`<<`) are YAML's own way to repeat and are left to the loader."""
    import yaml

    if id(node) in seen:  # an alias: its node was looked at where it was defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[object, int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                # the key as the loader reads it (`1` and `0x1` are one int key; `1` and "1" two keys)
                value = (key.tag, _scalar(key))
                if value in lines:
                    raise _KeyTwice(f"`{key.value}` is given twice (lines {lines[value]} and {key.start_mark.line + 1})")
                lines[value] = key.start_mark.line + 1
    if isinstance(node.value, list):
        for child in node.value:
            for part in child if isinstance(child, tuple) else (child,):
                _no_key_twice(part, seen)


def _expanded_nodes(node: Any, sizes: dict[int, int], open_: set[int]) -> int:
    """How many nodes `node` stands for with every alias expanded (a node reached twice, through
    an alias, counts twice); _AliasError for a node inside itself or past YAML_NODES_MAX."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise _AliasError("an alias refers to a node that contains it")
    open_.add(key)
    children = node.value if isinstance(node.value, list) else []
    total = 1
    for child in children:
        for part in child if isinstance(child, tuple) else (child,):  # a mapping's (key, value) pairs
            total += _expanded_nodes(part, sizes, open_)
    open_.discard(key)
    if total > YAML_NODES_MAX:
        raise _AliasError(f"its aliases expand to more than {YAML_NODES_MAX:,} nodes")
    sizes[key] = total
    return total


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class UnreadableJSON(InputError, json.JSONDecodeError):
    """A JSON file that cannot be read or parsed: bad input (exit 2). Also a JSONDecodeError (so a
    ValueError), so that a caller that treats an unparsable file as absent or damaged (a cache
    entry, a manifest to replace) still catches it as before."""

    def __init__(self, message: str) -> None:
        json.JSONDecodeError.__init__(self, message, "", 0)
        self.args = (message,)
        self.msg = message

    def __str__(self) -> str:
        return self.msg


def json_text(text: str) -> Any:
    """One JSON value from text (a line of a JSONL file); `ValueError` carrying only what is wrong
    (the decoder's message, "nested too deeply", a number too long to convert), for the caller to
    name where it is in its own words."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as error:
        raise ValueError(error.msg) from error
    except RecursionError as error:
        raise ValueError("nested too deeply") from error
    except ValueError as error:  # an integer past Python's digit limit
        raise ValueError(_first_line(error)) from error


def unique_keys(pairs: list[tuple[str, JsonValue]]) -> dict[str, JsonValue]:
    """json's `object_pairs_hook` that refuses an object giving one key twice (ValueError): the
    decoder would keep the last one without a word. Any JSON object, as parsed: its reader checks it."""
    result: dict[str, JsonValue] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice")
        result[key] = value
    return result


def read_json(path: Path) -> Any:
    """Parse a JSON file. A file that cannot be read or parsed (not UTF-8, invalid JSON, an object
    that gives a key twice, nested too deeply, a number too long to convert, a directory,
    unreadable) is `UnreadableJSON`: one line naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as stream:
            return json.load(stream, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as error:
        raise UnreadableJSON(f"{path}: invalid JSON ({error.msg} at line {error.lineno} column {error.colno})") from error
    except UnicodeDecodeError as error:
        raise UnreadableJSON(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    except RecursionError as error:
        raise UnreadableJSON(f"{path}: invalid JSON (nested too deeply)") from error
    except ValueError as error:  # an integer past Python's digit limit
        raise UnreadableJSON(f"{path}: invalid JSON ({_first_line(error)})") from error
    except OSError as error:
        raise UnreadableJSON(f"{path}: cannot read it ({error.strerror or _first_line(error)})") from error


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False, keep: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success rename it into place.

    On any error the temporary directory (and any parent directories this call created)
    is removed and an existing `final` is left untouched. With `overwrite`, an existing
    `final` is replaced only after the new one is complete. `keep`: for a cache shared by
    processes (an entry is the same whoever makes it), an existing `final` for which
    `keep(final)` is true is kept and this one dropped, also when another process published it
    while this one was being made; a `final` that fails `keep` (damaged) is replaced.

    Testing hook: see `atomic_file` (`$QUANTGATE_FAULT_KILL_AT_WRITE`).
    """
    final = Path(final).absolute()
    if final.exists() and not overwrite and keep is None:
        raise OutputExistsError(f"{final} already exists (pass --overwrite to replace it)")
    created_parents = []
    parent = final.parent
    while not parent.exists():
        created_parents.append(parent)
        parent = parent.parent
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=_staging_prefix(final), dir=final.parent))
    os.chmod(temporary, 0o755)  # mkdtemp makes 0700; a published artifact is meant to be read
    try:
        yield temporary
        _fault_point(final, temporary)
        if keep is not None:
            _publish_shared(temporary, final, keep)
        elif final.exists():
            _replace_directory(temporary, final)
        else:
            temporary.rename(final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        for directory in created_parents:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def _replace_directory(temporary: Path, final: Path) -> None:
    """`final` replaced by `temporary`. Where the system swaps two directories in one step
    (`_exchange`), they are swapped and the old one, now under the temporary's name, removed:
    one who looks meanwhile finds the old entry or the new one, never none and never half of
    one. Elsewhere the old one is renamed aside first, then the new one renamed in (a moment
    with none), then the old one removed; if the new one cannot be renamed in, the old one is
    put back (or removed, when something else took its place), so nothing is left aside."""
    if _exchange(temporary, final):
        shutil.rmtree(temporary, ignore_errors=True)
        return
    retired = final.with_name(f".{final.name}.old-{_writer()}-{uuid.uuid4().hex[:8]}")
    final.rename(retired)
    try:
        temporary.rename(final)
    except BaseException:
        with contextlib.suppress(OSError):
            retired.rename(final)
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)  # gone already when it was put back


_RENAME_EXCHANGE = 2  # renameat2's flag (Linux 3.15); renamex_np's RENAME_SWAP (macOS 10.12) has the same value
_AT_FDCWD = -100


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing directories in one step (Linux `renameat2(RENAME_EXCHANGE)`, macOS
    `renamex_np(RENAME_SWAP)`). False where this system or filesystem cannot (the caller then
    renames in two steps); an error when it can but the swap fails (one of them is gone)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform.startswith("linux"):
            done = libc.renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
        elif sys.platform == "darwin":
            done = libc.renamex_np(os.fsencode(first), os.fsencode(second), _RENAME_EXCHANGE)
        else:
            return False
    except (OSError, AttributeError):  # no C library to load, or one without the call (glibc < 2.28)
        return False
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # a kernel or filesystem without the swap (EPERM: a seccomp filter that refuses it)
    raise OSError(code, os.strerror(code), str(first), None, str(second))


@contextlib.contextmanager
def _publishing_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `directory` itself while an entry in it is judged and put in
    place: one at a time among the processes publishing into it, and nothing made beside the
    entries (no lock file to leave behind). Held only for the judging and the renames, never
    while an entry is made. A filesystem that cannot lock a directory (NFS emulates `flock`
    with POSIX locks, which want a file open for writing) publishes without it."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing drops the lock


def _publish_shared(temporary: Path, final: Path, keep: Callable[[Path], bool]) -> None:
    """Publish a shared cache entry (see `atomic_directory`'s `keep`): an entry found whole stays
    and ours is dropped; a missing one is renamed in, a damaged one replaced.

    Why the lock: a judgment made without it can be stale by the time it is acted on. Writer B
    looked and found no entry (or judged one damaged because it read it while another writer
    was swapping it); writer A then published a whole entry; B, acting on what it saw, replaced
    A's entry: A (or any reader) looking right after publishing found `final` missing (between
    B's rename aside and rename in) or emptied under it (B removing the retired one), and
    another writer judging it meanwhile found it damaged and replaced it in turn. So an entry is
    put in place only by a process holding the directory's lock (`_publishing_lock`), after
    judging it again under that lock: no writer that merely saw an entry mid-publish replaces
    it, and only an entry that is really damaged (or one `keep` refuses, `pull --force`) is
    ever replaced, in one swap where the system allows (`_replace_directory`). An entry found
    whole without the lock (the common case) is kept at once: judging it again under the lock
    would only hold up the other writers (a model's judgment hashes gigabytes)."""
    if final.exists() and keep(final):
        shutil.rmtree(temporary, ignore_errors=True)  # the same entry, published by another process
        return
    with _publishing_lock(final.parent):
        # the loop is for writers that do not take the lock (an `overwrite` write of the same
        # path, a filesystem without locks): among those that do, a judgment holds until acted on
        for _ in range(8):
            if final.exists() and keep(final):
                shutil.rmtree(temporary, ignore_errors=True)
                return
            try:
                if final.exists():
                    _replace_directory(temporary, final)  # damaged: ours replaces it
                else:
                    temporary.rename(final)
                return
            except FileNotFoundError:
                continue  # another process retired it meanwhile: look again
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue  # another process's entry landed first: look again
    raise OSError(errno.EBUSY, f"cannot publish {final}: other processes keep replacing it")


# What atomic_file and atomic_directory leave when their process is killed mid-write: a staging
# sibling (`.NAME.partial-PID-XXXX`) or a replaced artifact not yet removed (`.NAME.old-PID-XXXX`).
_TEMPORARY = re.compile(r"^\..+\.(partial|old)-(?:(\d+)-(?:([0-9a-f]{8})-)?)?[A-Za-z0-9_]+$")


def remove_temporaries(root: Path, only_stale: bool = False) -> list[Path]:
    """Remove every staging or retired sibling under `root` that a killed writer left behind.
    Without `only_stale`: only for a directory no writer is using now (a run directory under
    its lock, after its tasks ended). With it, for a directory live processes may be writing
    (a cache shared by runs): only those whose writer (the pid and machine in the name) no longer runs on
    this machine. Returns what was removed."""
    found = [path for path in Path(root).rglob(".*") if (match := _TEMPORARY.match(path.name))
             and not (only_stale and not _stale(match))]
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


def _stale(match: re.Match[str]) -> bool:
    """A staging name's writer is known to be gone: it ran on this machine (in this boot) and its
    pid runs no more. A writer on another machine, or one whose name says neither, is left alone."""
    pid, host = match.group(2), match.group(3)
    return pid is not None and host == _host_tag() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    """Whether a process with this pid runs here (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


class MachineJSON(TypedDict):
    python: str
    platform: str
    cpu_count: int | None


class ProvenanceJSON(TypedDict):
    """An artifact's `provenance` as written (read back as quantgate.core.records.Provenance)."""

    created_at: str
    libraries: dict[str, str | None]
    machine: MachineJSON
    wall_seconds: float
    peak_memory_bytes: int


def provenance(stopwatch: Stopwatch) -> ProvenanceJSON:
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


@contextlib.contextmanager
def sibling_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `PATH.lock` (a sibling, kept) while `path` is read and rewritten:
    a file that is rewritten whole (the ledger) and shared by processes (runs with different run
    directories, `quantgate gate` in CI) would otherwise lose one of two writes made at once.
    Waits for the other holder; the kernel drops the lock however the holder dies."""
    lock = Path(path).with_name(f"{Path(path).name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # closing drops the lock
