"""Byte accounting from headers alone: every layout's bits per weight equal the figure its
format implies (checked against hand arithmetic), every byte lands in a category, and the gap
to the 4.15-bit rule is explained line by line. Checkpoints here are header-only files."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest

from quantgate.quantize.measure.accounting import measure, rule_bits
from tests.helpers import assert_every_byte_accounted, write_header_only

Tensors = dict[str, tuple[str, list[int]]]


# --- builders: the layouts of docs/sources.md, as header entries ------------------------------

def ct_packed(prefix: str, in_f: int, out_f: int, group: int, symmetric: bool = True, scale: str = "BF16", g_idx: bool = False) -> Tensors:
    groups = math.ceil(in_f / group)
    tensors = {
        f"{prefix}.weight_packed": ("I32", [out_f, in_f * 4 // 32]),
        f"{prefix}.weight_scale": (scale, [out_f, groups]),
        f"{prefix}.weight_shape": ("I64", [2]),
    }
    if not symmetric:
        tensors[f"{prefix}.weight_zero_point"] = ("I32", [math.ceil(out_f * 4 / 32), groups])
    if g_idx:
        tensors[f"{prefix}.weight_g_idx"] = ("I32", [in_f])
    return tensors


def gptq(prefix: str, in_f: int, out_f: int, group: int, bits: int = 4) -> Tensors:
    groups = math.ceil(in_f / group)
    return {
        f"{prefix}.qweight": ("I32", [in_f * bits // 32, out_f]),
        f"{prefix}.qzeros": ("I32", [groups, out_f * bits // 32]),
        f"{prefix}.scales": ("F16", [groups, out_f]),
        f"{prefix}.g_idx": ("I32", [in_f]),
    }


def awq(prefix: str, in_f: int, out_f: int, group: int) -> Tensors:
    groups = in_f // group
    return {
        f"{prefix}.qweight": ("I32", [in_f, out_f // 8]),
        f"{prefix}.qzeros": ("I32", [groups, out_f // 8]),
        f"{prefix}.scales": ("F16", [groups, out_f]),
    }


def ct_group(targets: list[str], group: int | None, symmetric: bool = True, fmt: str = "pack-quantized", strategy: str = "group",
             bits: int = 4, kind: str = "int", inputs: dict | None = None, actorder: str | None = None) -> dict:
    return {"format": fmt, "targets": targets, "input_activations": inputs,
            "weights": {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy, "group_size": group, "actorder": actorder}}


def ct_config(groups: dict, fmt: str = "pack-quantized", **extra) -> dict:
    return {"tie_word_embeddings": True, "dtype": "bfloat16", "num_hidden_layers": 1, **extra,
            "quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups, "ignore": ["lm_head"]}}


def write_checkpoint(root: Path, tensors: Tensors, config: dict | None = None, shards: int = 1, **json_files: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    for name, value in json_files.items():
        (root / name).write_text(json.dumps(value))
    if shards == 1:
        write_header_only(root / "model.safetensors", tensors, {"format": "pt"})
        return root
    names = list(tensors)
    weight_map = {}
    for number in range(shards):
        part = names[number::shards]
        shard = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        write_header_only(root / shard, {name: tensors[name] for name in part})
        weight_map |= {name: shard for name in part}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def non_linear(hidden: int = 576, vocab: int = 1024, dtype: str = "BF16") -> Tensors:
    return {"model.embed_tokens.weight": (dtype, [vocab, hidden]), "model.norm.weight": (dtype, [hidden]),
            "model.layers.0.input_layernorm.weight": (dtype, [hidden])}


def layer(data: dict, name: str) -> dict:
    return next(entry for entry in data["linear_layers"] if entry["name"] == name)


# --- the worked example of docs/sources.md: one 4096 x 4096 layer, g = 128 ----------------------

N = 4096 * 4096
PREFIX = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("layout, printed, stored", [
    ("ct-symmetric", 4.125, 8_388_608 + 262_144 + 16),
    ("ct-asymmetric", 4.156, 8_388_608 + 262_144 + 16 + 65_536),
    ("awq-gemm", 4.156, 8_388_608 + 262_144 + 65_536),
    ("gptq-v1", 4.164, 8_388_608 + 262_144 + 65_536 + 16_384),
    ("fp8-per-channel", 8.004, 16_777_216 + 8_192),
])
def test_worked_example_layers_have_the_printed_bits_per_weight(tmp_path: Path, layout: str, printed: float, stored: int) -> None:
    if layout.startswith("ct-"):
        symmetric = layout == "ct-symmetric"
        tensors = ct_packed(PREFIX, 4096, 4096, 128, symmetric)
        config = ct_config({"group_0": ct_group(["Linear"], 128, symmetric)})
    elif layout == "awq-gemm":
        tensors = awq(PREFIX, 4096, 4096, 128)
        config = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}}
    elif layout == "gptq-v1":
        tensors = gptq(PREFIX, 4096, 4096, 128)
        config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}}
    else:
        tensors = {f"{PREFIX}.weight": ("F8_E4M3", [4096, 4096]), f"{PREFIX}.weight_scale": ("BF16", [4096, 1])}
        config = ct_config({"group_0": ct_group(["Linear"], None, fmt="float-quantized", strategy="channel", bits=8, kind="float")},
                           fmt="float-quantized")
    data = measure(write_checkpoint(tmp_path / layout, tensors, config)).to_json()
    entry = layer(data, PREFIX)
    assert entry["parameters"] == N and entry["bytes"] == stored
    assert round(entry["bits_per_weight"], 3) == printed
    assert entry["exact_bits_per_weight"] == pytest.approx(stored * 8 / N, rel=1e-15) and entry["gaps"] == []
    assert_every_byte_accounted(data)


# --- our INT4 checkpoints: width-576 layers at g64, down_proj at g128 -----------------------

def demo_shaped_int4(symmetric: bool) -> tuple[Tensors, dict]:
    """One block of the demo model's shapes (hidden 576, intermediate 1536, 3 KV heads of 64)."""
    shapes = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192), "self_attn.v_proj": (576, 192),
              "self_attn.o_proj": (576, 576), "mlp.gate_proj": (576, 1536), "mlp.up_proj": (576, 1536), "mlp.down_proj": (1536, 576)}
    tensors = non_linear()
    for name, (in_f, out_f) in shapes.items():
        tensors |= ct_packed(f"model.layers.0.{name}", in_f, out_f, 64 if in_f == 576 else 128, symmetric)
    narrow = ["re:.*\\." + re.escape(name) + "$" for name in shapes if name != "mlp.down_proj"]
    config = ct_config({"group_0": ct_group(narrow, 64, symmetric), "group_1": ct_group(["re:.*\\.mlp\\.down_proj$"], 128, symmetric)})
    return tensors, config


