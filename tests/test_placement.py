"""Streamed stages (quantgate/core/memory.py Placement; docs/models.md, "Streamed stages"): a
quantization or an evaluation that keeps the model on disk (compressed-tensors' disk offload, each
module's weights read when it runs) computes what the in-memory path computes: the same checkpoint
bytes, the same scores. Preflight picks the streamed path where the in-memory one would not fit,
says so, and refuses in one line where even streamed does not fit."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from quantgate import quantize
from quantgate.core import memory
from quantgate.core.errors import InputError
from quantgate.core.memory import Placement
from quantgate.core.models import is_streamed
from quantgate.pipeline.plan import from_mapping
from quantgate.pipeline.runner import Pipeline
from tests.helpers import plan_mapping


def test_the_shape_is_read_from_the_headers(quant_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(quant_model, dtype=torch.float32)
    found = memory.shape(quant_model)
    assert found.parameters == sum(parameter.numel() for parameter in loaded.parameters())
    assert found.largest_layer == max(sum(p.numel() for p in layer.parameters()) for layer in loaded.model.layers)
    assert found.largest_other == loaded.model.embed_tokens.weight.numel()  # the embedding (the head is tied to it)


def test_auto_takes_memory_where_it_fits_and_streams_where_it_does_not() -> None:
    needs = memory.StageNeeds(memory=10 * 10**9, streamed=3 * 10**9)
    roomy = memory.Allowance(12 * 10**9, "the kernel's MemAvailable")
    tight = memory.Allowance(6 * 10**9, "the memory cgroup /x (limit 6.0 GB)")
    assert memory.choose(Placement.auto, needs, roomy, "evaluate").placement is Placement.memory
    assert memory.choose(Placement.auto, needs, None, "evaluate").placement is Placement.memory  # nothing read: as before
    chosen = memory.choose(Placement.auto, needs, tight, "evaluate")
    assert chosen.placement is Placement.streamed and chosen.taken == "streamed"
    assert "streamed from disk, about 3.0 GB" in chosen.reason and "10.0 GB" in chosen.reason and "/x" in chosen.reason
    for asked in (Placement.memory, Placement.streamed):  # asked for: taken as it is
        assert memory.choose(asked, needs, tight if asked is Placement.memory else roomy, "quantize").placement is asked


def test_streamed_needs_grow_with_a_layer_and_the_activations_not_with_the_depth() -> None:
    small = memory.ModelShape(parameters=10**9, largest_layer=4 * 10**7, largest_other=2 * 10**8, vocabulary=150_000,
                              hidden=1536, intermediate=8960)
    deeper = memory.ModelShape(**{**vars(small), "parameters": 4 * 10**9})  # four times the layers
    for stage in ("evaluate", "quantize"):
        assert memory.stage_needs(deeper, stage).memory > 3 * memory.stage_needs(small, stage).memory - 3 * memory.BASE_BYTES
    # streamed, nothing grows with the depth but a quantization's shard, up to its cap: the larger of
    # calibrating (rows, GPTQ's Hessians) and saving (the shard)
    assert memory.stage_needs(deeper, "evaluate").streamed == memory.stage_needs(small, "evaluate").streamed
    calibrating = 16 * 256 * 4 * (4 * 1536 + 2 * 8960) + 4 * (6 * 1536**2 + 3 * 8960**2)
    grown = memory.stage_needs(deeper, "quantize").streamed - memory.stage_needs(small, "quantize").streamed
    assert grown == max(calibrating, memory.SHARD_BYTES) - max(calibrating, 10**9)
    # an evaluation: the larger of a forward's onloaded tensors and scoring's distributions (one item's:
    # tokens x vocabulary, FP32, SCORED_COPIES of them; the batch's logits are not made)
    base = memory.stage_needs(small, "evaluate").streamed
    wider = memory.stage_needs(small, "evaluate", memory.Work(batch=8)).streamed - base
    longer = memory.stage_needs(small, "evaluate", memory.Work(tokens=4096)).streamed - base
    onloaded = 4 * (3 * 4 * 10**7 + 2 * 10**8)
    assert wider == 0 and longer == memory.SCORED_COPIES * 4096 * 150_000 * 4 - max(onloaded, memory.SCORED_COPIES * 512 * 150_000 * 4)


def test_a_mixture_of_experts_counts_every_experts_hessian(tmp_path: Path) -> None:
    # Qwen2-MoE's config names (Qwen1.5-MoE-A2.7B's widths): 60 experts of 1408, a shared expert of
    # 5632; the dense MLP's intermediate_size is there too and no layer uses it
    import json

    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.gate.weight": torch.zeros(60, 8)}, str(tmp_path / "model.safetensors"))
    config = {"hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60,
              "shared_expert_intermediate_size": 5632, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = memory.shape(tmp_path)
    assert (found.experts, found.expert_intermediate, found.shared_intermediate) == (60, 1408, 5632)
    h = 2048
    assert found.hessian_bytes() == 4 * (4 * h**2 + 60 * (2 * h**2 + 1408**2) + (2 * h**2 + 5632**2) + 2 * 5632**2)
    dense = memory.ModelShape(**{**vars(found), "experts": 0, "expert_intermediate": 0, "shared_intermediate": 0})
    assert dense.hessian_bytes() == 4 * (6 * h**2 + 3 * 5632**2)
    # 2.9 GB against the dense formula's 0.5 GB: the difference is in the streamed quantization's estimate
    added = memory.stage_needs(found, "quantize").streamed - memory.stage_needs(dense, "quantize").streamed
    assert added == found.hessian_bytes() - dense.hessian_bytes() > 2 * 10**9
    # DeepSeek's names: n_routed_experts, and n_shared_experts of moe_intermediate_size each
    config = {"hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 512, "n_routed_experts": 16, "n_shared_experts": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    found = memory.shape(tmp_path)
    assert (found.experts, found.expert_intermediate, found.shared_intermediate) == (16, 512, 1024)
    # its first layers' dense MLP (4096 wide) needs more than a layer of experts: the larger is counted
    assert found.hessian_bytes() == 4 * (6 * 1024**2 + 3 * 4096**2)


def _tensors(checkpoint: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    from safetensors.torch import load_file

    loaded = load_file(checkpoint / "model.safetensors")
    return {name: (str(tensor.dtype), tuple(tensor.shape), tensor.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
            for name, tensor in loaded.items()}


@pytest.fixture
def offloaded(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each model the quantize stage loaded (the model, then the smoke check's) was offloaded to disk."""
    from quantgate.quantize import stage

    seen: list[bool] = []
    load = stage.load_causal_lm

    def loading(model_dir: Path, dtype: object, streamed: bool, scratch: Path | None = None) -> object:
        model = load(model_dir, dtype, streamed, scratch)
        seen.append(is_streamed(model))
        return model

    monkeypatch.setattr(stage, "load_causal_lm", loading)
    return seen


