"""Stage 3a: byte accounting of a checkpoint from its safetensors headers alone: which format
it is, where every byte goes, bits per weight per layer, and why the total is not the rule.

`account` is pure over parsed headers and config dicts; `measure` is the glue that reads them.
Every formula is in bits with exact fractions, so the explanation sums to the byte.
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any

from quantgate.core.errors import InputError
from quantgate.core.headers import DTYPE_BITS, FLOATING_DTYPES, CheckpointFiles, TensorEntry, read_checkpoint

SCHEMA_VERSION = 1
KIND = "measurement"

# The rule the report compares against: GPTQ (Frantar et al., 2022, §5) puts INT4 with one
# 16-bit scale (and zero point) per 128 weights at about 4.15 bits per weight; 8-bit formats
# are 8, unquantized models their dtype's width.
RULE_GROUP_SIZE = 128
NOMINAL_SCALE_BITS = 16  # the formats' figures assume 16-bit scales (token-cost.md)


def rule_bits(bits: int) -> Fraction:
    """The rule's bits per weight for `bits`-bit weights: 4 -> 4.15 (4 + 0.15 of group-128
    overhead, GPTQ's estimate), 8 -> 8, 16 -> 16."""
    return Fraction(bits) + (Fraction(15, 100) if bits < 8 else 0)


class Category(str, Enum):
    quantized_weights = "quantized_weights"
    scales = "scales"  # weight scales, activation (input) scales, KV-cache scales
    zero_points = "zero_points"
    g_idx = "g_idx"
    shape_metadata = "shape_metadata"  # compressed-tensors weight_shape, I64[2] per packed layer
    unquantized_linear = "unquantized_linear"
    biases = "biases"
    embeddings = "embeddings"
    lm_head = "lm_head"
    norms = "norms"
    other = "other"


# Which categories are read at decode with a linear layer (for the --baseline linear ratio).
LINEAR_CATEGORIES = (Category.quantized_weights, Category.scales, Category.zero_points, Category.g_idx,
                     Category.shape_metadata, Category.unquantized_linear, Category.biases)
PARAMETER_CATEGORIES = (Category.quantized_weights, Category.unquantized_linear, Category.biases,
                        Category.embeddings, Category.lm_head, Category.norms, Category.other)

# Tensor-name suffixes and the role they play, as data (compressed-tensors, AutoGPTQ/GPTQModel,
# AutoAWQ, transformers). The longest suffix wins; a name with none of them is "other".
SUFFIX_ROLES: dict[str, str] = {
    "weight_packed": "packed_weight",  # compressed-tensors pack-quantized
    "weight_scale": "weight_scale",
    "weight_scale_inv": "weight_scale",  # transformers fine-grained FP8
    "weight_zero_point": "weight_zero_point",
    "weight_g_idx": "g_idx",
    "weight_shape": "weight_shape",
    "weight_global_scale": "activation_scale",
    "input_scale": "activation_scale",
    "input_zero_point": "activation_scale",
    "input_global_scale": "activation_scale",
    "output_scale": "activation_scale",
    "output_zero_point": "activation_scale",
    "k_scale": "kv_scale",
    "v_scale": "kv_scale",
    "qweight": "packed_weight",  # GPTQ and AWQ
    "qzeros": "weight_zero_point",
    "scales": "weight_scale",
    "g_idx": "g_idx",
    "weight": "weight",
    "bias": "bias",
}
ROLE_CATEGORY = {
    "packed_weight": Category.quantized_weights,
    "weight_scale": Category.scales,
    "activation_scale": Category.scales,
    "kv_scale": Category.scales,
    "weight_zero_point": Category.zero_points,
    "g_idx": Category.g_idx,
    "weight_shape": Category.shape_metadata,
    "bias": Category.biases,
}
QUANTIZED_WEIGHT_DTYPES = frozenset({"I8", "U8", "F8_E4M3", "F8_E5M2", "F4"})
# Layouts whose bytes `format_bytes` knows; any other quantized layer is counted, not checked.
KNOWN_LAYOUTS = frozenset({"pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "gptq", "awq-gemm"})

# Architecture knowledge as data: module names of embeddings, output heads, norms and blocks
# across Llama/Mistral/Qwen (model.embed_tokens, lm_head), GPT-2 (wte, ln_f), GPT-NeoX
# (embed_in, embed_out), Falcon/BLOOM (word_embeddings), Meta's Llama (tok_embeddings, output).
EMBEDDING_MODULE = re.compile(r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|embed_in|tok_embeddings|embed_positions|position_embeddings|token_type_embeddings)$")
LM_HEAD_MODULE = re.compile(r"(^|\.)(lm_head|embed_out)$|^output$")
NORM_MODULE = re.compile(r"(?i)(norm|^ln(_|\d|f|$))")
BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer|decoder_layers)\.(\d+)(?:\.|$)")

CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "half": "F16", "float": "F32", "float64": "F64"}


@dataclass(frozen=True)
class Scheme:
    """How a linear layer's weights are quantized, as its format describes them."""

    layout: str  # pack-quantized | int-quantized | float-quantized | naive-quantized | gptq | awq-gemm | unknown
    bits: int
    type: str = "int"  # int | float
    symmetric: bool = True
    strategy: str = "group"  # group | channel | tensor | block
    group_size: int | None = None
    block: tuple[int, int] | None = None
    g_idx: bool = False  # the format stores g_idx for this layer
    static_input: bool = False  # static activation scales are stored (input_scale)
    zero_point_bits: int = 0  # bits per stored zero point (0: none)
    source: str = ""


@dataclass(frozen=True)
class FormatInfo:
    family: str  # compressed-tensors | gptq | awq | dense | unknown
    layout: str
    name: str
    detected_from: str
    quant_method: str | None
    weights: dict[str, Any] | None
    activations: dict[str, Any] | None
    tie_word_embeddings: bool | None
    config_dtype: str | None


@dataclass
class Gap:
    cause: str
    bits: Fraction  # signed: bits above (positive) or below the reference
    detail: str
    role: str | None = None  # for a layer's gap: the tensor role it is about

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "bytes": _num(self.bits / 8), "detail": self.detail}


@dataclass
class LinearLayer:
    name: str
    block: int | None
    quantized: bool
    layout: str
    bits: int | None
    group_size: int | None
    symmetric: bool | None
    strategy: str | None
    in_features: int
    out_features: int
    parameters: int
    bytes_by_role: dict[str, int]
    exact_bits: Fraction | None  # what the format implies, with 16-bit scales
    nominal_bits: Fraction | None  # b + (16 + zero-point bits)/g, without per-layer constants
    gaps: list[Gap] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    storage_bits: int | None = None  # bits a weight takes in its container (8 for int-quantized INT4)
    zero_point_bits: int = 0

    def nominal_at(self, group_size: int) -> Fraction | None:
        """The nominal figure this layer would have at another group size."""
        if self.nominal_bits is None or self.storage_bits is None:
            return None
        if self.strategy != "group" or not self.group_size:
            return self.nominal_bits
        return (self.storage_bits + Fraction(NOMINAL_SCALE_BITS + self.zero_point_bits, group_size)) * self.parameters

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_role.values())

    @property
    def bits_per_weight(self) -> float:
        return self.bytes * 8 / self.parameters if self.parameters else 0.0

    def to_json(self) -> dict[str, Any]:
        exact = self.exact_bits / self.parameters if self.exact_bits is not None and self.parameters else None
        nominal = self.nominal_bits / self.parameters if self.nominal_bits is not None and self.parameters else None
        return {
            "name": self.name, "block": self.block, "quantized": self.quantized, "layout": self.layout,
            "bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric, "strategy": self.strategy,
            "in_features": self.in_features, "out_features": self.out_features, "parameters": self.parameters,
            "bytes": self.bytes, "bytes_by_role": dict(sorted(self.bytes_by_role.items())),
            "bits_per_weight": self.bits_per_weight,
            "exact_bits_per_weight": _num(exact), "nominal_bits_per_weight": _num(nominal),
            "gaps": [gap.to_json() for gap in self.gaps], "notes": self.notes,
        }


