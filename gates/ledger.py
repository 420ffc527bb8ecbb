"""The approval ledger: append-only JSONL, one record per verdict, each record carrying the
hash of the previous one (a hash chain), so any edit, insertion or deletion is detected.

`verify_checkpoint` is what a deployment step calls: a checkpoint is deployable only if
its current weight bytes match an `approved` record of an intact ledger, and, given the public
key, only if that record carries a signature by the key over its own claims and the
checkpoint's files (gates/signing.py): the chain detects an edit, the signature a rewrite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import JsonValue, ValidationError

from quantgate.core.artifacts import atomic_file, canonical_json, sha256_bytes
from quantgate.core.errors import InputError, QuantgateError
from quantgate.core.models import weight_hashes
from quantgate.gates import signing
from quantgate.gates.ledger_record import SERVING_KIND as SERVING_KIND
from quantgate.gates.ledger_record import LedgerRecord

# A ledger line as parsed, before its fields are checked: what the chain hashes.
Line = dict[str, JsonValue]

GENESIS = "0" * 64
SCHEMA_VERSION = 1



class LedgerTampered(QuantgateError):
    exit_code = 1


def record_hash(record: Line) -> str:
    """sha256 of the record's canonical JSON without its own `record_hash` field."""
    return sha256_bytes(canonical_json({k: v for k, v in record.items() if k != "record_hash"}).encode("utf-8"))


# A record is tens of kilobytes (a signed one carries its signature); a line past this is no record.
MAX_LINE = 16 * 1024 * 1024


def read(ledger: Path) -> list[LedgerRecord]:
    """Every record, after checking the whole chain; LedgerTampered names the first bad line.
    Any bytes are read without a traceback: a line that is not UTF-8, not JSON (or nested too
    deeply, or longer than MAX_LINE), not an object, or whose fields have the wrong types is
    tampering. A missing ledger is empty (a new one); one that cannot be read is an InputError."""
    ledger = Path(ledger)
    if not ledger.exists():
        return []
    records: list[LedgerRecord] = []
    previous = GENESIS
    try:
        with open(ledger, "rb") as stream:
            for number, line in enumerate(iter(lambda: stream.readline(MAX_LINE + 1), b""), start=1):
                record = _parse(ledger, number, line)
                if record.get("prev_hash") != previous:
                    raise LedgerTampered(f"ledger {ledger} tampered: line {number} does not follow line {number - 1}")
                if record.get("record_hash") != _hash_or_none(record):
                    raise LedgerTampered(f"ledger {ledger} tampered: line {number} was edited")
                records.append(_checked(ledger, number, record))
                previous = str(record["record_hash"])
    except OSError as error:
        raise InputError(f"ledger {ledger}: cannot read it ({error.strerror or error})") from error
    return records


def _parse(ledger: Path, number: int, line: bytes) -> Line:
    if len(line) > MAX_LINE:
        raise LedgerTampered(f"ledger {ledger} tampered: line {number} is longer than {MAX_LINE} bytes")
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise LedgerTampered(f"ledger {ledger} tampered: line {number} is not UTF-8 text") from error
    except RecursionError as error:
        raise LedgerTampered(f"ledger {ledger} tampered: line {number} is nested too deeply") from error
    except ValueError as error:  # not JSON, or a number past Python's digit limit
        raise LedgerTampered(f"ledger {ledger} tampered: line {number} is not JSON") from error
    if not isinstance(record, dict):
        raise LedgerTampered(f"ledger {ledger} tampered: line {number} is not a JSON object")
    parsed: Line = record
    return parsed


def _hash_or_none(record: Line) -> str | None:
    try:
        return record_hash(record)
    except (ValueError, RecursionError):  # nothing the writer wrote: it hashes what it writes
        return None


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _checkpoint_ok(checkpoint: Any) -> bool:
    if checkpoint is None:
        return True
    if not isinstance(checkpoint, dict) or not _is(checkpoint.get("path", ""), str):
        return False
    weights = checkpoint.get("weights", {})
    return isinstance(weights, dict) and all(_is(digest, str) for digest in weights.values())


def _policy_ok(policy: Any, approved: bool) -> bool:
    if policy is None:
        return not approved  # an approval names its policy
    return isinstance(policy, dict) and _is(policy.get("name"), str) and _is(policy.get("version"), str) and all(
        policy.get(key) is None or _strings(policy[key]) for key in ("narrowed_to", "dropped"))


def _signature_ok(signature: Any) -> bool:
    return signature is None or (isinstance(signature, dict) and all(
        _is(signature.get(key), str) for key in ("bundle", "key_sha256", "claims_sha256", "file")))


