"""The quantization stage's typed config. Algorithm knobs carry llmcompressor's defaults."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from quantgate.quantize.presets import PRESETS, Observer, get_preset


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
    # the weights' scale observer (compressed-tensors): unset, the format's own (gptq-int4:
    # "imatrix_mse", the others the library's minmax); "imatrix_mse" searches each group's range
    # for the least activation-weighted error (E[x^2] from calibration, llama.cpp's importance
    # matrix), "mse" the same unweighted, "minmax" the range itself (docs/int4-quality.md measures
    # them). Filled in at validation, so the quantize stage's key holds the observer in use.
    observer: Observer | None = Field(default=None, validate_default=True)
    # GPTQ (llmcompressor GPTQModifier defaults)
    dampening_frac: float = Field(default=0.01, ge=0.0, lt=1.0)
    actorder: Literal["static", "group", "weight"] | None = "static"
    block_size: int = Field(default=128, gt=0)
    # AWQ (llmcompressor AWQModifier defaults)
    # the scale grid: with duo scaling its points are i / (n_grid - 2), with "both" each half's
    # i / (n_grid / 2 - 1), without it i / (n_grid - 1) (llmcompressor's AWQModifier): fewer points
    # than that divide by zero or make a one-point grid
    awq_n_grid: int = Field(default=20, ge=3)
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

    @field_validator("observer")
    @classmethod
    def _format_observer(cls, value: Observer | None, info: ValidationInfo) -> Observer | None:
        if value is None and "format" in info.data:  # format is declared first: validated by now
            return get_preset(info.data["format"]).observer
        return value

    @field_validator("awq_duo_scaling")
    @classmethod
    def _grid_for_both(cls, value: bool | Literal["both"], info: ValidationInfo) -> bool | Literal["both"]:
        if value == "both" and info.data.get("awq_n_grid", 20) < 4:
            raise ValueError(f"awq_duo_scaling 'both' halves the grid: awq_n_grid must be at least 4, got {info.data['awq_n_grid']}")
        return value

    @field_validator("group_size")
    @classmethod
    def _multiple_of_32(cls, value: int) -> int:
        if value <= 0 or value % 32:
            raise ValueError(f"group size must be a positive multiple of 32, got {value}")
        return value


# A layer left at the baseline's dtype in a mixed-precision checkpoint.
UNQUANTIZED = "16-bit"


class MixedConfig(BaseModel):
    """A mixed-precision checkpoint: every linear layer's format (or 16-bit), from an allocation.

    One llmcompressor run makes it: the INT4 layers with their format's algorithm (GPTQ, or AWQ
    scales then round-to-nearest), the 8-bit layers with theirs (SmoothQuant on their blocks
    only, then the same GPTQ pass), the rest left at the baseline's dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: dict[str, str] = Field(min_length=1, description="linear layer name -> format or '16-bit'")
    # each format's knobs (a QuantizeConfig of that format); default: the format's defaults
    knobs: dict[str, QuantizeConfig] = Field(default_factory=dict)
    group_size: int = Field(default=128, description="INT4 layers: weights per scale (with the fallback)")
    ignore: tuple[str, ...] = Field(default=("lm_head",))
    num_calibration_samples: int | None = Field(default=None, gt=0)

    @field_validator("layers")
    @classmethod
    def _known_formats(cls, value: dict[str, str]) -> dict[str, str]:
        for name in sorted(set(value.values()) - {UNQUANTIZED}):
            get_preset(name)
        return value

    @field_validator("group_size")
    @classmethod
    def _multiple_of_32(cls, value: int) -> int:
        return QuantizeConfig._multiple_of_32(value)

    @property
    def formats(self) -> list[str]:
        """The quantized formats present, in preset order."""
        present = set(self.layers.values())
        return [name for name in PRESETS if name in present]

    def knobs_for(self, name: str) -> QuantizeConfig:
        return self.knobs.get(name) or QuantizeConfig(format=name, group_size=self.group_size, ignore=self.ignore)