@pytest.mark.parametrize("symmetric", [True, False])
def test_mixed_group_sizes_are_each_at_their_own_exact_figure(tmp_path: Path, symmetric: bool) -> None:
    tensors, config = demo_shaped_int4(symmetric)
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, config)).to_json()
    zero_bits = 0 if symmetric else 4
    for entry in data["linear_layers"]:
        in_f, out_f = entry["in_features"], entry["out_features"]
        group = 64 if in_f == 576 else 128
        n = in_f * out_f
        # bpw = (b N + 16 N/g + zp N/g + 128 bits of weight_shape) / N  (docs/sources.md)
        exact = Fraction(4 * n + 16 * n // group + zero_bits * n // group + 128, n)
        assert entry["group_size"] == group
        assert Fraction(entry["bytes"] * 8, n) == exact, entry["name"]
        assert entry["exact_bits_per_weight"] == pytest.approx(float(exact), rel=1e-15)
    by_scheme = data["quantized_linear"]["by_scheme"]
    assert set(by_scheme) == {"4-bit group g64", "4-bit group g128"}
    assert by_scheme["4-bit group g64"]["nominal_bits_per_weight"] == (4.25 if symmetric else 4.3125)
    assert by_scheme["4-bit group g128"]["nominal_bits_per_weight"] == (4.125 if symmetric else 4.15625)
    assert data["quantized_linear"]["bits_per_weight"]["format_at_g128"] == (4.125 if symmetric else 4.15625)
    assert data["format"]["family"] == "compressed-tensors" and data["format"]["weights"]["group_sizes"] == [64, 128]
    assert_every_byte_accounted(data)


def test_gap_to_the_rule_is_explained_by_cause(tmp_path: Path) -> None:
    tensors, config = demo_shaped_int4(symmetric=True)
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, config)).to_json()
    lines = {line["cause"]: line["bytes"] for line in data["explanation"]["lines"]}
    narrow = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 2  # weights of the g64 layers
    wide = 1536 * 576
    weights = narrow + wide
    # 4.125 at g128 against the rule's 4.15
    assert lines["format_vs_rule"] == pytest.approx((4.125 - 4.15) * weights / 8)
    # g64 carries 16/64 - 16/128 = 0.125 more bits a weight
    assert lines["other_group_size"] == pytest.approx(0.125 * narrow / 8)
    assert lines["shape_metadata"] == 7 * 16
    # embeddings and norms at 16 bits instead of 4.15
    assert lines["unquantized_embeddings"] == pytest.approx((16 - 4.15) * 1024 * 576 / 8)
    assert lines["unquantized_norms"] == pytest.approx((16 - 4.15) * 2 * 576 / 8)
    assert lines["header"] == data["totals"]["header_bytes"]
    assert set(lines) == {"format_vs_rule", "other_group_size", "shape_metadata", "unquantized_embeddings", "unquantized_norms", "header"}
    assert data["rule"]["bits_per_weight"] == 4.15
    assert_every_byte_accounted(data)


