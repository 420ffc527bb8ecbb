"""The report's document, report.json (`schema_version` 2): what a run's records say, typed
(`RunRecords`), and the `Report` made from them once (gates.report.compose): every rule's outcome
(deployable, the recommendation, the verdict's wording), every sentence, table cell and figure
datum the page and the Markdown show. The renderers (gates/templates, gates.figures) read a
`Report` and decide nothing, so `quantgate report` renders the same page from report.json alone.

Two kinds of model: `Record` holds what the run's own records say (a verdict's gates, its looks,
its serve check); built from those records (`RunRecords.from_records`) it keeps the fields it
names and leaves the rest of each record out, and read back from report.json it refuses an
unknown field like every other document. The view models (the summary, the tables, the
figures) are made here only, so they are strict both ways."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypeVar

from pydantic import ConfigDict, JsonValue, ValidationError, ValidationInfo, model_validator

from quantgate.core.errors import IntegrityError
from quantgate.core.validation import Strict, first_problem

SCHEMA_VERSION: Final = 2
READABLE_VERSIONS = (2,)  # what `gates.report.read` accepts; version 1 (a plain dict) holds none of the view

# The key of the validation context under which a record keeps only the fields this module names.
FROM_RECORDS = "from_records"

# A search row's role (its `search.role`): a trial, judged on the search split (its verdict
# approves nothing), or the chosen trial's held-out gate (the search's result).
TRIAL: Final = "trial"
HELD_OUT: Final = "held-out"
SearchRole = Literal["trial", "held-out"]

# A setting's value as an engine reads it ("1", 1, true).
Scalar = str | int | float | bool | None

R = TypeVar("R", bound="Record")


class Document(Strict):
    """A part of report.json. A record's estimate may be infinite (a divergence against a zero
    probability) or NaN: kept as the record has it, written as JSON's Infinity and NaN (as
    json.dumps writes them), so that the document reads back exactly as it was written."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=True, ser_json_inf_nan="constants")


class Record(Document):
    """What a run's record says, as far as the report reads it: built under the FROM_RECORDS
    context, a field the record has and the report does not name is left out (a serve record's
    per-item numbers, a search's verdicts, which are rows of their own)."""

    @model_validator(mode="before")
    @classmethod
    def _named_fields_only(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get(FROM_RECORDS) and isinstance(data, Mapping):
            return {key: value for key, value in data.items() if key in cls.model_fields}
        return data

    @classmethod
    def of_record(cls: type[R], value: object, where: str) -> R:
        """What the report reads of a record's JSON `value` (read from `where`): the fields named
        here, the rest left out; IntegrityError, one line naming the field, when one is damaged."""
        try:
            return cls.model_validate(value, context={FROM_RECORDS: True})
        except ValidationError as error:
            problem = first_problem(error)
            place = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in problem.path).lstrip(".")
            raise IntegrityError(f"{where}: {place}: {problem.message}" if place else f"{where}: {problem.message}") from error


# ---- a row's records ------------------------------------------------------------------------------

class GateRecord(Record):
    """One gate as a verdict records it (gates.verdict.GateResult.as_dict)."""

    gate: str
    outcome: str
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    limit: float | None = None
    unit: str = ""
    reason: str = ""
    items: int | None = None
    look: int | None = None
    looks: int | None = None
    confidence: float | None = None
    decided_by: str | None = None
    half_width: float | None = None
    detectable: float | None = None
    stability: float | None = None
    stability_resamples: int | None = None
    stability_inner_resamples: int | None = None
    stability_seed: int | None = None


class MetricEntry(Record):
    """A metric column's value for a row, and where a gate judged it, its difference, interval and outcome."""

    value: float | None = None
    difference: float | None = None
    low: float | None = None
    high: float | None = None
    unit: str | None = None
    outcome: str | None = None


class Bound(Record):
    """The decode-step lower bounds on one hardware profile."""

    batch1_ms: float
    batch32_ms: float


class Sequential(Record):
    """A verdict's looks: per set the looks planned, the items evaluated (0: not run), what stopped them."""

    looks: dict[str, list[int]] = {}
    items: dict[str, int] | None = None
    error_control: str | None = None
    confidence: float | None = None
    blocked_by: str | None = None
    not_evaluated: dict[str, str] = {}
    trace: list[dict[str, JsonValue]] = []


class Tail(Record):
    """One tail of the per-token KL (or of Δp) with its bootstrap interval."""

    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    confidence: float | None = None
    items: int | None = None


