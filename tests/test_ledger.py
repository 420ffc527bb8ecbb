"""The approval ledger: a hash chain that detects edits, and `verify` as a deployment step sees it
(its records signed by the user's own key; tests/test_trust.py and test_signing.py cover what a
signature adds: a chain recomputed by hand, an unknown key, an unsigned record)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantgate.core.exitcodes import Exit
from quantgate.core.models import checkpoint_files, weight_hashes
from quantgate.gates import keys, ledger, signing
from quantgate.gates.ledger import LedgerTampered, Status, verify_checkpoint
from quantgate.gates.ledger_record import LedgerRecord


def fake_checkpoint(path: Path, content: bytes = b"weights") -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(content)
    return path


def verdict(checkpoint: Path, outcome: str, reasons: list[str] | None = None) -> dict:
    return {
        "kind": "verdict",
        "checkpoint": {"path": str(checkpoint.resolve()), "format": "gptq-int4", "weights": weight_hashes(checkpoint),
                       "files": checkpoint_files(checkpoint)},
        "policy": {"name": "default", "version": "v1", "sha256": "0" * 64},
        "evalsets": [{"name": "arc-easy", "version": "v1", "sha256": "1" * 64}],
        "metrics": {"arc-easy/acc": {"difference": -0.004}},
        "verdict": outcome,
        "reasons": reasons or [],
    }


def entry(checkpoint: Path, outcome: str, reasons: list[str] | None = None) -> LedgerRecord:
    """The verdict as the ledger's record of it."""
    return LedgerRecord.model_validate(verdict(checkpoint, outcome, reasons))


def user_key() -> signing.Key:
    """The user's own signing key (made on first use; its public key in the user's trust file)."""
    return signing.load_signing_key(keys.ensure_default_key())


def test_records_chain_and_read_back(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    first = ledger.append(book, entry(checkpoint, "blocked", ["arc-easy acc -2.0 points exceeds -1.0"]))
    second = ledger.append(book, entry(checkpoint, "approved"))
    assert first.prev_hash == ledger.GENESIS and second.prev_hash == first.record_hash
    assert [record.verdict for record in ledger.read(book)] == ["blocked", "approved"]


def test_approved_checkpoint_verifies(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, entry(checkpoint, "approved"), user_key())
    result = verify_checkpoint(checkpoint, book)
    assert result.deployable and result.status is Status.approved


def test_blocked_checkpoint_does_not_verify_and_says_why(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, entry(checkpoint, "blocked", ["hellaswag acc_norm -2.4 points exceeds -1.0"]))
    result = verify_checkpoint(checkpoint, book)
    assert result.status is Status.blocked and "hellaswag acc_norm" in result.reason


def test_changed_checkpoint_does_not_verify(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, entry(checkpoint, "approved"), user_key())
    (checkpoint / "model.safetensors").write_bytes(b"weights, edited")
    result = verify_checkpoint(checkpoint, book)
    assert result.status is Status.changed and "model.safetensors changed" in result.reason and not result.deployable


def test_unknown_checkpoint_does_not_verify(tmp_path: Path) -> None:
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, entry(fake_checkpoint(tmp_path / "a"), "approved"))
    assert verify_checkpoint(fake_checkpoint(tmp_path / "b", b"other"), book).status is Status.unknown


@pytest.mark.parametrize("edit", ["flip-verdict", "delete-first", "swap", "garbage"])
def test_edited_ledger_is_detected(tmp_path: Path, edit: str) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, entry(checkpoint, "blocked", ["too slow"]))
    ledger.append(book, entry(fake_checkpoint(tmp_path / "other", b"x"), "approved"))
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
        ledger.append(book, entry(checkpoint, "approved"))  # never extend a broken chain


