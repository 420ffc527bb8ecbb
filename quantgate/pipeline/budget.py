"""What a format's checkpoint of the baseline will weigh, predicted before any quantization from
the baseline's safetensors headers (its linear layers' shapes) and the storage layouts of
`quantize.measure.layouts`: how a search's byte ceiling is checked before any work. The search
itself allocates with the exact bytes its uniform checkpoints measure, not with these."""

from __future__ import annotations

import re
from pathlib import Path

from quantgate.quantize.config import QuantizeConfig
from quantgate.quantize.groups import effective_group_size
from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.layouts import Scheme, ceil_div, expected_bytes
from quantgate.quantize.presets import get_preset


def ignored(name: str, ignore: tuple[str, ...]) -> bool:
    """Whether `ignore` (module names, or 're:' regexes as compressed-tensors takes them) names `name`."""
    for pattern in ignore:
        if pattern.startswith("re:") and re.match(pattern[3:], name):
            return True
        if name == pattern or name.endswith(f".{pattern}"):
            return True
    return False


def _scheme(cfg: QuantizeConfig, in_features: int) -> Scheme | None:
    preset = get_preset(cfg.format)
    weights, _ = preset.args(dynamic=cfg.fp8_dynamic)
    group_size = effective_group_size(in_features, cfg.group_size) if preset.grouped else None
    if preset.grouped and group_size is None:
        return None  # left unquantized
    activations = preset.input_activations or {}
    symmetric = bool(weights.get("symmetric", True))
    # the layout compressed-tensors stores the format in (the registry's entry)
    return Scheme(layout=preset.layout, bits=int(weights["num_bits"]), type=weights["type"],
                  symmetric=symmetric, strategy=weights["strategy"], group_size=group_size,
                  static_input=bool(activations) and not activations.get("dynamic", False) and not cfg.fp8_dynamic,
                  zero_point_bits=0 if symmetric else int(weights["num_bits"]))


def predicted_bytes(model_dir: Path, cfg: QuantizeConfig) -> tuple[int, int]:
    """(the tensor bytes of `cfg`'s uniform checkpoint of the baseline, the baseline's own)."""
    baseline = measure(model_dir)
    scale_bytes = 4 if baseline.baseline_dtype == "F32" else 2  # scales are stored in the baseline's dtype
    total = baseline.tensor_bytes
    for layer in baseline.linear_layers:
        scheme = None if ignored(layer.name, cfg.ignore) else _scheme(cfg, layer.in_features)
        if scheme is None:
            continue
        groups = ceil_div(layer.in_features, scheme.group_size) if scheme.strategy == "group" and scheme.group_size else 1
        stored = expected_bytes(scheme, layer.in_features, layer.out_features, groups, scale_bytes)
        # the layouts store the weight side; a bias stays as it is
        total += sum(stored.values()) - sum(size for role, size in layer.bytes_by_role.items() if role != "bias")
    return total, baseline.tensor_bytes
