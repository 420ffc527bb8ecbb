"""An evaluation's results manifest as a record: what `evalsets.run` writes at the top of a results
directory (docs/evaluate.md, "Results directory"), and what every reader of results reads: the
model's identity, the baseline's, the config, and per golden set its directory, metrics and
cache key. The directory's files are checked against `files` by `evalsets.load_results`.

`ModelIdentity` is also what an evaluation's cache keys hold of a model (`numbers()`).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, field_validator

from quantgate.core.records import FileTable, Provenance, Record, RecordPart
from quantgate.core.validation import is_file_name, is_path
from quantgate.evalsets.config import EvaluateConfig, Kind

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
    files: FileTable
    provenance: Provenance