def test_verify_command_exit_codes(cli, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    ledger.append(book, entry(checkpoint, "approved"), user_key())
    ok = cli("verify", checkpoint, "--ledger", book)
    assert ok.code == Exit.APPROVED and "approved" in ok.out
    (checkpoint / "model.safetensors").write_bytes(b"changed")
    changed = cli("verify", checkpoint, "--ledger", book)
    assert changed.code == Exit.UNTRUSTED and "changed since the verdict" in changed.out


# ---- bad input and damaged ledgers: one line and exit 2, or "tampered"; never a traceback ------


def test_a_missing_or_unreadable_ledger_is_bad_input(cli, tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    missing = cli("verify", checkpoint, "--ledger", tmp_path / "missing.jsonl")
    assert missing.code == 2 and missing.err == f"quantgate: error: ledger {tmp_path / 'missing.jsonl'} does not exist\n"
    directory = cli("verify", checkpoint, "--ledger", tmp_path)
    assert directory.code == 2 and directory.err.startswith("quantgate: error: ledger ") and len(directory.err.splitlines()) == 1


def rechained(records: list) -> bytes:
    """Records (any JSON values) written with a valid hash chain, as a rewriter would."""
    lines, previous = [], ledger.GENESIS
    for record in records:
        record = {**record, "prev_hash": previous}
        record["record_hash"] = previous = ledger.record_hash(record)
        lines.append(json.dumps(record))
    return ("\n".join(lines) + "\n").encode("utf-8")


def damaged(case: str, checkpoint: Path) -> bytes:
    good = {**verdict(checkpoint, "approved"), "time": "2026-01-01T00:00:00+00:00"}
    return {
        "not-utf-8": b'{"verdict": "\xff\xfe"}\n',
        "deep-nesting": b"[" * 200_000 + b"\n",
        "deep-but-parsable": rechained([{**good, "meta": json.loads("[" * 900 + "]" * 900)}]),
        "huge-line": b'{"x": "' + b"a" * 2048 + b'"}\n',
        "not-an-object": b"[1, 2, 3]\n",
        "null": b"null\n",
        "huge-number": b'{"n": ' + b"9" * 5000 + b"}\n",
        "nan": b'{"n": NaN}\n',
        "lone-surrogate": b'{"s": "\\ud800"}\n',
        "checkpoint-a-string": rechained([{**good, "checkpoint": "ckpt"}]),
        "weights-a-list": rechained([{**good, "checkpoint": {"path": str(checkpoint), "weights": ["x"]}}]),
        "policy-a-number": rechained([{**good, "policy": 3}]),
        "no-policy-on-an-approval": rechained([{k: v for k, v in good.items() if k != "policy"}]),
        "time-a-number": rechained([{**good, "time": 5}]),
        "reasons-a-string": rechained([{**good, "reasons": "because"}]),
        "narrowed-a-string": rechained([{**good, "policy": {**good["policy"], "narrowed_to": "arc-easy"}}]),
        "signed-a-string": rechained([{**good, "signed": "yes"}]),
        "signature-a-list": rechained([{**good, "signed": True, "signature": ["x"]}]),
    }[case]


@pytest.mark.parametrize("case", ["not-utf-8", "deep-nesting", "deep-but-parsable", "huge-line", "not-an-object", "null",
                                  "huge-number", "nan", "lone-surrogate", "checkpoint-a-string", "weights-a-list",
                                  "policy-a-number", "no-policy-on-an-approval", "time-a-number", "reasons-a-string",
                                  "narrowed-a-string", "signed-a-string", "signature-a-list"])
def test_a_damaged_ledger_is_tampered_never_a_traceback(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setattr(ledger, "MAX_LINE", 1024)  # the huge line, at a size a test affords
    checkpoint = fake_checkpoint(tmp_path / "ckpt")
    book = tmp_path / "ledger.jsonl"
    book.write_bytes(damaged(case, checkpoint))
    with pytest.raises(LedgerTampered, match="tampered: line 1 "):
        ledger.read(book)
    result = cli("verify", checkpoint, "--ledger", book)
    assert result.code == Exit.UNTRUSTED and ": ledger tampered: " in result.out and result.err == ""


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                           max_leaves=8)
FIELDS = st.sampled_from(["verdict", "checkpoint", "policy", "time", "reasons", "split", "signed", "signature", "weights",
                          "path", "name", "version", "narrowed_to"]) | st.text(max_size=6)
# a record's fields: the ones verify reads, holding any JSON value (nested the same way)
RECORDS = st.recursive(st.dictionaries(FIELDS, JSON_VALUES, max_size=6), lambda inner: st.dictionaries(FIELDS, inner, max_size=4),
                       max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=300), st.lists(RECORDS, max_size=3).map(lambda records: rechained(
    [record if isinstance(record, dict) else {} for record in records]))))
def test_any_bytes_read_as_records_or_tampered(tmp_path: Path, data: bytes) -> None:
    """Random bytes, and random JSON values under a valid chain: read gives records or says
    tampered; verify gives a status. Nothing else escapes."""
    book = tmp_path / "fuzz.jsonl"
    book.write_bytes(data)
    keys.ensure_default_key()  # a trust file to check an approval against
    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        fake_checkpoint(checkpoint)
    try:
        ledger.read(book)
    except LedgerTampered:
        pass
    assert isinstance(verify_checkpoint(checkpoint, book).status, Status)


PATHS = [("verdict",), ("time",), ("reasons",), ("split",), ("signed",), ("signature",), ("checkpoint",), ("checkpoint", "path"),
         ("checkpoint", "weights"), ("checkpoint", "weights", "model.safetensors"), ("checkpoint", "files"),
         ("checkpoint", "files", "model.safetensors"), ("policy",), ("policy", "name"),
         ("policy", "version"), ("policy", "narrowed_to"), ("policy", "dropped")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), value=JSON_VALUES)
def test_any_value_in_any_field_verify_reads_gives_a_status(tmp_path: Path, path: tuple[str, ...], value) -> None:
    """An approval whose chain a rewriter recomputed, with one field verify reads set to any
    JSON value: a status (tampered where the type is wrong), never a traceback."""
    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        fake_checkpoint(checkpoint)
    keys.ensure_default_key()  # a trust file to check an approval against
    record = json.loads(json.dumps({**verdict(checkpoint, "approved"), "time": "2026-01-01T00:00:00+00:00"}))
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    book = tmp_path / "fuzz.jsonl"
    book.write_bytes(rechained([record]))
    assert isinstance(verify_checkpoint(checkpoint, book).status, Status)
