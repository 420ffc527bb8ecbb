"""The formats quantgate makes, declared once: one entry a format, holding its compressed-tensors
scheme, algorithm, precision class, on-disk layout and what each device class's engine computes
for it. The presets, the backend, the accounting, the serving table, the policy and the planner
read it (docs/usage.md, "Adding a format").

It lives in quantgate.core because every stage reads it and the stages are siblings
(quantize, quantize.measure and serving import none of each other). The quantization arguments
are written out, not built from compressed-tensors' PRESET_SCHEMES at import (that import costs
seconds, and `quantgate --help` needs none of it): tests/test_formats.py checks each entry
against the preset it names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from quantgate.core.errors import InputError, did_you_mean
from quantgate.core.hf_config import QuantizationArgs

# ---- precision classes: which of a policy's bounds gate a checkpoint ---------------------------


class PrecisionClass(str, Enum):
    """The width of a checkpoint's weights as a policy names its bounds (the keys of the policy
    YAML files and of a plan's `evaluation.discordance`)."""

    eight_bit = "8bit"
    four_bit = "4bit"

    def __str__(self) -> str:  # "8bit" in messages and records, as on Python 3.11's StrEnum
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


PRECISION_CLASSES: tuple[PrecisionClass, ...] = tuple(PrecisionClass)  # policy order: the 8-bit bounds first


def precision_class(bits: int) -> PrecisionClass:
    """The precision class of weights `bits` wide: INT4 and narrower take the 4-bit bounds, any
    wider (INT8, FP8) the 8-bit ones."""
    return PrecisionClass.four_bit if bits <= 4 else PrecisionClass.eight_bit


# ---- algorithms: the llmcompressor modifiers a format is made with -----------------------------


class Algorithm(str, Enum):
    gptq = "gptq"  # GPTQModifier: second-order weight rounding (Frantar et al., 2022)
    awq = "awq"  # AWQModifier scales, then QuantizationModifier (Lin et al., 2023)
    smoothquant_gptq = "smoothquant+gptq"  # SmoothQuantModifier, then GPTQModifier (Xiao et al., 2022)
    round_to_nearest = "rtn"  # QuantizationModifier alone (FP8 needs no solver)


# One step a modifier: "smoothquant" and "awq" move scales (they need per-architecture layer
# mappings), "gptq" solves for the weights, "quantize" rounds them to nearest.
Step = Literal["smoothquant", "awq", "gptq", "quantize"]


@dataclass(frozen=True)
class AlgorithmSteps:
    steps: tuple[Step, ...]  # the llmcompressor modifiers, in recipe order
    mappings: str | None  # the llmcompressor layer-mapping registry it needs per architecture
    solver: bool  # calibration data shapes the weights (False: round to nearest)


ALGORITHMS: dict[Algorithm, AlgorithmSteps] = {
    Algorithm.gptq: AlgorithmSteps(("gptq",), None, solver=True),
    Algorithm.awq: AlgorithmSteps(("awq", "quantize"), "AWQ", solver=True),
    Algorithm.smoothquant_gptq: AlgorithmSteps(("smoothquant", "gptq"), "SmoothQuant", solver=True),
    Algorithm.round_to_nearest: AlgorithmSteps(("quantize",), None, solver=False),
}

# the weights' scale observers a config may name (compressed-tensors' registry names)
Observer = Literal["minmax", "mse", "imatrix_mse"]

# ---- device classes and what an engine computes on each ---------------------------------------

# The device classes (docs/serving.md, "Device classes"): vLLM's CPU kernels differ between them.
AVX2 = "cpu-avx2"  # x86 without AVX-512 (or any other CPU: no AVX-512 kernel is built for it)
AVX512 = "cpu-avx512"  # avx512f, no AMX
AVX512_AMX = "cpu-avx512-amx"  # avx512f and amx_bf16 (Sapphire Rapids and later)
CUDA_PREFIX = "cuda-sm"  # cuda-sm90: an NVIDIA GPU of compute capability 9.0
CPU_CLASSES = (AVX2, AVX512, AVX512_AMX)
CPU_ENGINE = "vllm-cpu"


