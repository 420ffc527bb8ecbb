"""Stage 3b: lower bounds on decode step time from bytes and FLOPs, and what speculative
decoding (Leviathan et al., 2023) can buy at a batch size (the model of docs/sources.md, "Decode
bounds"). Pure math on plain numbers, a typed config, and `compute`, the versioned JSON."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator
from rich.table import Table

from quantgate.core.errors import InputError
from quantgate.core.headers import read_checkpoint
from quantgate.core.hf_config import ModelConfig
from quantgate.core.validation import Problem, Strict, validated
from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.hardware import HardwareProfile
from quantgate.quantize.measure.measurement import Measurement

SCHEMA_VERSION = 1
KIND = "bounds"
GB = 1e9
GIB = 2**30
LOWER_BOUND_NOTE = "every time is a lower bound from peak bandwidth and peak dense FLOP/s, never a measurement"
VERIFY_COST_NOTE = ("verify_cost_ratio = bound(batch, gamma + 1) / bound(batch, 1) replaces the paper's free "
                    "verification (the +1); an extension of Leviathan et al. (2023), not part of it")

M = TypeVar("M", bound=BaseModel)
Cell = Callable[["FormatBounds"], str]  # one cell of the per-format table, from a format's result


# --- the formulas (docs/sources.md, "Decode bounds") ----------------------------------------

def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def check_speculative(alpha: float, gamma: int, draft_cost: float) -> None:
    _require(0.0 <= alpha < 1.0, f"alpha must be in [0, 1), got {alpha:g}")
    _require(gamma >= 1, f"gamma (draft length) must be at least 1, got {gamma}")
    _require(draft_cost >= 0.0, f"draft cost c must be >= 0, got {draft_cost:g}")


def weight_bytes(parameters: float, bits_per_weight: float) -> float:
    _require(parameters > 0 and bits_per_weight > 0, "parameters and bits per weight must be positive")
    return parameters * bits_per_weight / 8


def kv_bytes_per_sequence(layers: int, kv_heads: int, head_dim: int, kv_bytes_per_element: float, context_tokens: int) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element x context tokens."""
    _require(min(layers, kv_heads, head_dim) >= 1, "layers, KV heads and head dim must be at least 1")
    _require(kv_bytes_per_element > 0 and context_tokens >= 0, "KV bytes per element must be > 0 and context tokens >= 0")
    return 2 * layers * kv_heads * head_dim * kv_bytes_per_element * context_tokens


def memory_time(weight_bytes_: float, batch: int, kv_per_sequence: float, bytes_per_second: float) -> float:
    """Each step reads every weight and every active sequence's KV cache once."""
    _require(batch >= 1, f"batch must be at least 1, got {batch}")
    _require(bytes_per_second > 0, f"memory bandwidth must be positive, got {bytes_per_second:g}")
    return (weight_bytes_ + batch * kv_per_sequence) / bytes_per_second


def compute_time(parameters: float, batch: int, positions: int, peak_flops: float) -> float:
    """2 FLOPs per parameter per token (one multiply-add), batch x positions tokens."""
    _require(batch >= 1 and positions >= 1, "batch and positions must be at least 1")
    _require(peak_flops > 0, f"peak FLOP/s must be positive, got {peak_flops:g}")
    return 2 * parameters * batch * positions / peak_flops