def _field_problem(record: Line) -> str | None:
    """The first field `verify` reads whose type is wrong, or None."""
    checks = [
        ("time", _is(record.get("time"), str)),
        ("verdict", record.get("verdict") is None or _is(record["verdict"], str)),
        ("split", record.get("split") is None or _is(record["split"], str)),
        ("reasons", record.get("reasons") is None or _strings(record["reasons"])),
        ("checkpoint", _checkpoint_ok(record.get("checkpoint"))),
        ("policy", _policy_ok(record.get("policy"), record.get("verdict") == "approved")),
        ("signed", _is(record.get("signed", False), bool)),
        ("signature", _signature_ok(record.get("signature"))),
    ]
    return next((name for name, ok in checks if not ok), None)


def _checked(ledger: Path, number: int, record: Line) -> LedgerRecord:
    """The line as a record: the fields verify checks first, in its order; then every field a
    reader of the ledger reads, typed (LedgerRecord)."""
    problem = _field_problem(record)
    if problem is None:
        try:
            return LedgerRecord.model_validate(record)
        except ValidationError as error:
            problem = str(error.errors()[0]["loc"][0])
    raise LedgerTampered(f"ledger {ledger} tampered: line {number} has a malformed {problem!r} field")


def append(ledger: Path, entry: LedgerRecord) -> LedgerRecord:
    """Chain `entry` onto the ledger and write the whole file anew atomically (temp + rename)."""
    ledger = Path(ledger)
    records = read(ledger)  # refuses to extend a tampered ledger
    record: Line = {
        **entry.to_json(),
        "schema_version": SCHEMA_VERSION,
        "time": entry.time or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quantgate_version": metadata.version("quantgate"),
        "prev_hash": records[-1].record_hash if records else GENESIS,
    }
    record["record_hash"] = record_hash(record)
    existing = ledger.read_bytes() if ledger.exists() else b""
    with atomic_file(ledger, durable=True) as stream:
        stream.write(existing)
        stream.write((json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))
    return LedgerRecord.model_validate(record)


class Status(str, Enum):
    approved = "approved"
    pending = "pending serving"  # quality passed; no class has served it as gated yet
    blocked = "blocked"
    unknown = "unknown"
    changed = "changed since approval"
    tampered = "ledger tampered"
    unsigned = "unsigned"
    wrong_key = "signed by another key"
    rewritten = "ledger rewritten"


@dataclass(frozen=True)
class Verification:
    status: Status
    reason: str
    record: LedgerRecord | None = None

    @property
    def deployable(self) -> bool:
        return self.status is Status.approved


def verify_checkpoint(checkpoint: Path, ledger: Path, public_key: Path | None = None, device_class: str | None = None) -> Verification:
    """Is this checkpoint, byte for byte, approved in this ledger? The newest matching record
    decides. With `public_key`, only an approval signed by that key over this very record and
    these files is (gates/signing.py); without it, the reason says whether the approval is
    signed. A ledger that does not exist or cannot be read, or a bad key file, is an InputError."""
    ledger = Path(ledger)
    if not ledger.exists():
        raise InputError(f"ledger {ledger} does not exist")
    if not ledger.is_file():
        raise InputError(f"ledger {ledger} is not a file")
    key = signing.load_public_key(public_key) if public_key is not None else None
    try:
        records = read(ledger)
    except LedgerTampered as error:
        return Verification(Status.tampered, str(error))
    weights = weight_hashes(checkpoint)
    matching = [record for record in records if record.weights == weights]
    # serving records (quantgate serving check --run) add evidence to the verdict before them; they judge nothing alone
    attested = [record for record in matching if record.kind == SERVING_KIND]
    matching = [record for record in matching if record.kind != SERVING_KIND]
    # a search trial's verdict was reached on the search split, the items the search selected on:
    # it approves nothing; the held-out gate of the chosen trial does (docs/search.md)
    trials = [record for record in matching if record.split == "search" and record.verdict == "approved"]
    matching = [record for record in matching if record not in trials]
    if trials and not matching:
        return Verification(Status.blocked, f"a search trial judged on the search split only ({trials[-1].verdict} "
                            f"{trials[-1].time}): only its held-out gate can approve it", trials[-1])
    if matching:
        record = matching[-1]
        if record.verdict in ("approved", "pending"):
            later = [entry for entry in attested if _index(records, entry) > _index(records, record)]
            return _by_class(Path(checkpoint), record, later, key, device_class)
        reasons = "; ".join(record.reasons or []) or "no reason recorded"
        return Verification(Status.blocked, f"blocked {record.time}: {reasons}", record)
    resolved = str(Path(checkpoint).resolve())
    same_place = [record for record in records if record.checkpoint_path == resolved]
    if same_place:
        approved = same_place[-1].weights or {}
        changed = sorted(name for name in set(weights) | set(approved) if weights.get(name) != approved.get(name))
        return Verification(Status.changed, f"{', '.join(changed)} changed since the verdict of {same_place[-1].time}", same_place[-1])
    return Verification(Status.unknown, "no verdict in the ledger for these weights")