@dataclass
class Measurement:
    """The accounting of one checkpoint; `to_json` is the documented, versioned schema."""

    checkpoint: str
    files: list[dict[str, Any]]
    index: str | None
    format: FormatInfo
    file_bytes: int
    header_bytes: int
    parameters: int
    categories: dict[str, dict[str, int]]
    blocks: list[dict[str, Any]]
    outside_blocks: dict[str, Any]
    linear_layers: list[LinearLayer]
    rule_bits_per_weight: Fraction
    baseline_dtype: str | None
    baseline_dtype_source: str
    explanation: list[Gap]
    unexplained_bits: Fraction
    notes: list[str]
    baseline: dict[str, Any] | None = None
    wall_seconds: float = 0.0

    @property
    def rule_source(self) -> str:
        if not self.quantized_layers:
            return f"unquantized: the width of the baseline dtype {self.baseline_dtype or '(assumed 16-bit)'}"
        if self.rule_bits_per_weight < 8:
            return "GPTQ (Frantar et al., 2022): INT4 with group-128 scales is about 4.15 bits per weight"
        return f"{int(self.rule_bits_per_weight)}-bit weights"

    @property
    def tensor_bytes(self) -> int:
        return self.file_bytes - self.header_bytes

    @property
    def quantized_layers(self) -> list[LinearLayer]:
        return [layer for layer in self.linear_layers if layer.quantized]

    def category_bytes(self, categories: tuple[Category, ...]) -> int:
        return sum(self.categories[category.value]["bytes"] for category in categories)

    @property
    def linear_bytes(self) -> int:
        return self.category_bytes(LINEAR_CATEGORIES)

    def quantized_summary(self) -> dict[str, Any]:
        layers = self.quantized_layers
        weights = sum(layer.parameters for layer in layers)
        stored = sum(layer.bytes for layer in layers)
        exact_layers = [layer for layer in layers if layer.exact_bits is not None]
        by_group: dict[str, dict[str, Any]] = {}
        for layer in layers:
            key = f"{layer.bits}-bit {layer.strategy}" + (f" g{layer.group_size}" if layer.group_size else "")
            entry = by_group.setdefault(key, {"bits": layer.bits, "strategy": layer.strategy, "group_size": layer.group_size,
                                              "layers": 0, "parameters": 0, "bytes": 0, "_exact": Fraction(0), "_nominal": Fraction(0)})
            entry["layers"] += 1
            entry["parameters"] += layer.parameters
            entry["bytes"] += layer.bytes
            entry["_exact"] += layer.exact_bits or 0
            entry["_nominal"] += layer.nominal_bits or 0
        for entry in by_group.values():
            weights_in_group = entry["parameters"] or None  # None: a layout measure cannot size
            exact, nominal = entry.pop("_exact"), entry.pop("_nominal")
            entry["bits_per_weight"] = entry["bytes"] * 8 / weights_in_group if weights_in_group else None
            entry["exact_bits_per_weight"] = _num(exact / weights_in_group) if weights_in_group and exact else None
            entry["nominal_bits_per_weight"] = _num(nominal / weights_in_group) if weights_in_group and nominal else None
        nominal_g128 = [layer.nominal_at(RULE_GROUP_SIZE) for layer in layers]
        return {
            "layers": len(layers),
            "parameters": weights,
            "bytes": stored,
            "bits_per_weight": {
                # weighted by parameters: total bits over total weights
                "measured": stored * 8 / weights if weights else None,
                "exact": _num(sum(layer.exact_bits for layer in exact_layers) / sum(layer.parameters for layer in exact_layers)) if exact_layers else None,
                "format_at_g128": _num(sum(nominal_g128) / weights) if weights and None not in nominal_g128 else None,
                "rule": _num(self.rule_bits_per_weight) if weights else None,
                "unweighted_mean": sum(layer.bits_per_weight for layer in layers) / len(layers) if layers else None,
            },
            "by_scheme": dict(sorted(by_group.items())),
        }

    def to_json(self) -> dict[str, Any]:
        expected_bits = self.rule_bits_per_weight * self.parameters
        lines = [gap.to_json() | {"bits_per_parameter": _num(gap.bits / self.parameters) if self.parameters else None}
                 for gap in self.explanation]
        exact_model_bits = self.file_bytes * 8 - sum(gap.bits for gap in self.explanation if gap.cause in STORAGE_CAUSES)
        return {
            "kind": KIND,
            "schema_version": SCHEMA_VERSION,
            "checkpoint": self.checkpoint,
            "index": self.index,
            "files": self.files,
            "format": vars(self.format),
            "totals": {
                "file_bytes": self.file_bytes,
                "header_bytes": self.header_bytes,
                "tensor_bytes": self.tensor_bytes,
                "parameters": self.parameters,
                "bits_per_parameter": self.file_bytes * 8 / self.parameters if self.parameters else None,
            },
            "categories": self.categories,
            "blocks": self.blocks,
            "outside_blocks": self.outside_blocks,
            "linear_layers": [layer.to_json() for layer in self.linear_layers],
            "quantized_linear": self.quantized_summary(),
            "whole_model": {
                "bits_per_parameter": {
                    "measured": self.file_bytes * 8 / self.parameters if self.parameters else None,
                    "exact": _num(exact_model_bits / self.parameters) if self.parameters else None,
                    "rule": _num(self.rule_bits_per_weight),
                },
            },
            "rule": {"bits_per_weight": _num(self.rule_bits_per_weight), "group_size": RULE_GROUP_SIZE, "source": self.rule_source},
            "baseline_dtype": {"dtype": self.baseline_dtype, "source": self.baseline_dtype_source},
            "explanation": {
                "expected_bytes": _num(expected_bits / 8),
                "measured_bytes": self.file_bytes,
                "gap_bytes": _num((self.file_bytes * 8 - expected_bits) / 8),
                "lines": lines,
                "unexplained_bytes": _num(self.unexplained_bits / 8),
            },
            "baseline": self.baseline,
            "notes": self.notes,
            "wall_seconds": self.wall_seconds,
        }


# Causes that are storage departing from the format (the rest is what the format implies).
STORAGE_CAUSES = frozenset({"wide_scales", "unaccounted_tensors", "missing_tensors", "wider_than_baseline", "tied_lm_head_stored"})


def _num(value: Fraction | float | int | None) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, Fraction):
        return value.numerator if value.denominator == 1 else float(value)
    return value


# --- format detection -------------------------------------------------------------------

