"""Which linear layers share one quantization scheme because the serving kernels fuse them.

vLLM loads q_proj, k_proj and v_proj into one `qkv_proj` matmul, and gate_proj and up_proj into
one `gate_up_proj` (its Llama-family models' `packed_modules_mapping`); a fused matmul has one
scheme, so a mixed-precision checkpoint whose q_proj is INT4 and whose k_proj is INT8 would not
load there. A mixture of experts' routed experts are one FusedMoE layer there, with one scheme for
them all. The per-layer sensitivity and the allocation therefore work on *layer groups*: a fused
set, a block's experts, or a layer alone. Pure functions on module names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# fused name -> the layer suffixes that vLLM packs into it (docs/search.md, "Layer groups")
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# container module -> the layer names each of its numbered experts holds: vLLM loads a block's
# routed experts into one FusedMoE layer (w13: every expert's gate and up projection, w2: every
# down projection), one scheme for all (Qwen2-MoE, OLMoE: gate/up/down_proj; Mixtral: w1/w3/w2)
EXPERTS: dict[str, tuple[str, ...]] = {"experts": ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")}
_BLOCK = re.compile(r"^(?P<prefix>.*?)\.(?P<index>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(rf"^(?P<container>(?:.+\.)?(?P<kind>{'|'.join(map(re.escape, EXPERTS))}))\.\d+\.(?P<leaf>[^.]+)$")


@dataclass(frozen=True)
class LayerGroup:
    """One unit of the allocation: `layers` (module names, model order) share a scheme."""

    name: str  # "model.layers.3.self_attn.qkv_proj", or the layer's own name
    block: int | None  # the decoder block's index, None outside the blocks
    role: str  # "self_attn.qkv_proj", "mlp.down_proj": the group's place within a block
    layers: tuple[str, ...]


def _parts(name: str) -> tuple[str, int | None, str]:
    """(module path without its last part, block index, role within the block)."""
    match = _BLOCK.match(name)
    if match is None:
        return name.rsplit(".", 1)[0] if "." in name else "", None, name
    return f"{match['prefix']}.{match['index']}", int(match["index"]), match["rest"]


def layer_groups(names: list[str]) -> list[LayerGroup]:
    """The linear layers `names` as groups: the experts of one container are one group named
    after it; each complete fused set (all of its members present under one parent module) is one
    group named after the fused matmul; every other layer is a group of its own. Ordered by
    block, then by the first member's position in `names`."""
    parent_of = {name: name.rsplit(".", 1)[0] if "." in name else "" for name in names}
    leaf = {name: name.rsplit(".", 1)[-1] for name in names}
    grouped: set[str] = set()
    groups: list[tuple[int, LayerGroup]] = []
    experts: dict[str, list[str]] = {}
    for name in names:
        match = _EXPERT.match(name)
        if match and match["leaf"] in EXPERTS[match["kind"]]:
            experts.setdefault(match["container"], []).append(name)
    for container, expert_layers in experts.items():
        _, block, role = _parts(container)
        groups.append((names.index(expert_layers[0]), LayerGroup(container, block, role, tuple(expert_layers))))
        grouped.update(expert_layers)
    for fused, members in FUSED.items():
        for parent in dict.fromkeys(parent_of[name] for name in names if leaf[name] in members and name not in grouped):
            present = [f"{parent}.{member}" if parent else member for member in members]
            if all(member in parent_of for member in present):
                first = min(names.index(member) for member in present)
                name = f"{parent}.{fused}" if parent else fused
                _, block, role = _parts(name)
                groups.append((first, LayerGroup(name, block, role, tuple(sorted(present, key=names.index)))))
                grouped.update(present)
    for position, name in enumerate(names):
        if name not in grouped:
            _, block, role = _parts(name)
            groups.append((position, LayerGroup(name, block, role, (name,))))
    groups.sort(key=lambda pair: (pair[1].block if pair[1].block is not None else -1, pair[0]))
    return [group for _, group in groups]
