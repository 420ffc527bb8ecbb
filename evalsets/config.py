"""Typed configs of the evaluation stage: golden-set kinds and the JSONL item each kind needs,
a golden set's manifest, `evalsets add`, and the evaluator's settings."""

from __future__ import annotations

from enum import Enum
from typing import Any, TypedDict

from pydantic import Field, JsonValue, field_validator, model_validator

from quantgate.core.artifacts import ProvenanceJSON
from quantgate.core.errors import did_you_mean
from quantgate.core.memory import Placement
from quantgate.core.validation import Strict, is_file_name


class Kind(str, Enum):
    multiple_choice = "multiple-choice"  # lm-eval multiple_choice: acc and acc_norm
    text = "text"  # perplexity, bits per byte, KL / top-1 agreement against the baseline
    last_word = "last-word"  # lm-eval loglikelihood: greedy accuracy and perplexity of the target
    generation = "generation"  # lm-eval generate_until, greedy: exact match against a reference


def parse_kind(value: str) -> Kind:
    valid = [kind.value for kind in Kind]
    if value not in valid:
        raise ValueError(f"unknown kind {value!r}{did_you_mean(value, valid)}; valid: {', '.join(valid)}")
    return Kind(value)


# ---- items: one JSON object per line of a golden set's items.jsonl ---------------------------


class _Item(Strict):
    id: str | int | None = Field(default=None, description="unique within the set; default: the line number")
    meta: dict[str, Any] | None = Field(default=None, description="carried along, never scored")


def _non_blank(value: str, field: str) -> str:
    if not value.strip():
        raise ValueError(f"{field} must not be empty")
    return value


class MultipleChoiceItem(_Item):
    query: str  # the prompt; each choice is appended after one space (lm-eval target_delimiter)
    choices: list[str] = Field(min_length=2)
    gold: int = Field(ge=0)  # index of the right choice

    @field_validator("query")
    @classmethod
    def _query(cls, value: str) -> str:
        return _non_blank(value, "query")

    @field_validator("choices")
    @classmethod
    def _choices(cls, value: list[str]) -> list[str]:
        for choice in value:
            _non_blank(choice, "every choice")
        return value

    @model_validator(mode="after")
    def _gold_in_range(self) -> MultipleChoiceItem:
        if self.gold >= len(self.choices):
            raise ValueError(f"gold {self.gold} is not an index of the {len(self.choices)} choices")
        return self


class TextItem(_Item):
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, value: str) -> str:
        return _non_blank(value, "text")


class LastWordItem(_Item):
    context: str
    target: str  # appended to the context verbatim: include the leading space (" signs")

    @field_validator("context", "target")
    @classmethod
    def _present(cls, value: str, info: Any) -> str:
        return _non_blank(value, info.field_name)


class GenerationItem(_Item):
    prompt: str
    reference: str  # compared with the greedy output, both stripped of surrounding whitespace

    @field_validator("prompt", "reference")
    @classmethod
    def _present(cls, value: str, info: Any) -> str:
        return _non_blank(value, info.field_name)


ITEM_MODELS: dict[Kind, type[_Item]] = {
    Kind.multiple_choice: MultipleChoiceItem,
    Kind.text: TextItem,
    Kind.last_word: LastWordItem,
    Kind.generation: GenerationItem,
}


def item_fields(kind: Kind) -> str:
    """'query, choices, gold (optional: id, meta)': what a JSONL line of this kind holds."""
    model = ITEM_MODELS[kind]
    required = [name for name, field in model.model_fields.items() if field.is_required()]
    optional = [name for name, field in model.model_fields.items() if not field.is_required()]
    return f"{', '.join(required)} (optional: {', '.join(optional)})"


class _GoldenItemBase(TypedDict):
    id: str  # as stored: a string (parse_items makes it one)


class GoldenItem(_GoldenItemBase, total=False):
    """One item of a set as stored in its items.jsonl (canonical: no nulls): the fields of its kind."""

    meta: dict[str, JsonValue]  # carried along, never scored
    query: str  # multiple-choice
    choices: list[str]
    gold: int
    text: str  # text
    context: str  # last-word
    target: str
    prompt: str  # generation
    reference: str


# ---- a golden set's manifest ----------------------------------------------------------------


class _LmEvalPromptBase(TypedDict):
    output_type: str
    doc_to_text: str
    doc_to_target: str


class LmEvalPrompt(_LmEvalPromptBase, total=False):
    """How lm-eval renders a kind's items (Jinja templates over the item's fields)."""

    doc_to_choice: str
    target_delimiter: str


class _PromptSectionBase(TypedDict):
    rendered_at_build: str


class PromptSection(_PromptSectionBase, total=False):
    """A manifest's `prompt`: how the items were rendered at build time, and how they are scored."""

    lm_eval: LmEvalPrompt  # the lm-eval kinds
    prefix_token: str  # text sets


class Scoring(TypedDict):
    """A manifest's `scoring` (part of the set's sha256)."""

    runner: str
    metrics: list[str]
    primary: str
    rule: str


