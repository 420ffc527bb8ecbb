"""The calibration stage's typed config."""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from quantgate.core.validation import Strict


class Packing(str, Enum):
    # Shuffled documents joined with the eos token and cut into full-length rows: every
    # calibration token is real text, no padding (what GPTQ/AWQ calibration usually uses).
    concat = "concat"
    # One document a row, truncated to seq_len and right-padded (attention mask 0 on padding).
    document = "document"


class CalibrationConfig(Strict):
    """What to build a calibration set from, and how."""

    model: str = Field(description="model directory, demo model name or hub id (for its tokenizer)")
    source: str = Field(description="'demo', a .txt/.jsonl/.parquet/.arrow file or a datasets directory")
    samples: int = Field(gt=0, description="number of rows")
    seq_len: int = Field(gt=0, description="tokens per row")
    seed: int = Field(default=0, ge=0)
    field: str = Field(default="text", description="column or JSON field holding the text")
    split: str | None = Field(default=None, description="split of a datasets DatasetDict directory")
    packing: Packing = Packing.concat
    chat_template: bool = Field(default=False, description="wrap each text as a user turn of the chat template")
    allow_fewer: bool = Field(default=False, description="accept fewer rows than asked when the source runs out")
    min_document_tokens: int = Field(default=16, gt=0, description="document packing: skip shorter documents")
    allow_pickle: bool = False
    trust_remote_code: bool = False
