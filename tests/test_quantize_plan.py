"""Group-size fallback and format presets: pure functions with known answers."""

from __future__ import annotations

import pytest

from quantgate.core.errors import InputError
from quantgate.quantize import QuantizeConfig, get_preset
from quantgate.quantize.groups import effective_group_size, plan_group_sizes


@pytest.mark.parametrize(
    "width, requested, expected",
    [
        (4096, 128, 128),
        (576, 128, 64),  # SmolLM2's hidden size
        (1536, 128, 128),  # SmolLM2's intermediate size
        (96, 128, 32),
        (100, 128, None),  # no serving group size divides it: left unquantized
        (576, 64, 64),
        (576, 256, 64),
        (64, 128, 64),  # narrower than a group
    ],
)
def test_layer_gets_the_largest_group_size_that_divides_its_width(width: int, requested: int, expected: int | None) -> None:
    assert effective_group_size(width, requested) == expected


def test_plan_lists_every_fallback_and_builds_suffix_targets() -> None:
    layers = [(f"model.layers.{i}.{role}", width) for i in range(3) for role, width in
              [("self_attn.q_proj", 576), ("mlp.down_proj", 1536)]]
    plan = plan_group_sizes(layers, 128)
    assert len(plan.fallbacks) == 3
    assert {f["group_size"] for f in plan.fallbacks} == {64}
    assert plan.targets_by_group_size() == {128: [r"re:.*\.mlp\.down_proj$"], 64: [r"re:.*\.self_attn\.q_proj$"]}


def test_layers_of_one_role_with_different_widths_are_targeted_by_name() -> None:
    plan = plan_group_sizes([("model.layers.0.mlp.down_proj", 1536), ("model.layers.1.mlp.down_proj", 576),
                             ("model.layers.2.mlp.down_proj", 100)], 128)
    targets = plan.targets_by_group_size()
    assert targets == {128: [r"re:^model\.layers\.0\.mlp\.down_proj$"], 64: [r"re:^model\.layers\.1\.mlp\.down_proj$"]}
    assert plan.unquantized == ["model.layers.2.mlp.down_proj"]


def test_unknown_format_lists_the_valid_ones() -> None:
    with pytest.raises(InputError, match=r"unknown format 'gptq-imt4' \(did you mean 'gptq-int4'\?\); valid formats: gptq-int4, awq-int4, smoothquant-w8a8, fp8-e4m3"):
        get_preset("gptq-imt4")


@pytest.mark.parametrize("size", [0, -32, 48, 100])
def test_group_size_must_be_a_positive_multiple_of_32(size: int) -> None:
    with pytest.raises(ValueError, match="positive multiple of 32"):
        QuantizeConfig(format="gptq-int4", group_size=size)


def test_presets_say_what_each_format_is() -> None:
    assert get_preset("gptq-int4").weights["symmetric"] is True
    assert get_preset("awq-int4").weights["symmetric"] is False
    assert get_preset("smoothquant-w8a8").input_activations["dynamic"] is True
    assert get_preset("fp8-e4m3").weights["type"] == "float"
    assert QuantizeConfig(format="smoothquant-w8a8").smoothing_strength == 0.8


def test_gptq_int4_rounds_with_the_importance_matrix_unless_told_otherwise() -> None:
    """gptq-int4's observer is imatrix_mse by default (docs/int4-quality.md: lower KL on two
    models at the same bytes); the other formats keep the library's; an explicit one is kept; and
    the default is in the config's dump, so the quantize stage's key tells the two apart."""
    assert QuantizeConfig(format="gptq-int4").observer == "imatrix_mse"
    assert QuantizeConfig(format="gptq-int4", observer="minmax").observer == "minmax"
    assert {QuantizeConfig(format=name).observer for name in ("awq-int4", "smoothquant-w8a8", "fp8-e4m3")} == {None}
    assert QuantizeConfig(format="gptq-int4").model_dump()["observer"] == "imatrix_mse"
    assert QuantizeConfig(format="gptq-int4") != QuantizeConfig(format="gptq-int4", observer="minmax")


@pytest.mark.parametrize("observer", [None, "minmax", "mse", "imatrix_mse"])
def test_the_observer_knob_reaches_every_weight_scheme(observer: str | None) -> None:
    from quantgate.quantize.config import MixedConfig
    from quantgate.quantize.llmcompressor_backend import _mixed_groups, config_groups

    cfg = QuantizeConfig(format="gptq-int4", observer=observer)
    groups = config_groups(get_preset("gptq-int4"), cfg, plan_group_sizes([("m.0.q_proj", 576), ("m.0.down_proj", 1536)], 128))
    expected = observer or "imatrix_mse"  # unset: gptq-int4's own
    assert {group.weights.observer for group in groups.values()} == {expected}
    mixed = MixedConfig(layers={"m.0.q_proj": "gptq-int4", "m.0.down_proj": "smoothquant-w8a8"}, knobs={"gptq-int4": cfg})
    schemes, _, _ = _mixed_groups(mixed, [("m.0.q_proj", 576), ("m.0.down_proj", 1536)], "bfloat16")
    assert schemes["gptq-int4_g64"].weights.observer == expected
    assert schemes["smoothquant-w8a8"].weights.observer is None  # its own knobs: the default