@pytest.mark.parametrize("fmt", ["gptq-int4", "smoothquant-w8a8", "fp8-e4m3"])
def test_a_streamed_quantization_writes_the_in_memory_checkpoint(fmt: str, quant_model: Path, quant_calibration: Path,
                                                                  tmp_path: Path, offloaded: list[bool], isolated_home: Path) -> None:
    made = {placement: quantize.run(quantize.QuantizeConfig(format=fmt), quant_model, quant_calibration,
                                    tmp_path / placement.value, placement=placement)
            for placement in (Placement.memory, Placement.streamed)}
    assert offloaded == [False, False, True, True]  # the model and the smoke check's reload, each way
    in_memory, streamed = made[Placement.memory].path, made[Placement.streamed].path
    assert _tensors(streamed) == _tensors(in_memory)  # every tensor: its dtype, shape and bytes
    assert json.loads((streamed / "config.json").read_text()) == json.loads((in_memory / "config.json").read_text())
    assert made[Placement.streamed].manifest.placement == "streamed" and made[Placement.memory].manifest.placement == "memory"
    assert made[Placement.streamed].manifest.smoke.completion == made[Placement.memory].manifest.smoke.completion
    assert not any((isolated_home / "scratch").iterdir())  # each scratch directory (the model's, the smoke check's) removed


