"""Which group size each linear layer gets. Pure functions on names and widths.

llmcompressor refuses a group-quantized layer whose input width is not a multiple of the
group size (SmolLM2's hidden size 576 is not a multiple of 128). Such a layer gets the
largest of 128, 64, 32 (no larger than requested) that divides its width, the sizes serving
kernels accept, or stays unquantized when none does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FALLBACK_GROUP_SIZES = (128, 64, 32)


def effective_group_size(in_features: int, requested: int) -> int | None:
    for size in (requested, *(g for g in FALLBACK_GROUP_SIZES if g < requested)):
        if in_features % size == 0:
            return size
    return None


@dataclass(frozen=True)
class LayerPlan:
    name: str
    in_features: int
    group_size: int | None  # None: left unquantized


@dataclass(frozen=True)
class GroupPlan:
    requested: int
    layers: tuple[LayerPlan, ...]

    @property
    def fallbacks(self) -> list[dict[str, object]]:
        """Every layer that did not get the requested group size, for the manifest."""
        return [
            {"layer": layer.name, "in_features": layer.in_features, "requested": self.requested,
             "group_size": layer.group_size, "quantized": layer.group_size is not None}
            for layer in self.layers
            if layer.group_size != self.requested
        ]

    @property
    def unquantized(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.group_size is None]

    def targets_by_group_size(self) -> dict[int, list[str]]:
        """compressed-tensors targets per group size: one regex per layer suffix when every
        layer with that suffix (q_proj, down_proj, ...) gets the same size, else exact names."""
        by_suffix: dict[str, set[int | None]] = {}
        for layer in self.layers:
            by_suffix.setdefault(_suffix(layer.name), set()).add(layer.group_size)
        targets: dict[int, list[str]] = {}
        for layer in self.layers:
            if layer.group_size is None:
                continue
            suffix = _suffix(layer.name)
            if len(by_suffix[suffix]) == 1:
                pattern = f"re:.*{re.escape(suffix)}$" if suffix != layer.name else f"re:^{re.escape(suffix)}$"
            else:
                pattern = f"re:^{re.escape(layer.name)}$"
            if pattern not in targets.setdefault(layer.group_size, []):
                targets[layer.group_size].append(pattern)
        return dict(sorted(targets.items(), reverse=True))


def _suffix(name: str) -> str:
    # "model.layers.3.mlp.down_proj" -> ".mlp.down_proj": the layer's role within a block.
    match = re.search(r"\.\d+(\..+)$", name)
    return match.group(1) if match else name


def plan_group_sizes(layers: list[tuple[str, int]], requested: int) -> GroupPlan:
    """`layers`: (module name, input width) of every linear layer to be quantized."""
    return GroupPlan(requested, tuple(LayerPlan(name, width, effective_group_size(width, requested)) for name, width in layers))