def test_partial_groups_are_rounded_up_and_explained(tmp_path: Path) -> None:
    # width 200 with g128: two groups, the second one partial
    tensors = ct_packed(PREFIX, 200, 64, 128) | non_linear(hidden=200, vocab=64)
    config = ct_config({"group_0": ct_group(["Linear"], 128)})
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, config)).to_json()
    entry = layer(data, PREFIX)
    assert entry["bytes"] == 64 * 25 * 4 + 64 * 2 * 2 + 16 and entry["gaps"] == []
    lines = {line["cause"]: line["bytes"] for line in data["explanation"]["lines"]}
    assert lines["partial_groups"] == pytest.approx(64 * 2 * 2 - 16 * 200 * 64 / 128 / 8)
    assert_every_byte_accounted(data)


# --- GPTQ and AWQ checkpoints made by other tools ----------------------------------------------

def test_gptq_with_quantize_config_json_only(tmp_path: Path) -> None:
    tensors = gptq("model.layers.0.mlp.down_proj", 1024, 256, 128) | gptq("model.layers.0.mlp.up_proj", 256, 1024, 128) | non_linear(256, 128, "F16")
    root = write_checkpoint(tmp_path / "gptq", tensors, {"tie_word_embeddings": False, "torch_dtype": "float16"},
                            **{"quantize_config.json": {"bits": 4, "group_size": 128, "desc_act": True, "sym": True}})
    data = measure(root).to_json()
    assert data["format"]["family"] == "gptq" and data["format"]["detected_from"].startswith("quantize_config.json")
    for name, (in_f, out_f) in {"model.layers.0.mlp.down_proj": (1024, 256), "model.layers.0.mlp.up_proj": (256, 1024)}.items():
        entry = layer(data, name)
        assert (entry["in_features"], entry["out_features"]) == (in_f, out_f)
        # 4 + 16/128 scales + 4/128 zeros + 32 bits of g_idx per input column (32/out per weight)
        assert Fraction(entry["bytes"] * 8, in_f * out_f) == 4 + Fraction(20, 128) + Fraction(32, out_f)
    lines = {line["cause"] for line in data["explanation"]["lines"]}
    assert "g_idx" in lines
    assert_every_byte_accounted(data)


@pytest.mark.parametrize("maker, family", [(gptq, "gptq"), (awq, "awq")])
def test_layout_is_detected_from_tensor_names_without_a_config(tmp_path: Path, maker, family: str) -> None:
    tensors = maker(PREFIX, 512, 256, 128) | non_linear(512, 64, "F16")
    data = measure(write_checkpoint(tmp_path / family, tensors)).to_json()
    assert data["format"]["family"] == family and "tensor names" in data["format"]["detected_from"]
    entry = layer(data, PREFIX)
    assert (entry["in_features"], entry["out_features"], entry["bits"], entry["group_size"]) == (512, 256, 4, 128)
    assert entry["gaps"] == []
    assert_every_byte_accounted(data)


# --- gaps a user must be told about ---------------------------------------------------------------

