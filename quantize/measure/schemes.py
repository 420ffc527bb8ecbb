"""A checkpoint's quantization config read as schemes: which config it has (config.json's
quantization_config, or AutoGPTQ's quantize_config.json), and the scheme it gives each module.

compressed-tensors `config_groups` targets and `ignore`, GPTQModel `dynamic` overrides and
AutoAWQ's `modules_to_not_convert` are honoured (docs/sources.md, "Checkpoint layouts").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantgate.core.errors import InputError
from quantgate.core.hf_config import ConfigGroup, ModelConfig, QuantizationConfig
from quantgate.quantize.measure.layouts import Scheme, find_layout

KNOWN_METHODS = ("compressed-tensors", "gptq", "awq")


def quantization_config(config: ModelConfig | None, quantize_config: QuantizationConfig | None) -> tuple[QuantizationConfig | None, str]:
    """(the quantization config, where it was found)."""
    if config:
        for key, found in (("quantization_config", config.get("quantization_config")),
                           ("compression_config", config.get("compression_config"))):
            if isinstance(found, dict):
                return found, f"config.json {key}"
    if quantize_config:
        return quantize_config, "quantize_config.json"
    return None, ""


def quant_method(qc: QuantizationConfig | None, source: str) -> str | None:
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


@dataclass(frozen=True)
class ConfigSchemes:
    """A checkpoint's quantization config: resolves the scheme it gives a module, and which
    modules it leaves alone."""

    method: str | None
    qc: QuantizationConfig | None
    source: str

    @classmethod
    def of(cls, config: ModelConfig | None, quantize_config: QuantizationConfig | None) -> ConfigSchemes:
        qc, source = quantization_config(config, quantize_config)
        return cls(quant_method(qc, source), qc, source)

    def scheme_for(self, module: str) -> Scheme | None:
        qc = self.qc or {}
        if self.method == "compressed-tensors":
            return _compressed_tensors_scheme(qc, module, self.source)
        if self.method == "gptq":
            return _gptq_scheme(qc, module, self.source)
        if self.method == "awq":
            return _awq_scheme(qc, module, self.source)
        return None

    def configured(self, module: str) -> Scheme | None:
        """The config's scheme for `module`, with values a hostile or broken config could garble
        (bits, group sizes, block shapes) checked, so they fail as one line, never a traceback."""
        try:
            scheme = self.scheme_for(module)
        except (TypeError, ValueError, AttributeError) as error:
            raise InputError(f"{self.source}: cannot read the quantization scheme of {module} ({error})") from error
        if scheme is None:
            return None
        if not 1 <= scheme.bits <= 32 or (scheme.group_size is not None and scheme.group_size < 1) or (
                scheme.block is not None and not all(isinstance(side, int) and side >= 1 for side in scheme.block)):
            raise InputError(f"{self.source}: invalid quantization scheme for {module} "
                             f"(bits {scheme.bits}, group size {scheme.group_size}, block {scheme.block})")
        return scheme


def _compressed_tensors_scheme(qc: QuantizationConfig, module: str, source: str) -> Scheme | None:
    for pattern in qc.get("ignore") or []:
        if isinstance(pattern, str) and (pattern == module or (pattern.startswith("re:") and _match_target(pattern, module))):
            return None
    top_format = qc.get("format")
    for group_name, group in sorted((qc.get("config_groups") or {}).items()):
        if not isinstance(group, dict) or not any(_match_target(str(target), module) for target in group.get("targets") or []):
            continue
        return _config_group_scheme(group, top_format, f"{source} config_groups.{group_name}")
    return None


def _config_group_scheme(group: ConfigGroup, top_format: str | None, source: str) -> Scheme | None:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        return None
    layout = str(group.get("format") or top_format or "pack-quantized")
    bits = int(weights.get("num_bits", 8))
    symmetric = bool(weights.get("symmetric", True))
    strategy = str(weights.get("strategy", "tensor"))
    group_size = weights.get("group_size")
    block = weights.get("block_structure")
    stated = group.get("input_activations")
    inputs = stated if isinstance(stated, dict) else {}
    # pack-quantized packs zero points into int32 like the weights (bits each); the others
    # store one zero point per scale in zp_dtype (int8 unless the config says otherwise).
    known = find_layout(layout)
    packs_zero_points = known is not None and known.packs_zero_points
    zero_bits = 0 if symmetric else (bits if packs_zero_points else _torch_dtype_bits(weights.get("zp_dtype"), 8))
    return Scheme(
        layout=layout, bits=bits, type=str(weights.get("type", "int")), symmetric=symmetric, strategy=strategy,
        group_size=int(group_size) if strategy == "group" and group_size else None,
        block=(block[0], block[1]) if strategy == "block" and isinstance(block, list) and len(block) == 2 else None,
        g_idx=strategy == "group" and weights.get("actorder") == "group",
        static_input=bool(inputs) and not inputs.get("dynamic", False),
        zero_point_bits=zero_bits, source=source,
    )


def _torch_dtype_bits(name: object, default: int) -> int:
    table = {"torch.int8": 8, "torch.uint8": 8, "torch.int32": 32, "torch.bfloat16": 16, "torch.float16": 16, "torch.float32": 32}
    return table.get(str(name), default)


def _gptq_scheme(qc: QuantizationConfig, module: str, source: str) -> Scheme | None:
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
    return Scheme(layout="gptq", bits=bits, type="int", symmetric=bool(qc.get("sym", True)),
                  strategy="group" if group > 0 else "channel", group_size=group if group > 0 else None,
                  g_idx=True, zero_point_bits=bits, source=source)


def _awq_scheme(qc: QuantizationConfig, module: str, source: str) -> Scheme | None:
    not_converted = qc.get("modules_to_not_convert") or []
    if any(isinstance(name, str) and name in module for name in not_converted):
        return None
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    # AutoAWQ's GEMM layer keeps qzeros even without zero_point: they are always stored.
    return Scheme(layout="awq-" + version, bits=bits, type="int", symmetric=not bool(qc.get("zero_point", True)),
                  strategy="group" if group > 0 else "channel", group_size=group if group > 0 else None,
                  zero_point_bits=bits, source=source)
