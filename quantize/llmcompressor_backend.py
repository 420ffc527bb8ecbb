"""The llmcompressor adapter: a preset, a config and a group-size plan become modifiers,
and `oneshot` runs them on the CPU or an accelerator. Nothing else in quantgate imports
llmcompressor."""

from __future__ import annotations

# llmcompressor, compressed_tensors and torch are imported where used: they take seconds to
# import, and building the group-size plan or `quantgate --help` needs none of them.
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quantgate.core.errors import InputError
from quantgate.core.formats import ALGORITHMS, Step
from quantgate.core.hf_config import QuantizationArgs as QuantizationArgsJSON
from quantgate.quantize.checkpoint import LayerFormat
from quantgate.quantize.compat import cpu_safe_pinning, no_traced_namespace_kept
from quantgate.quantize.config import MixedConfig, QuantizeConfig
from quantgate.quantize.fusion import FUSED, layer_groups
from quantgate.quantize.groups import GroupPlan, plan_group_sizes
from quantgate.quantize.presets import PRESETS, Algorithm, Preset, get_preset

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationScheme

# What a quantization unit imports (preload)
QUANTIZATION_LIBRARIES = ("transformers", "compressed_tensors.quantization", "llmcompressor", "llmcompressor.modifiers.gptq",
                          "llmcompressor.modifiers.quantization", "llmcompressor.modifiers.transform")


def preload() -> None:
    """Import what a quantization imports (QUANTIZATION_LIBRARIES) in this process, so that the
    units a run forks from it find them loaded instead of importing them again
    (docs/reliability.md, "No unit ends the run")."""
    for name in QUANTIZATION_LIBRARIES:
        importlib.import_module(name)


# ---- architectures: what llmcompressor knows of them, as data -------------------------------

# Linear layers that vLLM's mixture-of-experts blocks load unquantized whatever the checkpoint
# says (Qwen2-MoE's `shared_expert_gate` is a ReplicatedLinear with quant_config=None, the routers
# `mlp.gate` GateLinears): never quantized or scored, on top of a config's own `ignore`.
ROUTERS = (r"re:.*\.mlp\.gate$", r"re:.*\.mlp\.shared_expert_gate$")