def test_lm_head_stored_although_tied_is_a_named_duplicate(tmp_path: Path) -> None:
    tensors = ct_packed(PREFIX, 256, 256, 128) | non_linear(256, 512) | {"lm_head.weight": ("BF16", [512, 256])}
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, ct_config({"group_0": ct_group(["Linear"], 128)}))).to_json()
    lines = {line["cause"]: line for line in data["explanation"]["lines"]}
    assert lines["tied_lm_head_stored"]["bytes"] == 512 * 256 * 2
    assert "duplicate of the embedding" in lines["tied_lm_head_stored"]["detail"]
    # a copy adds bytes, not parameters
    assert data["categories"]["lm_head"] == {"bytes": 512 * 256 * 2, "parameters": 0, "tensors": 1}
    assert data["totals"]["parameters"] == 256 * 256 + 512 * 256 + 2 * 256
    assert_every_byte_accounted(data)


def test_scales_wider_than_16_bits_are_explained(tmp_path: Path) -> None:
    tensors = ct_packed(PREFIX, 256, 256, 128, scale="F32") | non_linear(256, 64)
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, ct_config({"group_0": ct_group(["Linear"], 128)}))).to_json()
    entry = layer(data, PREFIX)
    assert [gap["cause"] for gap in entry["gaps"]] == ["wide_scales"] and entry["gaps"][0]["bytes"] == 256 * 2 * 2
    assert entry["bits_per_weight"] > entry["exact_bits_per_weight"]
    lines = {line["cause"]: line["bytes"] for line in data["explanation"]["lines"]}
    assert lines["wide_scales"] == 256 * 2 * 2
    # the figure the format implies leaves the storage departures out
    assert data["whole_model"]["bits_per_parameter"]["exact"] < data["whole_model"]["bits_per_parameter"]["measured"]
    assert_every_byte_accounted(data)


def test_unquantized_tensors_wider_than_the_baseline_dtype(tmp_path: Path) -> None:
    baseline = write_checkpoint(tmp_path / "base", {f"{PREFIX}.weight": ("BF16", [256, 256])} | non_linear(256, 64), {"torch_dtype": "bfloat16"})
    # AutoAWQ run in FP32 on a CPU writes FP32 embeddings and norms next to F16 scales
    tensors = awq(PREFIX, 256, 256, 64) | non_linear(256, 64, "F32")
    config = {"torch_dtype": "float32", "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}}
    checkpoint = write_checkpoint(tmp_path / "awq", tensors, config)
    alone = measure(checkpoint).to_json()
    assert alone["baseline_dtype"]["dtype"] == "F32"  # without a baseline, config.json's dtype is the reference
    data = measure(checkpoint, baseline).to_json()
    assert data["baseline_dtype"] == {"dtype": "BF16", "source": f"the baseline at {baseline}"}
    lines = {line["cause"]: line for line in data["explanation"]["lines"]}
    assert lines["wider_than_baseline"]["bytes"] == (64 * 256 + 2 * 256) * 2
    assert "F32" in lines["wider_than_baseline"]["detail"]
    assert_every_byte_accounted(data)


def test_tensors_the_format_does_not_account_for_are_named(tmp_path: Path) -> None:
    # a g_idx in a layer whose config says static activation order, and an unknown buffer
    tensors = ct_packed(PREFIX, 256, 256, 128, g_idx=True) | non_linear(256, 64) | {"model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", [32])}
    config = ct_config({"group_0": ct_group(["Linear"], 128, actorder="static")})
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, config)).to_json()
    entry = layer(data, PREFIX)
    assert [gap["cause"] for gap in entry["gaps"]] == ["unaccounted_tensors"] and "weight_g_idx" in entry["gaps"][0]["detail"]
    lines = {line["cause"]: line for line in data["explanation"]["lines"]}
    assert lines["unaccounted_tensors"]["bytes"] == 256 * 4
    assert data["categories"]["other"]["tensors"] == 1 and "unquantized_other" in lines
    assert_every_byte_accounted(data)


def test_group_activation_order_stores_g_idx_as_the_format_says(tmp_path: Path) -> None:
    tensors = ct_packed(PREFIX, 256, 256, 128, g_idx=True) | non_linear(256, 64)
    config = ct_config({"group_0": ct_group(["Linear"], 128, actorder="group")})
    entry = layer(measure(write_checkpoint(tmp_path / "ckpt", tensors, config)).to_json(), PREFIX)
    assert entry["gaps"] == [] and entry["bytes_by_role"]["g_idx"] == 256 * 4