def test_a_streamed_mixed_checkpoint_is_the_in_memory_one(quant_model: Path, quant_calibration: Path, tmp_path: Path,
                                                           offloaded: list[bool]) -> None:
    from tests.test_quantize_mixed import linear_names

    layers = linear_names(quant_model)
    # the first decoder layer in INT4, the second in W8A8 (a fused group's layers share a format)
    cfg = quantize.MixedConfig(layers={layer: ("gptq-int4" if ".layers.0." in layer else "smoothquant-w8a8") for layer in layers})
    in_memory = quantize.run_mixed(cfg, quant_model, quant_calibration, tmp_path / "memory", placement=Placement.memory).path
    streamed = quantize.run_mixed(cfg, quant_model, quant_calibration, tmp_path / "streamed", placement=Placement.streamed).path
    assert _tensors(streamed) == _tensors(in_memory)
    assert offloaded == [False, False, True, True]


def test_autoawq_refuses_to_stream(quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="AutoAWQ quantizes the model in memory"):
        quantize.run(quantize.QuantizeConfig(format="awq-int4", backend="autoawq"), quant_model, quant_calibration, tmp_path / "out",
                     placement=Placement.streamed)
    assert not (tmp_path / "out").exists()


def _close(left: Any, right: Any, tolerance: float) -> bool:
    """Equal, numbers within `tolerance` (nats, for log-probabilities), nested lists and mappings alike."""
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_close(left[key], right[key], tolerance) for key in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(_close(a, b, tolerance) for a, b in zip(left, right, strict=True))
    if isinstance(left, float) and isinstance(right, float):
        return math.isclose(left, right, abs_tol=tolerance) or (math.isnan(left) and math.isnan(right))
    return bool(left == right)


