"""`measure` on real checkpoints: the demo model in the four formats, the demo model itself,
and an AutoAWQ GEMM checkpoint. Every quantized layer sits at its format's exact figure
(worked here by hand, independently of the accounting code) and every byte is accounted for."""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest

from quantgate.quantize.measure.accounting import measure
from tests.helpers import assert_every_byte_accounted

pytestmark = pytest.mark.integration


def exact_bits_per_weight(fmt: str, in_features: int, out_features: int, group: int | None = None) -> Fraction:
    """bpw = (b N + scale_bits N/g + zero_point_bits N/g + extra) / N (docs/sources.md), per layout."""
    n = in_features * out_features
    if fmt == "gptq-int4":  # pack-quantized symmetric, BF16 scales, weight_shape I64[2]
        return Fraction(4 * n + 16 * n // group + 128, n)
    if fmt in ("awq-int4",):  # pack-quantized asymmetric: zero points packed 4 bits each
        return Fraction(4 * n + 16 * n // group + 4 * n // group + 128, n)
    if fmt == "autoawq":  # AWQ GEMM: qweight, qzeros I32 packed, F16 scales; no weight_shape
        return Fraction(4 * n + 16 * n // group + 4 * n // group, n)
    if fmt == "smoothquant-w8a8":  # INT8, one BF16 scale per output channel
        return Fraction(8 * n + 16 * out_features, n)
    if fmt == "fp8-e4m3":  # FP8, one BF16 weight scale and one static BF16 input scale per tensor
        return Fraction(8 * n + 16 + 16, n)
    return Fraction(16)  # the BF16 baseline


def demo_group(in_features: int) -> int:
    # hidden 576 is not a multiple of 128: those layers fell back to 64; down_proj (1536) kept 128
    return 64 if in_features == 576 else 128


@pytest.mark.parametrize("fmt", ["gptq-int4", "awq-int4", "smoothquant-w8a8", "fp8-e4m3"])
def test_demo_checkpoint_layers_are_at_their_exact_figure(demo_checkpoints, demo_model, fmt: str) -> None:
    data = measure(demo_checkpoints[fmt], demo_model.path).to_json()
    layers = data["linear_layers"]
    quantized = [entry for entry in layers if entry["quantized"]]
    assert len(quantized) == 30 * 7 and len(layers) == len(quantized)  # lm_head is tied, not stored
    for entry in quantized:
        group = demo_group(entry["in_features"]) if fmt.endswith("int4") else None
        assert entry["group_size"] == group, entry["name"]
        assert Fraction(entry["bytes"] * 8, entry["parameters"]) == exact_bits_per_weight(fmt, entry["in_features"], entry["out_features"], group), entry["name"]
        assert entry["gaps"] == [] and entry["exact_bits_per_weight"] == pytest.approx(entry["bits_per_weight"], rel=1e-15)
    if fmt.endswith("int4"):
        assert set(data["quantized_linear"]["by_scheme"]) == {"4-bit group g64", "4-bit group g128"}
        lines = {line["cause"] for line in data["explanation"]["lines"]}
        assert {"format_vs_rule", "other_group_size", "shape_metadata", "unquantized_embeddings"} <= lines
    assert data["format"]["family"] == "compressed-tensors"
    assert data["totals"]["parameters"] == demo_model.manifest["conversion"]["parameters"]
    # in a 135M-parameter model the embedding alone is a fifth of the parameters (docs/sources.md)
    assert 0.19 < data["categories"]["embeddings"]["parameters"] / data["totals"]["parameters"] < 0.23
    assert data["baseline"]["parameters_match"] and data["baseline"]["ratio_total"] < 0.65
    assert not any(line["cause"] in ("wider_than_baseline", "tied_lm_head_stored", "wide_scales") for line in data["explanation"]["lines"])
    assert_every_byte_accounted(data)


def test_demo_model_itself_is_16_bits_a_weight(demo_model) -> None:
    data = measure(demo_model.path).to_json()
    assert data["format"]["name"] == "unquantized BF16" and data["quantized_linear"]["layers"] == 0
    assert len(data["linear_layers"]) == 30 * 7
    assert all(entry["bits_per_weight"] == 16 for entry in data["linear_layers"])
    assert data["totals"]["parameters"] == demo_model.manifest["conversion"]["parameters"]
    assert [line["cause"] for line in data["explanation"]["lines"]] == ["header"]
    assert_every_byte_accounted(data)


@pytest.fixture(scope="module")
def autoawq_checkpoint(quant_model: Path, quant_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GEMM checkpoint written by AutoAWQ itself (quantize + save_quantized) from the tiny
    model: measure needs its layout, not a smoke check, so the backend's reload is skipped."""
    if importlib.util.find_spec("awq") is None:
        pytest.skip("the autoawq extra is not installed")
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    from quantgate import calibration

    out = tmp_path_factory.mktemp("autoawq") / "awq"
    rows = [row.tolist() for row in calibration.load(quant_calibration).input_ids[:4]]
    # FP32 on a CPU, as quantgate's AutoAWQ backend runs there: FP32 embeddings and norms result
    model = AutoAWQForCausalLM.from_pretrained(str(quant_model), torch_dtype=torch.float32, trust_remote_code=False, safetensors=True)
    model.quantize(AutoTokenizer.from_pretrained(quant_model), quant_config={"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"},
                   calib_data=rows, max_calib_samples=4, max_calib_seq_len=64, apply_clip=False)
    model.save_quantized(str(out), safetensors=True)
    return out


def test_autoawq_checkpoint_layers_are_at_their_exact_figure(autoawq_checkpoint: Path, quant_model: Path) -> None:
    data = measure(autoawq_checkpoint, quant_model).to_json()
    assert data["format"]["family"] == "awq" and data["format"]["layout"] == "awq-gemm"
    assert json.loads((autoawq_checkpoint / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    quantized = [entry for entry in data["linear_layers"] if entry["quantized"]]
    assert len(quantized) == 2 * 7
    for entry in quantized:
        assert entry["group_size"] == 64
        assert Fraction(entry["bytes"] * 8, entry["parameters"]) == exact_bits_per_weight("autoawq", entry["in_features"], entry["out_features"], 64)
        assert entry["gaps"] == []
    lines = {line["cause"]: line for line in data["explanation"]["lines"]}
    # FP32 embedding and norms against the BF16 baseline: named, and sized to the byte
    assert lines["wider_than_baseline"]["bytes"] == (512 * 192 + 5 * 192) * 2
    assert_every_byte_accounted(data)


def test_bounds_from_the_demo_checkpoints(cli, demo_checkpoints, demo_model) -> None:
    result = cli("bounds", "--hardware", "h100-sxm", "--checkpoint", demo_model.path, "--checkpoint", demo_checkpoints["gptq-int4"],
                 "--batch", "8", "--context", "2048", "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert (data["model"]["layers"], data["model"]["kv_heads"], data["model"]["head_dim"]) == (30, 3, 64)
    formats = {entry["name"]: entry for entry in data["formats"]}
    # INT4 linear layers, but the 16-bit embedding (a fifth of the parameters) is half the bytes left
    assert formats["gptq-int4"]["weight_bytes"] < 0.45 * formats[demo_model.path.name]["weight_bytes"]
