"""The quantization stage's typed config. Algorithm knobs carry llmcompressor's defaults."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantize.presets import PRESETS, get_preset


class Backend(str, Enum):
    llmcompressor = "llmcompressor"
    autoawq = "autoawq"  # reference AWQ implementation, awq-int4 only (extra `autoawq`)


class QuantizeConfig(BaseModel):
    """How to quantize: the format, the group size, what to leave alone, and the knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = Field(description=f"one of {', '.join(PRESETS)}")
    group_size: int = Field(default=128, description="INT4 formats: weights per scale (a positive multiple of 32)")
    # lm_head is left alone by default; embeddings are not Linear layers, so never targeted.
    ignore: tuple[str, ...] = Field(default=("lm_head",), description="module names or 're:' regexes to leave unquantized")
    backend: Backend = Backend.llmcompressor
    num_calibration_samples: int | None = Field(default=None, gt=0, description="rows of the calibration set to use (default: all)")
    # GPTQ (llmcompressor GPTQModifier defaults)
    dampening_frac: float = Field(default=0.01, ge=0.0, lt=1.0)
    actorder: Literal["static", "group", "weight"] | None = "static"
    block_size: int = Field(default=128, gt=0)
    # AWQ (llmcompressor AWQModifier defaults)
    awq_n_grid: int = Field(default=20, gt=0)
    awq_duo_scaling: bool | Literal["both"] = True
    # SmoothQuant: 0.8 rather than llmcompressor's 0.5, the strength its W8A8 examples use
    smoothing_strength: float = Field(default=0.8, gt=0.0, lt=1.0)
    # FP8: dynamic per-token activations (no activation scales from calibration)
    fp8_dynamic: bool = False

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        get_preset(value)
        return value

    @field_validator("group_size")
    @classmethod
    def _multiple_of_32(cls, value: int) -> int:
        if value <= 0 or value % 32:
            raise ValueError(f"group size must be a positive multiple of 32, got {value}")
        return value
