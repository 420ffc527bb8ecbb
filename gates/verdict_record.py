"""The verdict as a record: `VerdictRecord` is what verdicts/<format>.json holds (the gate stage's
value), what `quantgate gate --json` prints and what the ledger's record of a verdict wraps; one
class builds it (gates.stage.verdict_record, with the runner's additions: `_with_split`, the serving
classes) and every reader reads it (`VerdictRecord.from_json`). `GateRecord` is one gate as a
verdict record (and a serving ledger record, and the sequential stage) writes it
(`GateResult.record()`), what every reader of a stored verdict's `gates` reads (`read_gates`).

A verdict record holds only what its verdict reached: the gate command's has no looks, a blocked
format's no tails, a run without a serve stage no `serving`. Those fields are absent from the JSON,
not null, and read back as their defaults: `to_json` writes the fields that were set, so a record
read and written again is the same bytes (its canonical JSON is the `verdict_sha256` the ledger
recognises it by, and a signature's claims).

A verdict record has never carried a `schema_version` (adding one would change every verdict's
sha256): it is read as version 1, and one that names another version is refused like any record's.

Numbers keep the type they were written with (a policy's limit of 1 stays 1): `int | float`.
A field an earlier verdict predates (a gate's look, its stability) reads as its default."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Final, Literal, TypedDict, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from quantgate.core.errors import IntegrityError
from quantgate.core.records import Record, RecordPart
from quantgate.core.validation import first_problem
from quantgate.evalsets.serve_record import ServedSummary
from quantgate.gates.policy import Outcome

Number = int | float
# An outcome is written as its value; read back as the enum.
OutcomeField = Annotated[Outcome, Field(strict=False)]

VERDICT_KIND: Final = "verdict"
VERDICT_VERSION: Final = 1  # implied: a verdict record does not write it (see the module docstring)
Status = Literal["approved", "pending", "blocked"]

P = TypeVar("P", bound=RecordPart)


class Sparse(RecordPart):
    """A part whose fields not reached are absent from its JSON (see the module docstring)."""

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class OpenPart(BaseModel):
    """A part of a record that quantgate writes but another layer (or another version) shapes: the
    fields its readers read, strictly typed; every other field kept as written, untyped here.
    `to_json` gives the fields back exactly as they were read or set."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, allow_inf_nan=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


def read_part(cls: type[P], value: object, where: str) -> P:
    """`value` (parsed JSON) read as the record part `cls` at `where`: IntegrityError, one line
    naming the field, when it is damaged."""
    try:
        return cls.model_validate(value)
    except ValidationError as error:
        raise _damaged(where, error) from error


def _damaged(where: str, error: ValidationError) -> IntegrityError:
    """One line: where, the damaged field's path in it, and what is wrong with it."""
    problem = first_problem(error)
    place = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in problem.path)
    return IntegrityError(f"{where}{place}: {problem.message}")


class GateRecord(RecordPart):
    """One gate (gates.verdict.GateResult), as written."""

    gate: str  # "hellaswag@v1 acc_norm"
    outcome: OutcomeField
    estimate: Number | None
    low: Number | None
    high: Number | None
    limit: Number
    unit: str
    reason: str
    items: int | None = None
    look: int | None = None
    looks: int | None = None
    confidence: Number | None = None
    decided_by: str = "exact"
    half_width: Number | None = None
    detectable: Number | None = None
    stability: Number | None = None
    stability_resamples: int | None = None
    stability_inner_resamples: int | None = None
    stability_seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


_GATES: TypeAdapter[list[GateRecord]] = TypeAdapter(list[GateRecord])


def read_gates(value: object, where: str) -> list[GateRecord]:
    """The gates in `value` (a verdict's `gates`, parsed JSON) read at `where`: IntegrityError, one
    line naming the gate and field, when one is damaged."""
    try:
        return _GATES.validate_python(value)
    except ValidationError as error:
        raise _damaged(f"{where}: gates", error) from error


# ---- the verdict record's parts ------------------------------------------------------------------

class SmokeCheck(TypedDict, total=False):
    """The quantize stage's smoke check, as a quantized checkpoint's manifest keeps it (`smoke`):
    what the finite-logits integrity gate reads."""

    prompt: str
    completion: str
    logits_finite: bool
    error: str


class OverlapSummary(RecordPart):
    """The calibration set's n-gram overlap with the golden sets (the overlap stage's value, what
    the calibration-overlap integrity gate reads)."""

    n: int
    candidate_ngrams: int
    shared_ngrams: int
    share: Number
    against: list[str]


class CheckpointRef(Sparse):
    """The checkpoint a verdict judged: where, its format, its weight files' sha256s (what the
    report and search read) and `files`, the sha256 of every file of the directory by its relative
    path (core.models.checkpoint_files): what `verify` matches and the signature covers. A verdict
    recorded before `files` existed reads as None (it covers the weights only)."""

    path: str
    format: str
    weights: dict[str, str]
    files: dict[str, str] | None = None


class BaselineRef(Sparse):
    model: str
    weights_sha256: str


