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