def _index(records: list[LedgerRecord], record: LedgerRecord) -> int:
    """Where `record` (the object itself) is in the ledger: records of equal fields are distinct lines."""
    return next(index for index, entry in enumerate(records) if entry is record)


# (status, why, the record that says so)
Evidence = tuple[str, str, LedgerRecord]


def class_evidence(record: LedgerRecord, attested: list[LedgerRecord]) -> dict[str, Evidence]:
    """Per device class the newest serving evidence on a verdict: (status, why, the record that
    says so): the run's own serve (the verdict's `classes`), then each serving record after it that
    attests this very verdict under the same policy; others are not evidence about it."""
    evidence = {name: (str(entry.status), str(entry.reason), record) for name, entry in (record.classes or {}).items()}
    policy = _policy_identity(record)
    for entry in attested:
        if entry.attests == record.verdict_sha256 and _policy_identity(entry) == policy and entry.device_class:
            reasons = "; ".join(entry.reasons or []) if entry.serving_status != "approved" else "served as gated"
            evidence[entry.device_class] = (str(entry.serving_status), f"{reasons} (attested {entry.time})", entry)
    return evidence


def _policy_identity(record: LedgerRecord) -> tuple[str | None, str | None, str | None]:
    policy = record.policy
    return (policy.name, policy.version, policy.sha256) if policy is not None else (None, None, None)


def _by_class(checkpoint: Path, record: LedgerRecord, attested: list[LedgerRecord], key: signing.Key | None,
              device_class: str | None) -> Verification:
    """A verdict whose quality passed: approved where a class (`device_class`, or any) served it as
    gated, blocked where that class's engine disagrees, else pending with what is missing."""
    evidence = class_evidence(record, attested)
    if not evidence and record.verdict == "approved":
        return _approved(checkpoint, record, key)  # a policy that gates no serving
    wanted = {device_class: evidence[device_class]} if device_class in evidence else {} if device_class else evidence
    approved = [(name, found) for name, found in wanted.items() if found[0] == "approved"]
    if approved:
        name, (_, why, source) = approved[-1]
        found = _approved(checkpoint, source, key)
        blocked = [other for other, entry in evidence.items() if entry[0] == "blocked"]
        also = f"; blocked on {', '.join(blocked)}" if blocked else ""
        return Verification(found.status, f"quality passed {record.time}; served as gated on {name}{also}; {found.reason}", source)
    if device_class and device_class in evidence and evidence[device_class][0] == "blocked":
        return Verification(Status.blocked, f"blocked on {device_class}: {evidence[device_class][1]}", evidence[device_class][2])
    missing = "; ".join(f"{name}: {status}: {why}" for name, (status, why, _) in evidence.items()) or \
        "; ".join(record.reasons or []) or "no serving evidence"
    where = f"no serving evidence from {device_class}; " if device_class and device_class not in evidence else ""
    nexts = [entry.next for entry in (record.classes or {}).values() if entry.next]
    return Verification(Status.pending, f"quality passed {record.time}, serving pending: {where}{missing}"
                        + (f"; serve it where it will run: {nexts[0]}" if nexts else ""), record)


def _approved(checkpoint: Path, record: LedgerRecord, key: signing.Key | None) -> Verification:
    """An approval (a verdict, or a serving record that completes a pending one) as it verifies."""
    policy = record.policy
    assert policy is not None  # an approval names its policy (read checks it)
    narrowed = (f" narrowed to {', '.join(policy.narrowed_to)} (not gated: {', '.join(policy.dropped or [])})"
                if policy.narrowed_to is not None else "")
    approval = f"approved {record.time} under policy {policy.name}@{policy.version}{narrowed}"
    if key is None:
        return Verification(Status.approved, f"{approval}; {signing.describe(record)}", record)
    check = signing.check(checkpoint, record, key)
    if check.problem is None:
        return Verification(Status.approved, f"{approval}; {check.reason}", record)
    return Verification(Status(check.problem.value), f"{approval}, but {check.reason}", record)
