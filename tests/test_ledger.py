"""The approval ledger: a hash chain that detects edits, and `verify` as a deployment step sees it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gates import ledger
from gates.ledger import LedgerTampered, Status, verify_checkpoint
from quantgate.core.models import weight_hashes


def fake_checkpoint(path: Path, content: bytes = b"weights") -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(content)
    return path


def verdict(checkpoint: Path, outcome: str, reasons: list[str] | None = None) -> dict:
    return {
        "kind": "verdict",
        "checkpoint": {"path": str(checkpoint.resolve()), "format": "gptq-int4", "weights": weight_hashes(checkpoint)},
        "policy": {"name": "default", "version": "v1", "sha256": "0" * 64},
        "evalsets": [{"name": "arc-easy", "version": "v1", "sha256": "1" * 64}],
        "metrics": {"arc-easy/acc": {"difference": -0.004}},
        "verdict": outcome,
        "reasons": reasons or [],
    }


def test_records_chain_and_read_back(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    first = ledger.append(book, verdict(checkpoint, "blocked", ["arc-easy acc -2.0 points exceeds -1.0"]))
    second = ledger.append(book, verdict(checkpoint, "approved"))
    assert first["prev_hash"] == ledger.GENESIS and second["prev_hash"] == first["record_hash"]
    assert [record["verdict"] for record in ledger.read(book)] == ["blocked", "approved"]


def test_approved_checkpoint_verifies(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, verdict(checkpoint, "approved"))
    result = verify_checkpoint(checkpoint, book)
    assert result.deployable and result.status is Status.approved


def test_blocked_checkpoint_does_not_verify_and_says_why(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, verdict(checkpoint, "blocked", ["hellaswag acc_norm -2.4 points exceeds -1.0"]))
    result = verify_checkpoint(checkpoint, book)
    assert result.status is Status.blocked and "hellaswag acc_norm" in result.reason


def test_changed_checkpoint_does_not_verify(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, verdict(checkpoint, "approved"))
    (checkpoint / "model.safetensors").write_bytes(b"weights, edited")
    result = verify_checkpoint(checkpoint, book)
    assert result.status is Status.changed and "model.safetensors" in result.reason


def test_unknown_checkpoint_does_not_verify(tmp_path: Path) -> None:
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, verdict(fake_checkpoint(tmp_path / "a"), "approved"))
    assert verify_checkpoint(fake_checkpoint(tmp_path / "b", b"other"), book).status is Status.unknown


@pytest.mark.parametrize("edit", ["flip-verdict", "delete-first", "swap", "garbage"])
def test_edited_ledger_is_detected(tmp_path: Path, edit: str) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, verdict(checkpoint, "blocked", ["too slow"]))
    ledger.append(book, verdict(fake_checkpoint(tmp_path / "other", b"x"), "approved"))
    lines = book.read_text().splitlines()
    if edit == "flip-verdict":
        record = json.loads(lines[0])
        record["verdict"] = "approved"
        lines[0] = json.dumps(record, sort_keys=True)
    elif edit == "delete-first":
        lines = lines[1:]
    elif edit == "swap":
        lines = [lines[1], lines[0]]
    else:
        lines.append("{not json")
    book.write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerTampered, match="tampered: line"):
        ledger.read(book)
    result = verify_checkpoint(checkpoint, book)
    assert result.status is Status.tampered and not result.deployable
    with pytest.raises(LedgerTampered):
        ledger.append(book, verdict(checkpoint, "approved"))  # never extend a broken chain


def test_verify_command_exit_codes(cli, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, verdict(checkpoint, "approved"))
    ok = cli("verify", checkpoint, "--ledger", book)
    assert ok.code == 0 and "approved" in ok.out
    (checkpoint / "model.safetensors").write_bytes(b"changed")
    changed = cli("verify", checkpoint, "--ledger", book)
    assert changed.code == 1 and "changed since approval" in changed.out
