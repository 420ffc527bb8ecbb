"""An evaluation's results manifest as a record: what `evalsets.run` writes at the top of a results
directory (docs/evaluate.md, "Results directory"), and what every reader of results reads: the
model's identity, the baseline's, the config, and per golden set its directory, metrics and
cache key. The directory's files are checked against `files` by `evalsets.load_results`.

`ModelIdentity` is also what an evaluation's cache keys hold of a model (`numbers()`).

Each set's directory holds two records of its own, written by `evalsets.evaluate` and read back
as plain JSON (docs/evaluate.md): `record.json` (`SetRecord`) and `items.json` (`ItemsFile`, its
per-item records `ItemRecord`). They are TypedDicts: the JSON objects as written, key for key,
so their bytes (sorted keys) and the cache keys over them stay what they were. `RunSettings` is
what of the settings decides one set's numbers (in its cache key and its record).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Final, Literal, TypedDict, final

from pydantic import Field, JsonValue, field_validator

from quantgate.core.artifacts import ProvenanceJSON
from quantgate.core.memory import Taken
from quantgate.core.records import FileTable, Provenance, Record, RecordPart
from quantgate.core.validation import is_file_name, is_path
from quantgate.evalsets.config import EvaluateConfig, Kind

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

RESULTS_KIND: Final = "evaluation-results"
SCHEMA_VERSION: Final = 1


class ModelIdentity(RecordPart):
    """A model evaluated: where it was, and the hashes that decide its numbers."""

    path: str
    weights_sha256: str
    config_sha256: str
    tokenizer_sha256: str
    storage_dtype: str  # the floating dtype most of its weights are stored in ("BF16")

    @field_validator("path")
    @classmethod
    def _a_path(cls, value: str) -> str:
        if not is_path(value):
            raise ValueError("no file can have this path (empty, too long, a NUL or an unpaired surrogate)")
        return value

    def numbers(self) -> dict[str, str]:
        """What of the identity decides the model's numbers, and so what every cache key holds of
        it: its weights, its config (quantization scheme included: two checkpoints may share
        weights and differ in activation quantization) and its tokenizer; not its path."""
        return {"weights_sha256": self.weights_sha256, "config_sha256": self.config_sha256,
                "tokenizer_sha256": self.tokenizer_sha256}


class BaselineResults(RecordPart):
    """The baseline results a text set's agreement metrics were computed against."""

    results: str  # their directory, resolved
    model: ModelIdentity


class SetResults(RecordPart):
    """One golden set's line of the manifest: where its results are and what they say."""

    dir: str  # its directory inside the results directory
    kind: Annotated[Kind, Field(strict=False)]  # written as its value
    sha256: str  # the golden set's
    primary: str
    metrics: dict[str, int | float]
    items: int
    limit: int | None
    offset: int
    cache_key: str
    from_cache: bool
    seconds: float

    @field_validator("dir")
    @classmethod
    def _a_file_name(cls, value: str) -> str:
        if not is_file_name(value):
            raise ValueError("no directory can have this name (empty, too long, a NUL or an unpaired surrogate)")
        return value


class ResultsManifest(Record):
    """manifest.json of a results directory."""

    KIND = RESULTS_KIND
    KIND_FIELD = "artifact"
    WHAT = "evaluation results manifest"
    READS = (SCHEMA_VERSION,)

    artifact: Literal["evaluation-results"] = "evaluation-results"
    schema_version: Literal[1] = SCHEMA_VERSION
    model: ModelIdentity
    baseline: BaselineResults | None
    # the settings as given; their own (lax) validation reads their enums and tuples back
    config: EvaluateConfig
    sets: dict[str, SetResults] = Field(min_length=1)
    model_load_seconds: float | None  # None: every set came from the cache
    # where the evaluated model was kept (quantgate.core.memory.Placement); None: every set came from the cache
    placement: Taken | None = None
    files: FileTable
    provenance: Provenance


# ---- a set's own records: record.json and items.json --------------------------------------


class _RunSettingsBase(TypedDict):
    limit: int | None
    batch_size: int
    device: str
    dtype: str  # "auto" under vLLM (the checkpoint's own)
    evaluator_version: int
    runner: str  # "transformers", "lm-eval/hf" or "lm-eval/vllm"


class RunSettings(_RunSettingsBase, total=False):
    """The settings that can change one set's numbers (`evaluate.run_settings`); a key absent
    from older cache keys is absent, not null, where it does not apply."""

    dtype_basis: str  # why this dtype (evaluate.compute_dtype_name): the device class's BF16 arithmetic, or the config
    max_tokens: int  # text sets
    top_k: int
    exact_positions: int
    num_fewshot: int  # lm-eval sets
    bootstrap_iters: int
    engine: dict[str, str]  # vLLM: the serving environment's identity
    engine_settings: dict[str, str]
    device_class: str
    grown_from: list[int]  # the limits of the earlier looks these results extend
    offset: int  # absent at 0


