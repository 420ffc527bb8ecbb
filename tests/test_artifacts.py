"""Atomic writes and integrity checks every stage relies on."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from quantgate.core.artifacts import atomic_directory, atomic_file, file_hashes, sha256_json, verify_files, write_json
from quantgate.core.errors import IntegrityError, OutputExistsError


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "new" / "nested" / "artifact"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as staging:
            (staging / "half.bin").write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_previous_artifact(tmp_path: Path) -> None:
    target = tmp_path / "artifact"
    target.mkdir()
    (target / "good.txt").write_text("previous")
    with pytest.raises(RuntimeError):
        with atomic_directory(target, overwrite=True) as staging:
            (staging / "good.txt").write_text("half")
            raise RuntimeError("crash")
    assert (target / "good.txt").read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


def test_existing_output_is_refused_without_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "artifact"
    target.mkdir()
    with pytest.raises(OutputExistsError, match="--overwrite"):
        with atomic_directory(target):
            pass


def test_overwrite_replaces_only_when_complete(tmp_path: Path) -> None:
    target = tmp_path / "artifact"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_directory(target, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
        assert (target / "old.txt").exists()  # still the old one while writing
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


def test_changed_missing_and_escaping_files_are_detected(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    hashes = file_hashes(tmp_path)
    verify_files(tmp_path, hashes, "set")
    (tmp_path / "a.txt").write_text("alpha!")
    with pytest.raises(IntegrityError, match="a.txt does not match"):
        verify_files(tmp_path, hashes, "set")
    with pytest.raises(IntegrityError, match="b.txt is missing"):
        verify_files(tmp_path, {"b.txt": "0" * 64}, "set")
    with pytest.raises(IntegrityError, match="outside"):
        verify_files(tmp_path, {"../escape.txt": "0" * 64}, "set")


def test_canonical_hash_ignores_key_order() -> None:
    assert sha256_json({"a": 1, "b": [1, 2]}) == sha256_json({"b": [1, 2], "a": 1})
    assert sha256_json({"a": 1}) != sha256_json({"a": 2})


@pytest.mark.parametrize("durable", [False, True])
def test_atomic_file_replaces_whole_or_not_at_all(tmp_path: Path, durable: bool) -> None:
    target = tmp_path / "deep" / "record.jsonl"
    with atomic_file(target, durable=durable) as stream:
        stream.write(b"first\n")
    assert target.read_bytes() == b"first\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    with pytest.raises(RuntimeError):
        with atomic_file(target, durable=durable) as stream:
            stream.write(b"half")
            raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"first\n" and [path.name for path in target.parent.iterdir()] == ["record.jsonl"]


def test_write_json_is_sorted_indented_utf8_with_a_final_newline(tmp_path: Path) -> None:
    write_json(tmp_path / "value.json", {"b": "é", "a": [1, 2]})
    assert (tmp_path / "value.json").read_text(encoding="utf-8") == json.dumps({"a": [1, 2], "b": "é"}, indent=2, ensure_ascii=False) + "\n"


# --- crashes and concurrent writers -----------------------------------------------------------

WRITER = """
import sys
from pathlib import Path
from quantgate.core.artifacts import atomic_directory, write_json
root = Path(sys.argv[1])
write_json(root / "first.json", {"n": 1})
with atomic_directory(root / "second") as staging:
    (staging / "big.bin").write_bytes(b"x" * 1000)