class SplitItems(Record):
    """The items of one set a search split covers: after `offset`, at most `ceiling`."""

    offset: int = 0
    ceiling: int | None = None


class SearchInfo(Record):
    """A search row's role, the split its verdict was reached on, and its trial's mix."""

    role: SearchRole
    checkpoint: str
    split: str | None = None
    split_items: dict[str, SplitItems] = {}
    groups_by_format: dict[str, int] = {}
    groups: int | None = None
    budget_ratio: float | None = None
    predicted_cost: float | None = None
    chosen: bool = False


class Agreement(Record):
    """Served against gated log-probabilities (evalsets.served), per token."""

    mean_abs_logprob_difference: float
    p99_abs_logprob_difference: float
    kl_served_gated_mean: float | None = None
    top1_agreement: float | None = None
    nll_change: float | None = None


class Greedy(Record):
    identical: int
    prompts: int


class Rate(Record):
    """Measured decode tokens/s at one batch size and the bound at the measured copy bandwidth."""

    tokens_per_s: float
    bound_tokens_per_s: float


class Engine(Record):
    engine: str
    version: str


class SchemeServed(Record):
    scheme: str
    served_as: str
    kernel: str | None = None
    mismatch: str | None = None  # the engine's log shows another scheme than serving.device.RULES expect


class EngineDefault(Record):
    """What the engine's default settings would serve instead, and how far that is from gated."""

    served_as: dict[str, str] = {}
    mismatch: str | None = None
    reason: str | None = None
    agreement: Agreement | None = None


class Serving(Record):
    """A row's serve check as its verdict keeps it (ServedSummary, evalsets.serve_record)."""

    served: bool = False
    status: str | None = None
    reason: str | None = None
    engine: Engine | None = None
    dtype: str | None = None
    device: str | None = None
    device_class: str | None = None
    engine_settings: dict[str, Scalar] = {}
    schemes: list[SchemeServed] = []
    kernels: list[str] = []
    engine_default: EngineDefault | None = None
    agreement: Agreement | None = None
    greedy: Greedy | None = None
    throughput: dict[str, Rate] = {}
    bandwidth_bytes_per_s: float | None = None


class AsServed(Record):
    """A device class's numerics gated on the golden sets the engine evaluates."""

    numerics: str | None = None
    settings: dict[str, Scalar] = {}
    served_as: dict[str, str] = {}
    status: str | None = None
    reason: str | None = None


class ClassVerdict(Record):
    """The verdict on one device class: approved, pending (with the command that attests it) or blocked."""

    status: str | None = None
    reason: str | None = None
    next: str | None = None
    as_served: list[AsServed] = []


class RowRecord(Record):
    """The baseline, a format, a search trial or the search's held-out gate, as its records say."""

    format: str
    bytes: int | None = None
    bits_per_weight_layers: float | None = None
    bits_per_parameter: float | None = None
    ratio_to_baseline: float | None = None
    bounds: dict[str, Bound] = {}
    metrics: dict[str, MetricEntry] = {}
    kl_divergence: float | None = None
    verdict: str
    reasons: list[str] = []
    gates: list[GateRecord] = []
    not_evaluated: dict[str, str] = {}
    sequential: Sequential | None = None
    tails: dict[str, dict[str, Tail]] = {}
    search: SearchInfo | None = None
    serving: Serving | None = None
    classes: dict[str, ClassVerdict] = {}


# ---- the run's records ------------------------------------------------------------------------------

class Policy(Record):
    """The run's policy identity; `narrowed_to` and `dropped` for a policy the plan narrowed."""

    name: str
    version: str
    sha256: str = ""
    narrowed_to: list[str] | None = None
    dropped: list[str] = []


class Profile(Record):
    name: str


class PlotAxes(Record):
    x: str | None = None
    y: str | None = None
    higher_is_better: bool | None = None


class EvalSet(Record):
    """The baseline's results on one golden set (`items`: its first look) and the set's planned looks."""

    spec: str
    items: int
    limit: int | None = None
    sha256: str | None = None
    size: int | None = None
    looks: list[int] = []


class Calibration(Record):
    samples: int
    seq_len: int
    fingerprint: str
    source: str


class BoundsInputs(Record):
    context_tokens: int
    kv_bytes_per_element: float


class AllocationChoice(Record):
    choice: dict[str, str] = {}


class SearchTrial(Record):
    name: str
    budget_bytes: int | None = None
    budget_ratio: float | None = None
    bytes: int | None = None
    ratio: float | None = None
    predicted_cost: float | None = None
    groups_by_format: dict[str, int] = {}
    allocation: AllocationChoice | None = None
    verdict: str | None = None
    reasons: list[str] = []