def _quantization_config(config: dict[str, Any] | None, quantize_config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    if config:
        for key in ("quantization_config", "compression_config"):
            if isinstance(config.get(key), dict):
                return config[key], f"config.json {key}"
    if quantize_config:
        return quantize_config, "quantize_config.json"
    return None, ""


def _method(qc: dict[str, Any] | None, source: str) -> str | None:
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method is None and source == "quantize_config.json":
        return "gptq"  # AutoGPTQ wrote quantize_config.json without a quant_method
    if method is None and "config_groups" in qc:
        return "compressed-tensors"
    return str(method).lower() if method is not None else None


def _match_target(target: str, module: str) -> bool:
    """compressed-tensors targets: 're:<regex>' (re.match), an exact module name, or a class name.
    Headers carry no class names; 'Linear' (or any '...Linear') names every linear layer."""
    if target.startswith("re:"):
        try:
            return re.match(target[3:], module) is not None
        except re.error:
            return False
    if target == module:
        return True
    return "." not in target and target.endswith("Linear")


@dataclass
class _ConfigSchemes:
    """Resolves the scheme the config gives a module, and which modules it leaves alone."""

    method: str | None
    qc: dict[str, Any] | None
    source: str

    def scheme_for(self, module: str) -> Scheme | None:
        qc = self.qc or {}
        if self.method == "compressed-tensors":
            for pattern in qc.get("ignore") or []:
                if isinstance(pattern, str) and (pattern == module or (pattern.startswith("re:") and _match_target(pattern, module))):
                    return None
            top_format = qc.get("format")
            for group_name, group in sorted((qc.get("config_groups") or {}).items()):
                if not isinstance(group, dict) or not any(_match_target(str(t), module) for t in group.get("targets") or []):
                    continue
                return _ct_scheme(group, top_format, f"{self.source} config_groups.{group_name}")
            return None
        if self.method == "gptq":
            bits = int(qc.get("bits", 4))
            group = int(qc.get("group_size", 128))
            for pattern, override in (qc.get("dynamic") or {}).items():  # GPTQModel per-module overrides
                negative = pattern.startswith("-:")
                regex = pattern[2:] if pattern[:2] in ("+:", "-:") else pattern
                try:
                    if re.match(regex, module):
                        if negative:
                            return None
                        bits = int(override.get("bits", bits))
                        group = int(override.get("group_size", group))
                        break
                except re.error:
                    continue
            return Scheme("gptq", bits, "int", bool(qc.get("sym", True)), "group" if group > 0 else "channel",
                          group if group > 0 else None, g_idx=True, zero_point_bits=bits, source=self.source)
        if self.method == "awq":
            not_converted = qc.get("modules_to_not_convert") or []
            if any(isinstance(name, str) and name in module for name in not_converted):
                return None
            bits = int(qc.get("bits", qc.get("w_bit", 4)))
            group = int(qc.get("group_size", qc.get("q_group_size", 128)))
            version = str(qc.get("version", "gemm")).lower()
            # AutoAWQ's GEMM layer keeps qzeros even without zero_point: they are always stored.
            return Scheme("awq-" + version, bits, "int", not bool(qc.get("zero_point", True)), "group" if group > 0 else "channel",
                          group if group > 0 else None, zero_point_bits=bits, source=self.source)
        return None


def _ct_scheme(group: dict[str, Any], top_format: str | None, source: str) -> Scheme | None:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        return None
    layout = str(group.get("format") or top_format or "pack-quantized")
    bits = int(weights.get("num_bits", 8))
    symmetric = bool(weights.get("symmetric", True))
    strategy = str(weights.get("strategy", "tensor"))
    group_size = weights.get("group_size")
    block = weights.get("block_structure")
    inputs = group.get("input_activations") if isinstance(group.get("input_activations"), dict) else None
    # pack-quantized packs zero points into int32 like the weights (bits each); the others
    # store one zero point per scale in zp_dtype (int8 unless the config says otherwise).
    zero_bits = 0 if symmetric else (bits if layout == "pack-quantized" else _torch_dtype_bits(weights.get("zp_dtype"), 8))
    return Scheme(
        layout=layout, bits=bits, type=str(weights.get("type", "int")), symmetric=symmetric, strategy=strategy,
        group_size=int(group_size) if strategy == "group" and group_size else None,
        block=tuple(block) if strategy == "block" and isinstance(block, list) and len(block) == 2 else None,
        g_idx=strategy == "group" and weights.get("actorder") == "group",
        static_input=bool(inputs) and not inputs.get("dynamic", False),
        zero_point_bits=zero_bits, source=source,
    )


def _torch_dtype_bits(name: Any, default: int) -> int:
    table = {"torch.int8": 8, "torch.uint8": 8, "torch.int32": 32, "torch.bfloat16": 16, "torch.float16": 16, "torch.float32": 32}
    return table.get(str(name), default)


def _role(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    if suffix in SUFFIX_ROLES:
        return module, SUFFIX_ROLES[suffix]
    return module, "other"


def _block_index(module: str) -> int | None:
    match = BLOCK_INDEX.search(module)
    return int(match.group(1)) if match else None


# --- layer geometry and what each format stores -------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _packed_words_bytes(values: int, bits: int) -> int:
    """Bytes of `values` bits-wide integers packed into int32 words."""
    return _ceil_div(values * bits, 32) * 4


def format_bytes(scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int = 2) -> dict[str, int]:
    """What the format stores for one linear layer, by role, with `scale_bytes`-wide scales.

    pack-quantized: weight_packed I32 [out, in*b/32], weight_scale [out, groups],
    weight_zero_point I32 [ceil(out*b/32), groups] if asymmetric, weight_shape I64[2] (16 B),
    weight_g_idx I32 [in] with group activation order. GPTQ: qweight I32 [in*b/32, out],
    qzeros I32 [groups, out*b/32], scales F16 [groups, out], g_idx I32 [in]. AWQ GEMM:
    qweight I32 [in, out*b/32], qzeros, scales as GPTQ, no g_idx (checkpoint-formats.md).
    """
    b, n = scheme.bits, in_features * out_features
    stored: dict[str, int] = {}
    scale_count = _scale_count(scheme, in_features, out_features, groups)
    if scheme.layout == "pack-quantized":
        stored["packed_weight"] = out_features * _packed_words_bytes(in_features, b)
        stored["weight_scale"] = scale_count * scale_bytes
        if not scheme.symmetric:
            stored["weight_zero_point"] = _packed_words_bytes(out_features, b) * (scale_count // out_features if out_features and scale_count >= out_features else 1)
        stored["weight_shape"] = 16
        if scheme.g_idx:
            stored["g_idx"] = in_features * 4
    elif scheme.layout in ("int-quantized", "float-quantized", "naive-quantized"):
        stored["weight"] = n * (1 if scheme.layout != "naive-quantized" else scale_bytes)
        stored["weight_scale"] = scale_count * scale_bytes
        if not scheme.symmetric:
            stored["weight_zero_point"] = scale_count * scheme.zero_point_bits // 8
        if scheme.g_idx:
            stored["g_idx"] = in_features * 4
    elif scheme.layout == "gptq":
        stored["packed_weight"] = _packed_words_bytes(in_features, b) * out_features
        stored["weight_zero_point"] = groups * _packed_words_bytes(out_features, b)  # v1 stores zero - 1, even when symmetric
        stored["weight_scale"] = groups * out_features * 2  # F16 by the format
        stored["g_idx"] = in_features * 4
    elif scheme.layout == "awq-gemm":
        stored["packed_weight"] = in_features * _packed_words_bytes(out_features, b)
        stored["weight_zero_point"] = groups * _packed_words_bytes(out_features, b)
        stored["weight_scale"] = groups * out_features * 2
    else:
        return {}
    if scheme.static_input:
        stored["activation_scale"] = scale_bytes  # one per-tensor input scale
    return stored


def _scale_count(scheme: Scheme, in_features: int, out_features: int, groups: int) -> int:
    if scheme.strategy == "group":
        return out_features * groups
    if scheme.strategy == "channel":
        return out_features
    if scheme.strategy == "block" and scheme.block:
        return _ceil_div(out_features, scheme.block[0]) * _ceil_div(in_features, scheme.block[1])
    return 1  # per tensor: one scalar


def storage_bits(scheme: Scheme) -> int:
    # int-/float-quantized keep one weight a byte whatever num_bits says (I8, F8_E4M3)
    return 8 if scheme.layout in ("int-quantized", "float-quantized") else scheme.bits


def nominal_bits(scheme: Scheme, parameters: int, group_size: int | None) -> Fraction:
    """b*N + (16 + zero-point bits)*N/g: the format's figure without per-layer constants
    (token-cost.md, "Bits per weight on disk"). Non-grouped strategies: b*N."""
    bits = Fraction(storage_bits(scheme))
    if scheme.strategy == "group" and group_size:
        bits += Fraction(NOMINAL_SCALE_BITS + scheme.zero_point_bits, group_size)
    return bits * parameters


def _geometry(scheme: Scheme, roles: dict[str, TensorEntry]) -> tuple[int, int, int] | None:
    """(in_features, out_features, groups) recovered from the shapes of a quantized layer."""
    b = scheme.bits
    if not 1 <= b <= 32:
        return None
    packed, weight, scale = roles.get("packed_weight"), roles.get("weight"), roles.get("weight_scale")
    if scheme.layout == "pack-quantized" and packed is not None and len(packed.shape) == 2:
        out_features, in_features = packed.shape[0], packed.shape[1] * 32 // b  # 32/b weights per int32
    elif scheme.layout == "gptq" and packed is not None and len(packed.shape) == 2:
        g_idx = roles.get("g_idx")
        in_features = g_idx.shape[0] if g_idx is not None and len(g_idx.shape) == 1 else packed.shape[0] * 32 // b
        out_features = packed.shape[1]
    elif scheme.layout.startswith("awq") and packed is not None and len(packed.shape) == 2:
        in_features = packed.shape[0]
        out_features = scale.shape[1] if scale is not None and len(scale.shape) == 2 else packed.shape[1] * 32 // b
    elif weight is not None and len(weight.shape) == 2:
        out_features, in_features = weight.shape
    else:
        return None
    if scale is None or not scale.shape:
        groups = 1
    elif scheme.layout in ("gptq",) or scheme.layout.startswith("awq"):
        groups = scale.shape[0]
    else:
        groups = scale.shape[1] if len(scale.shape) == 2 else 1
    return in_features, out_features, groups


def _infer_scheme(roles: dict[str, TensorEntry], method: str | None) -> Scheme:
    """A scheme from tensor names and shapes alone (no usable quantization config)."""
    packed, weight, scale = roles.get("packed_weight"), roles.get("weight"), roles.get("weight_scale")
    if packed is not None and packed.name.endswith(".weight_packed"):
        return Scheme("pack-quantized", 4, symmetric="weight_zero_point" not in roles,
                      strategy="group" if scale is not None and len(scale.shape) == 2 and scale.shape[1] > 1 else "channel",
                      g_idx="g_idx" in roles, zero_point_bits=0 if "weight_zero_point" not in roles else 4, source="tensor names (4 bits assumed)")
    if packed is not None and scale is not None and len(packed.shape) == 2 and len(scale.shape) == 2:
        if "g_idx" in roles or packed.shape[1] == scale.shape[1] or method == "gptq":
            g_idx = roles.get("g_idx")
            bits = 32 * packed.shape[0] // g_idx.shape[0] if g_idx is not None and g_idx.shape and g_idx.shape[0] else 4
            return Scheme("gptq", bits, g_idx=True, zero_point_bits=bits, source="tensor names (GPTQ layout)")
        bits = 32 * packed.shape[1] // scale.shape[1] if scale.shape[1] else 4
        return Scheme("awq-gemm", bits, symmetric=False, zero_point_bits=bits, source="tensor names (AWQ GEMM layout)")
    if weight is not None and weight.dtype in QUANTIZED_WEIGHT_DTYPES:
        layout = "float-quantized" if weight.dtype.startswith("F") else "int-quantized"
        per_tensor = scale is None or scale.numel == 1
        return Scheme(layout, 8, "float" if layout == "float-quantized" else "int", "weight_zero_point" not in roles,
                      "tensor" if per_tensor else "channel", static_input="activation_scale" in roles,
                      zero_point_bits=0 if "weight_zero_point" not in roles else 8, source="tensor names")
    return Scheme("unknown", 8, source="tensor names (layout not recognised)")


def _observed_group_size(in_features: int, groups: int, configured: int | None) -> int | None:
    if groups <= 0:
        return configured
    if configured and _ceil_div(in_features, configured) == groups:
        return configured
    if in_features % groups == 0:
        return in_features // groups
    return _ceil_div(in_features, groups)


# --- the accounting --------------------------------------------------------------------------

def account(checkpoint: CheckpointFiles, baseline: Measurement | None = None) -> Measurement:
    """Every byte of `checkpoint` by category, per block and per linear layer; bits per weight
    against the format's exact figure and the rule; the gap explained line by line."""
    config = checkpoint.config or {}
    qc, qc_source = _quantization_config(checkpoint.config, checkpoint.quantize_config)
    method = _method(qc, qc_source)
    schemes = _ConfigSchemes(method, qc, qc_source)
    tensors = checkpoint.tensors
    notes: list[str] = []

    modules: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    others: list[TensorEntry] = []
    for name, entry in tensors.items():
        module, role = _role(name)
        if role == "other" or role in modules[module]:
            others.append(entry)
        else:
            modules[module][role] = entry

    tie = config.get("tie_word_embeddings") if isinstance(config.get("tie_word_embeddings"), bool) else None
    baseline_dtype, baseline_source = _baseline_dtype(baseline, config, tensors)
    baseline_bits = Fraction(_dtype_bits(baseline_dtype)) if baseline_dtype else None

    # Tensor -> (category, parameters); layers with their roles.
    assigned: dict[str, tuple[Category, int]] = {}
    layers: list[LinearLayer] = []
    embeddings_stored = any(EMBEDDING_MODULE.search(module) for module in modules)
    tied_duplicates: list[TensorEntry] = []
    in_quantized_layers: set[str] = set()
    for module, roles in sorted(modules.items()):
        is_quantized = "packed_weight" in roles or (
            "weight" in roles and "weight_scale" in roles) or (
            "weight" in roles and roles["weight"].dtype in QUANTIZED_WEIGHT_DTYPES)
        weight = roles.get("weight")
        if is_quantized:
            layer = _quantized_layer(module, roles, schemes, method)
            layers.append(layer)
            # the packed weight carries the layer's parameters; a plain `weight` beside it is a stray
            weight_role = "packed_weight" if "packed_weight" in roles else "weight"
            for role, entry in roles.items():
                if role != "bias":  # a bias stays unquantized: explained with the other unquantized tensors
                    in_quantized_layers.add(entry.name)
                if role == weight_role:
                    category, parameters = Category.quantized_weights, layer.parameters
                elif role == "weight":
                    category, parameters = Category.other, 0
                else:
                    category, parameters = ROLE_CATEGORY.get(role, Category.other), entry.numel if role == "bias" else 0
                assigned[entry.name] = (category, parameters)
            continue
        for role, entry in roles.items():
            if role in ("weight_scale", "activation_scale", "kv_scale", "weight_zero_point", "g_idx", "weight_shape"):
                assigned[entry.name] = (ROLE_CATEGORY[role], 0)
                continue
            if EMBEDDING_MODULE.search(module):
                category = Category.embeddings
            elif LM_HEAD_MODULE.search(module):
                category = Category.lm_head
            elif NORM_MODULE.search(module.rpartition(".")[2]):
                category = Category.norms
            elif role == "bias":
                category = Category.biases
            elif role == "weight" and len(entry.shape) == 2:
                category = Category.unquantized_linear
            else:
                category = Category.other
            parameters = entry.numel
            if category is Category.lm_head and tie and embeddings_stored:
                tied_duplicates.append(entry)
                parameters = 0  # a copy of the embedding: bytes, not parameters
            assigned[entry.name] = (category, parameters)
        if weight is not None and len(weight.shape) == 2 and not EMBEDDING_MODULE.search(module) \
                and not NORM_MODULE.search(module.rpartition(".")[2]):
            out_features, in_features = weight.shape
            layers.append(LinearLayer(
                module, _block_index(module), False, "unquantized", weight.bits, None, None, None, in_features, out_features,
                weight.numel, {role: entry.nbytes for role, entry in roles.items()}, None, None,
            ))
    for entry in others:
        assigned[entry.name] = (Category.other, entry.numel if entry.dtype in FLOATING_DTYPES else 0)

    categories = {category.value: {"bytes": 0, "parameters": 0, "tensors": 0} for category in Category}
    blocks: dict[int, dict[str, Any]] = {}
    outside = _empty_block(None)
    for name, (category, parameters) in assigned.items():
        entry = tensors[name]
        categories[category.value]["bytes"] += entry.nbytes
        categories[category.value]["parameters"] += parameters
        categories[category.value]["tensors"] += 1
        index = _block_index(name)
        target = outside if index is None else blocks.setdefault(index, _empty_block(index))
        target["bytes"][category.value] += entry.nbytes
        target["total_bytes"] += entry.nbytes
        target["parameters"] += parameters

    parameters = sum(value["parameters"] for value in categories.values())
    file_bytes = sum(file.file_bytes for file in checkpoint.files)
    header_bytes = sum(file.header_bytes for file in checkpoint.files)
    quantized = [layer for layer in layers if layer.quantized]
    rule = _rule_for(quantized, baseline_bits)

    explanation = _explain(quantized, assigned, in_quantized_layers, tensors, tied_duplicates, rule, baseline_bits, baseline_dtype, header_bytes)
    unexplained = Fraction(file_bytes * 8) - rule * parameters - sum((gap.bits for gap in explanation), Fraction(0))
    if unexplained:
        explanation.append(Gap("unexplained", unexplained, "bytes no line above accounts for (a bug in measure: please report it)"))

    if tie and any(LM_HEAD_MODULE.search(module) for module in modules) and not embeddings_stored:
        notes.append("tie_word_embeddings is true but only lm_head is stored")
    if tie is None and config:
        notes.append("config.json does not say tie_word_embeddings; a stored lm_head is counted as its own parameters")
    if qc is not None and method not in ("compressed-tensors", "gptq", "awq"):
        notes.append(f"quant_method {method!r} is not one measure knows; layouts were read from tensor names")
    if qc is not None and not quantized:
        notes.append(f"{qc_source} says quant_method {method!r}, but no layer is stored in a quantized layout measure recognises")

    measurement = Measurement(
        checkpoint=str(checkpoint.root),
        files=[{"name": file.path.name, "bytes": file.file_bytes, "header_bytes": file.header_bytes, "tensors": len(file.tensors)}
               for file in checkpoint.files],
        index=checkpoint.index.name if checkpoint.index else None,
        format=_format_info(quantized, method, qc, qc_source, config, tensors),
        file_bytes=file_bytes,
        header_bytes=header_bytes,
        parameters=parameters,
        categories=categories,
        blocks=[blocks[index] for index in sorted(blocks)],
        outside_blocks=outside,
        linear_layers=layers,
        rule_bits_per_weight=rule,
        baseline_dtype=baseline_dtype,
        baseline_dtype_source=baseline_source,
        explanation=explanation,
        unexplained_bits=unexplained,
        notes=notes,
    )
    if baseline is not None:
        measurement.baseline = compare_to_baseline(measurement, baseline)
    return measurement


def _empty_block(index: int | None) -> dict[str, Any]:
    return {"index": index, "bytes": {category.value: 0 for category in Category}, "total_bytes": 0, "parameters": 0}


def _dtype_bits(dtype: str) -> int:
    return DTYPE_BITS[dtype]


def _baseline_dtype(baseline: Measurement | None, config: dict[str, Any], tensors: dict[str, TensorEntry]) -> tuple[str | None, str]:
    """The dtype unquantized tensors should have: the baseline's, else config.json's, else
    the commonest floating dtype among the checkpoint's own unquantized tensors."""
    if baseline is not None and baseline.baseline_dtype:
        return baseline.baseline_dtype, f"the baseline at {baseline.checkpoint}"
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value.replace("torch.", "") in CONFIG_DTYPES:
            return CONFIG_DTYPES[value.replace("torch.", "")], f"config.json {key}"
    counts: Counter[str] = Counter()
    for entry in tensors.values():
        if entry.dtype in ("BF16", "F16", "F32"):
            counts[entry.dtype] += entry.nbytes
    if counts:
        return counts.most_common(1)[0][0], "the commonest floating dtype in the checkpoint"
    return None, "unknown"


def _rule_for(quantized: list[LinearLayer], baseline_bits: Fraction | None) -> Fraction:
    if quantized:
        weights: Counter[int] = Counter()
        for layer in quantized:
            weights[layer.bits or 8] += layer.parameters
        return rule_bits(weights.most_common(1)[0][0])
    return baseline_bits or Fraction(16)


def _configured_scheme(schemes: _ConfigSchemes, module: str) -> Scheme | None:
    """The config's scheme for `module`, with values a hostile or broken config could garble
    (bits, group sizes, block shapes) checked, so they fail as one line, never a traceback."""
    try:
        scheme = schemes.scheme_for(module)
    except (TypeError, ValueError, AttributeError) as error:
        raise InputError(f"{schemes.source}: cannot read the quantization scheme of {module} ({error})") from error
    if scheme is None:
        return None
    if not 1 <= scheme.bits <= 32 or (scheme.group_size is not None and scheme.group_size < 1) or (
            scheme.block is not None and not all(isinstance(side, int) and side >= 1 for side in scheme.block)):
        raise InputError(f"{schemes.source}: invalid quantization scheme for {module} "
                         f"(bits {scheme.bits}, group size {scheme.group_size}, block {scheme.block})")
    return scheme


def _quantized_layer(module: str, roles: dict[str, TensorEntry], schemes: _ConfigSchemes, method: str | None) -> LinearLayer:
    configured = _configured_scheme(schemes, module)
    inferred = _infer_scheme(roles, method)
    scheme = configured if configured is not None and _layout_agrees(configured, inferred) else inferred
    layer_notes = []
    if configured is None and schemes.qc is not None:
        layer_notes.append("quantized, but the quantization config names no scheme for this layer; scheme read from its tensors")
    elif configured is not None and scheme is inferred:
        layer_notes.append(f"the config describes {configured.layout}, the tensors look like {inferred.layout}")
    geometry = _geometry(scheme, roles)
    measured = {role: entry.nbytes for role, entry in roles.items() if role != "bias"}
    if geometry is None or scheme.layout not in KNOWN_LAYOUTS or not geometry[0] or not geometry[1]:
        some = roles.get("packed_weight") or roles.get("weight") or next(iter(roles.values()))
        weight = roles.get("weight")
        out_features, in_features = weight.shape if weight is not None and len(weight.shape) == 2 else (0, 0)
        return LinearLayer(module, _block_index(module), True, scheme.layout, None, None, None, None, in_features, out_features,
                           in_features * out_features, measured, None, None,
                           notes=[*layer_notes, f"layout {scheme.layout!r} not one measure checks ({some.name} {some.dtype} "
                                                f"{list(some.shape)}); bytes counted, no exact figure"])
    in_features, out_features, groups = geometry
    group_size = None
    if scheme.strategy == "group":
        group_size = _observed_group_size(in_features, groups, scheme.group_size)
        if scheme.group_size and group_size != scheme.group_size:
            layer_notes.append(f"config says group size {scheme.group_size}, the scales say {group_size}")
        scheme = Scheme(**{**vars(scheme), "group_size": group_size})
    parameters = in_features * out_features
    expected = format_bytes(scheme, in_features, out_features, groups if scheme.strategy == "group" else 1)
    nominal = nominal_bits(scheme, parameters, group_size)
    gaps = _layer_gaps(module, roles, expected, scheme)
    return LinearLayer(
        module, _block_index(module), True, scheme.layout, scheme.bits, group_size, scheme.symmetric, scheme.strategy,
        in_features, out_features, parameters, measured, Fraction(sum(expected.values()) * 8), nominal, gaps, layer_notes,
        storage_bits=storage_bits(scheme), zero_point_bits=scheme.zero_point_bits if scheme.strategy == "group" else 0,
    )


def _layout_agrees(configured: Scheme, inferred: Scheme) -> bool:
    if inferred.layout == "unknown":
        return True
    if configured.layout == inferred.layout:
        return True
    # int-/float-quantized and naive share the tensor names; GPTQ/AWQ share qweight
    families = ({"int-quantized", "float-quantized", "naive-quantized"}, {"gptq", "awq-gemm", "awq-gemv"})
    return any(configured.layout in family and inferred.layout in family for family in families)


def _layer_gaps(module: str, roles: dict[str, TensorEntry], expected: dict[str, int], scheme: Scheme) -> list[Gap]:
    """Measured minus exact, by role: each difference named by its cause."""
    gaps: list[Gap] = []
    for role in sorted(set(expected) | {role for role in roles if role != "bias"}):
        stored = roles.get(role)
        stored_bytes = stored.nbytes if stored is not None else 0
        want = expected.get(role)
        if want is None:
            gaps.append(Gap("unaccounted_tensors", Fraction(stored_bytes * 8), f"{stored.name} ({stored.dtype} {list(stored.shape)}) is not part of the {scheme.layout} format", role))
            continue
        if stored is None:
            gaps.append(Gap("missing_tensors", Fraction(-want * 8), f"the {scheme.layout} format stores a {role} for {_short_name(module)}; the checkpoint does not", role))
            continue
        difference = stored_bytes - want
        if not difference:
            continue
        if role in ("weight_scale", "activation_scale") and stored.bits > NOMINAL_SCALE_BITS:
            wide = stored.numel * (stored.bits - NOMINAL_SCALE_BITS) // 8
            gaps.append(Gap("wide_scales", Fraction(wide * 8), f"{stored.name} is {stored.dtype}, {stored.bits} bits a scale where the format's figure assumes 16", role))
            difference -= wide
        if difference:
            gaps.append(Gap("unaccounted_tensors", Fraction(difference * 8),
                            f"{stored.name} ({stored.dtype} {list(stored.shape)}) is {stored_bytes} bytes, the format implies {want}", role))
    return gaps


def _explain(quantized: list[LinearLayer], assigned: dict[str, tuple[Category, int]], in_quantized_layers: set[str], tensors: dict[str, TensorEntry],
             tied_duplicates: list[TensorEntry], rule: Fraction, baseline_bits: Fraction | None,
             baseline_dtype: str | None, header_bytes: int) -> list[Gap]:
    """File bytes minus the rule's (rule x parameters), split into causes that sum exactly."""
    lines: list[Gap] = []
    rule_text = f"{float(rule):g}"

    # 1. the format's own figure at group 128 against the rule's estimate
    by_scheme: dict[tuple[Any, ...], list[LinearLayer]] = defaultdict(list)
    for layer in quantized:
        by_scheme[(layer.layout, layer.bits, layer.strategy, layer.symmetric)].append(layer)
    for (layout, bits, strategy, symmetric), group in sorted(by_scheme.items(), key=str):
        known = [layer for layer in group if layer.nominal_bits is not None]
        if known:
            at_128 = sum((layer.nominal_at(RULE_GROUP_SIZE) for layer in known), Fraction(0))
            weights = sum(layer.parameters for layer in known)
            figure = at_128 / weights
            where = f"at group size {RULE_GROUP_SIZE} " if strategy == "group" else f"per {strategy} "
            lines.append(Gap("format_vs_rule", at_128 - rule * weights,
                             f"{len(known)} {layout} {bits}-bit {'symmetric' if symmetric else 'asymmetric'} layers: the format {where}is "
                             f"{float(figure):.4g} bits/weight, the rule says {rule_text} ({weights:,} weights)"))
        unknown = [layer for layer in group if layer.nominal_bits is None]
        if unknown:
            stored = sum(layer.bytes for layer in unknown)
            lines.append(Gap("unknown_format_layers", Fraction(stored * 8) - rule * sum(layer.parameters for layer in unknown),
                             f"{len(unknown)} quantized layers in a layout measure cannot check ({unknown[0].name}, ...)"))

    # 2. layers that got another group size than 128
    by_size: dict[int, list[LinearLayer]] = defaultdict(list)
    for layer in quantized:
        if layer.strategy == "group" and layer.group_size and layer.group_size != RULE_GROUP_SIZE and layer.nominal_bits is not None:
            by_size[layer.group_size].append(layer)
    for size, group in sorted(by_size.items()):
        extra = sum((layer.nominal_bits - layer.nominal_at(RULE_GROUP_SIZE) for layer in group), Fraction(0))
        weights = sum(layer.parameters for layer in group)
        lines.append(Gap("other_group_size", extra,
                         f"{len(group)} layers got group size {size}, not {RULE_GROUP_SIZE} ({_examples(group)}): "
                         f"{float(extra / weights):+.4g} bits/weight on {weights:,} weights"))

    # 3. what the format stores beyond its nominal figure; 4. storage departing from the format
    extras: dict[str, Fraction] = defaultdict(Fraction)
    storage: dict[str, list[Gap]] = defaultdict(list)
    for layer in quantized:
        if layer.exact_bits is None or layer.nominal_bits is None:
            continue
        measured_minus_exact = sum((gap.bits for gap in layer.gaps), Fraction(0))
        by_role = _extras_by_role(layer)
        for cause, bits in by_role.items():
            extras[cause] += bits
        for gap in layer.gaps:
            storage[gap.cause].append(gap)
        residual = Fraction(layer.bytes * 8) - layer.exact_bits - measured_minus_exact
        if residual:  # cannot happen: the layer's gaps are measured minus exact by role
            extras["partial_groups"] += residual
    extra_text = {
        "shape_metadata": "weight_shape, I64[2] = 16 bytes a packed layer",
        "g_idx": "g_idx, one I32 per input column",
        "activation_scales": "static activation (input) scales",
        "channel_scales": "per-channel or per-tensor weight scales (and zero points)",
        "partial_groups": "scales and zero points of partial groups, packing to whole int32 words",
    }
    for cause in ("channel_scales", "g_idx", "shape_metadata", "activation_scales", "partial_groups"):
        if extras.get(cause):
            lines.append(Gap(cause, extras[cause], extra_text[cause]))
    for cause in ("wide_scales", "unaccounted_tensors", "missing_tensors"):
        gaps = storage.get(cause)
        if gaps:
            total = sum((gap.bits for gap in gaps), Fraction(0))
            first = gaps[0].detail
            more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
            lines.append(Gap(cause, total, f"{first}{more}"))

    # 5. unquantized tensors at the baseline's width against the rule; 6. wider than that
    wider: list[TensorEntry] = []
    wider_bits = Fraction(0)
    per_category: dict[Category, list[Fraction]] = defaultdict(lambda: [Fraction(0), Fraction(0), Fraction(0)])
    duplicate_names = {entry.name for entry in tied_duplicates}
    loose: dict[str, list[TensorEntry]] = defaultdict(list)
    for name, (category, parameters) in assigned.items():
        if name in in_quantized_layers or name in duplicate_names:
            continue
        entry = tensors[name]
        if category in (Category.scales, Category.zero_points, Category.g_idx, Category.shape_metadata):
            # quantization tensors outside any quantized layer: KV-cache scales, or strays
            loose["kv_cache_scales" if _role(name)[1] == "kv_scale" else "unaccounted_tensors"].append(entry)
            continue
        width = Fraction(entry.bits)
        if baseline_bits is not None and entry.dtype in FLOATING_DTYPES and width > baseline_bits:
            wider.append(entry)
            wider_bits += (width - baseline_bits) * entry.numel
            width = baseline_bits
        totals = per_category[category]
        totals[0] += width * entry.numel - rule * parameters
        totals[1] += parameters
        totals[2] += 1
    for category, (bits, parameters, count) in sorted(per_category.items(), key=lambda item: item[0].value):
        if not bits:
            continue
        width_text = f"stored at {baseline_dtype}" if baseline_dtype else "stored unquantized"
        lines.append(Gap(f"unquantized_{category.value}", bits,
                         f"{category.value.replace('_', ' ')}: {int(count)} tensor{'s' if count != 1 else ''}, {int(parameters):,} parameters, "
                         f"{width_text}, not at the rule's {rule_text} bits"))
    for cause, entries in sorted(loose.items()):
        what = "KV-cache quantization scales (k_scale, v_scale)" if cause == "kv_cache_scales" else \
            f"quantization tensors outside any quantized layer ({_examples(entries)})"
        lines.append(Gap(cause, Fraction(sum(entry.nbytes for entry in entries) * 8), f"{len(entries)} {what}"))
    if wider:
        dtypes = sorted({entry.dtype for entry in wider})
        lines.append(Gap("wider_than_baseline", wider_bits,
                         f"{len(wider)} unquantized tensors stored as {'/'.join(dtypes)}, wider than the baseline's {baseline_dtype} "
                         f"({_examples(wider)})"))

    # 7. an lm_head stored although tie_word_embeddings is true
    if tied_duplicates:
        stored = sum(entry.nbytes for entry in tied_duplicates)
        lines.append(Gap("tied_lm_head_stored", Fraction(stored * 8),
                         f"{tied_duplicates[0].name} is stored although tie_word_embeddings is true: a duplicate of the embedding"))

    # 8. the headers themselves
    lines = [line for line in lines if line.bits]
    lines.append(Gap("header", Fraction(header_bytes * 8), "safetensors headers (8-byte length and JSON) of every file"))
    return lines


def _extras_by_role(layer: LinearLayer) -> dict[str, Fraction]:
    """Exact minus nominal bits of a quantized layer, split by the role that causes it. The
    nominal figure is b*N for the weights and (16 + zp)*N/g for scales and zero points (0 for
    non-grouped strategies), so the parts always sum to exact - nominal."""
    extras: dict[str, Fraction] = defaultdict(Fraction)
    exact = _exact_roles(layer)
    n = layer.parameters
    weight_bits = Fraction(layer.storage_bits or 8) * n
    grouped = layer.strategy == "group" and bool(layer.group_size)
    scale_nominal = Fraction(NOMINAL_SCALE_BITS * n, layer.group_size) if grouped else Fraction(0)
    zero_nominal = layer.nominal_bits - weight_bits - scale_nominal if grouped and layer.nominal_bits is not None else Fraction(0)
    extras["partial_groups"] += exact.pop("packed_weight", 0) + exact.pop("weight", 0) - weight_bits
    scales = exact.pop("weight_scale", 0) - scale_nominal + exact.pop("weight_zero_point", 0) - zero_nominal
    extras["partial_groups" if grouped else "channel_scales"] += scales
    for role, bits in exact.items():
        extras[{"weight_shape": "shape_metadata", "g_idx": "g_idx"}.get(role, "activation_scales")] += bits
    return extras


def _exact_roles(layer: LinearLayer) -> dict[str, Fraction]:
    """The exact per-role bits of a quantized layer: measured minus its gaps, by role."""
    exact = {role: Fraction(nbytes * 8) for role, nbytes in layer.bytes_by_role.items()}
    for gap in layer.gaps:
        role = gap.role or "other"
        exact[role] = exact.get(role, Fraction(0)) - gap.bits
    return exact


def _examples(items: list[Any], limit: int = 2) -> str:
    names = sorted({_short_name(getattr(item, "name", str(item))) for item in items})
    shown = ", ".join(names[:limit])
    return shown + (", ..." if len(names) > limit else "")


def _short_name(name: str) -> str:
    # "model.layers.3.self_attn.q_proj" -> "self_attn.q_proj": the role within a block
    match = re.search(r"\.\d+\.(.+)$", name)
    return match.group(1) if match else name


def _format_info(quantized: list[LinearLayer], method: str | None, qc: dict[str, Any] | None, qc_source: str,
                 config: dict[str, Any], tensors: dict[str, TensorEntry]) -> FormatInfo:
    tie = config.get("tie_word_embeddings") if isinstance(config.get("tie_word_embeddings"), bool) else None
    config_dtype = next((str(config[key]) for key in ("torch_dtype", "dtype") if isinstance(config.get(key), str)), None)
    if not quantized:
        counts: Counter[str] = Counter()
        for entry in tensors.values():
            counts[entry.dtype] += entry.nbytes
        dtype = counts.most_common(1)[0][0] if counts else "unknown"
        source = f"{qc_source} (quant_method {method})" if qc else "tensor dtypes (no quantization config)"
        return FormatInfo("dense", dtype.lower(), f"unquantized {dtype}", source, method, None, None, tie, config_dtype)
    layouts = Counter(layer.layout for layer in quantized)
    layout = layouts.most_common(1)[0][0]
    family = {"pack-quantized": "compressed-tensors", "int-quantized": "compressed-tensors", "float-quantized": "compressed-tensors",
              "naive-quantized": "compressed-tensors", "gptq": "gptq"}.get(layout, "awq" if layout.startswith("awq") else "unknown")
    bits = sorted({layer.bits for layer in quantized if layer.bits})
    groups = sorted({layer.group_size for layer in quantized if layer.group_size})
    strategies = sorted({layer.strategy for layer in quantized if layer.strategy})
    symmetric = sorted({layer.symmetric for layer in quantized if layer.symmetric is not None})
    kind = "FP" if layout == "float-quantized" else "INT"
    name = f"{family} {layout} {kind}{'/'.join(map(str, bits))}"
    name += f" {'symmetric' if symmetric == [True] else 'asymmetric' if symmetric == [False] else 'mixed symmetry'}"
    name += f", group size {'/'.join(map(str, groups))}" if groups else f", per {'/'.join(strategies)}"
    activations = None
    if method == "compressed-tensors" and qc:
        for group in (qc.get("config_groups") or {}).values():
            if isinstance(group, dict) and isinstance(group.get("input_activations"), dict):
                activations = {key: group["input_activations"].get(key) for key in ("num_bits", "type", "strategy", "dynamic", "symmetric")}
                name += f", {activations['type']}{activations['num_bits']} {'dynamic' if activations['dynamic'] else 'static'} activations"
                break
    detected = f"{qc_source} (quant_method {method}) and tensor names" if qc else "tensor names (no quantization config)"
    weights = {"bits": bits, "group_sizes": groups, "strategies": strategies, "symmetric": symmetric[0] if len(symmetric) == 1 else None}
    return FormatInfo(family, layout, name, detected, method, weights, activations, tie, config_dtype)


def compare_to_baseline(measurement: Measurement, baseline: Measurement) -> dict[str, Any]:
    """Bytes against the baseline's: the whole checkpoint, and the linear layers alone."""
    linear, baseline_linear = measurement.linear_bytes, baseline.linear_bytes
    result = {
        "checkpoint": baseline.checkpoint,
        "dtype": baseline.baseline_dtype,
        "file_bytes": baseline.file_bytes,
        "tensor_bytes": baseline.tensor_bytes,
        "parameters": baseline.parameters,
        "linear_bytes": baseline_linear,
        "checkpoint_linear_bytes": linear,
        "ratio_total": measurement.file_bytes / baseline.file_bytes if baseline.file_bytes else None,
        "ratio_linear": linear / baseline_linear if baseline_linear else None,
        "parameters_match": baseline.parameters == measurement.parameters,
    }
    if not result["parameters_match"]:
        measurement.notes.append(f"the baseline has {baseline.parameters:,} parameters, this checkpoint {measurement.parameters:,}")
    return result


def measure(checkpoint: str | Path, baseline: str | Path | None = None) -> Measurement:
    """Read the headers of `checkpoint` (and `baseline`) and account for every byte.

    Reads the 8-byte length and the JSON header of each safetensors file plus config.json,
    never tensor data, so any size is measured in milliseconds.
    """
    started = time.perf_counter()
    base = account(read_checkpoint(Path(baseline))) if baseline is not None else None
    measurement = account(read_checkpoint(Path(checkpoint)), base)
    measurement.wall_seconds = round(time.perf_counter() - started, 6)
    return measurement


# --- presentation (rich), kept apart from the math ------------------------------------------

def render(measurement: Measurement) -> list[Any]:
    """Rich renderables for the terminal: format, categories, layers by scheme, the gap."""
    from rich.table import Table

    data = measurement.to_json()
    out: list[Any] = [f"[bold]{data['checkpoint']}[/]: {data['format']['name']}",
                      f"  detected from {data['format']['detected_from']}",
                      f"  {len(data['files'])} file(s), {data['totals']['file_bytes']:,} bytes, {data['totals']['parameters']:,} parameters, "
                      f"{_fmt(data['totals']['bits_per_parameter'])} bits/parameter"]
    categories = Table(title="bytes by category", title_justify="left")
    for column in ("category", "bytes", "share", "parameters", "tensors"):
        categories.add_column(column, justify="left" if column == "category" else "right")
    total = data["totals"]["file_bytes"] or 1
    for name, value in data["categories"].items():
        if value["bytes"] or value["tensors"]:
            categories.add_row(name, f"{value['bytes']:,}", f"{value['bytes'] / total:.2%}", f"{value['parameters']:,}", str(value["tensors"]))
    categories.add_row("header", f"{data['totals']['header_bytes']:,}", f"{data['totals']['header_bytes'] / total:.2%}", "", str(len(data["files"])))
    categories.add_row("[bold]total[/]", f"[bold]{total:,}[/]", "100%", f"{data['totals']['parameters']:,}", "")
    out.append(categories)
    summary = data["quantized_linear"]
    if summary["layers"]:
        schemes = Table(title="quantized linear layers (bits per weight)", title_justify="left")
        for column in ("scheme", "layers", "weights", "measured", "exact (format)", "nominal"):
            schemes.add_column(column, justify="left" if column == "scheme" else "right")
        for key, entry in summary["by_scheme"].items():
            schemes.add_row(key, str(entry["layers"]), f"{entry['parameters']:,}", _fmt(entry["bits_per_weight"]),
                            _fmt(entry["exact_bits_per_weight"]), _fmt(entry["nominal_bits_per_weight"]))
        bpw = summary["bits_per_weight"]
        schemes.add_row("[bold]all (weighted mean)[/]", str(summary["layers"]), f"{summary['parameters']:,}", _fmt(bpw["measured"]),
                        _fmt(bpw["exact"]), _fmt(bpw["format_at_g128"]) + " at g128")
        out.append(schemes)
        out.append(f"  rule: {_fmt(bpw['rule'])} bits/weight ({data['rule']['source']})")
    figures = data["whole_model"]["bits_per_parameter"]
    out.append(f"  whole model: {_fmt(figures['measured'])} bits/parameter measured, {_fmt(figures['exact'])} as the format implies, "
               f"{_fmt(figures['rule'])} by the rule")
    explanation = data["explanation"]
    gap = Table(title=f"why {total:,} bytes, not the rule's {explanation['expected_bytes']:,.0f}", title_justify="left")
    for column in ("cause", "bytes", "bits/param", "detail"):
        gap.add_column(column, justify="right" if column in ("bytes", "bits/param") else "left", overflow="fold")
    for line in explanation["lines"]:
        gap.add_row(line["cause"], f"{line['bytes']:+,.1f}", f"{line['bits_per_parameter']:+.4f}" if line["bits_per_parameter"] is not None else "", line["detail"])
    gap.add_row("[bold]gap[/]", f"[bold]{explanation['gap_bytes']:+,.1f}[/]", "", "")
    out.append(gap)
    if data["baseline"]:
        base = data["baseline"]
        out.append(f"  against the baseline ({base['dtype']}, {base['file_bytes']:,} bytes): {base['ratio_total']:.4f} of its bytes in all, "
                   f"{base['ratio_linear']:.4f} for the linear layers alone")
    for note in data["notes"]:
        out.append(f"  note: {note}")
    return out


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"