def test_fp8_per_tensor_scales_are_one_scalar_each(tmp_path: Path) -> None:
    tensors = {f"{PREFIX}.weight": ("F8_E4M3", [256, 512]), f"{PREFIX}.weight_scale": ("BF16", [1]), f"{PREFIX}.input_scale": ("BF16", [1])}
    inputs = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    config = ct_config({"group_0": ct_group(["Linear"], None, fmt="float-quantized", strategy="tensor", bits=8, kind="float", inputs=inputs)},
                       fmt="float-quantized")
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors | non_linear(512, 64), config)).to_json()
    entry = layer(data, PREFIX)
    assert Fraction(entry["bytes"] * 8, 256 * 512) == 8 + Fraction(16 + 16, 256 * 512) and entry["gaps"] == []
    assert "static activations" in data["format"]["name"]
    assert_every_byte_accounted(data)


def test_int8_per_channel_w8a8(tmp_path: Path) -> None:
    tensors = {f"{PREFIX}.weight": ("I8", [256, 512]), f"{PREFIX}.weight_scale": ("BF16", [256, 1])}
    inputs = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    config = ct_config({"group_0": ct_group(["Linear"], None, fmt="int-quantized", strategy="channel", bits=8, inputs=inputs)}, fmt="int-quantized")
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors | non_linear(512, 64), config)).to_json()
    entry = layer(data, PREFIX)
    assert Fraction(entry["bytes"] * 8, 256 * 512) == 8 + Fraction(16, 512) and entry["gaps"] == []
    assert data["rule"]["bits_per_weight"] == 8
    assert_every_byte_accounted(data)


# --- dense models, shards, baselines --------------------------------------------------------------

def test_dense_bf16_model_is_16_bits_plus_its_header(tmp_path: Path) -> None:
    tensors = {f"{PREFIX}.weight": ("BF16", [256, 256]), "lm_head.weight": ("BF16", [64, 256])} | non_linear(256, 64)
    data = measure(write_checkpoint(tmp_path / "dense", tensors, {"tie_word_embeddings": False, "torch_dtype": "bfloat16"})).to_json()
    assert data["format"]["family"] == "dense" and data["format"]["name"] == "unquantized BF16"
    assert layer(data, PREFIX)["bits_per_weight"] == 16 and data["quantized_linear"]["layers"] == 0
    assert [line["cause"] for line in data["explanation"]["lines"]] == ["header"]
    assert data["categories"]["lm_head"]["parameters"] == 64 * 256
    assert_every_byte_accounted(data)


def test_sharded_checkpoint_is_measured_through_its_index(tmp_path: Path) -> None:
    tensors, config = demo_shaped_int4(symmetric=False)
    single = measure(write_checkpoint(tmp_path / "one", tensors, config)).to_json()
    sharded = measure(write_checkpoint(tmp_path / "three", tensors, config, shards=3)).to_json()
    assert sharded["index"] == "model.safetensors.index.json" and len(sharded["files"]) == 3
    assert sharded["categories"] == single["categories"]
    assert [entry["bytes"] for entry in sharded["linear_layers"]] == [entry["bytes"] for entry in single["linear_layers"]]
    assert_every_byte_accounted(sharded)


def test_single_safetensors_file_can_be_measured(tmp_path: Path) -> None:
    tensors, config = demo_shaped_int4(symmetric=True)
    root = write_checkpoint(tmp_path / "ckpt", tensors, config)
    assert measure(root / "model.safetensors").to_json()["categories"] == measure(root).to_json()["categories"]


def test_baseline_ratio_whole_and_linear_layers(tmp_path: Path) -> None:
    dense = {f"{PREFIX}.weight": ("BF16", [256, 256])} | non_linear(256, 64)
    baseline = write_checkpoint(tmp_path / "base", dense, {"torch_dtype": "bfloat16", "tie_word_embeddings": True})
    tensors = ct_packed(PREFIX, 256, 256, 128) | non_linear(256, 64)
    checkpoint = write_checkpoint(tmp_path / "ckpt", tensors, ct_config({"group_0": ct_group(["Linear"], 128)}))
    data = measure(checkpoint, baseline).to_json()
    base = data["baseline"]
    linear = 256 * 32 * 4 + 256 * 2 * 2 + 16
    assert base["linear_bytes"] == 256 * 256 * 2 and base["checkpoint_linear_bytes"] == linear
    assert base["ratio_linear"] == linear / (256 * 256 * 2)
    assert base["ratio_total"] == data["totals"]["file_bytes"] / base["file_bytes"] and base["parameters_match"]