@dataclass(frozen=True)
class Decode:
    """Decoding one model whose weights take `weight_bytes`, with `kv_per_sequence` KV-cache
    bytes a sequence, on one accelerator: its step bounds at any batch and positions."""

    weight_bytes: float
    parameters: float
    kv_per_sequence: float
    hardware: HardwareProfile

    def memory_time(self, batch: int) -> float:
        return memory_time(self.weight_bytes, batch, self.kv_per_sequence, self.hardware.hbm_bytes_per_second)

    def compute_time(self, batch: int, positions: int) -> float:
        return compute_time(self.parameters, batch, positions, self.hardware.peak_dense_flops)

    def step_bound(self, batch: int, positions: int) -> tuple[float, str]:
        """(seconds, 'memory' or 'compute'): the larger of the two lower bounds wins."""
        memory = self.memory_time(batch)
        compute = self.compute_time(batch, positions)
        return (compute, "compute") if compute > memory else (memory, "memory")

    def verify_cost_ratio(self, batch: int, gamma: int) -> float:
        """bound(batch, gamma + 1) / bound(batch, 1): 1 while verifying stays memory bound."""
        verify, _ = self.step_bound(batch, gamma + 1)
        plain, _ = self.step_bound(batch, 1)
        return verify / plain

    def compute_bound_batch(self, positions: int) -> int | None:
        """The smallest batch at which `positions` positions per sequence are compute bound
        (compute_time > memory_time), or None if no batch is: solve
        B * (2 P positions / F - kv / BW) > W / BW for the integer B."""
        hardware = self.hardware
        per_sequence = (2 * self.parameters * positions / hardware.peak_dense_flops
                        - self.kv_per_sequence / hardware.hbm_bytes_per_second)
        if per_sequence <= 0:
            return None  # each sequence adds more memory time than compute time
        batch = max(1, math.floor(self.weight_bytes / hardware.hbm_bytes_per_second / per_sequence))
        # settle the float at the boundary with the same comparison step_bound makes
        while self.step_bound(batch, positions)[1] != "compute":
            batch += 1
        while batch > 1 and self.step_bound(batch - 1, positions)[1] == "compute":
            batch -= 1
        return batch


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """(1 - alpha^(gamma+1)) / (1 - alpha): tokens one target step yields (Leviathan et al., eq. 1)."""
    check_speculative(alpha, gamma, 0.0)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float:
    """Expected tokens per iteration over the iteration's cost in plain steps, gamma*c + verify."""
    check_speculative(alpha, gamma, draft_cost)
    _require(verify_cost_ratio >= 1.0, f"verify cost ratio must be >= 1, got {verify_cost_ratio:g}")
    return expected_tokens_per_step(alpha, gamma) / (gamma * draft_cost + verify_cost_ratio)


def best_gamma(alpha: float, draft_cost: float, gamma_range: tuple[int, int], ratio_for: Callable[[int], float]) -> tuple[int, float]:
    """The draft length in [low, high] with the largest speedup; `ratio_for(gamma)` gives the
    verify cost ratio at that gamma. Ties go to the shorter draft."""
    low, high = gamma_range
    _require(1 <= low <= high, f"gamma range must satisfy 1 <= low <= high, got {low}:{high}")
    best = (low, -math.inf)
    for gamma in range(low, high + 1):
        value = speedup(alpha, gamma, draft_cost, ratio_for(gamma))
        if value > best[1] * (1 + 1e-12):
            best = (gamma, value)
    return best


def break_even_alpha(gamma: int, draft_cost: float, verify_cost_ratio_: float = 1.0) -> float | None:
    """The acceptance rate at which speculative decoding merely breaks even (speedup = 1):
    sum_{k=0..gamma} alpha^k = gamma*c + verify. None when no alpha < 1 reaches it."""
    check_speculative(0.0, gamma, draft_cost)
    target = gamma * draft_cost + verify_cost_ratio_
    if target <= 1.0:
        return 0.0  # even alpha = 0 breaks even
    if target >= gamma + 1:
        return None  # the sum only reaches gamma + 1 as alpha -> 1
    low, high = 0.0, 1.0
    for _ in range(200):  # bisection: the sum increases with alpha on [0, 1)
        middle = (low + high) / 2
        if sum(middle**k for k in range(gamma + 1)) < target:
            low = middle
        else:
            high = middle
        if high - low < 1e-15:
            break
    return (low + high) / 2


# --- the typed inputs -----------------------------------------------------------------------

