"""Mixed-precision checkpoints on the tiny model: one llmcompressor run gives every layer group
its own scheme; the checkpoint says which layer has which (config.json, manifest), is measured to
the byte against the uniform checkpoints' layers, and reloads with finite logits. Assignments
that a serving engine or the formats cannot take are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate import quantize
from quantgate.core.errors import InputError
from quantgate.quantize.config import UNQUANTIZED, MixedConfig
from quantgate.quantize.fusion import layer_groups
from quantgate.quantize.llmcompressor_backend import check_mixed, check_mixed_formats
from quantgate.quantize.measure.accounting import measure

INT4, INT8 = "gptq-int4", "smoothquant-w8a8"


def linear_names(model: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    from quantgate.quantize.llmcompressor_backend import linear_layers

    return [name for name, _ in linear_layers(AutoModelForCausalLM.from_pretrained(model), ["lm_head"])]


def assignment(names: list[str]) -> dict[str, str]:
    """Block 0's attention 8-bit, block 1's o_proj 16-bit, block 1's down_proj 8-bit, the rest INT4."""
    layers = {}
    for name in names:
        if name.startswith("model.layers.0.self_attn.") and not name.endswith("o_proj"):
            layers[name] = INT8
        elif name == "model.layers.1.self_attn.o_proj":
            layers[name] = UNQUANTIZED
        elif name == "model.layers.1.mlp.down_proj":
            layers[name] = INT8
        else:
            layers[name] = INT4
    return layers


@pytest.fixture(scope="module")
def mixed(quant_model: Path, quant_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, Path]]:
    root = tmp_path_factory.mktemp("mixed")
    layers = assignment(linear_names(quant_model))
    checkpoint = quantize.run_mixed(MixedConfig(layers=layers), quant_model, quant_calibration, root / "mixed").path
    uniform = {fmt: quantize.run(quantize.QuantizeConfig(format=fmt), quant_model, quant_calibration, root / fmt).path
               for fmt in (INT4, INT8)}
    return checkpoint, layers, uniform


def test_the_checkpoint_names_every_layers_scheme(mixed) -> None:
    checkpoint, layers, _ = mixed
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    targeted: dict[str, tuple[int, str]] = {}
    for group in config["config_groups"].values():
        for target in group["targets"]:
            assert target.startswith("re:^") and target.endswith("$")  # exact names
            targeted[target[4:-1].replace("\\", "")] = (group["weights"]["num_bits"], group["format"])
    assert {name for name, fmt in layers.items() if fmt != UNQUANTIZED} == set(targeted)
    for name, fmt in layers.items():
        if fmt == INT4:
            assert targeted[name] == (4, "pack-quantized")
        elif fmt == INT8:
            assert targeted[name] == (8, "int-quantized")
    assert "model.layers.1.self_attn.o_proj" in config["ignore"]  # left 16-bit
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format"] == "mixed" and {name: entry["format"] for name, entry in manifest["layers"].items()} == layers
    assert manifest["smoothed"] == ["model.layers.0.input_layernorm"]  # SmoothQuant only where 8-bit q/k/v
    assert manifest["smoke"]["logits_finite"] is True


def test_measured_to_the_byte_against_the_uniform_checkpoints_layers(mixed) -> None:
    checkpoint, layers, uniform = mixed
    per_format = {fmt: {layer["name"]: layer["bytes"] for layer in measure(path).to_json()["linear_layers"]} for fmt, path in uniform.items()}
    data = measure(checkpoint).to_json()
    measured = {layer["name"]: layer for layer in data["linear_layers"]}
    for name, fmt in layers.items():
        layer = measured[name]
        if fmt == UNQUANTIZED:
            assert not layer["quantized"] and layer["bits"] == 16
        else:
            assert layer["bytes"] == per_format[fmt][name], name  # the allocation's figure, exactly
    assert data["explanation"]["unexplained_bytes"] == 0
    assert set(data["quantized_linear"]["by_scheme"]) == {"4-bit group g64", "4-bit group g128", "8-bit channel"}


def test_reloads_with_finite_logits(mixed) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint, _, _ = mixed
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert torch.isfinite(logits).all()


def test_layer_groups_follow_vllms_fused_matmuls() -> None:
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    groups = {group.name: group.layers for group in layer_groups(names)}
    assert groups == {
        "model.layers.0.self_attn.qkv_proj": tuple(names[:3]), "model.layers.0.self_attn.o_proj": (names[3],),
        "model.layers.0.mlp.gate_up_proj": tuple(names[4:6]), "model.layers.0.mlp.down_proj": (names[6],)}
    # an incomplete fused set is not a group: each layer stands alone
    assert [group.name for group in layer_groups(names[:2])] == names[:2]


@pytest.mark.parametrize(("change", "fragment"), [
    ({"model.layers.0.self_attn.k_proj": INT4}, "is one fused matmul in vLLM"),
    ({"model.layers.9.mlp.down_proj": INT4}, "no (quantizable) linear layer"),
    ({"model.layers.0.mlp.down_proj": None}, "without a format"),
])
def test_assignments_a_server_cannot_take_are_refused(quant_model: Path, change: dict[str, str | None], fragment: str) -> None:
    names = linear_names(quant_model)
    layers = assignment(names)
    for name, fmt in change.items():
        if fmt is None:
            layers.pop(name)
        else:
            layers[name] = fmt
    with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_mixed(MixedConfig(layers=layers), [(name, 192) for name in names])


@pytest.mark.parametrize(("formats", "fragment"), [
    ([INT4, "awq-int4"], "one 4-bit format"),
    ([INT4, "fp8-e4m3"], "fp8-e4m3 cannot be mixed"),
])
def test_formats_one_checkpoint_cannot_hold_together_are_refused(formats: list[str], fragment: str) -> None:
    with pytest.raises(InputError, match=fragment):
        check_mixed_formats(formats)
