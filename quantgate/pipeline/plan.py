"""A run plan: everything `quantgate run` needs for one model, in one YAML file, validated
before any work starts (an unknown field, format, set, metric or profile is an error that
lists the valid ones, exit 2).

Relative paths in a plan (the output directory, a calibration source file, a policy or
hardware YAML) resolve against the directory quantgate runs in, as command-line paths do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator, model_validator

from quantgate.core.artifacts import read_yaml, sha256_json
from quantgate.core.errors import InputError, did_you_mean
from quantgate.core.formats import PRECISION_CLASSES, PrecisionClass
from quantgate.core.memory import Placement
from quantgate.core.validation import Problem, Strict, is_path, validated
from quantgate.evalsets.served import ServeCheckConfig
from quantgate.quantize.presets import get_preset

SCHEMA_VERSION = 1
# The embedded demo plan: one file, installed with the package (`quantgate run demo`, `make demo`).
DEMO_PLAN = Path(str(resources.files("quantgate.pipeline") / "plans" / "demo.yaml"))


def _distinct_known_formats(value: tuple[str, ...]) -> tuple[str, ...]:
    """Format names each a preset (an unknown one: InputError listing the valid ones), none twice."""
    for name in value:
        get_preset(name)
    if len(set(value)) != len(value):
        raise ValueError("a format is named twice")
    return value


class CalibrationPlan(Strict):
    """`quantgate calibrate` settings; the model is the plan's."""

    source: str = "demo"
    samples: int = Field(default=128, gt=0)
    seq_len: int = Field(default=512, gt=0)
    seed: int = Field(default=0, ge=0)
    field: str = "text"
    split: str | None = None
    packing: str = "concat"
    chat_template: bool = False

    @field_validator("source")
    @classmethod
    def _nameable_source(cls, value: str) -> str:
        return _nameable(value)


def _nameable(value: str) -> str:
    """A path the filesystem can be asked about (else ValueError: too long, a NUL, not Unicode)."""
    if not is_path(value):
        raise ValueError(f"not a path ({len(value)} characters{', with a NUL' if chr(0) in value else ''})")
    return value


# A ceiling the sample-size planner chooses from the policy's bounds and a prior discordance,
# before any candidate is evaluated (docs/gates.md, "Planned ceilings")
PLANNED = "planned"


def _ceiling(value: Any) -> Any:
    if value == PLANNED or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"a ceiling is a positive number of items or `{PLANNED}`, not {value!r}")


# a set's ceiling: its first N items at most, or `planned`
Ceiling = Annotated[int | Literal["planned"], BeforeValidator(_ceiling)]


class _DiscordanceBase(Strict):
    """What DiscordancePrior holds besides one field a precision class (those are built from the
    format registry's classes, keyed as a policy keys its bounds)."""

    model_config = ConfigDict(serialize_by_alias=True)

    source: str = Field(description="where the values come from (a measurement, a paper): required")

    @model_validator(mode="before")
    @classmethod
    def _sourced(cls, value: Any) -> Any:
        if isinstance(value, dict):
            source = value.get("source")
            if not isinstance(source, str) or not source.strip():
                raise ValueError("a planning discordance needs `source:`, where its values come from (a measurement, a paper): "
                                 "it is recorded with every gate's power")
            if not any(precision in value for precision in PRECISION_CLASSES):
                named = ", ".join(f"`{precision}:`" for precision in PRECISION_CLASSES)
                several = "both" if len(PRECISION_CLASSES) == 2 else "several"
                raise ValueError(f"a planning discordance gives {named} or {several} (a share of items in (0, 1])")
        return value

    @property
    def values(self) -> dict[str, float]:
        given = {precision.value: getattr(self, _class_field(precision)) for precision in PRECISION_CLASSES}
        return {precision: value for precision, value in given.items() if value is not None}


def _class_field(precision: PrecisionClass) -> str:
    return f"class_{precision.name}"


if TYPE_CHECKING:
    DiscordancePrior = _DiscordanceBase
else:
    DiscordancePrior = create_model(
        "DiscordancePrior", __base__=_DiscordanceBase, __module__=__name__,
        __doc__="""The share of items two models answer differently that `planned` ceilings assume for
    accuracy gates, per precision class (a class not given: quantgate's default), and where that
    number comes from: recorded with every gate's power.""",
        **{_class_field(precision): (float | None, Field(default=None, alias=precision.value, gt=0, le=1)) for precision in PRECISION_CLASSES},
    )


def _set_items(value: Any) -> Any:
    """One set's items as a mapping of splits: a lone number (or `planned`) is its ceiling, which
    the search and held-out splits then take too."""
    return value if isinstance(value, dict) else {"ceiling": _ceiling(value)}