class Repeat(Record):
    budget_bytes: int | None = None
    same_as: str | None = None


class SearchSpace(Record):
    groups: int | None = None
    fixed_bytes: int | None = None
    baseline_bytes: int | None = None
    uniform_bytes: dict[str, int] = {}


class HeldOutVerdict(Record):
    verdict: str
    reasons: list[str] = []


class SearchRecord(Record):
    """The search's record (search.json) without its verdicts (those are rows)."""

    formats: list[str] = []
    objective: str | None = None
    max_trials: int | None = None
    ceiling_bytes: int | None = None
    lo_bytes: int | None = None
    space: SearchSpace = SearchSpace()
    trials: list[SearchTrial] = []
    repeats: list[Repeat] = []
    chosen: str | None = None
    held_out: HeldOutVerdict | None = None
    conclusion: str | None = None


class SensitivityGroup(Record):
    name: str
    block: int | None = None
    role: str | None = None
    parameters: int | None = None
    scores: dict[str, float] = {}


class Sensitivity(Record):
    """The layer groups' sensitivity (sensitivity/sensitivity.json) and the rank check's rho per format."""

    method: str | None = None
    formula: str | None = None
    unit: str | None = None
    fisher: str | None = None
    tokens: int | None = None
    formats: list[str] = []
    totals: dict[str, float] = {}
    groups: list[SensitivityGroup] = []
    spearman: dict[str, float | None] = {}


class FailedUnitEntry(Record):
    """A unit of the run that failed (run.json's failed_units; gates.run_record.FailedUnit): the
    run went on without it, and the same command tries it again."""

    kind: str
    unit: str
    reason: str
    log: str | None = None
    signal: str | None = None
    peak_memory_bytes: int | None = None

    @property
    def line(self) -> str:
        """Its reason, with the signal and the peak memory of a child process that a signal ended."""
        died = f" [{self.signal}, peak memory {self.peak_memory_bytes / 2**30:.2f} GiB]" \
            if self.signal and self.peak_memory_bytes is not None and self.signal not in self.reason else ""
        return self.reason + died


class RunFacts(Record):
    """What the report reads of a run besides its rows."""

    model: str
    model_path: str | None = None
    policy: Policy
    hardware: list[Profile] = []
    metric_columns: list[str] = []
    plot: PlotAxes = PlotAxes()
    evalsets: list[EvalSet] = []
    calibration: Calibration | None = None
    bounds_inputs: BoundsInputs | None = None
    confidence: float = 0.95
    ledger: str | None = None
    search: SearchRecord | None = None
    sensitivity: Sensitivity | None = None
    failed_units: list[FailedUnitEntry] = []  # each unit that failed (the run went on without it)
    no_verdict: str | None = None  # why the run reached no verdict at all (its baseline failed); None: it did


class RunRecords(RunFacts):
    """A run's records, as gates.report.records reads them from a run directory: the data step's input."""

    rows: list[RowRecord]

    @classmethod
    def from_records(cls, data: Mapping[str, Any]) -> RunRecords:
        """From the records' own JSON: each keeps the fields named here, the rest is left out."""
        return cls.model_validate(data, context={FROM_RECORDS: True})


# ---- what the report says -----------------------------------------------------------------------------

class Row(RowRecord):
    """A row with the rules' outcomes: whether it may be deployed, its verdict in words, its name
    in a sentence, and per device class the serving verdict."""

    deployable: bool
    verdict_text: str
    display_name: str
    long_name: str  # a search row with its mix
    row_class: str  # its class in the formats table, its badge's
    class_lines: list[str]


class MeasuredChoice(Document):
    """On the machine the serve stage ran on: the deployable format vLLM decodes fastest at batch 1."""

    format: str | None
    tokens_per_s: float | None
    baseline_tokens_per_s: float | None
    slower_than_baseline: list[str]
    device: str | None


class Summary(Document):
    """The page's first section, sentence by sentence."""

    recommendations: list[str]  # per hardware profile
    measured: str | None  # the recommendation for the machine the serve stage measured
    approved: str
    search: list[str]
    narrowed: str | None
    blocked: list[str]
    pending: list[str]
    serving_classes: list[str]
    engine_defaults: list[str]  # those of `serving_classes` where the engine's default would serve other numerics