class _OrderRuleBase(TypedDict):
    rule: str


class OrderRule(_OrderRuleBase, total=False):
    seed: int


class SetSource(TypedDict, total=False):
    """Where a set's items come from: a package's file (the built-in sets) or a user's file."""

    package: str
    version: str
    file: str
    sha256: str
    dataset: str
    split: str
    rows: int
    selection: str
    items: int


class GenerationJson(TypedDict):
    """GenerationSettings as written."""

    until: list[str]
    max_new_tokens: int


class _SetIdentityBase(TypedDict):
    name: str
    version: str
    kind: str
    files: dict[str, str]
    prompt: PromptSection
    scoring: Scoring


class SetIdentity(_SetIdentityBase, total=False):
    """What of a manifest a set's sha256 covers (evalsets.sets.set_sha256)."""

    generation: GenerationJson


class BuiltFields(TypedDict):
    """What a set's builder says of it beyond its name, version and kind."""

    title: str
    description: str
    order: OrderRule
    source: SetSource
    licence: str
    attribution: str
    prompt: PromptSection
    scoring: Scoring


class _SetFieldsBase(BuiltFields):
    name: str
    version: str
    kind: str
    rebuild: str


class SetFields(_SetFieldsBase, total=False):
    """A manifest's fields before its files are written and hashed (evalsets.sets.write_set)."""

    generation: GenerationJson
    provenance: ProvenanceJSON  # user sets: quantgate.core.artifacts.provenance


class GoldenManifest(SetFields):
    """manifest.json of a golden set, as written and as `GoldenSet.manifest` holds it (read back
    after SetManifest checked it)."""

    artifact: str
    schema_version: int
    data_file: str
    files: dict[str, str]
    items: int
    sha256: str


class GenerationSettings(Strict):
    """Greedy decoding of a generation set (lm-eval generate_until)."""

    until: tuple[str, ...] = Field(default=("\n",), description="stop sequences")
    max_new_tokens: int = Field(default=64, gt=0, le=4096)


class SetManifest(Strict):
    """manifest.json of `evalsets/data/<name>/v<N>/` (and of user sets); validated on load."""

    artifact: str = Field(pattern="^golden-set$")
    schema_version: int = Field(ge=1, le=1)
    name: str
    version: str = Field(pattern=r"^v[1-9][0-9]*$")
    kind: Kind
    title: str
    description: str = ""
    data_file: str
    files: dict[str, str]
    items: int = Field(gt=0)
    sha256: str = Field(pattern="^[0-9a-f]{64}$")
    order: dict[str, Any]
    source: dict[str, Any]
    licence: str
    attribution: str
    prompt: dict[str, Any]
    scoring: dict[str, Any]
    generation: GenerationSettings | None = None
    rebuild: str
    provenance: dict[str, Any] | None = None  # user sets: when and with what they were added

    @field_validator("files")
    @classmethod
    def _relative_names(cls, value: dict[str, str]) -> dict[str, str]:
        if not all(is_file_name(name) for name in value):
            raise ValueError("a file name is empty, too long, or holds a NUL or an unpaired surrogate")
        return value

    @field_validator("order")
    @classmethod
    def _order_rule(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value.get("rule"), str):
            raise ValueError("order has no `rule` text")
        return value

    @field_validator("scoring")
    @classmethod
    def _scoring_metrics(cls, value: dict[str, Any]) -> dict[str, Any]:
        metrics = value.get("metrics")
        if not isinstance(metrics, list) or not all(isinstance(name, str) for name in metrics) or not isinstance(value.get("primary"), str):
            raise ValueError("scoring has no `metrics` list of names and `primary` metric")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SetManifest:
        if self.data_file not in self.files:
            raise ValueError(f"data_file {self.data_file!r} is not among the hashed files")
        if (self.kind is Kind.generation) != (self.generation is not None):
            raise ValueError("generation settings belong to, and only to, a generation set")
        return self


# ---- evalsets add ---------------------------------------------------------------------------

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"