write_json(root / "third.json", {"n": 3})
"""


@pytest.mark.parametrize("kill_at, torn", [("2", "second"), ("1:third", "third.json"), ("3", "third.json")])
def test_the_fault_hook_kills_inside_the_chosen_write_leaving_only_its_half_staged_sibling(tmp_path: Path, kill_at: str,
                                                                                            torn: str) -> None:
    import os
    import signal
    import subprocess
    import sys

    from quantgate.core.artifacts import FAULT_KILL_AT_WRITE, remove_temporaries

    env = os.environ | {FAULT_KILL_AT_WRITE: kill_at}
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert json.loads((tmp_path / "first.json").read_text()) == {"n": 1} and not (tmp_path / torn).exists()
    (staged,) = [path for path in tmp_path.iterdir() if path.name.startswith(".")]
    assert staged.name.startswith(f".{torn}.partial-")
    half = staged / "big.bin" if staged.is_dir() else staged
    assert half.stat().st_size in (500, len(json.dumps({"n": 3}, indent=2)) // 2)
    assert remove_temporaries(tmp_path) == [staged] and not staged.exists()
    clean = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "again")], capture_output=True, text=True, check=False)
    assert clean.returncode == 0 and sorted(path.name for path in (tmp_path / "again").iterdir()) == ["first.json", "second", "third.json"]


def test_only_stale_temporaries_are_removed_from_a_shared_directory(tmp_path: Path) -> None:
    import os

    from quantgate.core.artifacts import _host_tag, remove_temporaries

    here = _host_tag()
    dead = tmp_path / f".entry.partial-{2**22 + 12345}-{here}-abc123"  # above any pid_max: no such process
    live = tmp_path / f".entry.partial-{os.getpid()}-{here}-def456"
    other = "0" * 8 if here != "0" * 8 else "1" * 8
    elsewhere = tmp_path / f".entry.partial-{2**22 + 12345}-{other}-abc123"  # another node's writer: its pid means nothing here
    unknown = tmp_path / ".entry.partial-ghi789"  # an older writer's: whose it is cannot be told
    for path in (dead, live, elsewhere, unknown):
        path.mkdir()
    assert remove_temporaries(tmp_path, only_stale=True) == [dead]
    assert live.exists() and elsewhere.exists() and unknown.exists()
    assert sorted(remove_temporaries(tmp_path)) == sorted([live, elsewhere, unknown])  # a run directory under its lock: all


PUBLISHER = """
import sys, time
from pathlib import Path
from quantgate.core.artifacts import atomic_directory, file_hashes, read_json, verify_files, write_json
final, ready, writers, keep = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "keep"

def whole(entry):
    try:
        verify_files(entry, read_json(entry / "manifest.json")["files"], "entry")
        return True
    except Exception:
        return False

options = {"keep": whole} if keep else {"overwrite": True}
with atomic_directory(final, **options) as staging:
    (staging / "result.txt").write_text("the same result" * 1000)
    write_json(staging / "manifest.json", {"files": file_hashes(staging)})
    # every writer has its entry staged before any publishes (a barrier, however loaded the machine)
    (ready / str(staging.name)).touch()
    deadline = time.time() + 120
    while len(list(ready.iterdir())) < writers and time.time() < deadline:
        time.sleep(0.01)
try:  # whole once published, and if not, why (printed with the test's failure)
    verify_files(final, read_json(final / "manifest.json")["files"], "entry")
except Exception as error:
    import os
    print(f"not whole after publishing: {error!r}; beside it: {sorted(os.listdir(final.parent))}")
    sys.exit(1)
"""


def _publish_at_once(final: Path, writers: int, mode: str) -> list[int]:
    import subprocess
    import sys
    import tempfile

    ready = Path(tempfile.mkdtemp(prefix="ready-", dir=final.parent))
    processes = [subprocess.Popen([sys.executable, "-c", PUBLISHER, str(final), str(ready), str(writers), mode], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
                 for _ in range(writers)]
    codes = []
    for process in processes:
        out, err = process.communicate()
        if process.returncode:
            print(out.decode(errors="replace"), err.decode(errors="replace"))  # shown by pytest when the test fails
        codes.append(process.returncode)
    return codes


def test_writers_publishing_the_same_cache_entry_at_once_all_succeed_and_leave_one_whole_entry(tmp_path: Path) -> None:
    """Two runs computing the same evaluation-cache key (or pulling the same demo model) publish
    it at once: each finds the entry the first one published, and keeps it."""
    from quantgate.core.artifacts import read_json

    for round_ in range(3):
        final = tmp_path / f"entry-{round_}"
        assert _publish_at_once(final, 6, "keep") == [0] * 6
        verify_files(final, read_json(final / "manifest.json")["files"], "entry")
        assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []
    # a damaged entry is replaced, not kept
    (final / "result.txt").write_text("torn")
    assert _publish_at_once(final, 1, "keep") == [0]
    assert (final / "result.txt").read_text() == "the same result" * 1000


@pytest.mark.parametrize("name", ["a\x00b", "x" * 5000, "caf\udce9"])
def test_a_manifest_naming_an_impossible_file_is_an_integrity_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(IntegrityError, match="cannot be read|is missing"):
        verify_files(tmp_path, {name: "0" * 64}, "checkpoint")