class _ItemRecordBase(TypedDict):
    id: str


class ItemRecord(_ItemRecordBase, total=False):
    """One item's results in items.json (docs/evaluate.md, "Per-item results"): the fields of
    its set's kind."""

    index: int
    metrics: dict[str, float]  # lm-eval sets: the item's per-item scores (acc, acc_norm, exact_match)
    # multiple-choice
    gold: int
    loglikelihoods: list[float]
    choice_chars: list[int]
    predicted: int
    predicted_norm: int
    # last-word
    loglikelihood: float
    greedy: bool
    # generation
    response: str
    reference: str
    # text
    tokens: int
    bytes: int
    truncated: bool
    nll: float
    kl_sum: float  # against a baseline
    top1_matches: int
    top_prob_change_sum: float
    # never written: the gates attach a text item's per-token values in memory
    # (quantgate.gates.stage.item_records; {"kl": ..., "top_prob_change": ...}, float32)
    token_values: dict[str, NDArray[np.float32]]


class ItemsFile(TypedDict):
    """items.json of one set's results."""

    schema_version: int
    evalset: str
    sha256: str
    kind: str
    primary: str
    limit: int | None
    offset: int
    items_total: int
    order: str
    model: dict[str, str]  # ModelIdentity.numbers()
    baseline: dict[str, str] | None
    items: list[ItemRecord]


class HeadCheck(TypedDict):
    rebuilt_from_hidden_states: bool
    max_abs_logit_difference: float | None
    tolerance: float


class ExactCheck(TypedDict, total=False):
    """Top-k mode: the estimated KL against the exact one at the sampled positions."""

    positions: int
    kl_exact_mean: float
    kl_topk_mean: float
    shortfall_mean: float
    shortfall_max: float
    worst_case_shortfall_mean: float


class _TextDetailsBase(TypedDict):
    items: int
    tokens: int
    bytes: int
    truncated_items: int
    nll_sum: float
    top_k: int
    head: HeadCheck


@final  # (final: `"evaluated_here" in details` tells the two apart)
class TextDetails(_TextDetailsBase, total=False):
    """A text set's `details` (evalsets.text_eval); the agreement fields only against a baseline."""

    agreement_mode: str  # "exact" or "top-k"
    baseline_top_k: int
    baseline_cache_sha256: str
    exact_check: ExactCheck


class SampleCounts(TypedDict):
    """lm-eval's n-samples of a task: the items it has, the items it evaluated."""

    original: int
    effective: int


class GrownFrom(TypedDict):
    items: int
    cache_key: str


class _LmEvalDetailsBase(TypedDict):
    samples: SampleCounts


@final
class LmEvalDetails(_LmEvalDetailsBase, total=False):
    """An lm-eval set's `details`; results grown from an earlier look name it."""

    grown_from: GrownFrom
    evaluated_here: int


# lm-eval's own provenance of a run (evalsets.lm_eval_tasks.provenance): the fields of its
# results object quantgate keeps, as lm-eval wrote them (JSON-safe), and the set evaluated.
LmEvalProvenance = TypedDict(
    "LmEvalProvenance",
    {
        "versions": JsonValue, "n-shot": JsonValue, "higher_is_better": JsonValue, "n-samples": JsonValue,
        "config": JsonValue, "git_hash": JsonValue, "date": JsonValue, "transformers_version": JsonValue,
        "lm_eval_version": JsonValue, "tokenizer_pad_token": JsonValue, "tokenizer_eos_token": JsonValue,
        "tokenizer_bos_token": JsonValue, "eot_token_id": JsonValue, "max_length": JsonValue,
        "pretty_env_info": JsonValue, "configs": JsonValue, "task_hashes": dict[str, str], "evalset": dict[str, str],
    },
)


class GrownLmEval(TypedDict):
    """Grown results' `lm_eval`: the earlier look's, and the run over the items past it."""

    grown_from: LmEvalProvenance | GrownLmEval
    items_past_it: LmEvalProvenance


class Timing(TypedDict):
    seconds: float
    items_per_second: float | None


class SetRecord(TypedDict):
    """record.json of one set's results."""

    schema_version: int
    evalset: str
    sha256: str
    kind: str
    primary: str
    metrics: dict[str, float]
    details: TextDetails | LmEvalDetails
    items: int
    items_total: int
    limit: int | None
    settings: RunSettings
    cache_key: str
    model: dict[str, str]
    baseline: dict[str, str] | None
    lm_eval: LmEvalProvenance | GrownLmEval | None
    timing: Timing
    provenance: ProvenanceJSON  # quantgate.core.artifacts.provenance (core.records.Provenance, as JSON)