def test_preflight_streams_where_memory_does_not_hold_a_stage_and_says_so(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's layers are small beside its embedding, so its streamed estimate is not the
    smaller one: the needs are set here to a large model's proportions (the 1.5B model's)."""
    monkeypatch.setattr(memory, "stage_needs", lambda found, stage, work=None: memory.StageNeeds(memory=12 * 10**9, streamed=4 * 10**9))
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(6 * 10**9, "the memory cgroup /sys/fs/cgroup/test (limit 6.0 GB)"))
    resolved = Pipeline(from_mapping(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"])), show_progress=False).preflight()
    assert resolved.quantize_placement is Placement.streamed and resolved.eval_cfg.placement is Placement.streamed
    assert resolved.memory_note is not None and resolved.memory_note.count("streamed from disk") == 2
    assert resolved.models_kept == 1  # two streamed models and a quantization: 3 x 3 GB past the libraries, more than 6 GB

    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(3 * 10**9, "the memory cgroup /sys/fs/cgroup/test (limit 3.0 GB)"))
    with pytest.raises(InputError) as refused:
        Pipeline(from_mapping(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"])), show_progress=False).preflight()
    assert "even streamed from disk" in str(refused.value) and "\n" not in str(refused.value)


def test_a_run_asked_to_stream_gives_the_in_memory_verdicts(quant_model: Path, tmp_path: Path, cli: Callable[..., Any],
                                                             isolated_home: Path) -> None:
    """`placement: streamed` in a plan: every quantization and evaluation streamed (their manifests
    say so), and the verdicts, gate estimates and checkpoints those of the same plan in memory."""
    runs = {}
    for placement in ("memory", "streamed"):
        plan = tmp_path / f"{placement}.yaml"
        (tmp_path / placement).mkdir()
        plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path / placement, formats=["gptq-int4"], placement=placement)))
        result = cli("run", plan, "--quiet")
        assert result.code in (0, 1), result.err
        runs[placement] = tmp_path / placement / "run"
    streamed, in_memory = runs["streamed"], runs["memory"]
    # every unit ran in a forked child that exits without finalizers: each removed its scratch directory itself
    assert not any((isolated_home / "scratch").iterdir())
    manifest = json.loads((streamed / "checkpoints" / "gptq-int4" / "manifest.json").read_text())
    assert manifest["placement"] == "streamed"
    record = json.loads((streamed / "run.json").read_text())
    assert record["placement"] == {"quantize": "streamed", "evaluate": "streamed"}
    assert json.loads((in_memory / "run.json").read_text())["placement"] == {"quantize": "memory", "evaluate": "memory"}
    assert _tensors(streamed / "checkpoints" / "gptq-int4") == _tensors(in_memory / "checkpoints" / "gptq-int4")
    verdict = {name: json.loads((run / "verdicts" / "gptq-int4.json").read_text())["value"] for name, run in runs.items()}
    assert verdict["streamed"]["verdict"] == verdict["memory"]["verdict"]
    assert _close(verdict["streamed"]["gates"], verdict["memory"]["gates"], 1e-4)
    assert _close(verdict["streamed"]["metrics"], verdict["memory"]["metrics"], 1e-4)
    # the placement is in no stage's key: the streamed run resumed in memory redoes nothing
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path / "streamed", formats=["gptq-int4"], placement="memory")))
    assert cli("run", again, "--quiet").code in (0, 1)
    stages = json.loads((streamed / "run.json").read_text())["stages"]
    assert stages and all(stage["status"] in ("reused", "skipped") for stage in stages), [
        (stage["stage"], stage["status"]) for stage in stages if stage["status"] not in ("reused", "skipped")]


def test_streaming_an_evaluation_on_a_gpu_is_refused_before_any_work(quant_model: Path, tmp_path: Path) -> None:
    plan = plan_mapping(quant_model, tmp_path, formats=["gptq-int4"], placement="streamed")
    plan["evaluation"]["device"] = "cuda"
    with pytest.raises(InputError, match="evaluation streams on the CPU, and this plan evaluates on cuda"):
        Pipeline(from_mapping(plan), show_progress=False).preflight()
    assert not (tmp_path / "run").exists()


def test_a_streamed_run_without_the_disk_for_its_scratch_is_refused_before_any_work(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Any]) -> None:
    """A streamed quantization writes its changed weights to the scratch directory and a streamed
    candidate its decompressed ones, in FP32: a disk with less free than that refuses the plan in
    preflight, in one line (exit 2), not after the quantization; in memory the disk is not asked."""
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(6 * 10**9, "the memory cgroup /sys/fs/cgroup/test (limit 6.0 GB)"))
    needs = memory.scratch_needs(memory.shape(quant_model))
    assert needs == 4 * memory.shape(quant_model).parameters
    monkeypatch.setattr(memory, "disk_free", lambda folder: memory.Allowance(needs - 1, f"the disk of {folder}"))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"], placement="streamed")))
    result = cli("run", plan, "--quiet")
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert result.err.startswith("quantgate: error: plan: streamed from disk, a stage writes up to about") and "scratch" in result.err
    assert "QUANTGATE_HOME" in result.err and not (tmp_path / "run").exists()
    # in memory nothing is written there: the same disk does not stop it
    resolved = Pipeline(from_mapping(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"], placement="memory")),
                        show_progress=False).preflight()
    assert resolved.quantize_placement is Placement.memory
    # enough free: the streamed plan passes preflight
    monkeypatch.setattr(memory, "disk_free", lambda folder: memory.Allowance(needs, f"the disk of {folder}"))
    resolved = Pipeline(from_mapping(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"], placement="streamed")),
                        show_progress=False).preflight()
    assert resolved.quantize_placement is Placement.streamed


def test_disk_free_reads_the_nearest_existing_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    asked = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: asked.append(Path(path)) or SimpleNamespace(total=10, used=4, free=6))
    found = memory.disk_free(tmp_path / "not" / "yet")  # the scratch directory is made on first use
    assert asked == [tmp_path] and found.bytes == 6 and str(tmp_path / "not" / "yet") in found.source


def test_a_search_counts_its_sensitivity_in_memory(quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's sensitivity takes gradients of every weight: in memory whatever the placement."""
    monkeypatch.setattr(memory, "stage_needs", lambda found, stage, work=None: memory.StageNeeds(memory=12 * 10**9, streamed=4 * 10**9))
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(6 * 10**9, "the memory cgroup /sys/fs/cgroup/test (limit 6.0 GB)"))
    from tests.test_pipeline_search import search_plan

    plan = search_plan(quant_model, tmp_path, max_trials=1)
    with pytest.raises(InputError, match=r"the search's sensitivity \(in memory only\) 12.0 GB"):
        Pipeline(from_mapping(plan), show_progress=False).preflight()


