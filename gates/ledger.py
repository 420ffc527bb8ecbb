"""The approval ledger: append-only JSONL, one record per verdict or serving attestation, each
carrying the hash of the previous one (a hash chain) and a signature (gates/signing.py) over its
own claims, its chain position and the files of the checkpoint it judges.

The chain alone proves order, not origin: anyone can recompute it. So `verify_checkpoint`, what a
deployment step calls, accepts a checkpoint only when every one of its files matches an approval
in the ledger, signed by a key of the trust file, and every record from that approval to the end
of the ledger is signed by a trusted key too (a record deleted or moved after the approval breaks
the signature of the record after it). docs/reliability.md, "Threat model", says what remains.
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
from quantgate.core.exitcodes import Exit
from quantgate.core.models import checkpoint_files, weight_file_hashes
from quantgate.gates import keys, signing
from quantgate.gates.ledger_record import SERVING_KIND as SERVING_KIND
from quantgate.gates.ledger_record import LedgerRecord

# A ledger line as parsed, before its fields are checked: what the chain hashes.
Line = dict[str, JsonValue]

GENESIS = "0" * 64
SCHEMA_VERSION = 1



class Untrusted(QuantgateError):
    """A record that cannot be trusted (unsigned, a key the trust file does not hold, a bad
    signature, files or settings that are not what was signed): exit 6."""

    exit_code = int(Exit.UNTRUSTED)


class LedgerTampered(Untrusted):
    """A ledger whose chain or lines do not hold: nothing in it can be trusted (exit 6)."""


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
    weights, files = checkpoint.get("weights", {}), checkpoint.get("files") or {}
    return isinstance(weights, dict) and all(_is(digest, str) for digest in weights.values()) and \
        isinstance(files, dict) and all(_is(digest, str) for digest in files.values())


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


def append(ledger: Path, entry: LedgerRecord, key: signing.Key | None = None, *, model_sig: Path | None = None,
           records: list[LedgerRecord] | None = None) -> LedgerRecord:
    """Chain `entry` onto the ledger, signed with `key` (its claims, its place in the chain and
    the files it names; with `model_sig`, a checkpoint directory, the signature is also written
    there as model.sig), and write the whole file anew atomically (temp + rename). The caller
    holds the ledger's sibling_lock where another process may append at once. Without a key the
    record says `signed: false` (tests, and ledgers of older versions). `records`: the ledger as
    the caller read it under that lock (not read again)."""
    ledger = Path(ledger)
    if records is None:
        records = read(ledger)  # refuses to extend a tampered ledger
    record: Line = {
        **entry.to_json(),
        "schema_version": SCHEMA_VERSION,
        "time": entry.time or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quantgate_version": metadata.version("quantgate"),
        "prev_hash": records[-1].record_hash if records else GENESIS,
        "signed": key is not None,
    }
    record.pop("signature", None)
    if key is not None:
        unsigned = LedgerRecord.model_validate(record)
        record["signature"] = signing.sign(unsigned, key, model_sig).to_json()
    record["record_hash"] = record_hash(record)
    existing = ledger.read_bytes() if ledger.exists() else b""
    with atomic_file(ledger, durable=True) as stream:
        stream.write(existing)
        stream.write((json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))
    return LedgerRecord.model_validate(record)


class Status(str, Enum):
    """What `verify` found; `EXIT` maps each to its exit code (quantgate/core/exitcodes.py)."""

    approved = "approved"
    approved_unsigned = "approved (UNSIGNED, accepted by --allow-unsigned)"
    pending = "pending serving"  # quality passed; no class has served it as gated yet
    blocked = "blocked"
    unknown = "unknown"
    changed = "changed since the verdict"
    weights_only = "weights only"  # a verdict of an older quantgate: it names the weight files, not every file
    tampered = "ledger tampered"
    # a signature's problems (signing.Problem, the same values)
    unsigned = "unsigned"
    unknown_key = "signed by an unknown key"
    bad_signature = "bad signature"
    rewritten = "ledger rewritten"


EXIT: dict[Status, Exit] = {
    Status.approved: Exit.APPROVED, Status.approved_unsigned: Exit.APPROVED, Status.pending: Exit.PENDING,
    Status.blocked: Exit.BLOCKED, Status.unknown: Exit.BLOCKED,
    **{status: Exit.UNTRUSTED for status in (Status.changed, Status.weights_only, Status.tampered, Status.unsigned,
                                             Status.unknown_key, Status.bad_signature, Status.rewritten)},
}


@dataclass(frozen=True)
class Verification:
    status: Status
    reason: str
    record: LedgerRecord | None = None

    @property
    def deployable(self) -> bool:
        return self.status in (Status.approved, Status.approved_unsigned)

    @property
    def exit_code(self) -> Exit:
        return EXIT[self.status]


def verify_checkpoint(checkpoint: Path, ledger: Path, trust: Path | None = None, device_class: str | None = None, *,
                      allow_unsigned: bool = False) -> Verification:
    """Is this checkpoint, every file of it, approved in this ledger under a trusted key? The
    newest record on exactly these files decides; an approval (or a pending verdict) counts only
    when it and every record after it in the ledger carry a valid signature by a key of the trust
    file `trust` (default: the user's own, gates/keys.py). `allow_unsigned` accepts unsigned
    records, and says so. A ledger that does not exist or cannot be read, a checkpoint that cannot
    be hashed or a bad trust file is an InputError."""
    ledger = Path(ledger)
    if not ledger.exists():
        raise InputError(f"ledger {ledger} does not exist")
    if not ledger.is_file():
        raise InputError(f"ledger {ledger} is not a file")
    # a trust file given is read first (a bad one is bad input); the user's own only when a verdict needs it
    trusted = trusted_keys(trust, allow_unsigned) if trust is not None else None
    try:
        records = read(ledger)
    except LedgerTampered as error:
        return Verification(Status.tampered, str(error))
    files = checkpoint_files(checkpoint)
    found, verdict = _decide(Path(checkpoint), records, files, device_class)
    if found.status not in (Status.approved, Status.pending) or verdict is None:
        return found
    return _signed(found, records, _index(records, verdict), trusted if trusted is not None else trusted_keys(None, allow_unsigned),
                   allow_unsigned)


def trusted_keys(path: Path | None, allow_unsigned: bool = False) -> dict[str, signing.Key]:
    """The trusted keys by fingerprint: the trust file given, else the user's own (bad input when
    there is none, unless `allow_unsigned`: then none)."""
    if path is not None:
        return keys.load_trust(path).keys
    default = keys.default_trust_file()
    if default.is_file():
        return keys.load_trust(default, "trust file").keys
    if allow_unsigned:
        return {}
    raise InputError(f"no trust file at {default}: give --trust FILE (the {keys.TRUST_FILE} a run writes beside its ledger)")


def require_signed(ledger: Path, records: list[LedgerRecord], record: LedgerRecord, trusted: dict[str, signing.Key]) -> None:
    """Untrusted, naming the line, unless `record` and every record after it carry a valid
    signature by a trusted key (what `verify` asks of an approval: see `_signed`)."""
    start = _index(records, record)
    for number, entry in enumerate(records[start:], start=start + 1):
        check = signing.check(entry, trusted)
        if check.problem is not None:
            raise Untrusted(f"ledger {ledger} line {number}: {check.problem.value}: {check.reason}")


def matches(record: LedgerRecord, files: dict[str, str]) -> bool:
    """Whether `record` judges a checkpoint of exactly these files (see `_matches`)."""
    return _matches(record, files, weight_file_hashes(files))


def _matches(record: LedgerRecord, files: dict[str, str], weights: dict[str, str]) -> bool:
    """A record on these files: every file, or (a verdict of an older quantgate) the weights."""
    return record.files == files if record.files is not None else record.weights is not None and record.weights == weights


def _decide(checkpoint: Path, records: list[LedgerRecord], files: dict[str, str],
            device_class: str | None) -> tuple[Verification, LedgerRecord | None]:
    """What the ledger says of these files before any signature is checked, and the verdict it
    rests on (the first record whose signature and everything after it must hold)."""
    weights = weight_file_hashes(files)
    matching = [record for record in records if _matches(record, files, weights)]
    # serving records (quantgate serving check --run) add evidence to the verdict before them; they judge nothing alone
    attested = [record for record in matching if record.kind == SERVING_KIND]
    matching = [record for record in matching if record.kind != SERVING_KIND]
    # a search trial's verdict was reached on the search split, the items the search selected on:
    # it approves nothing, and no serving evidence completes a pending one (attest serves only a
    # held-out verdict); the held-out gate of the chosen trial does (docs/search.md)
    trials = [record for record in matching if record.split == "search" and record.verdict in ("approved", "pending")]
    matching = [record for record in matching if record not in trials]
    if trials and not matching:
        return Verification(Status.blocked, f"a search trial judged on the search split only ({trials[-1].verdict} "
                            f"{trials[-1].time}): only its held-out gate can approve it", trials[-1]), None
    if matching:
        record = matching[-1]
        if record.verdict in ("approved", "pending"):
            if record.files is None:
                return Verification(Status.weights_only, f"the verdict of {record.time} names the weight files only (recorded "
                                    "by an older quantgate): config, tokenizer and chat template are not covered; gate it again",
                                    record), None
            later = [entry for entry in attested if _index(records, entry) > _index(records, record)]
            return _by_class(record, later, device_class), record
        reasons = "; ".join(record.reasons or []) or "no reason recorded"
        return Verification(Status.blocked, f"blocked {record.time}: {reasons}", record), None
    resolved = str(Path(checkpoint).resolve())
    near = [record for record in records if record.kind != SERVING_KIND and record.weights is not None
            and (record.weights == weights or record.checkpoint_path == resolved)]
    if near:
        last = near[-1]
        recorded, now = (last.files, files) if last.files is not None else (last.weights or {}, weights)
        return Verification(Status.changed, f"{signing.describe_changes(recorded, now)} since the verdict of {last.time} "
                            f"({last.verdict} {last.format})", last), None
    return Verification(Status.unknown, "no verdict in the ledger for these files"), None


def _signed(found: Verification, records: list[LedgerRecord], start: int, trusted: dict[str, signing.Key],
            allow_unsigned: bool) -> Verification:
    """`found` (approved or pending) if the verdict it rests on (line `start` + 1) and every record
    after it carry a valid signature by a trusted key; else the first problem, naming the line."""
    unsigned: list[int] = []
    used: set[str] = set()
    for number, record in enumerate(records[start:], start=start + 1):
        check = signing.check(record, trusted)
        if check.problem is signing.Problem.unsigned and allow_unsigned:
            unsigned.append(number)
            continue
        if check.problem is not None:
            what = f"{record.kind or 'verdict'} {record.format or ''}".strip()
            after = "" if number == start + 1 else \
                " (a record after the verdict that cannot be checked could hide a deleted or reordered one)"
            return Verification(Status(check.problem.value), f"line {number} of the ledger ({what}): {check.reason}{after}; "
                                f"{found.status.value}: {found.reason}", record)
        if record.signature is not None:
            used.add(record.signature.key_sha256[:16])
    by = f"signed by key sha256 {', '.join(sorted(used))}..." if used else ""
    if unsigned:
        lines = ", ".join(map(str, unsigned))
        note = f"UNSIGNED line{'s' if len(unsigned) > 1 else ''} {lines} accepted by --allow-unsigned"
        status = Status.approved_unsigned if found.status is Status.approved else found.status
        return Verification(status, f"{found.reason}; {note}" + (f"; {by}" if by else ""), found.record)
    return Verification(found.status, f"{found.reason}; {by}", found.record)


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


def _by_class(record: LedgerRecord, attested: list[LedgerRecord], device_class: str | None) -> Verification:
    """A verdict whose quality passed: approved where a class (`device_class`, or any) served it as
    gated, blocked where that class's engine disagrees, else pending with what is missing."""
    evidence = class_evidence(record, attested)
    if not evidence and record.verdict == "approved":
        return _approved(record)  # a policy that gates no serving
    wanted = {device_class: evidence[device_class]} if device_class in evidence else {} if device_class else evidence
    approved = [(name, found) for name, found in wanted.items() if found[0] == "approved"]
    if approved:
        name, (_, why, source) = approved[-1]
        found = _approved(source)
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


def _approved(record: LedgerRecord) -> Verification:
    """An approval (a verdict, or a serving record that completes a pending one), before its
    signatures are checked."""
    policy = record.policy
    if policy is None:  # read() refuses an approval without its policy; a serving record names the verdict's
        return Verification(Status.approved, f"approved {record.time}", record)
    narrowed = (f" narrowed to {', '.join(policy.narrowed_to)} (not gated: {', '.join(policy.dropped or [])})"
                if policy.narrowed_to is not None else "")
    return Verification(Status.approved, f"approved {record.time} under policy {policy.name}@{policy.version}{narrowed}", record)
