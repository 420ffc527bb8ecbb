"""A verdict's gates as record parts: `GateRecord` is one gate as a verdict record (and a serving
ledger record, and the sequential stage) writes it (`GateResult.record()`), and what every reader
of a stored verdict's `gates` reads (`read_gates`). The verdict record around them is not typed
yet: its other fields are read as JSON.

Numbers keep the type they were written with (a policy's limit of 1 stays 1): `int | float`.
A field an earlier verdict predates (a gate's look, its stability) reads as its default."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from quantgate.core.errors import IntegrityError
from quantgate.core.records import RecordPart
from quantgate.core.validation import first_problem
from quantgate.gates.policy import Outcome

Number = int | float


class GateRecord(RecordPart):
    """One gate (gates.verdict.GateResult), as written."""

    gate: str  # "hellaswag@v1 acc_norm"
    outcome: Annotated[Outcome, Field(strict=False)]  # written as its value
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
        problem = first_problem(error)
        place = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in problem.path)
        raise IntegrityError(f"{where}: gates{place}: {problem.message}") from error