class FormatRow(Document):
    format: str
    link: bool  # a candidate's name links to its section; the baseline has none
    mix: str | None  # a search row's mix, under its name
    long_name: str
    numbers: list[str]  # MB, x baseline, bits/weight, a bound per profile, KL
    verdict: str
    note: str  # 'blocked by 2 of 9 gates, 4 not evaluated'
    items: list[str]  # per set ('wiki-text 25'), or one number for an older record
    row_class: str


class FormatsTable(Document):
    header: list[str]
    rows: list[FormatRow]


class RecommendationList(Document):
    """report.md's recommendation section."""

    intro: str
    lines: list[str]


class PlotPoint(Document):
    mb: float
    value: float
    label: str
    verdict: str
    trial: bool
    front: bool  # on the Pareto front


class FrontPoint(Document):
    mb: float
    value: float
    label: str


class HeldOutMark(Document):
    """The chosen trial's point, ringed by its held-out verdict."""

    checkpoint: str
    approved: bool


class PlotFigure(Document):
    """Size against the plot's metric: the points, the Pareto front in order of size, the ring."""

    metric: str
    points: list[PlotPoint]
    front: list[FrontPoint]
    held_out: HeldOutMark | None
    trials: bool  # the legend names the trials' diamonds
    note: str | None


class ForestRow(Document):
    """A metric gate in the forest plot: how far past its limit its interval's ends and its
    estimate are, the worse side positive (None: not drawn), and the numbers beside it."""

    label: str
    outcome: str
    reason: str
    low: float | None
    estimate: float | None
    high: float | None
    numbers: str
    limit: str


class ForestFigure(Document):
    format: str
    rows: list[ForestRow]


class StabilityBar(Document):
    label: str
    share: float
    unstable: bool


class StabilityFigure(Document):
    format: str
    bar: float  # the share below which a gate is flagged
    rows: list[StabilityBar]


class StabilitySection(Document):
    lines: list[str]
    unstable: bool
    figure: StabilityFigure


class GateRow(Document):
    cells: list[str]
    outcome: str


class TailCell(Document):
    value: str
    interval: str


class TailRow(Document):
    set: str
    items: str | None  # '25 items'
    cells: list[TailCell]


class TailsSection(Document):
    note: str
    header: list[str]
    rows: list[TailRow]


class Candidate(Document):
    """A candidate's section."""

    format: str
    row_class: str
    verdict_text: str
    facts: str
    search_note: str | None
    blocked: str | None
    forest: ForestFigure
    gate_header: list[str]
    gates: list[GateRow]
    reasons: list[str]  # a verdict recorded without its gates: its reasons
    stability: StabilitySection | None
    tails: TailsSection | None
    not_evaluated: list[str]


class TrialRow(Document):
    cells: list[str]
    passed: bool  # passed the search split


class SeriesLegend(Document):
    format: str
    label: str  # 'gptq-int4 (total 0.00213)'


class SensitivityPoint(Document):
    name: str
    block: int | None
    scores: dict[str, float]  # every charted format's, 0 where the record has none


class AllocationStrip(Document):
    trial: str
    choice: dict[str, str]  # layer group -> format


class SensitivityFigure(Document):
    axis: str  # the score's unit, on a log scale
    series: list[SeriesLegend]
    groups: list[SensitivityPoint]
    allocation: AllocationStrip | None


class SensitivitySection(Document):
    caption: str
    header: list[str]
    rows: list[list[str]]
    figure: SensitivityFigure


class SearchSection(Document):
    conclusion: str
    held_out: str
    held_out_approved: bool
    lines: list[str]
    header: list[str]
    trials: list[TrialRow]
    sensitivity: SensitivitySection | None


class ServingRow(Document):
    cells: list[str]
    failed: bool  # not served, and not pending: its reason in red


class ServingSection(Document):
    note: str
    header: list[str]
    rows: list[ServingRow]


class MeasuredSection(Document):
    lines: list[str]
    header: list[str]
    rows: list[list[str]]


class Report(RunFacts):
    """report.json: the run's records and everything the report says of them."""

    schema_version: Literal[2] = SCHEMA_VERSION
    key: str | None = None  # the hash of the run's data the report was made from (the runner's reuse check)
    rows: list[Row]
    recommendation: dict[str, str | None]  # per hardware profile, the format (row) recommended
    measured_recommendation: MeasuredChoice | None
    policy_line: str
    summary: Summary
    formats: FormatsTable
    recommendations: RecommendationList
    figure: PlotFigure
    search_section: SearchSection | None
    serving_section: ServingSection | None
    candidates: list[Candidate]
    measured: MeasuredSection
