"""A ledger record, typed: `LedgerRecord` is one line of the approval ledger (gates/ledger.py),
appended or about to be: a verdict (a `VerdictRecord` with the verdict's own sha256, whether it is
signed, and its signature) or a serving record (gates/attest.py), with the chain's own fields.

The ledger is a log that outlives quantgate's versions, so its record names what a reader of the
ledger reads (verify, attest, the signature's checks): those fields are typed, and a line where
one has another type is tampering (gates.ledger.read says which). Every other field of a verdict
(its metrics, gates, golden sets...) is carried as written, untyped here: the chain and a
signature's claims hash the line as it is, and `VerdictRecord` types it where a verdict is made.
`to_json` gives the line's fields back exactly as they were read or set."""

from __future__ import annotations

from quantgate.core.artifacts import sha256_json
from quantgate.gates.verdict_record import OpenPart, VerdictRecord

SERVING_KIND = "serving"  # a serving record's `kind` (gates/attest.py)


class LedgerPart(OpenPart):
    """A part of a ledger line: the fields a reader of the ledger reads, strictly typed; any other
    field kept as written (see the module docstring)."""


class LedgerCheckpoint(LedgerPart):
    path: str | None = None
    weights: dict[str, str] | None = None
    files: dict[str, str] | None = None  # every file of the directory (gates.verdict_record.CheckpointRef)


class SignedServing(LedgerPart):
    """The serve check's settings a run gated with (evalsets.served.ServeCheckConfig, as written):
    carried in the verdict's ledger record so that its signature covers them, and read from there
    by `serving check --run` (gates/attest.py), never from the run's unauthenticated run.json."""


class LedgerPolicy(LedgerPart):
    """The policy a record was reached under: name, version, sha256, and a narrowing."""

    name: str
    version: str
    sha256: str | None = None
    narrowed_to: list[str] | None = None
    dropped: list[str] | None = None


class Signature(LedgerPart):
    """A signed record's signature (gates/signing.py): the model-signing bundle, the key's
    fingerprint and the sha256 of the claims it binds."""

    format: str | None = None
    file: str
    bundle: str
    bundle_sha256: str | None = None
    key_sha256: str
    claims_sha256: str


class ClassEvidence(LedgerPart):
    """A verdict's entry for one device class (its `classes`)."""

    status: str | None = None
    reason: str | None = None
    next: str | None = None


class LedgerRecord(LedgerPart):
    """One ledger line (see the module docstring). The fields verify checks first come first,
    in the order it names a malformed one."""

    time: str | None = None  # every appended record has it (gates.ledger.append)
    verdict: str | None = None  # approved, pending, blocked; None on a serving record
    split: str | None = None
    reasons: list[str] | None = None
    checkpoint: LedgerCheckpoint | None = None
    policy: LedgerPolicy | None = None
    signed: bool = False
    signature: Signature | None = None
    kind: str | None = None  # "verdict", or "serving" (SERVING_KIND)
    format: str | None = None
    verdict_sha256: str | None = None  # a verdict's: the sha256 of the verdict record it wraps
    classes: dict[str, ClassEvidence] | None = None  # a verdict's: per device class
    attests: str | None = None  # a serving record's: the verdict_sha256 of the verdict it adds evidence to
    device_class: str | None = None
    serving_status: str | None = None
    serving_settings: SignedServing | None = None  # a run's verdict: the serve check's settings it gated with
    # a run's verdict: the sha256 of the results manifests it was reached on ("candidate", "baseline"),
    # what `serving check --run` compares a serve against (gates/attest.py checks them)
    results_sha256: dict[str, str] | None = None
    schema_version: int | None = None
    quantgate_version: str | None = None
    prev_hash: str | None = None
    record_hash: str | None = None

    @classmethod
    def of_verdict(cls, verdict: VerdictRecord) -> LedgerRecord:
        """The ledger's copy of a verdict, with the verdict's own hash: a rerun that reaches the
        same verdict on the same bytes finds it there and appends nothing."""
        value = verdict.to_json()
        return cls.model_validate({**value, "verdict_sha256": sha256_json(value)})

    def with_fields(self, **fields: object) -> LedgerRecord:
        """This record with `fields` set (a LedgerPart as its JSON), checked against their types."""
        return LedgerRecord.model_validate({**self.to_json(), **{name: value.to_json() if isinstance(value, LedgerPart) else value
                                                                 for name, value in fields.items()}})

    @property
    def weights(self) -> dict[str, str] | None:
        """The weight files' sha256s of the checkpoint it judges (None: it names none)."""
        return self.checkpoint.weights if self.checkpoint is not None else None

    @property
    def files(self) -> dict[str, str] | None:
        """Every file's sha256 of the checkpoint it judges (None: it names none, or predates `files`)."""
        return self.checkpoint.files if self.checkpoint is not None else None

    @property
    def checkpoint_path(self) -> str | None:
        return self.checkpoint.path if self.checkpoint is not None else None
