"""Stage 2 on a tiny model: each format yields a complete checkpoint whose config says what
it is, which reloads and generates, keeps the baseline's dtype, and is published atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate import quantize
from quantgate.core.artifacts import sha256_file, verify_files
from quantgate.core.headers import read_header
from quantgate.quantize.checkpoint import QuantizationFailed

FORMATS = ["gptq-int4", "awq-int4", "smoothquant-w8a8", "fp8-e4m3"]


@pytest.fixture(scope="module")
def checkpoints(quant_model: Path, quant_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name in FORMATS:
        made[name] = quantize.run(quantize.QuantizeConfig(format=name), quant_model, quant_calibration, root / name).path
    made["fp8-e4m3-dynamic"] = quantize.run(
        quantize.QuantizeConfig(format="fp8-e4m3", fp8_dynamic=True), quant_model, quant_calibration, root / "fp8-dyn"
    ).path
    return made


def quantization_config(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "config.json").read_text())["quantization_config"]


def weights_by_group_size(config: dict) -> dict[int, dict]:
    return {group["weights"]["group_size"]: group for group in config["config_groups"].values()}


def test_gptq_int4_config(checkpoints: dict[str, Path]) -> None:
    config = quantization_config(checkpoints["gptq-int4"])
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    groups = weights_by_group_size(config)
    assert set(groups) == {64, 128}  # width 192 falls back to 64; down_proj (width 512) keeps 128
    for group in groups.values():
        weights = group["weights"]
        assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"]) == (4, "int", True, "group")
        assert group["input_activations"] is None
    assert groups[128]["targets"] == [r"re:.*\.mlp\.down_proj$"]
    assert "lm_head" in config["ignore"]


def test_awq_int4_config(checkpoints: dict[str, Path]) -> None:
    config = quantization_config(checkpoints["awq-int4"])
    groups = weights_by_group_size(config)
    assert set(groups) == {64, 128}
    for group in groups.values():
        assert (group["weights"]["num_bits"], group["weights"]["symmetric"], group["weights"]["strategy"]) == (4, False, "group")
    header = read_header(checkpoints["awq-int4"] / "model.safetensors")
    assert any(name.endswith("weight_zero_point") for name in header)  # asymmetric: zero points stored


def test_smoothquant_w8a8_config(checkpoints: dict[str, Path]) -> None:
    config = quantization_config(checkpoints["smoothquant-w8a8"])
    assert config["format"] == "int-quantized"
    (group,) = config["config_groups"].values()
    assert (group["weights"]["num_bits"], group["weights"]["type"], group["weights"]["strategy"]) == (8, "int", "channel")
    activations = group["input_activations"]
    assert (activations["num_bits"], activations["type"], activations["strategy"], activations["dynamic"]) == (8, "int", "token", True)
    recipe = (checkpoints["smoothquant-w8a8"] / "recipe.yaml").read_text()
    assert "SmoothQuantModifier" in recipe and "smoothing_strength: 0.8" in recipe and "GPTQModifier" in recipe


def test_fp8_e4m3_static_and_dynamic_configs(checkpoints: dict[str, Path]) -> None:
    (static,) = quantization_config(checkpoints["fp8-e4m3"])["config_groups"].values()
    assert (static["weights"]["type"], static["weights"]["num_bits"], static["weights"]["strategy"]) == ("float", 8, "tensor")
    assert (static["input_activations"]["strategy"], static["input_activations"]["dynamic"]) == ("tensor", False)
    header = read_header(checkpoints["fp8-e4m3"] / "model.safetensors")
    assert any(name.endswith("input_scale") for name in header)  # static activation scales from calibration
    assert {entry["dtype"] for name, entry in header.items() if name.endswith("proj.weight")} == {"F8_E4M3"}
    (dynamic,) = quantization_config(checkpoints["fp8-e4m3-dynamic"])["config_groups"].values()
    assert (dynamic["weights"]["strategy"], dynamic["input_activations"]["strategy"], dynamic["input_activations"]["dynamic"]) == ("channel", "token", True)


@pytest.mark.parametrize("name", FORMATS)
def test_checkpoint_reloads_and_generates(checkpoints: dict[str, Path], name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[name])
    ids = tokenizer("The river rises in the", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.isfinite(logits).all()
    assert generated.shape[1] == ids.shape[1] + 4


@pytest.mark.parametrize("name", [*FORMATS, "fp8-e4m3-dynamic"])
def test_each_checkpoint_is_stored_in_the_layout_its_registry_entry_names(checkpoints: dict[str, Path], name: str) -> None:
    """The planner predicts a format's bytes from its entry's layout; the checkpoint must be in it."""
    from quantgate.core.formats import FORMATS as REGISTRY
    from quantgate.quantize.measure.accounting import measure

    assert measure(checkpoints[name]).format.layout == REGISTRY[name.removesuffix("-dynamic")].layout


@pytest.mark.parametrize("name", FORMATS)
def test_unquantized_tensors_keep_the_baseline_dtype(checkpoints: dict[str, Path], name: str) -> None:
    header = read_header(checkpoints[name] / "model.safetensors")
    kept = {tensor: entry["dtype"] for tensor, entry in header.items()
            if tensor.endswith(("embed_tokens.weight", "norm.weight", "layernorm.weight"))}
    assert kept and set(kept.values()) == {"BF16"}, kept
    assert "lm_head.weight" not in header  # tied to the embedding and ignored: stored once
    scales = {entry["dtype"] for tensor, entry in header.items() if tensor.endswith("_scale")}
    assert scales == {"BF16"}  # 16-bit scales, though calibration computed in FP32 on the CPU
    assert not [tensor for tensor, entry in header.items() if entry.get("dtype") in ("F32", "F64")]


@pytest.mark.parametrize("name", FORMATS)
def test_manifest_records_provenance_and_files(checkpoints: dict[str, Path], name: str, quant_model: Path, quant_calibration: Path) -> None:
    manifest = json.loads((checkpoints[name] / "manifest.json").read_text())
    calibration_manifest = json.loads((quant_calibration / "manifest.json").read_text())
    assert manifest["format"] == name
    assert manifest["calibration"]["fingerprint"] == calibration_manifest["fingerprint"]
    assert manifest["baseline"]["weights_sha256"] == sha256_file(quant_model / "model.safetensors")
    assert manifest["recipe"]["text"] == (checkpoints[name] / "recipe.yaml").read_text()
    assert manifest["provenance"]["libraries"]["llmcompressor"] and manifest["provenance"]["wall_seconds"] > 0
    assert manifest["smoke"]["logits_finite"] is True
    verify_files(checkpoints[name], manifest["files"], name)
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (checkpoints[name] / tokenizer_file).read_bytes() == (quant_model / tokenizer_file).read_bytes()


def test_group_size_fallbacks_are_listed_in_the_manifest(checkpoints: dict[str, Path]) -> None:
    manifest = json.loads((checkpoints["gptq-int4"] / "manifest.json").read_text())
    fallbacks = manifest["group_size"]["fallbacks"]
    assert len(fallbacks) == 2 * 6  # q, k, v, o, gate, up in each of 2 layers have width 192
    assert all(f["in_features"] == 192 and f["group_size"] == 64 for f in fallbacks)
    assert not any("down_proj" in f["layer"] for f in fallbacks)


def test_nan_logits_block_publication(quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(quant_model, tmp_path / "broken"))
    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "ckpt"
    with pytest.raises(QuantizationFailed, match="NaN or Inf logits"):
        quantize.run(quantize.QuantizeConfig(format="fp8-e4m3", fp8_dynamic=True), broken, quant_calibration, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["broken"]


def test_failed_run_leaves_an_existing_checkpoint_untouched(checkpoints: dict[str, Path], quant_model: Path,
                                                           quant_calibration: Path, tmp_path: Path, monkeypatch) -> None:
    import shutil

    out = Path(shutil.copytree(checkpoints["fp8-e4m3"], tmp_path / "ckpt"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(*args, **kwargs):
        raise QuantizationFailed("simulated failure after saving")

    monkeypatch.setattr("quantgate.quantize.stage.smoke_check", crash)
    with pytest.raises(QuantizationFailed):
        quantize.run(quantize.QuantizeConfig(format="gptq-int4"), quant_model, quant_calibration, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("knobs, message", [
    ({"awq_n_grid": 2}, "greater than or equal to 3"),  # with duo scaling the grid's points are i / (n_grid - 2)
    ({"awq_n_grid": 3, "awq_duo_scaling": "both"}, "awq_n_grid must be at least 4"),  # each half: i / (n_grid / 2 - 1)
])
def test_an_awq_grid_too_small_to_search_is_refused(knobs: dict, message: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        quantize.QuantizeConfig(format="awq-int4", **knobs)
    assert quantize.QuantizeConfig(format="awq-int4", awq_n_grid=3).awq_n_grid == 3  # the smallest grid that searches


@pytest.mark.parametrize("name", ["gptq-int4", "mixed"])
def test_no_quantized_model_is_kept_alive_once_it_is_saved(name: str, quant_model: Path, quant_calibration: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The model llmcompressor quantized is freed before the smoke check loads the checkpoint again
    (llmcompressor's global session kept it until the next quantization; so did the caller's frame):
    the whole model was held twice, which is what a 1.5B model's peak showed."""
    import gc
    import weakref

    from quantgate.quantize import stage

    models: list[weakref.ref[object]] = []
    load, smoke = stage._load_model, stage.smoke_check

    def loading(model_dir: Path, dtype: object, *streamed: object) -> object:
        loaded = load(model_dir, dtype, *streamed)
        models.append(weakref.ref(loaded))
        return loaded

    alive_at_smoke: list[bool] = []

    def smoking(checkpoint: Path, dtype: str, *streamed: object) -> object:
        gc.collect()
        alive_at_smoke.append(models[-1]() is not None)
        return smoke(checkpoint, dtype, *streamed)

    monkeypatch.setattr(stage, "_load_model", loading)
    monkeypatch.setattr(stage, "smoke_check", smoking)
    if name == "mixed":
        from tests.test_quantize_mixed import linear_names

        layers = linear_names(quant_model)
        quantize.run_mixed(quantize.MixedConfig(layers={layer: "gptq-int4" for layer in layers}), quant_model, quant_calibration,
                           tmp_path / name)
    else:
        quantize.run(quantize.QuantizeConfig(format=name), quant_model, quant_calibration, tmp_path / name)
    assert alive_at_smoke == [False]
