"""The approval ledger: append-only JSONL, one record per verdict, each record carrying the
hash of the previous one (a hash chain), so any edit, insertion or deletion is detected.

`verify_checkpoint` is what a deployment step calls: a checkpoint is deployable only if
its current weight bytes match an `approved` record of an intact ledger.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Any

from quantgate.core.artifacts import atomic_file, canonical_json, sha256_bytes
from quantgate.core.errors import QuantgateError
from quantgate.core.models import weight_hashes

GENESIS = "0" * 64
SCHEMA_VERSION = 1


class LedgerTampered(QuantgateError):
    exit_code = 1


def record_hash(record: dict[str, Any]) -> str:
    """sha256 of the record's canonical JSON without its own `record_hash` field."""
    return sha256_bytes(canonical_json({k: v for k, v in record.items() if k != "record_hash"}).encode("utf-8"))


def read(ledger: Path) -> list[dict[str, Any]]:
    """Every record, after checking the whole chain; LedgerTampered names the first bad line."""
    ledger = Path(ledger)
    if not ledger.exists():
        return []
    records, previous = [], GENESIS
    with open(ledger, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise LedgerTampered(f"ledger {ledger} tampered: line {number} is not JSON") from error
            if not isinstance(record, dict) or record.get("prev_hash") != previous:
                raise LedgerTampered(f"ledger {ledger} tampered: line {number} does not follow line {number - 1}")
            if record.get("record_hash") != record_hash(record):
                raise LedgerTampered(f"ledger {ledger} tampered: line {number} was edited")
            records.append(record)
            previous = record["record_hash"]
    return records


def append(ledger: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """Chain `entry` onto the ledger and write the whole file anew atomically (temp + rename)."""
    ledger = Path(ledger)
    records = read(ledger)  # refuses to extend a tampered ledger
    record = {
        **entry,
        "schema_version": SCHEMA_VERSION,
        "time": entry.get("time") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quantgate_version": metadata.version("quantgate"),
        "prev_hash": records[-1]["record_hash"] if records else GENESIS,
    }
    record["record_hash"] = record_hash(record)
    existing = ledger.read_bytes() if ledger.exists() else b""
    with atomic_file(ledger, durable=True) as stream:
        stream.write(existing)
        stream.write((json.dumps(record, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))
    return record


class Status(str, Enum):
    approved = "approved"
    blocked = "blocked"
    unknown = "unknown"
    changed = "changed since approval"
    tampered = "ledger tampered"


@dataclass(frozen=True)
class Verification:
    status: Status
    reason: str
    record: dict[str, Any] | None = None

    @property
    def deployable(self) -> bool:
        return self.status is Status.approved


def verify_checkpoint(checkpoint: Path, ledger: Path) -> Verification:
    """Is this checkpoint, byte for byte, approved in this ledger? The newest matching record decides."""
    try:
        records = read(ledger)
    except LedgerTampered as error:
        return Verification(Status.tampered, str(error))
    if not Path(ledger).exists():
        return Verification(Status.unknown, f"ledger {ledger} does not exist")
    weights = weight_hashes(checkpoint)
    matching = [record for record in records if record.get("checkpoint", {}).get("weights") == weights]
    # a search trial's verdict was reached on the search split, the items the search selected on:
    # it approves nothing; the held-out gate of the chosen trial does (docs/search.md)
    trials = [record for record in matching if record.get("split") == "search" and record.get("verdict") == "approved"]
    matching = [record for record in matching if record not in trials]
    if trials and not matching:
        return Verification(Status.blocked, f"a search trial judged on the search split only ({trials[-1]['verdict']} "
                            f"{trials[-1]['time']}): only its held-out gate can approve it", trials[-1])
    if matching:
        record = matching[-1]
        if record.get("verdict") == "approved":
            policy = record["policy"]
            narrowed = (f" narrowed to {', '.join(policy['narrowed_to'])} (not gated: {', '.join(policy.get('dropped') or [])})"
                        if policy.get("narrowed_to") is not None else "")
            return Verification(Status.approved, f"approved {record['time']} under policy "
                                f"{policy['name']}@{policy['version']}{narrowed}", record)
        reasons = "; ".join(record.get("reasons") or []) or "no reason recorded"
        return Verification(Status.blocked, f"blocked {record['time']}: {reasons}", record)
    resolved = str(Path(checkpoint).resolve())
    same_place = [record for record in records if record.get("checkpoint", {}).get("path") == resolved]
    if same_place:
        changed = sorted(name for name in set(weights) | set(same_place[-1]["checkpoint"]["weights"])
                         if weights.get(name) != same_place[-1]["checkpoint"]["weights"].get(name))
        return Verification(Status.changed, f"{', '.join(changed)} changed since the verdict of {same_place[-1]['time']}", same_place[-1])
    return Verification(Status.unknown, "no verdict in the ledger for these weights")
