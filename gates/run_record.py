"""The run's record, run.json, as a record: `RunRecord` is what the pipeline writes while a run
goes and when it ends (quantgate.pipeline.runner, `_Run.manifest`), and what the report
(gates.report_records) and serving attestation (gates.attest) read of a run directory.

Its `plan` is the plan as the pipeline resolved it (quantgate.pipeline.plan's model, a layer above
the gates): named here only for the fields a gate reads, the rest kept as written."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import JsonValue, field_validator

from quantgate.core.memory import Taken
from quantgate.core.records import Record, RecordPart
from quantgate.core.rundir import RUN_KIND
from quantgate.gates.verdict_record import ClassVerdict, Number, OpenPart, PolicyIdentity, Sparse, Status, VerdictRecord

RUN_SCHEMA_VERSION = 1


class RunPlan(OpenPart):
    """The plan as run.json records it: what the report and attestation read of it."""

    model: str
    search: dict[str, JsonValue] | None = None  # the search's settings (quantgate.pipeline.plan), passed through
    serving: dict[str, JsonValue] | None = None  # the serve stage's config: evalsets.served.ServeCheckConfig's fields


class RunPolicy(PolicyIdentity):
    """The policy's identity and the file it was read from."""

    path: str


class PlotAxes(RecordPart):
    x: str
    y: str | None
    higher_is_better: bool


class PlannedPower(RecordPart):
    """One gate's planned power at its ceiling (gates.samplesize.GatePower.as_dict)."""

    split: str
    set: str
    gate: str
    precision: str
    ceiling: int
    planned: bool
    items: int | None
    power: Number | None
    target: Number
    effect: Number
    limit: Number
    unit: str
    discordance: Number | None
    source: str
    decidable: bool | None


class RunStage(RecordPart):
    """A stage's status (quantgate.pipeline.progress.StageStatus)."""

    stage: str
    status: str
    seconds: Number
    detail: str
    where: str


class RunVerdict(RecordPart):
    """A verdict as run.json lists it: the status, why, and per device class."""

    verdict: Status
    reasons: list[str]
    classes: dict[str, ClassVerdict]

    @classmethod
    def of(cls, record: VerdictRecord) -> RunVerdict:
        return cls(verdict=record.verdict, reasons=record.reasons, classes=record.classes or {})


class FailedUnit(RecordPart):
    """A unit of the run that raised, died or never answered (the run went on without it; the same
    command tries it again): which, why, its log, and for a unit run in a child process that a
    signal ended, the signal and the child's peak memory (its resident set, os.wait4's ru_maxrss)."""

    kind: str  # its stage kind: calibration, measure, evaluate, quantize, sensitivity, serve
    unit: str  # "quantize gptq-int4", "evaluate baseline", "quantize search-2"
    reason: str  # one line: "quantize gptq-int4 failed: RuntimeError: ... (log ...)"
    log: str | None = None
    signal: str | None = None  # "SIGKILL" (an OOM kill), "SIGSEGV"
    peak_memory_bytes: int | None = None  # the child's peak resident set

    def __str__(self) -> str:
        return self.reason


# run.json's status: "running" while it goes, "finished" once every verdict and the report are
# written, BASELINE_FAILED when the baseline (the one unit every verdict needs) failed: no verdicts.
RUNNING, FINISHED, BASELINE_FAILED = "running", "finished", "baseline failed"
# STOPPED: the run ended before its verdicts (Ctrl-C, bad input found mid-run, a tampered ledger, a
# bug): what run.json says instead of "running", with the failed units so far; the same command resumes.
STOPPED = "stopped"


class RunRecord(Sparse, Record):
    """run.json (docs/gates.md, "The run directory")."""

    KIND: ClassVar[str] = RUN_KIND
    WHAT: ClassVar[str] = "record of a quantgate run"
    READS: ClassVar[tuple[int, ...]] = (RUN_SCHEMA_VERSION,)

    kind: Literal["quantgate-run"]
    schema_version: Literal[1]
    status: str  # RUNNING, FINISHED, BASELINE_FAILED, STOPPED
    plan: RunPlan
    plan_file: str | None
    plan_sha256: str
    model: str
    formats: list[str]
    sets: list[str]
    hardware: list[str]
    policy: RunPolicy
    confidence: Number
    looks: dict[str, list[int]]
    planned_power: list[PlannedPower]
    plot: PlotAxes
    ledger: str
    stages: list[RunStage]
    verdicts: dict[str, RunVerdict]
    failed_units: list[FailedUnit]
    seconds: Number | None
    quantgate_version: str
    # where quantization and evaluation kept the model (core.memory.Placement: "memory" or
    # "streamed"), and preflight's memory note where it said one; absent from earlier runs' records
    placement: dict[Literal["quantize", "evaluate"], Taken] | None = None
    memory_note: str | None = None

    @field_validator("failed_units", mode="before")
    @classmethod
    def _lines(cls, value: object) -> object:
        """A run.json of an earlier 0.x quantgate names each failed unit in a line: read as its reason."""
        if not isinstance(value, list):
            return value
        return [{"kind": "unknown", "unit": entry.split(" failed:")[0], "reason": entry} if isinstance(entry, str) else entry
                for entry in value]