def test_measure_reads_only_the_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    import quantgate.core.headers

    tensors, config = demo_shaped_int4(symmetric=True)
    root = write_checkpoint(tmp_path / "ckpt", tensors, config)
    read: list[int] = []
    real_open = builtins.open

    class Counting:
        def __init__(self, stream):
            self.stream = stream

        def read(self, size=-1):
            data = self.stream.read(size)
            read.append(len(data))
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stream.close()

    monkeypatch.setattr(quantgate.core.headers, "open", lambda path, mode="r", *a, **k: Counting(real_open(path, mode, *a, **k)), raising=False)
    data = measure(root).to_json()
    assert sum(read) == data["totals"]["header_bytes"] < data["totals"]["file_bytes"] / 100


def test_the_rule_is_4_15_for_int4_and_the_width_otherwise() -> None:
    assert rule_bits(4) == Fraction(415, 100) and rule_bits(8) == 8 and rule_bits(16) == 16


def test_measure_json_has_the_documented_schema(cli, tmp_path: Path) -> None:
    tensors, config = demo_shaped_int4(symmetric=True)
    result = cli("measure", write_checkpoint(tmp_path / "ckpt", tensors, config), "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["kind"] == "measurement" and data["schema_version"] == 1
    assert set(data) == {"kind", "schema_version", "checkpoint", "index", "files", "format", "totals", "categories", "blocks",
                         "outside_blocks", "linear_layers", "quantized_linear", "whole_model", "rule", "baseline_dtype",
                         "explanation", "baseline", "notes", "wall_seconds"}
    assert set(data["categories"]) == {"quantized_weights", "scales", "zero_points", "g_idx", "shape_metadata", "unquantized_linear",
                                       "biases", "embeddings", "lm_head", "norms", "other"}
    assert data["blocks"][0]["index"] == 0 and data["outside_blocks"]["index"] is None


def test_measure_prints_a_readable_account(cli, tmp_path: Path) -> None:
    tensors, config = demo_shaped_int4(symmetric=True)
    result = cli("measure", write_checkpoint(tmp_path / "ckpt", tensors, config))
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "compressed-tensors pack-quantized INT4 symmetric, group size 64/128" in text
    assert "other_group_size" in text and "4.1500" in text and "bytes by category" in text


def test_biases_of_quantized_layers_are_unquantized_parameters(tmp_path: Path) -> None:
    # Qwen2-style q/k/v biases next to GPTQ-packed weights
    tensors = gptq(PREFIX, 256, 256, 128) | {f"{PREFIX}.bias": ("F16", [256])} | non_linear(256, 64, "F16")
    config = {"torch_dtype": "float16", "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}}
    data = measure(write_checkpoint(tmp_path / "ckpt", tensors, config)).to_json()
    assert layer(data, PREFIX)["gaps"] == [] and "bias" not in layer(data, PREFIX)["bytes_by_role"]
    assert data["categories"]["biases"] == {"bytes": 512, "parameters": 256, "tensors": 1}
    lines = {line["cause"]: line["bytes"] for line in data["explanation"]["lines"]}
    assert lines["unquantized_biases"] == pytest.approx((16 - 4.15) * 256 / 8)
    assert_every_byte_accounted(data)


def test_every_cause_is_documented_with_its_origin_and_the_gate_lists_follow_it() -> None:
    from quantgate.quantize.measure.causes import STORAGE_CAUSES, UNEXPLAINED_CAUSES, Cause, Origin

    doc = (Path(__file__).resolve().parents[1] / "docs" / "measure-and-bounds.md").read_text()
    rows = dict(re.findall(r"^\| `([\w<>]+)` \| (implied|storage|unplaced) \|", doc, re.M))
    for cause in Cause:
        key = "unquantized_<category>" if cause.value.startswith("unquantized_") else cause.value
        assert rows.get(key) == cause.origin.value, cause
    assert set(rows) <= {cause.value for cause in Cause} | {"unquantized_<category>"}
    assert STORAGE_CAUSES == {cause.value for cause in Cause if cause.origin is Origin.storage}
    assert UNEXPLAINED_CAUSES == STORAGE_CAUSES | {"unknown_format_layers", "unexplained"}