class SetItems(Strict):
    """How many items one set gets on each split: its first N (or `planned`, the sample-size
    planner's number for the precision classes judged on that split). A split not given takes
    the one before it (the search split the ceiling, the held-out split the search split): its
    number, or `planned` again (docs/search.md)."""

    # the plan's split: the formats and the baseline are evaluated in the policy's looks up to it
    # (None: the whole set)
    ceiling: Ceiling | None = None
    # the search split: the first of the ceiling's items, on which the search's trials are judged
    search: Ceiling | None = None
    # the held-out split: the items after the ceiling, on which the search's choice is gated again
    held_out: Ceiling | None = None


# Plan fields that were moved, with where each is now: a plan that still gives one is refused in
# one line saying so (a field that is dropped without a word would change what is evaluated).
MOVED_FIELDS: dict[tuple[str, ...], str] = {
    ("evaluation", "limit"): "evaluation.items: N",  # one value: every set
    ("evaluation", "limits"): "evaluation.items: {SET: N}",
    ("search", "limits"): "evaluation.items: {SET: {search: N}}",
    ("search", "holdout_limits"): "evaluation.items: {SET: {held_out: N}}",
}


class EvaluationPlan(Strict):
    """`quantgate evaluate` settings, the same for the baseline and every candidate, and how many
    items each set gets on each split."""

    sets: tuple[str, ...] = Field(min_length=1)
    # per set (NAME or NAME@vN): its first N items (or `planned`) on every split, or
    # {ceiling: N, search: N, held_out: N}; one value instead of the mapping: every set. A set not
    # named: the whole set. The policy's looks come before the ceiling.
    items: dict[str, Annotated[SetItems, BeforeValidator(_set_items)]] = Field(
        default_factory=dict, description="how many items each set gets: its first N, or `planned`")
    # the prior of `planned` ceilings for accuracy gates: {CLASS: D, ..., source: "..."}, a class
    # of core.formats.PRECISION_CLASSES each
    discordance: DiscordancePrior | None = None
    batch_size: int = Field(default=4, gt=0)
    max_tokens: int = Field(default=512, gt=1)
    top_k: int = Field(default=64, gt=0)
    device: str | None = None
    # the dtype the reference evaluation computes in: auto (FP32 on a CPU, the accelerator's storage
    # dtype on a GPU), float32 or bfloat16
    dtype: str = "auto"
    backend: str = "hf"

    @model_validator(mode="before")
    @classmethod
    def _every_set(cls, value: Any) -> Any:
        """`items: N` (or `planned`): N for each set the plan names, as they are named."""
        if isinstance(value, dict) and "items" in value and not isinstance(value["items"], dict):
            sets = value.get("sets")
            if isinstance(sets, list | tuple) and all(isinstance(name, str) for name in sets):
                value = {**value, "items": {name: value["items"] for name in sets}}
        return value

    def items_for(self, spec: str, name: str) -> SetItems:
        """A set's items, by NAME@vN, else by NAME; a set not named gets the whole of itself."""
        return self.items.get(spec) or self.items.get(name) or SetItems()


class SearchPlan(Strict):
    """The mixed-precision search (docs/search.md): the smallest checkpoint that passes the gates,
    its layers in `formats` or 16-bit, trials bisected on the verdicts, the one chosen gated again
    on held-out items."""

    formats: tuple[str, ...] = Field(description="the formats to mix (each among the plan's formats); 16-bit is always a candidate")
    objective: Literal["smallest-approved"] = "smallest-approved"
    max_trials: int = Field(default=4, ge=1, le=32, description="trials at most (each one quantization and its looks)")
    max_bytes_ratio: float | None = Field(default=None, gt=0, description="byte ceiling: at most this fraction of the baseline's bytes")
    # stop bisecting once the largest budget that failed and the smallest that passed are this
    # close (a fraction of the baseline's bytes)
    resolution: float = Field(default=0.01, gt=0, lt=1)
    # how many items its splits get: evaluation.items, per set {search: N, held_out: N}
    fisher: Literal["sampled", "empirical"] = "sampled"
    # calibration rows the sensitivity's Fisher uses (one backward pass each); default: all
    sensitivity_rows: int | None = Field(default=None, gt=0)

    @field_validator("formats")
    @classmethod
    def _two_known_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        _distinct_known_formats(value)
        if len(value) < 2:
            raise ValueError(f"a search mixes at least two formats (with 16-bit besides); got {', '.join(value) or 'none'}: "
                             "for one format, list it in formats and drop the search")
        return value


# The stage kinds a plan's `resources:` can name: each is one Ray task a unit (docs/scale-out.md).
STAGE_KINDS = ("calibration", "overlap", "measure", "evaluate", "quantize", "sensitivity", "serve")
StageKind = Literal["calibration", "overlap", "measure", "evaluate", "quantize", "sensitivity", "serve"]