class PolicyIdentity(Sparse):
    """The policy a verdict was reached under (LoadedPolicy.identity); `narrowed_to` and `dropped`
    only where the policy was narrowed."""

    name: str
    version: str
    sha256: str
    narrowed_to: list[str] | None = None
    dropped: list[str] | None = None


class EvalSetRef(Sparse):
    """One golden set the candidate was evaluated on."""

    name: str
    version: str
    sha256: str
    limit: int | None
    items: int


class MetricSummary(Sparse):
    """A gate's numbers, keyed by the gate in a verdict's `metrics`."""

    outcome: OutcomeField
    estimate: Number | None
    low: Number | None
    high: Number | None
    limit: Number
    unit: str


class Tail(Sparse):
    """One tail metric of a text set with its bootstrap interval (gates.verdict.tails)."""

    estimate: Number
    low: Number
    high: Number
    confidence: Number
    items: int


class TraceEntry(Sparse):
    """One gate at one look (quantgate.pipeline.looks)."""

    set: str
    metric: str
    look: int
    looks: int
    items: int
    confidence: Number
    outcome: str
    estimate: Number | None
    low: Number | None
    high: Number | None
    limit: Number
    stability: Number | None = None


class SequentialSummary(Sparse):
    """A verdict's record of its looks (quantgate.pipeline.runner.sequential_summary)."""

    looks: dict[str, list[int]]
    items: dict[str, int]
    error_control: str
    confidence: Number
    blocked_by: str | None
    not_evaluated: dict[str, str]
    trace: list[TraceEntry]


class SplitItems(Sparse):
    """The items of one set a search split covers: after `offset`, at most `ceiling`."""

    offset: int
    ceiling: int


class AsServedSummary(Sparse):
    """What a device class's entry keeps of its numerics gated as served."""

    numerics: str
    settings: dict[str, str]
    served_as: dict[str, str]
    status: str
    reason: str


class ClassVerdict(Sparse):
    """The verdict on one device class: approved, pending (with the command that attests it) or blocked."""

    status: Status
    reason: str
    next: str | None = None
    as_served: list[AsServedSummary] | None = None


class AsServedRecord(Sparse):
    """What a device class serves, gated (quantgate.pipeline.runner.as_served_record): the numerics,
    the policy's metric gates on the served results and `status`: passed, failed or not evaluated."""

    numerics: str
    device_class: str
    settings: dict[str, str]
    served_as: dict[str, str]
    because: str
    status: str
    reason: str
    results: str | None = None
    gates: list[GateRecord] | None = None

    def summary(self) -> AsServedSummary:
        return AsServedSummary(numerics=self.numerics, settings=self.settings, served_as=self.served_as, status=self.status,
                               reason=self.reason)


class VerdictRecord(Sparse, Record):
    """A verdict, as written (see the module docstring). The fields after `results` are added where
    they apply: `tails` by a gate that evaluated, the looks by the pipeline, `serving` and `classes`
    where a serve stage ran, `as_served` where a class serves other numerics, the split fields for a
    search's trial or held-out gate."""

    KIND: ClassVar[str] = VERDICT_KIND
    WHAT: ClassVar[str] = "verdict record"
    READS: ClassVar[tuple[int, ...]] = (VERDICT_VERSION,)

    kind: Literal["verdict"]
    # implied, never written (see the module docstring)
    schema_version: Literal[1] = Field(default=VERDICT_VERSION, exclude=True)
    format: str
    precision: str
    checkpoint: CheckpointRef | None
    baseline: BaselineRef
    policy: PolicyIdentity
    evalsets: list[EvalSetRef]
    metrics: dict[str, MetricSummary]
    gates: list[GateRecord]
    verdict: Status  # approved, pending (quality passed, serving evidence that approves it missing) or blocked
    quality: Literal["passed", "blocked"] | None = None
    reasons: list[str]
    results: str | None = None
    tails: dict[str, dict[str, Tail]] | None = None
    sequential: SequentialSummary | None = None
    not_evaluated: dict[str, str] | None = None
    serving: ServedSummary | None = None
    classes: dict[str, ClassVerdict] | None = None
    as_served: list[AsServedRecord] | None = None
    checkpoint_name: str | None = None
    split: str | None = None
    split_items: dict[str, SplitItems] | None = None

    @classmethod
    def from_json(cls, value: object, where: str) -> VerdictRecord:
        """The verdict in `value` (see Record.from_json); written without a schema_version, it
        reads as version 1."""
        if isinstance(value, dict) and "schema_version" not in value:
            value = {**value, "schema_version": VERDICT_VERSION}
        return super().from_json(value, where)

    def with_fields(self, **fields: object) -> VerdictRecord:
        """This verdict with `fields` added (or replaced), each checked against its type."""
        return VerdictRecord.from_json({**self.to_json(), **_as_json(fields)}, "a verdict record")


def _as_json(fields: dict[str, object]) -> dict[str, object]:
    def one(value: object) -> object:
        if isinstance(value, Sparse):
            return value.to_json()
        if isinstance(value, RecordPart):
            return value.model_dump(mode="json", by_alias=True, exclude_unset=True)
        if isinstance(value, dict):
            return {key: one(item) for key, item in value.items()}
        if isinstance(value, list):
            return [one(item) for item in value]
        return value

    return {key: one(value) for key, value in fields.items()}