def test_a_placement_that_is_not_one_is_refused_in_one_line(cli: Callable[..., Any], tmp_path: Path) -> None:
    result = cli("quantize", "--model", str(tmp_path), "--format", "gptq-int4", "--calibration", str(tmp_path),
                 "--out", str(tmp_path / "out"), "--placement", "gpu")
    assert result.code == 2 and "invalid placement: 'gpu' (auto, memory or streamed)" in result.err
    assert result.err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_scratch_directories_of_dead_processes_on_this_machine_are_swept(tmp_path: Path) -> None:
    from quantgate.core import models

    dead = 2**22 + 1  # above the kernel's pid_max default: no such process
    gone = tmp_path / f"{models._scratch_prefix(dead)}-abc"
    alive = tmp_path / f"{models._scratch_prefix(1)}-abc"  # pid 1 runs
    other_host = tmp_path / f"streamed-another_machine-{dead}-abc"  # a node sharing the home: not looked up here
    for folder in (gone, alive, other_host):
        folder.mkdir()
    models._sweep(tmp_path)
    assert not gone.exists() and alive.exists() and other_host.exists()


def test_single_commands_streamed_without_the_disk_for_their_scratch_are_refused(
        quant_model: Path, quant_calibration: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Any]) -> None:
    """`quantize --placement streamed` writes the weights it quantizes to the scratch directory, an
    evaluation of a compressed checkpoint streamed its decompressed weights: each is refused in one
    line, exit 2, nothing at --out, where the disk has less free; a streamed baseline writes
    nothing there and is not asked."""
    from quantgate import evalsets

    needs = memory.scratch_needs(memory.shape(quant_model))
    monkeypatch.setattr(memory, "disk_free", lambda folder: memory.Allowance(needs - 1, f"the disk of {folder}"))
    out = tmp_path / "out"
    result = cli("quantize", "--model", quant_model, "--format", "gptq-int4", "--calibration", quant_calibration, "--out", out,
                 "--placement", "streamed")
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert result.err.startswith("quantgate: error: quantize: streamed from disk, a stage writes up to about") and not out.exists()
    compressed = tmp_path / "compressed"
    compressed.mkdir()
    config = json.loads((quant_model / "config.json").read_text())
    (compressed / "config.json").write_text(json.dumps({**config, "quantization_config": {"format": "pack-quantized"}}))
    for found in quant_model.iterdir():  # its weights, tokenizer and the rest as they are
        if found.name != "config.json":
            (compressed / found.name).symlink_to(found)
    cfg = evalsets.EvaluateConfig(evalsets=("wiki-text",), placement=Placement.streamed)
    with pytest.raises(InputError, match=r"^evaluate: streamed from disk, a stage writes up to about"):
        evalsets.Evaluator(compressed).placement(cfg, "cpu")
    assert evalsets.Evaluator(quant_model).placement(cfg, "cpu").placement is Placement.streamed
    monkeypatch.setattr(memory, "disk_free", lambda folder: memory.Allowance(needs, f"the disk of {folder}"))
    assert evalsets.Evaluator(compressed).placement(cfg, "cpu").placement is Placement.streamed