class ExecutorPlan(Strict):
    """Where the stages run: `local` (this process, one after another) or `ray` (each unit a Ray
    task; without an address a Ray of this machine's own is started, as on a laptop)."""

    kind: Literal["local", "ray"] = "local"
    # `auto` (the cluster this machine belongs to), `HOST:PORT` of a head node, or `ray://HOST:10001`
    address: str | None = None
    # how often Ray runs a task again whose worker died (killed, out of memory, its node lost);
    # an error the task raises itself is never retried: the same inputs give the same error
    max_retries: int = Field(default=2, ge=0, le=10)

    @model_validator(mode="after")
    def _address_needs_ray(self) -> ExecutorPlan:
        if self.address is not None and self.kind != "ray":
            raise ValueError(f"an address is for the ray executor; this plan's executor is {self.kind}")
        return self


class StageResources(Strict):
    """What one task of a stage kind asks of the cluster (the local executor ignores it)."""

    cpus: float = Field(default=1, ge=0, description="CPUs; torch runs this many threads in the task (at least one)")
    gpus: float = Field(default=0, ge=0, description="GPUs (a fraction shares one)")
    memory_gib: float | None = Field(default=None, gt=0, description="memory Ray reserves for the task, GiB")


class ReportPlan(Strict):
    plot_metric: str | None = Field(default=None, description="'SET METRIC' on the plot's y axis (default: the first text-set KL)")