# SmoothQuant's smoothing: the layer norm whose scales absorb it, for each fused group it feeds
# (roles of quantize.fusion). `None`: Llama-family blocks, llmcompressor's default and what mixed
# checkpoints of any other architecture get. A named architecture is one whose llmcompressor
# mapping is wrong, its uniform W8A8 made with these instead: Gemma 3 feeds its MLP from
# pre_feedforward_layernorm, and its post_attention_layernorm (which llmcompressor 0.14 smooths)
# normalises the attention's output before the residual sum, so smoothing it into gate/up_proj
# changes the model (KL 0.016 against its baseline instead of 0.00001 on the tiny Gemma 3 of
# tests/architectures.py).
SMOOTH_NORMS: dict[str | None, dict[str, str]] = {
    None: {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"},
    "Gemma3ForCausalLM": {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "pre_feedforward_layernorm"},
}
# The algorithms that move scales from a layer norm (or a layer) into the layers it feeds, which
# need to know per architecture which module feeds which. llmcompressor keeps these mappings in
# registries by architecture and falls back to Llama's for any other name, which fails mid-run
# where the names differ (GPT-NeoX's query_key_value) and smooths the wrong layers where they
# happen to match: such an architecture is refused before the model loads (the registry's
# AlgorithmSteps.mappings names the algorithms that need them).
MAPPED = {algorithm: steps.mappings for algorithm, steps in ALGORITHMS.items() if steps.mappings}


def mapped_architectures(algorithm: Algorithm) -> frozenset[str]:
    """The architectures `algorithm` has layer mappings for: llmcompressor's registries, and
    SMOOTH_NORMS for SmoothQuant."""
    if algorithm is Algorithm.awq:
        from llmcompressor.modifiers.transform.awq.dynamic_mappings import AWQ_DYNAMIC_MAPPING_REGISTRY
        from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY

        return frozenset(AWQ_MAPPING_REGISTRY) | frozenset(AWQ_DYNAMIC_MAPPING_REGISTRY)
    from llmcompressor.modifiers.transform.smoothquant.dynamic_mappings import SMOOTHQUANT_DYNAMIC_MAPPING_REGISTRY
    from llmcompressor.modifiers.transform.smoothquant.utils import MAPPINGS_REGISTRY

    return frozenset(MAPPINGS_REGISTRY) | frozenset(SMOOTHQUANT_DYNAMIC_MAPPING_REGISTRY) | frozenset(a for a in SMOOTH_NORMS if a)


def check_architecture(preset: Preset, architecture: str) -> None:
    """Refuse, in one line, a format whose algorithm has no layer mappings for `architecture`."""
    algorithm = MAPPED.get(preset.algorithm)
    if algorithm is None or architecture in mapped_architectures(preset.algorithm):
        return
    from importlib.metadata import version

    raise InputError(f"{preset.name} cannot be made for {architecture}: llmcompressor {version('llmcompressor')} has no "
                     f"{algorithm} mappings for it (which layer norm feeds which layers), and Llama's, its fallback, "
                     "would fail or smooth the wrong layers")


def prepare_model(model: Any) -> Any:
    """The model as llmcompressor quantizes it: a mixture of experts' fused 3-D expert tensors
    (transformers 5) become one Linear layer per expert, which `oneshot` would otherwise do only
    after the group-size plan was made without them (and GPTQ and AWQ left the experts 16-bit)."""
    from compressed_tensors.offload import disable_onloading

    # Shapes only: a streamed model's parameters are read from disk where accessed, and
    # parameters() keeps every tensor it yields until it ends (the whole model in FP32), so the
    # offloaded placeholders, which carry the shapes, are looked at instead.
    with disable_onloading():
        fused = any(parameter.dim() == 3 for parameter in model.parameters())
    if not fused:
        return model  # no fused experts (and llmcompressor's import, seconds, spared)
    from llmcompressor.modeling.moe.linearize import linearize_moe

    return linearize_moe(model)


def linear_layers(model: Any, ignore: list[str]) -> list[tuple[str, int]]:
    """(name, input width) of every Linear layer not matched by `ignore` or ROUTERS, in model order."""
    from compressed_tensors.utils import match_named_modules

    return [(name, int(module.in_features)) for name, module in match_named_modules(model, ["Linear"], [*ignore, *ROUTERS])]


def routers(model: Any) -> list[str]:
    """The ROUTERS patterns some Linear layer of `model` matches: what its recipe's `ignore` adds."""
    from compressed_tensors.utils import match_named_modules

    linear = {name for name, _ in match_named_modules(model, ["Linear"])}
    return [pattern for pattern in ROUTERS if any(name in linear for name, _ in match_named_modules(model, [pattern]))]


def smoothquant_mappings(architecture: str | None) -> list[Any] | None:
    """SmoothQuantModifier mappings for an architecture SMOOTH_NORMS corrects; None: llmcompressor's."""
    norms = SMOOTH_NORMS.get(architecture) if architecture else None
    if norms is None:
        return None
    mappings = []
    for role, norm in norms.items():
        parent, fused = role.rsplit(".", 1)
        mappings.append([[f"re:.*{re.escape(parent)}\\.{member}$" for member in FUSED[fused]], f"re:.*{re.escape(norm)}$"])
    return mappings


def plan_for(model: Any, preset: Preset, cfg: QuantizeConfig) -> GroupPlan | None:
    if not preset.grouped:
        return None
    return plan_group_sizes(linear_layers(model, list(cfg.ignore)), cfg.group_size)


def _scheme(targets: list[str], weights: QuantizationArgsJSON, activations: QuantizationArgsJSON | None, storage_dtype: str) -> QuantizationScheme:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    # Scales are rounded to the baseline's dtype while they are computed, so a model
    # calibrated in FP32 (on a CPU) is optimised for the very scales that get stored.
    scale_dtype = {"scale_dtype": getattr(torch, storage_dtype)}
    static_activations = activations and not activations.get("dynamic", False)
    return QuantizationScheme(
        targets=targets,
        weights=QuantizationArgs(**weights, **scale_dtype),
        input_activations=QuantizationArgs(**activations, **(scale_dtype if static_activations else {})) if activations else None,
    )


def weight_args(preset: Preset, cfg: QuantizeConfig) -> QuantizationArgsJSON:
    """The preset's weight QuantizationArgs with the config's observer, where one is set."""
    args = QuantizationArgsJSON(**preset.weights)
    if cfg.observer:
        args["observer"] = cfg.observer
    return args


def config_groups(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16") -> dict[str, QuantizationScheme]:
    if plan is not None:
        return {
            f"group_{index}": _scheme(targets, {**weight_args(preset, cfg), "group_size": size}, preset.input_activations, storage_dtype)
            for index, (size, targets) in enumerate(plan.targets_by_group_size().items())
        }
    return {"group_0": _scheme(["Linear"], *_ungrouped_args(preset, cfg), storage_dtype)}


def _ungrouped_args(preset: Preset, cfg: QuantizeConfig) -> tuple[QuantizationArgsJSON, QuantizationArgsJSON | None]:
    """(weights, input activations) of an ungrouped format: its dynamic variant's where the config
    asks for it and the format has one (those weights as the registry gives them), else its own
    with the config's observer."""
    if cfg.fp8_dynamic and preset.dynamic_input_activations:
        return preset.args(dynamic=True)
    return weight_args(preset, cfg), preset.input_activations


def restore_storage_dtype(model: Any, storage_dtype: str) -> None:
    """Cast a model calibrated in a wider dtype back to the baseline's for saving: every
    floating tensor except the quantized layers' weights, which compression turns into
    integers or FP8 from their exact (wider) fake-quantized values."""
    import torch
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.cache import OffloadCache

    target = getattr(torch, storage_dtype)
    replaced: dict[int, Any] = {}  # a streamed model's offloaded tensor -> its cast one (tied weights share one)
    for module in model.modules():
        quantized = getattr(module, "quantization_scheme", None) is not None
        streamed = isinstance(module._parameters, OffloadCache)
        for name in list(module._parameters):
            if quantized and name == "weight":
                continue
            if not streamed:
                parameter = module._parameters[name]
                if parameter is not None and parameter.is_floating_point() and parameter.dtype != target:
                    parameter.data = parameter.data.to(target)
                continue
            # an offloaded module: a streamed model's (its tensors on disk), or an in-memory one's after
            # llmcompressor's oneshot (which puts its modules behind a CPU offload cache). The cache
            # keeps a tensor's dtype on an update, so the tensor is replaced (streamed: a new file in
            # the scratch directory)
            offloaded = module._parameters.offloaded_values[name]
            if offloaded is None or not offloaded.is_floating_point() or offloaded.dtype == target:
                continue
            if id(offloaded) in replaced:
                with disable_onloading():
                    module._parameters[name] = replaced[id(offloaded)]
                continue
            cast = torch.nn.Parameter(module._parameters[name].to(target), requires_grad=False)
            del module._parameters[name]
            module._parameters[name] = cast
            replaced[id(offloaded)] = module._parameters.offloaded_values[name]
    model.config.dtype = target


def build_recipe(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16",
                 model: Any = None) -> list[Any]:
    """The llmcompressor modifiers for one format (for `model`: its routers and architecture)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    ignore = [*cfg.ignore, *(plan.unquantized if plan else []), *(routers(model) if model is not None else [])]
    architecture = type(model).__name__ if model is not None else None
    groups = config_groups(preset, cfg, plan, storage_dtype)
    # the config's activation order where the weights are grouped (the order g_idx records);
    # ungrouped formats take GPTQModifier's default
    gptq_knobs: dict[str, Any] = {"dampening_frac": cfg.dampening_frac, "block_size": cfg.block_size,
                                  **({"actorder": cfg.actorder} if preset.grouped else {})}
    modifiers: dict[Step, Callable[[], Any]] = {
        "smoothquant": lambda: SmoothQuantModifier(smoothing_strength=cfg.smoothing_strength, mappings=smoothquant_mappings(architecture)),
        "awq": lambda: AWQModifier(n_grid=cfg.awq_n_grid, duo_scaling=cfg.awq_duo_scaling),
        "gptq": lambda: GPTQModifier(config_groups=groups, ignore=ignore, **gptq_knobs),
        "quantize": lambda: QuantizationModifier(config_groups=groups, ignore=ignore),
    }
    return [modifiers[step]() for step in preset.steps.steps]


def needs_calibration(preset: Preset, cfg: QuantizeConfig) -> bool:
    # Round to nearest with dynamic activations has no activation scales to observe: weights alone decide.
    return preset.steps.solver or not (cfg.fp8_dynamic and preset.dynamic_input_activations is not None)


def quantize_in_place(model: Any, recipe: list[Any], dataset: Any, samples: int, seq_len: int) -> None:
    """Run llmcompressor's oneshot on `model` (modified in place, not saved)."""
    from llmcompressor import oneshot

    with cpu_safe_pinning(), no_traced_namespace_kept():
        oneshot(
            model=model,
            recipe=recipe,
            dataset=dataset,
            num_calibration_samples=samples,
            max_seq_length=seq_len,
            shuffle_calibration_samples=False,  # the calibration set is already a seeded sample
        )


def release() -> None:
    """Reset llmcompressor's global session: after `oneshot` it keeps the model it quantized (its
    state's `model`) until the next session starts, which kept a whole model alive beside the
    smoke check's and every later stage's."""
    from llmcompressor.core import active_session

    active_session().reset()  # type: ignore[no-untyped-call]  # llmcompressor's session is not annotated


# ---- mixed precision: one scheme per layer group, one llmcompressor run ---------------------

# The formats a mixed checkpoint may hold are the registry's `mixable` ones. GPTQ handles any
# weight scheme, so one GPTQ pass quantizes every class; AWQ's scales come before a
# round-to-nearest pass over every group.


@dataclass(frozen=True)
class MixedPlan:
    recipe: list[Any]
    layers: dict[str, LayerFormat]  # layer -> its format and group size (None: not grouped)
    unquantized: list[str]  # layers a format asked for but no group size fits (left 16-bit)
    smoothed: list[str]  # the layer norms SmoothQuant scaled


def _exact(name: str) -> str:
    return f"re:^{re.escape(name)}$"


def check_mixed_formats(formats: list[str]) -> None:
    """Refuse, in one line, formats that one mixed checkpoint cannot hold together: the registry's
    mixable formats only, one of each weight width."""
    by_bits: dict[int, list[str]] = {}
    for name in formats:
        preset = get_preset(name)
        by_bits.setdefault(preset.bits, []).append(name)
        if not preset.mixable:
            allowed = [entry.name for entry in PRESETS.values() if entry.mixable and entry.bits == preset.bits]
            raise InputError(f"{name} cannot be mixed: mixed checkpoints take {' or '.join(allowed) or 'no format'} "
                             f"for their {preset.bits}-bit layers")
    for bits, names in by_bits.items():
        if len(names) > 1:
            raise InputError(f"a mixed checkpoint takes one {bits}-bit format, not {', '.join(names)}")


def check_mixed(cfg: MixedConfig, layers: list[tuple[str, int]]) -> None:
    """Refuse, in one line, a mixed assignment that the model or the formats cannot take."""
    present = dict(layers)
    unknown = sorted(set(cfg.layers) - set(present))
    if unknown:
        raise InputError(f"the mixed assignment names {len(unknown)} layer(s) the model has no (quantizable) linear layer for: {unknown[0]}")
    missing = sorted(set(present) - set(cfg.layers))
    if missing:
        raise InputError(f"the mixed assignment leaves {len(missing)} linear layer(s) without a format (give '16-bit' to keep one): {missing[0]}")
    check_mixed_formats(cfg.formats)
    for group in layer_groups([name for name, _ in layers]):
        formats = {cfg.layers[layer] for layer in group.layers}
        if len(formats) > 1:
            raise InputError(f"{group.name} is one fused matmul in vLLM: its layers must share a format, got {', '.join(sorted(formats))}")


def _mixed_groups(cfg: MixedConfig, layers: list[tuple[str, int]], storage_dtype: str) -> tuple[dict[str, QuantizationScheme], dict[str, LayerFormat], list[str]]:
    groups: dict[str, QuantizationScheme] = {}
    table: dict[str, LayerFormat] = {}
    unquantized: list[str] = []
    for name in cfg.formats:
        preset, knobs = get_preset(name), cfg.knobs_for(name)
        mine = [(layer, width) for layer, width in layers if cfg.layers[layer] == name]
        if preset.grouped:
            plan = plan_group_sizes(mine, cfg.group_size)
            unquantized += plan.unquantized
            for size in sorted({layer.group_size for layer in plan.layers if layer.group_size}, reverse=True):
                targets = [_exact(layer.name) for layer in plan.layers if layer.group_size == size]
                groups[f"{name}_g{size}"] = _scheme(targets, {**weight_args(preset, knobs), "group_size": size},
                                                    preset.input_activations, storage_dtype)
            table.update({layer.name: LayerFormat(format=name, group_size=layer.group_size) for layer in plan.layers if layer.group_size})
        else:
            groups[name] = _scheme([_exact(layer) for layer, _ in mine], *_ungrouped_args(preset, knobs), storage_dtype)
            table.update({layer: LayerFormat(format=name, group_size=None) for layer, _ in mine})
    return groups, table, unquantized


def _smooth_mappings(cfg: MixedConfig, layers: list[tuple[str, int]], smoothed_format: str,
                     architecture: str | None = None) -> dict[str, list[str]]:
    """SmoothQuant's mappings (layer norm -> the fused group it feeds) for the 8-bit format's
    groups only: smoothing moves activation outliers into the weights, which INT4 layers would
    pay for."""
    mappings = {}
    norms = SMOOTH_NORMS.get(architecture, SMOOTH_NORMS[None])
    for group in layer_groups([name for name, _ in layers]):
        norm = norms.get(group.role)
        if norm and cfg.layers[group.layers[0]] == smoothed_format:
            mappings[f"{group.name[: -len(group.role) - 1]}.{norm}"] = list(group.layers)
    return mappings


def build_mixed_recipe(model: Any, cfg: MixedConfig, storage_dtype: str = "bfloat16") -> MixedPlan:
    """The llmcompressor modifiers for a mixed checkpoint, and which layer gets which scheme."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    layers = linear_layers(model, list(cfg.ignore))
    check_mixed(cfg, layers)
    groups, table, unquantized = _mixed_groups(cfg, layers, storage_dtype)
    ignore = [*cfg.ignore, *(_exact(name) for name, _ in layers if name not in table)]
    algorithms = {get_preset(name).algorithm: name for name in cfg.formats}
    recipe: list[Any] = []
    smoothed: list[str] = []
    if (name := algorithms.get(Algorithm.smoothquant_gptq)) and (mappings := _smooth_mappings(cfg, layers, name, type(model).__name__)):
        recipe.append(SmoothQuantModifier(smoothing_strength=cfg.knobs_for(name).smoothing_strength,
                                          mappings=[[[_exact(layer) for layer in group], _exact(norm)] for norm, group in mappings.items()]))
        smoothed = list(mappings)
    if (name := algorithms.get(Algorithm.awq)) is not None:
        knobs = cfg.knobs_for(name)
        recipe += [AWQModifier(n_grid=knobs.awq_n_grid, duo_scaling=knobs.awq_duo_scaling),
                   QuantizationModifier(config_groups=groups, ignore=ignore)]
    else:
        knobs = cfg.knobs_for(algorithms.get(Algorithm.gptq) or cfg.formats[0])
        recipe.append(GPTQModifier(config_groups=groups, ignore=ignore, actorder=knobs.actorder,
                                   dampening_frac=knobs.dampening_frac, block_size=knobs.block_size))
    return MixedPlan(recipe, table, unquantized, smoothed)