class Computes(str, Enum):
    """What an engine computes for a format's scheme on one device class."""

    serves = "serves"  # the checkpoint's scheme, usably
    serves_as = "serves as another scheme"  # by the engine's default, unless `setting` is given
    slow_path = "a slow path"  # served, too slowly to check (the serve stage's probe makes it pending)
    no_usable_path = "no usable path"
    no_kernel = "no kernel"  # does not load: pending serving there

    @property
    def gap(self) -> bool:
        """Known not to serve usably: what preflight names and what a node does not advertise."""
        return self in (Computes.slow_path, Computes.no_usable_path, Computes.no_kernel)


@dataclass(frozen=True)
class Expectation:
    """What `engine` is expected to compute for a format on `device_class`, with its source. A
    class a format names no expectation for is expected to serve it."""

    device_class: str
    computes: Computes
    source: str
    engine: str = CPU_ENGINE
    # the format's variant it is about: "static" or "dynamic" activation scales (None: both)
    variant: Literal["static", "dynamic"] | None = None
    served_as: str | None = None  # Computes.serves_as: the scheme the engine's default computes
    setting: tuple[str, str] | None = None  # the environment variable and value that serve the scheme as it is
    default: str | None = None  # the variable's value when it is not set


def _all_cpus(computes: Computes, source: str) -> tuple[Expectation, ...]:
    return tuple(Expectation(device_class, computes, source) for device_class in CPU_CLASSES)


# INT4 weight-only (W4A16): the facts GPTQ's and AWQ's checkpoints share
INT4_WEIGHT_ONLY_ON_CPU = (
    Expectation(AVX2, Computes.no_kernel,
                "cpu_gemm_wna16 is compiled only with AVX-512 (vLLM issue #55613; measured: the INT4 checkpoint does not load)"),
    Expectation(AVX512, Computes.serves, "vLLM 0.32 CPU build: CPUWNA16LinearKernel (cpu_gemm_wna16) on 16-bit activations"),
    # vllm/envs.py: VLLM_CPU_INT4_W4A8 defaults to "1"; model_executor/kernels/linear/mixed_precision/cpu.py:
    # use_w4a8 where AMX tiles are supported and the activations are BF16, then ops.int4_scaled_mm_cpu
    Expectation(AVX512_AMX, Computes.serves_as,
                "vLLM 0.32 CPU build: vllm/envs.py (VLLM_CPU_INT4_W4A8, default 1) and "
                "model_executor/kernels/linear/mixed_precision/cpu.py (use_w4a8 with AMX and BF16 activations)",
                served_as="W4A8", setting=("VLLM_CPU_INT4_W4A8", "0"), default="1"),
)


# ---- schemes ----------------------------------------------------------------------------------


def scheme_name(weights: QuantizationArgs, activations: QuantizationArgs | None) -> str:
    """The scheme a serving engine sees in a config group: W4A16, W8A8 (int8 activations), FP8
    (float8 weights and activations, static activation scales), FP8_DYNAMIC (dynamic ones), W8A16 ...
    from its weights' and input activations' bits, type and scales (compressed-tensors' preset names)."""
    bits = int(weights.get("num_bits", 16))
    if weights.get("type") == "float" and bits == 8:
        if not activations:
            return "FP8-W8A16"
        # the activation scales decide the kernel on a CPU: static ones need static_scaled_fp8_quant,
        # which vLLM's CPU build lacks, dynamic per-token ones do not (docs/serving.md, "Device classes")
        return "FP8_DYNAMIC" if activations.get("dynamic") else "FP8"
    return f"W{bits}A{int(activations.get('num_bits', 16)) if activations else 16}"


