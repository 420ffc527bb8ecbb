"""A calibration set's manifest as a record: what `calibration.run` writes next to the tokens, and
what every reader of a calibration set reads (its fingerprint, its tokenizer's hash, how many rows
of how many tokens).

The fingerprint and the input key are hashes of values the builder computes (not of this file),
so the record may be read and written again without changing either.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import ConfigDict, Field

from quantgate.calibration.config import CalibrationConfig
from quantgate.core.records import FileTable, Provenance, Record, RecordPart

KIND: Final = "calibration-set"
SCHEMA_VERSION: Final = 1


class CalibrationSource(RecordPart):
    """Where the documents came from, and the sha256 of what was read."""

    spec: str  # as given: "demo", a file or a datasets directory
    kind: str  # demo | txt | jsonl | parquet | arrow | datasets
    description: str
    sha256: str
    documents: int


class TokenizerIdentity(RecordPart):
    """The tokenizer the rows were made with: a quantization refuses a model with another one."""

    # `class` is the field's written name (a Python keyword, so the attribute is class_)
    model_config = ConfigDict(populate_by_name=True)

    sha256: str
    files: dict[str, str]
    class_: str = Field(alias="class")
    vocab_size: int
    eos_token_id: int | None


class Selection(RecordPart):
    """What decided which tokens are in the set (calibration.build.selection_settings), and the
    documents used, in the order they were packed."""

    samples_requested: int
    seq_len: int
    seed: int
    field: str
    split: str | None
    packing: Literal["concat", "document"]
    chat_template: bool
    allow_fewer: bool
    min_document_tokens: int | None  # document packing only
    shuffle: str
    documents_used: list[int]


class CalibrationManifest(Record):
    """manifest.json of a calibration set."""

    KIND = KIND
    WHAT = "calibration set manifest"
    READS = (SCHEMA_VERSION,)

    kind: Literal["calibration-set"] = "calibration-set"
    schema_version: Literal[1] = SCHEMA_VERSION
    fingerprint: str  # identifies the set byte for byte: source, tokenizer, selection, tokens
    input_key: str  # what the set is made from: an existing set with this key is reused
    model: str
    source: CalibrationSource
    tokenizer: TokenizerIdentity
    selection: Selection
    samples: int
    seq_len: int
    tokens: int  # real tokens (attention mask 1)
    tokens_sha256: str
    files: FileTable
    # the config as given; its own (lax) validation reads its enums and defaults back
    config: CalibrationConfig
    provenance: Provenance