def checked(model: type[M], values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> M:
    """`model` built from `values`, or InputError('invalid <where>: <message>') in one line,
    where `where` is what the user typed for the first bad field (`names`, e.g. the command
    line's option) or the field's name with dashes."""

    def message(problem: Problem) -> str:
        where = (names or {}).get(problem.field, problem.field.replace("_", "-")) or "settings"
        return f"invalid {where}: {problem.message}"

    return validated(model, values, message=message)


class ModelShape(Strict):
    """What the bounds need of a model: parameters and the KV cache's shape."""

    parameters: float = Field(gt=0)
    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    source: str = "given"


class WeightFormat(Strict):
    """A weight format as the bounds see it: bits per weight (a rule or a measured figure), or
    measured bytes. (Not a quantize `Preset`, nor a measured checkpoint's `DetectedFormat`.)"""

    name: str = Field(min_length=1)
    bits_per_weight: float | None = Field(default=None, gt=0)
    weight_bytes: float | None = Field(default=None, gt=0)
    source: str = "given"

    @model_validator(mode="after")
    def _one_of(self) -> WeightFormat:
        if (self.bits_per_weight is None) == (self.weight_bytes is None):
            raise ValueError(f"format {self.name!r} needs exactly one of bits_per_weight and weight_bytes")
        return self

    def stored_bytes(self, parameters: float) -> float:
        """The weights' bytes: measured, or parameters x bits per weight / 8."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        assert self.bits_per_weight is not None  # _one_of: exactly one of the two is set
        return weight_bytes(parameters, self.bits_per_weight)


# The reference case's three formats (docs/sources.md); 4.15 = 4 + 16/128 scale + zero point (GPTQ paper, §5)
DEFAULT_FORMATS = (
    WeightFormat(name="bf16", bits_per_weight=16, source="16-bit weights"),
    WeightFormat(name="fp8_e4m3", bits_per_weight=8, source="8-bit weights"),
    WeightFormat(name="int4_g128", bits_per_weight=4.15, source="GPTQ's estimate for INT4 with group-128 scales"),
)


class BoundsConfig(Strict):
    hardware: HardwareProfile
    model: ModelShape
    formats: tuple[WeightFormat, ...] = DEFAULT_FORMATS
    batch: int = Field(default=1, ge=1)
    context_tokens: int = Field(default=2048, ge=0)
    kv_bytes_per_element: float = Field(default=2.0, gt=0)
    alpha: float = Field(default=0.8, ge=0, lt=1, description="draft acceptance rate")
    gamma: int = Field(default=4, ge=1, description="draft length")
    draft_cost: float = Field(default=0.1, ge=0, description="one draft step / one target step")
    plain_step_ms: float | None = Field(default=None, gt=0, description="measured plain step; default: each format's bound")
    alphas: tuple[float, ...] = ()
    gamma_range: tuple[int, int] | None = None
    compare_kv_bytes: tuple[float, ...] = ()

    @field_validator("alphas")
    @classmethod
    def _alphas_in_range(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        for value in values:
            if not 0 <= value < 1:
                raise ValueError(f"every alpha must be in [0, 1), got {value:g}")
        return values

    @field_validator("gamma_range")
    @classmethod
    def _range(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1 <= value[0] <= value[1] <= 1024:
            raise ValueError(f"gamma range must satisfy 1 <= low <= high <= 1024, got {value[0]}:{value[1]}")
        return value

    @field_validator("compare_kv_bytes")
    @classmethod
    def _positive(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        if any(value <= 0 for value in values):
            raise ValueError("KV bytes per element must be positive")
        return values

    @field_validator("formats")
    @classmethod
    def _unique(cls, values: tuple[WeightFormat, ...]) -> tuple[WeightFormat, ...]:
        names = [spec.name for spec in values]
        if not names:
            raise ValueError("at least one format is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"format names must be unique, got {', '.join(names)}")
        return values


def reference_case(hardware: HardwareProfile) -> BoundsConfig:
    """The reference case of docs/sources.md (with the `reference` hardware profile)."""
    return BoundsConfig(
        hardware=hardware,
        model=ModelShape(parameters=70e9, layers=80, kv_heads=8, head_dim=128, source="docs/sources.md reference case"),
        batch=32, context_tokens=2048, kv_bytes_per_element=2, alpha=0.8, gamma=4, draft_cost=0.1, plain_step_ms=25.0,
    )


# --- the result: the bounds JSON (docs/measure-and-bounds.md, "bounds JSON, schema_version 1") ---
# Printed (`quantgate bounds --json`) and read in memory (the measure stage), never read back from
# a file: kept as dicts, named field by field.


class Speedup(TypedDict):
    speedup: float
    iteration_time_ms: float
    average_tpot_ms: float


class Speculative(TypedDict):
    expected_tokens_per_target_step: float
    plain_step_ms: float
    plain_step_source: str
    free_verification: Speedup
    with_verify_cost: Speedup


class FreeBestGamma(TypedDict):
    gamma: int
    speedup: float


class BestGamma(TypedDict):
    range: list[int]
    gamma: int
    speedup: float
    verify_cost_ratio: float
    free_verification: FreeBestGamma


class StepBounds(TypedDict):
    batch: int
    positions: int
    memory_bound_ms: float
    compute_bound_ms: float
    bound_ms: float
    binds: str  # "memory" | "compute"


class VerifyBounds(TypedDict):
    positions: int
    bound_ms: float
    binds: str
    verify_cost_ratio: float


class AlphaPoint(TypedDict):
    alpha: float
    speedup: float
    speedup_free_verification: float


class _FormatBoundsBase(TypedDict):
    name: str
    source: str
    bits_per_weight: float
    weight_bytes: float
    weight_gb: float
    weight_gib: float
    kv_bytes_per_element: float
    batch1_weight_bound_ms: float
    step: StepBounds
    verify: VerifyBounds
    speculative: Speculative
    compute_bound_batch: int | None
    break_even_alpha: float | None


class FormatBounds(_FormatBoundsBase, total=False):
    """One weight format's bounds; the sweeps only where the config asks for them."""

    alpha_sweep: list[AlphaPoint]
    best_gamma: BestGamma


class Comparison(TypedDict):
    format: str
    against: str
    byte_ratio: float
    step_bound_improvement: float
    batch1_bound_improvement: float


class KVAlternative(TypedDict):
    kv_bytes_per_element: float
    kv_bytes_per_sequence: float
    formats: list[FormatBounds]


class BoundsInputs(TypedDict):
    batch: int
    context_tokens: int
    kv_bytes_per_element: float
    alpha: float
    gamma: int
    draft_cost: float
    plain_step_ms: float | None
    alphas: list[float]
    gamma_range: list[int] | None
    compare_kv_bytes: list[float]


class HardwareFigures(TypedDict):
    """A HardwareProfile as JSON."""

    name: str
    kind: str
    description: str
    hbm_bytes_per_second: float
    peak_dense_flops: float
    flops_dtype: str
    source: str


class ModelShapeFigures(TypedDict):
    """A ModelShape as JSON."""

    parameters: float
    layers: int
    kv_heads: int
    head_dim: int
    source: str


class Bounds(TypedDict):
    """The bounds JSON, schema_version 1."""

    kind: str
    schema_version: int
    lower_bounds: bool
    hardware: HardwareFigures
    model: ModelShapeFigures
    inputs: BoundsInputs
    kv_bytes_per_sequence: float
    kv_bytes_per_step: float
    expected_tokens_per_target_step: float
    break_even_alpha_free_verification: float | None
    formats: list[FormatBounds]
    comparisons: list[Comparison]
    kv_alternatives: list[KVAlternative]
    notes: list[str]


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _speculative(cfg: BoundsConfig, step_ms: float, ratio: float) -> Speculative:
    plain = cfg.plain_step_ms if cfg.plain_step_ms is not None else step_ms
    free = speedup(cfg.alpha, cfg.gamma, cfg.draft_cost, 1.0)
    costed = speedup(cfg.alpha, cfg.gamma, cfg.draft_cost, ratio)
    return {
        "expected_tokens_per_target_step": expected_tokens_per_step(cfg.alpha, cfg.gamma),
        "plain_step_ms": plain,
        "plain_step_source": "given" if cfg.plain_step_ms is not None else "this format's step bound",
        "free_verification": {"speedup": free, "iteration_time_ms": plain * (cfg.gamma * cfg.draft_cost + 1),
                              "average_tpot_ms": plain / free},
        "with_verify_cost": {"speedup": costed, "iteration_time_ms": plain * (cfg.gamma * cfg.draft_cost + ratio),
                             "average_tpot_ms": plain / costed},
    }


def _best_gamma(cfg: BoundsConfig, decode: Decode, gamma_range: tuple[int, int]) -> BestGamma:
    def ratio_for(gamma: int) -> float:
        return decode.verify_cost_ratio(cfg.batch, gamma)

    gamma, value = best_gamma(cfg.alpha, cfg.draft_cost, gamma_range, ratio_for)
    free_gamma, free_value = best_gamma(cfg.alpha, cfg.draft_cost, gamma_range, lambda _: 1.0)
    return {"range": list(gamma_range), "gamma": gamma, "speedup": value, "verify_cost_ratio": ratio_for(gamma),
            "free_verification": {"gamma": free_gamma, "speedup": free_value}}


def _format_result(cfg: BoundsConfig, spec: WeightFormat, kv_per_sequence: float, kv_bytes: float) -> FormatBounds:
    model, hardware = cfg.model, cfg.hardware
    weights = spec.stored_bytes(model.parameters)
    decode = Decode(weight_bytes=weights, parameters=model.parameters, kv_per_sequence=kv_per_sequence, hardware=hardware)
    step, binds = decode.step_bound(cfg.batch, 1)
    verify, verify_binds = decode.step_bound(cfg.batch, cfg.gamma + 1)
    ratio = verify / step
    result: FormatBounds = {
        "name": spec.name,
        "source": spec.source,
        "bits_per_weight": spec.bits_per_weight if spec.bits_per_weight is not None else weights * 8 / model.parameters,
        "weight_bytes": weights,
        "weight_gb": weights / GB,
        "weight_gib": weights / GIB,
        "kv_bytes_per_element": kv_bytes,
        "batch1_weight_bound_ms": _ms(weights / hardware.hbm_bytes_per_second),
        "step": {"batch": cfg.batch, "positions": 1, "memory_bound_ms": _ms(decode.memory_time(cfg.batch)),
                 "compute_bound_ms": _ms(decode.compute_time(cfg.batch, 1)), "bound_ms": _ms(step), "binds": binds},
        "verify": {"positions": cfg.gamma + 1, "bound_ms": _ms(verify), "binds": verify_binds, "verify_cost_ratio": ratio},
        "speculative": _speculative(cfg, _ms(step), ratio),
        "compute_bound_batch": decode.compute_bound_batch(cfg.gamma + 1),
        "break_even_alpha": break_even_alpha(cfg.gamma, cfg.draft_cost, ratio),
    }
    if cfg.alphas:
        result["alpha_sweep"] = [{"alpha": alpha, "speedup": speedup(alpha, cfg.gamma, cfg.draft_cost, ratio),
                                  "speedup_free_verification": speedup(alpha, cfg.gamma, cfg.draft_cost, 1.0)} for alpha in cfg.alphas]
    if cfg.gamma_range:
        result["best_gamma"] = _best_gamma(cfg, decode, cfg.gamma_range)
    return result


def _comparisons(formats: list[FormatBounds]) -> list[Comparison]:
    """Every format against the first: bytes, and the step bounds at the batch and at batch 1."""
    first = formats[0]
    return [{
        "format": entry["name"], "against": first["name"],
        "byte_ratio": first["weight_bytes"] / entry["weight_bytes"],
        "step_bound_improvement": first["step"]["bound_ms"] / entry["step"]["bound_ms"],
        "batch1_bound_improvement": first["batch1_weight_bound_ms"] / entry["batch1_weight_bound_ms"],
    } for entry in formats[1:]]


def _kv_alternatives(cfg: BoundsConfig) -> list[KVAlternative]:
    """Every format again with each other KV-cache width, without the sweeps."""
    model = cfg.model
    alternatives: list[KVAlternative] = []
    for kv_bytes in cfg.compare_kv_bytes:
        alt_cfg = cfg.model_copy(update={"kv_bytes_per_element": kv_bytes, "alphas": (), "gamma_range": None})
        alt_kv = kv_bytes_per_sequence(model.layers, model.kv_heads, model.head_dim, kv_bytes, cfg.context_tokens)
        alternatives.append({
            "kv_bytes_per_element": kv_bytes,
            "kv_bytes_per_sequence": alt_kv,
            "formats": [_format_result(alt_cfg, spec, alt_kv, kv_bytes) for spec in cfg.formats],
        })
    return alternatives


def compute(cfg: BoundsConfig) -> Bounds:
    """Every bound of the model in docs/sources.md for each format, the sweeps asked for, as versioned JSON."""
    model = cfg.model
    kv_per_sequence = kv_bytes_per_sequence(model.layers, model.kv_heads, model.head_dim, cfg.kv_bytes_per_element, cfg.context_tokens)
    formats = [_format_result(cfg, spec, kv_per_sequence, cfg.kv_bytes_per_element) for spec in cfg.formats]
    comparisons = _comparisons(formats)
    alternatives = _kv_alternatives(cfg)
    return {
        "kind": KIND,
        "schema_version": SCHEMA_VERSION,
        "lower_bounds": True,
        "hardware": _hardware_figures(cfg.hardware),
        "model": _shape_figures(model),
        "inputs": {
            "batch": cfg.batch, "context_tokens": cfg.context_tokens, "kv_bytes_per_element": cfg.kv_bytes_per_element,
            "alpha": cfg.alpha, "gamma": cfg.gamma, "draft_cost": cfg.draft_cost, "plain_step_ms": cfg.plain_step_ms,
            "alphas": list(cfg.alphas), "gamma_range": list(cfg.gamma_range) if cfg.gamma_range else None,
            "compare_kv_bytes": list(cfg.compare_kv_bytes),
        },
        "kv_bytes_per_sequence": kv_per_sequence,
        "kv_bytes_per_step": kv_per_sequence * cfg.batch,
        "expected_tokens_per_target_step": expected_tokens_per_step(cfg.alpha, cfg.gamma),
        "break_even_alpha_free_verification": break_even_alpha(cfg.gamma, cfg.draft_cost, 1.0),
        "formats": formats,
        "comparisons": comparisons,
        "kv_alternatives": alternatives,
        "notes": [LOWER_BOUND_NOTE, VERIFY_COST_NOTE,
                  "speedups assume independent acceptances with rate alpha (Leviathan et al., 2023)",
                  f"compute bounds use the profile's peak dense {cfg.hardware.flops_dtype.upper()} FLOP/s for every format"],
    }


def _hardware_figures(hardware: HardwareProfile) -> HardwareFigures:
    return HardwareFigures(name=hardware.name, kind=hardware.kind, description=hardware.description,
                           hbm_bytes_per_second=hardware.hbm_bytes_per_second, peak_dense_flops=hardware.peak_dense_flops,
                           flops_dtype=hardware.flops_dtype, source=hardware.source)


def _shape_figures(model: ModelShape) -> ModelShapeFigures:
    return ModelShapeFigures(parameters=model.parameters, layers=model.layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
                             source=model.source)


# --- models and formats from checkpoints -----------------------------------------------------

def model_from_checkpoint(checkpoint: str | Path, config: ModelConfig | None, parameters: int) -> ModelShape:
    """Layers, KV heads and head dim from a checkpoint's config.json; parameters from `measure`."""
    if not config:
        raise InputError(f"{checkpoint}: no config.json, so the KV cache's shape is unknown; give --layers, --kv-heads, --head-dim")
    nested = config.get("text_config")
    text_config = nested if isinstance(nested, dict) else config
    layers = text_config.get("num_hidden_layers", text_config.get("n_layer"))
    heads = text_config.get("num_attention_heads", text_config.get("n_head"))
    kv_heads = text_config.get("num_key_value_heads", heads)
    head_dim = text_config.get("head_dim")
    if head_dim is None and isinstance(text_config.get("hidden_size"), int) and isinstance(heads, int) and heads:
        head_dim = text_config["hidden_size"] // heads
    missing = [name for name, value in (("num_hidden_layers", layers), ("num_key_value_heads", kv_heads), ("head_dim", head_dim))
               if not isinstance(value, int) or value < 1]
    if missing:
        raise InputError(f"{checkpoint}: config.json does not give {', '.join(missing)}; pass them with --layers, --kv-heads, --head-dim")
    return checked(ModelShape, {"parameters": parameters, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                                "source": f"{checkpoint} (config.json, measure)"})


def measured_format(checkpoint: str | Path, measured: Measurement) -> tuple[ModelShape, WeightFormat]:
    """The model shape and the stored-bytes format of a checkpoint already measured
    (`quantize.measure.accounting.measure`): only its config.json is read again."""
    shape = model_from_checkpoint(checkpoint, read_checkpoint(Path(checkpoint)).config, measured.parameters)
    spec = checked(WeightFormat, {"name": Path(checkpoint).name or str(checkpoint), "weight_bytes": measured.tensor_bytes,
                                  "source": f"measured: {measured.format.name}"})
    return shape, spec


def measured_model(checkpoints: list[Path]) -> tuple[ModelShape, list[WeightFormat]]:
    """One model's shape from the checkpoints' config.json, and each one's stored bytes as a format."""
    shapes, measured = [], []
    for path in checkpoints:
        shape, spec = measured_format(path, measure(path))
        shapes.append(shape)
        measured.append(spec)
    if len({(shape.layers, shape.kv_heads, shape.head_dim) for shape in shapes}) > 1:
        raise InputError("the --checkpoint models differ in layers, KV heads or head dim; bound one model at a time")
    return shapes[0], measured



# --- presentation (rich), kept apart from the math ------------------------------------------

def render(result: Bounds) -> list[Any]:
    """Rich renderables for the terminal: the per-format table, comparisons, notes."""
    hardware, inputs = result["hardware"], result["inputs"]
    out: list[Any] = [
        f"[bold]lower bounds[/] on {hardware['name']} ({hardware['kind']}: {hardware['hbm_bytes_per_second']:.3g} B/s, "
        f"{hardware['peak_dense_flops']:.3g} dense FLOP/s); model {result['model']['parameters']:.4g} parameters, "
        f"{result['model']['layers']} layers, {result['model']['kv_heads']} KV heads x {result['model']['head_dim']}",
        f"  batch {inputs['batch']}, context {inputs['context_tokens']:,} tokens, KV {inputs['kv_bytes_per_element']:g} B/element: "
        f"{result['kv_bytes_per_sequence']:,.0f} KV bytes a sequence; alpha {inputs['alpha']:g}, gamma {inputs['gamma']}, c {inputs['draft_cost']:g}",
    ]
    out.append(_format_table(result["formats"], inputs, "bounds per format (all times are lower bounds)"))
    for comparison in result["comparisons"]:
        out.append(f"  {comparison['against']} -> {comparison['format']}: weight bytes / {comparison['byte_ratio']:.2f}, "
                   f"batch-{inputs['batch']} step bound / {comparison['step_bound_improvement']:.2f}")
    for alternative in result["kv_alternatives"]:
        out.append(_format_table(alternative["formats"], inputs | {"kv_bytes_per_element": alternative["kv_bytes_per_element"]},
                                 f"with {alternative['kv_bytes_per_element']:g}-byte KV ({alternative['kv_bytes_per_sequence']:,.0f} bytes a sequence)"))
    free = result["break_even_alpha_free_verification"]
    out.append(f"  expected tokens per target step {result['expected_tokens_per_target_step']:.4f}; break-even alpha (free verification) "
               f"{'none' if free is None else f'{free:.4f}'}")
    for note in result["notes"]:
        out.append(f"  note: {note}")
    return out


def _format_table(formats: list[FormatBounds], inputs: BoundsInputs, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    for entry in formats:
        table.add_column(entry["name"], justify="right")
    batch, gamma = inputs["batch"], inputs["gamma"]
    rows: list[tuple[str, Cell]] = [
        ("bits per weight", lambda e: f"{e['bits_per_weight']:.4g}"),
        ("weight bytes (GB, 1e9)", lambda e: _fixed(e["weight_gb"], 4)),
        ("weight GiB", lambda e: _fixed(e["weight_gib"], 2)),
        ("batch-1 weight bound (ms, >=)", lambda e: _fixed(e["batch1_weight_bound_ms"], 3)),
        (f"batch-{batch} step bound (ms, >=)", lambda e: _fixed(e["step"]["bound_ms"], 3)),
        ("binds", lambda e: e["step"]["binds"]),
        (f"verify_cost_ratio (gamma+1 = {gamma + 1})", lambda e: f"{e['verify']['verify_cost_ratio']:.4f}"),
        (f"speculative speedup at batch {batch}", lambda e: f"{e['speculative']['with_verify_cost']['speedup']:.4f}"),
        ("iteration time (ms, >=)", lambda e: _fixed(e["speculative"]["with_verify_cost"]["iteration_time_ms"], 3)),
        ("average TPOT (ms, >=)", lambda e: _fixed(e["speculative"]["with_verify_cost"]["average_tpot_ms"], 4)),
        (f"compute-bound batch at {gamma + 1} positions", lambda e: str(e["compute_bound_batch"] or "never")),
        ("break-even alpha", lambda e: "none" if e["break_even_alpha"] is None else f"{e['break_even_alpha']:.4f}"),
    ]
    if formats and "best_gamma" in formats[0]:
        rows.append(("best gamma (speedup)", lambda e: f"{e['best_gamma']['gamma']} ({e['best_gamma']['speedup']:.4f})"))
    for point in (formats[0].get("alpha_sweep") or []) if formats else []:
        rows.append((f"speedup at alpha {point['alpha']:g}", _sweep_cell(point["alpha"])))
    for label, cell in rows:
        table.add_row(label, *(cell(entry) for entry in formats))
    return table


def _sweep_cell(alpha: float) -> Cell:
    def cell(entry: FormatBounds) -> str:
        return next(f"{point['speedup']:.4f}" for point in entry["alpha_sweep"] if point["alpha"] == alpha)

    return cell


def _fixed(value: float, decimals: int) -> str:
    """Fixed decimals as the reference table prints them (docs/sources.md); significant digits for values below 1."""
    return f"{value:.{decimals}f}" if value == 0 or abs(value) >= 1 else f"{value:.4g}"