class RunPlan(Strict):
    schema_version: int = SCHEMA_VERSION
    model: str = Field(description="baseline: a model directory or a demo model name")
    formats: tuple[str, ...] = Field(min_length=1)
    quantize: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per format: QuantizeConfig fields")
    calibration: CalibrationPlan = CalibrationPlan()
    evaluation: EvaluationPlan
    policy: str = "default"
    narrow_policy: tuple[str, ...] | None = Field(
        default=None, min_length=1, description="gate only these golden sets of the policy (recorded in every verdict as narrowed)")
    hardware: tuple[str, ...] = ("reference", "h200")
    out: str = "runs/out"
    ledger: str | None = Field(default=None, description="default: <out>/ledger.jsonl")
    # sign every ledger record with this PEM private key (ECDSA; docs/gates.md "Signed records");
    # default: the user's own, QUANTGATE_HOME/keys/signing-key.pem, made on the first run
    signing_key: str | None = Field(default=None, description="a PEM private key: every ledger record is signed with it "
                                    "(default: your own key, made on first use)")
    report: ReportPlan = ReportPlan()
    search: SearchPlan | None = Field(default=None, description="a gated mixed-precision search (docs/search.md)")
    # the serve stage's settings; a policy with a serving gate serves with the defaults when absent
    serving: ServeCheckConfig | None = Field(default=None, description="the serve stage: vLLM loads and agrees (docs/serving.md)")
    # where the stages run (docs/scale-out.md): `local`, `ray`, or {kind: ray, address: ..., max_retries: ...}
    executor: ExecutorPlan = ExecutorPlan()
    # per stage kind, what each of its tasks asks of a Ray cluster
    resources: dict[StageKind, StageResources] = Field(default_factory=dict)
    allow_pickle: bool = False
    # where quantization and evaluation keep the model (core.memory.Placement): auto (in memory where
    # this machine's memory holds each stage's estimate, else streamed from disk), memory or streamed;
    # the numbers are the same either way (docs/models.md, "Streamed stages")
    placement: Placement = Placement.auto

    @field_validator("executor", mode="before")
    @classmethod
    def _executor_by_name(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("out", "ledger", "signing_key")
    @classmethod
    def _nameable_paths(cls, value: str | None) -> str | None:
        return None if value is None else _nameable(value)

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(f"this quantgate reads plan schema_version {SCHEMA_VERSION}, not {value}")
        return value

    @field_validator("formats")
    @classmethod
    def _known_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _distinct_known_formats(value)

    @model_validator(mode="after")
    def _options_for_listed_formats(self) -> RunPlan:
        for name in self.quantize:
            if name not in self.formats:
                raise ValueError(f"quantize options for {name!r}, which is not in formats ({', '.join(self.formats)})")
        for name in self.search.formats if self.search else ():
            if name not in self.formats:
                raise ValueError(f"search.formats names {name!r}, which is not in formats ({', '.join(self.formats)}): "
                                 "the search takes each format's exact bytes from its uniform checkpoint")
        for name, items in self.evaluation.items.items() if self.search is None else ():
            split = "search" if items.search is not None else "held_out" if items.held_out is not None else None
            if split is not None:  # counted for nothing: said, not ignored
                raise ValueError(f"evaluation.items.{name}.{split} is for a search's split, and the plan has no search")
        return self


@dataclass(frozen=True)
class LoadedPlan:
    plan: RunPlan
    path: Path | None  # None: built from a mapping
    base: Path  # relative paths resolve here

    def resolve(self, value: str) -> Path:
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.base / path

    @property
    def out(self) -> Path:
        return self.resolve(self.plan.out)

    @property
    def ledger(self) -> Path:
        return self.resolve(self.plan.ledger) if self.plan.ledger else self.out / "ledger.jsonl"

    @property
    def signing_key(self) -> Path | None:
        return self.resolve(self.plan.signing_key) if self.plan.signing_key else None

    @property
    def sha256(self) -> str:
        return sha256_json(self.plan.model_dump(mode="json"))


class PlanError(InputError):
    """A plan that cannot be run as written."""


def _section(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model of the section a field at `path` is in (the plan, or calibration, evaluation,
    report), or None when it is inside a mapping of free values (quantize options)."""
    section: type[BaseModel] | None = RunPlan
    for part in path[:-1]:
        if section is None:
            break
        field = section.model_fields.get(str(part))
        if field is None:  # a key of a mapping of sections (`resources: {quantize: ...}`): its value's model
            continue
        section = _model_in(field.annotation)
    return section


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds: itself, or inside an optional (`SearchPlan | None`), a mapping's
    values (`dict[str, SetItems]`) or an annotation (`Annotated[SetItems, ...]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in get_args(annotation) if (found := _model_in(arg)) is not None), None)


def _describe(problem: Problem, where: str) -> str:
    """A plan's first problem in one line; an unknown field lists the valid ones of its section."""
    message = problem.message
    if problem.path and problem.path[-1] == "[key]":  # a key outside a mapping's allowed ones (a stage kind)
        name = str(problem.path[-2])
        location = ".".join(str(part) for part in problem.path[:-1])
        return f"plan {where}: {location}: not a stage kind{did_you_mean(name, list(STAGE_KINDS))}; valid: {', '.join(STAGE_KINDS)}"
    moved = MOVED_FIELDS.get(tuple(str(part) for part in problem.path)) if problem.kind == "extra_forbidden" else None
    if moved is not None:
        return f"plan {where}: {problem.location}: moved: write it as `{moved}` (docs/gates.md, \"The pipeline\")"
    section = _section(problem.path) if problem.kind == "extra_forbidden" else None
    if section is not None:
        valid, name = [field.alias or key for key, field in section.model_fields.items()], str(problem.path[-1])
        message = f"unknown field{did_you_mean(name, valid)}; valid: {', '.join(valid)}"
    return f"plan {where}: {problem.location or 'plan'}: {message}"


def from_mapping(raw: Any, where: str = "(mapping)", base: Path | None = None, path: Path | None = None) -> LoadedPlan:
    if not isinstance(raw, dict):
        raise InputError(f"plan {where}: expected a YAML mapping with model, formats, evaluation, ...")
    try:
        plan = validated(RunPlan, raw, error=PlanError, message=lambda problem: _describe(problem, where))
    except PlanError:
        raise
    except InputError as error:  # an unknown format from get_preset, raised inside a validator
        raise PlanError(f"plan {where}: {error}") from error
    return LoadedPlan(plan, path, (base or Path.cwd()).resolve())


def with_executor(loaded: LoadedPlan, kind: str | None, address: str | None) -> LoadedPlan:
    """The plan with its executor overridden from the command line (`--executor`, `--address`):
    an address alone means the ray executor; the plan's max_retries stay."""
    current = loaded.plan.executor
    if kind == "local" and address:
        raise InputError("--address names a Ray cluster: it goes with --executor ray, not --executor local")
    chosen = kind or ("ray" if address else current.kind)
    values = {"kind": chosen, "address": address if address is not None else (current.address if chosen == current.kind else None),
              "max_retries": current.max_retries}
    executor = validated(ExecutorPlan, values, error=InputError,
                         names={"kind": "--executor", "address": "--address"}, what="invalid option")
    return replace(loaded, plan=loaded.plan.model_copy(update={"executor": executor}))


def with_signing_key(loaded: LoadedPlan, key: Path) -> LoadedPlan:
    """The plan with its signing key overridden from the command line (`--signing-key`)."""
    return replace(loaded, plan=loaded.plan.model_copy(update={"signing_key": str(Path(key).expanduser().absolute())}))


def load_plan(spec: str | Path) -> LoadedPlan:
    """A plan YAML file, or 'demo' for the embedded demo plan (quantgate/pipeline/plans/demo.yaml)."""
    path = DEMO_PLAN if str(spec) == "demo" else Path(spec)
    if not path.is_file():
        raise InputError(f"plan file {path} does not exist")
    return from_mapping(read_yaml(path, "plan"), str(path), Path.cwd(), path)