# ---- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    # compressed-tensors' preset (quant_scheme.PRESET_SCHEMES) the arguments below are
    scheme: str
    algorithm: Algorithm
    # compressed-tensors QuantizationArgs for weights, and for input activations (or None)
    weights: QuantizationArgs
    # the storage layout compressed-tensors writes the weights in (quantize.measure.layouts names)
    layout: str
    input_activations: QuantizationArgs | None = None
    # the dynamic (per-token, no calibration scales) variant, where the format has one
    dynamic_scheme: str | None = None
    dynamic_weights: QuantizationArgs | None = None
    dynamic_input_activations: QuantizationArgs | None = None
    grouped: bool = False  # weights take a group size (and the divisibility fallback)
    # the weights' scale observer when a config names none (None: compressed-tensors' own, minmax)
    observer: Observer | None = None
    # one mixed-precision checkpoint (the search) may hold its layers beside another class's
    mixable: bool = False
    # what each device class's engine computes for it (a class not named: served)
    serving: tuple[Expectation, ...] = ()
    # weight arguments set otherwise than the named preset, on purpose (its notes say why)
    overrides: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bits(self) -> int:
        return int(self.weights["num_bits"])

    @property
    def precision(self) -> PrecisionClass:
        return precision_class(self.bits)

    @property
    def steps(self) -> AlgorithmSteps:
        return ALGORITHMS[self.algorithm]

    def expected(self, engine: str, device_class: str, dynamic: bool = False) -> list[Expectation]:
        """What `engine` is expected to compute on `device_class` for this format's checkpoints
        (the dynamic variant's where asked and the format has one)."""
        variant = "dynamic" if dynamic and self.dynamic_input_activations is not None else "static"
        return [fact for fact in self.serving if (fact.engine, fact.device_class) == (engine, device_class) and fact.variant in (None, variant)]

    def args(self, dynamic: bool = False) -> tuple[QuantizationArgs, QuantizationArgs | None]:
        """(weights, input activations) of the static variant, or of the dynamic one where asked and the format has one."""
        if dynamic and self.dynamic_input_activations is not None:
            return self.dynamic_weights or self.weights, self.dynamic_input_activations
        return self.weights, self.input_activations

    def served_scheme(self, dynamic: bool = False) -> str:
        """The scheme a serving engine sees in this format's checkpoints (serving.device.scheme_of)."""
        return scheme_name(*self.args(dynamic))


