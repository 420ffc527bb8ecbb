"""gptq-int8 (INT8 weight-only, W8A16), the format added as one registry entry: it quantizes the
tiny model, the accounting measures it at 8 bits a weight plus one scale a row, and what each CPU
class's engine computes for it is the registry's. It goes through the whole pipeline, gated under
the 8-bit bounds its bits give, in tests/test_every_format.py, as every registry entry does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate import quantize
from quantgate.core.formats import FORMATS
from quantgate.quantize.measure.accounting import measure
from quantgate.serving import device

FORMAT = "gptq-int8"


@pytest.fixture(scope="module")
def checkpoint(quant_model: Path, quant_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize.run(quantize.QuantizeConfig(format=FORMAT), quant_model, quant_calibration,
                        tmp_path_factory.mktemp("int8") / FORMAT).path


def test_gptq_int8_is_int8_weights_per_channel_with_16_bit_activations(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"]) == (8, "int", True, "channel")
    assert group["input_activations"] is None
    assert config["format"] == FORMATS[FORMAT].layout == "pack-quantized"
    assert "GPTQModifier" in (checkpoint / "recipe.yaml").read_text()
    assert device.checkpoint_schemes(json.loads((checkpoint / "config.json").read_text())) == ["W8A16"]


def test_the_accounting_measures_gptq_int8_at_eight_bits_and_a_scale_a_row(checkpoint: Path, quant_model: Path) -> None:
    measured = measure(checkpoint, quant_model)
    assert measured.format.layout == FORMATS[FORMAT].layout
    layers = [layer for layer in measured.linear_layers if layer.quantized]
    assert layers and {(layer.bits, layer.strategy, layer.layout) for layer in layers} == {(8, "channel", "pack-quantized")}
    # every byte is the format's: 8 bits a weight, one 16-bit scale per output row, and
    # pack-quantized's weight_shape (two int64, 128 bits) a layer
    assert all(layer.exact_bits is not None and not layer.gaps for layer in layers), [layer.notes for layer in layers]
    assert all(layer.exact_bits == 8 * layer.parameters + 16 * layer.out_features + 128 for layer in layers)
    assert measured.unexplained_bits == 0 and measured.format.name == "compressed-tensors pack-quantized INT8 symmetric, per channel"


@pytest.mark.parametrize("device_class", device.CPU_CLASSES)
def test_vllms_cpu_build_has_no_kernel_for_w8a16_on_any_cpu_class(device_class: str) -> None:
    """Pending serving on CPU: its checkpoints load as CompressedTensorsWNA16 with uint8b128
    weights, which no CPU mixed-precision kernel of vLLM 0.32 takes (the registry's source)."""
    (gap,) = device.known_gaps("vllm-cpu", device_class, ["W8A16"])
    assert gap.what == "no kernel" and "uint4b8 only" in gap.source
    assert "W8A16" in device.SCHEMES and device.serve_resource("W8A16") not in device.node_resources("vllm-cpu", device_class)