class AddConfig(Strict):
    """A user's golden set: its name and kind, and what the manifest should say about it."""

    name: str = Field(pattern=NAME_PATTERN, description="lower-case letters, digits, '.', '_', '-'")
    kind: Kind
    title: str | None = None
    description: str = ""
    licence: str = "unspecified (user supplied)"
    attribution: str = "user supplied"
    generation: GenerationSettings | None = None  # generation sets only; default: GenerationSettings()

    @field_validator("kind", mode="before")
    @classmethod
    def _kind(cls, value: Any) -> Any:
        return parse_kind(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _generation_only(self) -> AddConfig:
        if self.generation is not None and self.kind is not Kind.generation:
            raise ValueError("stop sequences and max new tokens apply to generation sets only")
        return self


# ---- the evaluator --------------------------------------------------------------------------


class EvalBackend(str, Enum):
    hf = "hf"  # lm-eval's HF backend on an already-loaded transformers model (in the compute dtype)
    vllm = "vllm"  # lm-eval's tasks through vLLM in the serving environment (text sets still use transformers)


class ComputeDtype(str, Enum):
    """The dtype the reference evaluation computes in (docs/evaluate.md, "Compute dtype")."""

    auto = "auto"  # by device: the storage dtype on an accelerator, FP32 on every CPU
    float32 = "float32"
    bfloat16 = "bfloat16"


class EvaluateConfig(Strict):
    """What to evaluate a model on, and the settings that can change a number (all in the cache key)."""

    evalsets: tuple[str, ...] = Field(min_length=1, description="NAME or NAME@vN, built-in or added")
    limit: int | None = Field(default=None, gt=0, description="first N items of each set's seeded order")
    limits: dict[str, int] = Field(default_factory=dict, description="per-set limit by NAME or NAME@vN; beats `limit`")
    # sequential evaluation: per set (NAME or NAME@vN), the earlier looks (item counts, increasing,
    # below its limit) whose cached items a multiple-choice, last-word or generation set's results
    # extend: only the items past the last of them are evaluated (text sets are evaluated whole)
    grown_from: dict[str, tuple[int, ...]] = Field(default_factory=dict)
    # per set (NAME or NAME@vN): items of its seeded order skipped before the first N are taken
    # (a held-out split: the items after those a search was judged on)
    offsets: dict[str, int] = Field(default_factory=dict)
    backend: EvalBackend = EvalBackend.hf
    # --backend vllm: the engine settings (environment variables) vLLM runs under, e.g.
    # {"VLLM_CPU_INT4_W4A8": "1"}: the settings that decide which scheme it computes (serving.device)
    engine_settings: dict[str, str] = Field(default_factory=dict)
    batch_size: int = Field(default=4, gt=0, le=512)
    # where the model is kept while it is evaluated (quantgate.core.memory.Placement): auto takes
    # the in-memory path where this process's memory holds it, else streams the model from disk;
    # the scores are the same either way (not part of the cache key), the results say which ran
    placement: Placement = Placement.auto
    # text sets: tokens scored per item (longer items are truncated, recorded per item)
    max_tokens: int = Field(default=512, gt=1)
    # text sets: baseline tokens whose log-probabilities are cached per position (docs/evaluate.md)
    top_k: int = Field(default=64, gt=0, le=1024)
    # text sets: positions where the whole baseline distribution is cached, to measure the
    # top-k estimate's shortfall against the exact KL divergence
    exact_positions: int = Field(default=32, ge=0, le=4096)
    bootstrap_iters: int = Field(default=1000, ge=0, description="lm-eval's stderr bootstrap (perplexity)")
    device: str | None = Field(default=None, description="default: cuda when available, else cpu")
    # `auto` is resolved per machine (evaluate.compute_dtype_name) and the dtype it gives is in each
    # set's settings, so results computed in different dtypes never share a cache entry
    dtype: ComputeDtype = Field(default=ComputeDtype.auto, description="the dtype the model computes in (auto: by device class)")
    use_cache: bool = True
    allow_pickle: bool = False

    @field_validator("evalsets")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError("an evalset is named twice")
        return value

    @field_validator("limits")
    @classmethod
    def _positive(cls, value: dict[str, int]) -> dict[str, int]:
        for name, limit in value.items():
            if limit <= 0:
                raise ValueError(f"the limit of {name} must be positive, got {limit}")
        return value

    @field_validator("grown_from")
    @classmethod
    def _increasing(cls, value: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        for name, looks in value.items():
            if any(n <= 0 for n in looks) or list(looks) != sorted(set(looks)):
                raise ValueError(f"grown_from of {name} must be positive item counts in increasing order, got {list(looks)}")
        return value

    @field_validator("offsets")
    @classmethod
    def _not_negative(cls, value: dict[str, int]) -> dict[str, int]:
        for name, offset in value.items():
            if offset < 0:
                raise ValueError(f"the offset of {name} must not be negative, got {offset}")
        return value

    @model_validator(mode="after")
    def _settings_need_the_engine(self) -> EvaluateConfig:
        if self.engine_settings and self.backend is not EvalBackend.vllm:
            raise ValueError("engine settings apply to --backend vllm only")
        return self

    def keyed(self) -> dict[str, JsonValue]:
        """The settings as a cache key hashes them: all of them, as JSON, but the placement (where
        the model is kept gives the same numbers, so a run resumed with less memory reuses what
        it made)."""
        return self.model_dump(mode="json", exclude={"placement"})

    def offset_for(self, name: str, spec: str) -> int:
        return self.offsets.get(spec, self.offsets.get(name, 0))

    def grown_from_for(self, name: str, spec: str) -> tuple[int, ...]:
        return self.grown_from.get(spec, self.grown_from.get(name, ()))

    def limit_for(self, name: str, spec: str) -> int | None:
        """The first-N limit of one set: by NAME@vN, else by NAME, else the common limit."""
        return self.limits.get(spec, self.limits.get(name, self.limit))