FORMATS: dict[str, Format] = {
    entry.name: entry
    for entry in (
        Format(
            name="gptq-int4",
            description="INT4 weights, group 128, symmetric; 16-bit activations (W4A16)",
            scheme="W4A16",
            algorithm=Algorithm.gptq,
            weights={"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"},
            layout="pack-quantized",
            grouped=True,
            # each group's range searched for the least activation-weighted error (E[x^2] from
            # calibration): KL against the baseline 0.354 -> 0.239 on SmolLM2-135M and
            # 0.141 -> 0.113 on Qwen2.5-Coder-1.5B at the same bytes (docs/int4-quality.md)
            observer="imatrix_mse",
            mixable=True,
            serving=INT4_WEIGHT_ONLY_ON_CPU,
        ),
        Format(
            name="awq-int4",
            description="INT4 weights, group 128, asymmetric with zero points; 16-bit activations (W4A16_ASYM)",
            scheme="W4A16_ASYM",
            algorithm=Algorithm.awq,
            # no observer: compressed-tensors' minmax, chosen on two models (imatrix_mse moved the 1.5B
            # model's perplexity change the wrong way: docs/int4-quality.md, "awq-int4's observer")
            weights={"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group"},
            layout="pack-quantized",
            grouped=True,
            mixable=True,
            serving=INT4_WEIGHT_ONLY_ON_CPU,
        ),
        Format(
            name="smoothquant-w8a8",
            description="SmoothQuant, then INT8 weights per channel and INT8 activations per token, dynamic",
            scheme="W8A8",
            algorithm=Algorithm.smoothquant_gptq,
            weights={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
            layout="int-quantized",
            mixable=True,
            serving=_all_cpus(Computes.serves, "vLLM 0.32 model_executor/kernels/linear/scaled_mm/cpu.py: CPUInt8ScaledMMLinearKernel "
                                               "on every CPU class (int8 weights, activations quantized to int8 per token)"),
        ),
        Format(
            name="fp8-e4m3",
            description="FP8 E4M3 weights and activations, per-tensor static scales from calibration",
            scheme="FP8",
            algorithm=Algorithm.round_to_nearest,
            weights={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
            input_activations={
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                "dynamic": False, "observer": "static_minmax",
            },
            layout="float-quantized",
            # FP8_DYNAMIC: per-channel weights, per-token activations scaled at run time
            dynamic_scheme="FP8_DYNAMIC",
            dynamic_weights={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            dynamic_input_activations={"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
            # FP8 is left out of mixed checkpoints: its uniform format needs no calibration and its
            # activation scales differ per tensor
            # Each variant is a scheme of its own to the serving tables (FP8, FP8_DYNAMIC: scheme_name),
            # since a CPU class serves one and lacks a kernel for the other.
            serving=(
                Expectation(AVX2, Computes.no_usable_path,
                            "static FP8: no static_scaled_fp8_quant op in the AVX2 library (it does not load); dynamic FP8: about "
                            "2 tokens/s a sequence at batch 1 on the demo model (measured)"),
                Expectation(AVX512, Computes.serves,
                            "dynamic FP8: ChannelWiseTorchFP8ScaledMMLinearKernel, about 13x slower than BF16 (2 prompts x 4 new "
                            "tokens in 4.0 s against 0.3 s on the demo model, measured): served, its tokens/s reported",
                            variant="dynamic"),
                Expectation(AVX512_AMX, Computes.slow_path,
                            "dynamic FP8: ChannelWiseTorchFP8ScaledMMLinearKernel, 54.8 s a forward pass of a 17-token prompt on the "
                            "demo model (measured; torch hands FP8 to oneDNN there)", variant="dynamic"),
                *(Expectation(device_class, Computes.no_kernel,
                              "static per-tensor FP8: vLLM 0.32's CPU build has no _C::static_scaled_fp8_quant kernel (measured on "
                              "AVX-512: the checkpoint does not load)", variant="static") for device_class in (AVX512, AVX512_AMX)),
            ),
        ),
        Format(
            name="gptq-int8",
            description="INT8 weights per channel, symmetric, by GPTQ; 16-bit activations (W8A16, weight-only)",
            scheme="W8A16",
            algorithm=Algorithm.gptq,
            # compressed-tensors 0.15's W8A16 preset groups by 128; per channel is the INT8 weight-only
            # scheme users ask for (one scale a row: 8.0x bits a weight, no group fallback)
            weights={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            overrides=("strategy",),
            layout="pack-quantized",  # weight-only INT: compressed-tensors packs it into int32 words
            serving=_all_cpus(Computes.no_kernel,
                              "vLLM 0.32 CPU build: W8A16 int8 loads as CompressedTensorsWNA16 (uint8b128), and no CPU mixed-precision "
                              "kernel takes it (model_executor/kernels/linear/mixed_precision/cpu.py: CPUWNA16 takes uint4 and "
                              "uint4b8 only; dynamic_4bit.py: int4 on Arm; zentorch.py: uint4 on AMD Zen); measured on AVX-512: the "
                              "demo checkpoint does not load (\"Failed to find a kernel that can implement the WNA16 linear layer\")"),
        ),
    )
}


def get_format(name: str) -> Format:
    if name not in FORMATS:
        valid = list(FORMATS)
        raise InputError(f"unknown format {name!r}{did_you_mean(name, valid)}; valid formats: {', '.join(valid)}")
    return FORMATS[name]


def served_schemes() -> tuple[str, ...]:
    """The schemes of the registry's formats, each once, in registry order."""
    return tuple(dict.fromkeys(scheme for entry in FORMATS.values() for scheme in (entry.served_scheme(), entry.served_scheme(dynamic=True))))
