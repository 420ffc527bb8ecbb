"""The formats quantgate exists for, as data: one row a format. Each row names the
llmcompressor algorithm and the compressed-tensors quantization arguments it produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from quantgate.core.errors import InputError, did_you_mean
from quantgate.core.hf_config import QuantizationArgs

# the weights' scale observers a config may name (compressed-tensors' registry names)
Observer = Literal["minmax", "mse", "imatrix_mse"]


class Algorithm(str, Enum):
    gptq = "gptq"  # GPTQModifier: second-order weight rounding (Frantar et al., 2022)
    awq = "awq"  # AWQModifier scales, then QuantizationModifier (Lin et al., 2023)
    smoothquant_gptq = "smoothquant+gptq"  # SmoothQuantModifier, then GPTQModifier (Xiao et al., 2022)
    round_to_nearest = "rtn"  # QuantizationModifier alone (FP8 needs no solver)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    algorithm: Algorithm
    # compressed-tensors QuantizationArgs for weights, and for input activations (or None)
    weights: QuantizationArgs
    input_activations: QuantizationArgs | None = None
    # where the dynamic (per-token, no calibration scales) activation variant differs
    dynamic_input_activations: QuantizationArgs | None = None
    grouped: bool = False  # weights take a group size (and the divisibility fallback)
    # the weights' scale observer when a config names none (None: compressed-tensors' own, minmax)
    observer: Observer | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="gptq-int4",
            description="INT4 weights, group 128, symmetric; 16-bit activations (W4A16)",
            algorithm=Algorithm.gptq,
            weights={"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"},
            grouped=True,
            # each group's range searched for the least activation-weighted error (E[x^2] from
            # calibration): KL against the baseline 0.354 -> 0.239 on SmolLM2-135M and
            # 0.141 -> 0.113 on Qwen2.5-Coder-1.5B at the same bytes (docs/int4-quality.md)
            observer="imatrix_mse",
        ),
        Preset(
            name="awq-int4",
            description="INT4 weights, group 128, asymmetric with zero points; 16-bit activations (W4A16_ASYM)",
            algorithm=Algorithm.awq,
            weights={"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group"},
            grouped=True,
        ),
        Preset(
            name="smoothquant-w8a8",
            description="SmoothQuant, then INT8 weights per channel and INT8 activations per token, dynamic",
            algorithm=Algorithm.smoothquant_gptq,
            weights={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
        ),
        Preset(
            name="fp8-e4m3",
            description="FP8 E4M3 weights and activations, per-tensor static scales from calibration",
            algorithm=Algorithm.round_to_nearest,
            weights={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
            input_activations={
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                "dynamic": False, "observer": "static_minmax",
            },
            # FP8_DYNAMIC: per-channel weights, per-token activations scaled at run time
            dynamic_input_activations={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
        ),
    )
}
# With dynamic activations, FP8 weights go per channel (llmcompressor's FP8_DYNAMIC preset).
FP8_DYNAMIC_WEIGHTS: QuantizationArgs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        valid = list(PRESETS)
        raise InputError(f"unknown format {name!r}{did_you_mean(name, valid)}; valid formats: {', '.join(valid)}")
    return PRESETS[name]
