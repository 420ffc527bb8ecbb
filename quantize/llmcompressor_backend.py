"""The llmcompressor adapter: a preset, a config and a group-size plan become modifiers,
and `oneshot` runs them on the CPU or an accelerator. Nothing else in quantgate imports
llmcompressor."""

from __future__ import annotations

# llmcompressor, compressed_tensors and torch are imported where used: they take seconds to
# import, and building the group-size plan or `quantgate --help` needs none of them.
from typing import Any

from quantize.compat import cpu_safe_pinning
from quantize.config import QuantizeConfig
from quantize.groups import GroupPlan, plan_group_sizes
from quantize.presets import FP8_DYNAMIC_WEIGHTS, Algorithm, Preset


def linear_layers(model: Any, ignore: list[str]) -> list[tuple[str, int]]:
    """(name, input width) of every Linear layer not matched by `ignore`, in model order."""
    from compressed_tensors.utils import match_named_modules

    return [(name, int(module.in_features)) for name, module in match_named_modules(model, ["Linear"], ignore)]


def plan_for(model: Any, preset: Preset, cfg: QuantizeConfig) -> GroupPlan | None:
    if not preset.grouped:
        return None
    return plan_group_sizes(linear_layers(model, list(cfg.ignore)), cfg.group_size)


def _scheme(targets: list[str], weights: dict[str, Any], activations: dict[str, Any] | None, storage_dtype: str) -> Any:
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


def config_groups(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16") -> dict[str, Any]:
    if plan is not None:
        return {
            f"group_{index}": _scheme(targets, {**preset.weights, "group_size": size}, preset.input_activations, storage_dtype)
            for index, (size, targets) in enumerate(plan.targets_by_group_size().items())
        }
    weights, activations = preset.weights, preset.input_activations
    if cfg.fp8_dynamic and preset.dynamic_input_activations:
        weights, activations = FP8_DYNAMIC_WEIGHTS, preset.dynamic_input_activations
    return {"group_0": _scheme(["Linear"], weights, activations, storage_dtype)}


def restore_storage_dtype(model: Any, storage_dtype: str) -> None:
    """Cast a model calibrated in a wider dtype back to the baseline's for saving: every
    floating tensor except the quantized layers' weights, which compression turns into
    integers or FP8 from their exact (wider) fake-quantized values."""
    import torch

    target = getattr(torch, storage_dtype)
    for module in model.modules():
        quantized = getattr(module, "quantization_scheme", None) is not None
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.is_floating_point() and parameter.dtype != target and not (quantized and name == "weight"):
                parameter.data = parameter.data.to(target)
    model.config.dtype = target


def build_recipe(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16") -> list[Any]:
    """The llmcompressor modifiers for one format."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    ignore = [*cfg.ignore, *(plan.unquantized if plan else [])]
    groups = config_groups(preset, cfg, plan, storage_dtype)
    gptq_knobs = {"dampening_frac": cfg.dampening_frac, "block_size": cfg.block_size}
    if preset.algorithm is Algorithm.gptq:
        return [GPTQModifier(config_groups=groups, ignore=ignore, actorder=cfg.actorder, **gptq_knobs)]
    if preset.algorithm is Algorithm.awq:
        return [
            AWQModifier(n_grid=cfg.awq_n_grid, duo_scaling=cfg.awq_duo_scaling),
            QuantizationModifier(config_groups=groups, ignore=ignore),
        ]
    if preset.algorithm is Algorithm.smoothquant_gptq:
        return [
            SmoothQuantModifier(smoothing_strength=cfg.smoothing_strength),
            GPTQModifier(config_groups=groups, ignore=ignore, **gptq_knobs),
        ]
    return [QuantizationModifier(config_groups=groups, ignore=ignore)]


def needs_calibration(preset: Preset, cfg: QuantizeConfig) -> bool:
    # FP8 with dynamic activations has no activation scales to observe: weights alone decide.
    return not (preset.algorithm is Algorithm.round_to_nearest and cfg.fp8_dynamic)


def quantize_in_place(model: Any, recipe: list[Any], dataset: Any, samples: int, seq_len: int) -> None:
    """Run llmcompressor's oneshot on `model` (modified in place, not saved)."""
    from llmcompressor import oneshot

    with cpu_safe_pinning():
        oneshot(
            model=model,
            recipe=recipe,
            dataset=dataset,
            num_calibration_samples=samples,
            max_seq_length=seq_len,
            shuffle_calibration_samples=False,  # the calibration set is already a seeded sample
        )
