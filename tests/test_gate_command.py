"""`quantgate gate` (and `verify`) on the tiny model: an identical candidate is approved, a
candidate with corrupted scales or FP32 embeddings is blocked with the reason, a policy edit
changes the verdict, an edited ledger and a changed checkpoint fail `verify`, and a signed approval
verifies with quantgate and with model-signing alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantgate import evalsets
from quantgate.core.exitcodes import Exit
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import TINY_POLICY, plan_mapping, write_policy


@pytest.fixture(scope="module")
def run_dir(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gate-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("gate-run-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    return root / "run"


def evaluate(model: Path, run_dir: Path, out: Path) -> Path:
    cfg = evalsets.EvaluateConfig(evalsets=("wiki-text@v1", "lambada@v1"), limit=4)
    return evalsets.run(cfg, model, out, baseline_results=run_dir / "results" / "baseline").path


def gate(cli, run_dir: Path, candidate: Path, policy: Path, *extra: str):
    return cli("gate", "--baseline", run_dir / "results" / "baseline", "--candidate", candidate, "--policy", policy, *extra)


def test_identical_candidate_is_approved(cli, run_dir: Path, quant_model: Path, tmp_path: Path) -> None:
    twin = Path(shutil.copytree(quant_model, tmp_path / "twin"))
    results = evaluate(twin, run_dir, tmp_path / "twin-results")
    policy = write_policy(tmp_path / "policy.yaml")
    result = gate(cli, run_dir, results, policy, "--precision", "8bit", "--json")
    assert result.code == 0, result.out + result.err
    record = json.loads(result.out)
    assert record["verdict"] == "approved" and record["reasons"] == []
    gates = {entry["gate"]: entry for entry in record["gates"]}
    assert gates["wiki-text@v1 kl_divergence"]["estimate"] == pytest.approx(0.0, abs=1e-9)
    assert gates["wiki-text@v1 top1_agreement"]["estimate"] == 1.0
    assert gates["lambada@v1 acc"]["estimate"] == 0.0 and gates["lambada@v1 acc"]["low"] == gates["lambada@v1 acc"]["high"] == 0.0
    # a foreign checkpoint names no format: the thresholds to use must be given
    unknown = gate(cli, run_dir, results, policy)
    assert unknown.code == 2 and "give --precision 8bit or 4bit" in unknown.err


def corrupt_scales(checkpoint: Path, out: Path) -> Path:
    """A copy of a checkpoint whose INT4 group scales are scrambled: same bytes, broken numerics."""
    import torch
    from safetensors.torch import load_file, save_file

    damaged = Path(shutil.copytree(checkpoint, out))
    (damaged / "manifest.json").unlink()  # no longer the checkpoint quantgate made
    tensors = load_file(damaged / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("weight_scale"):
            factors = torch.exp(torch.randn(tensor.shape, generator=generator) * 1.5).to(tensor.dtype)
            tensors[name] = tensor * factors
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    return damaged


def test_candidate_with_corrupted_scales_is_blocked_for_its_numerics(cli, run_dir: Path, tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml")
    honest = gate(cli, run_dir, run_dir / "results" / "gptq-int4", policy, "--json")
    assert honest.code == 0, honest.out
    damaged = corrupt_scales(run_dir / "checkpoints" / "gptq-int4", tmp_path / "damaged")
    results = evaluate(damaged, run_dir, tmp_path / "damaged-results")
    result = gate(cli, run_dir, results, policy, "--precision", "4bit", "--json")
    assert result.code == 1
    record = json.loads(result.out)
    outcomes = {entry["gate"]: entry["outcome"] for entry in record["gates"]}
    assert outcomes["wiki-text@v1 kl_divergence"] == "fail"
    assert outcomes["size bits_per_weight"] == "pass" and outcomes["size unexplained_bytes"] == "pass"  # same bytes
    kl = next(reason for reason in record["reasons"] if "kl_divergence" in reason)
    assert kl.startswith("wiki-text kl_divergence ") and kl.endswith("exceeds 0.0500")
    honest_kl = json.loads(honest.out)["metrics"]["wiki-text@v1 kl_divergence"]["estimate"]
    assert record["metrics"]["wiki-text@v1 kl_divergence"]["estimate"] > 10 * honest_kl


def test_fp32_embeddings_under_a_bf16_baseline_are_blocked_by_the_size_gate(cli, run_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint = Path(shutil.copytree(run_dir / "checkpoints" / "fp8-e4m3", tmp_path / "wide"))
    tensors = load_file(checkpoint / "model.safetensors")
    name = next(key for key in tensors if key.endswith("embed_tokens.weight"))
    tensors[name] = tensors[name].to(torch.float32)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    result = gate(cli, run_dir, run_dir / "results" / "fp8-e4m3", write_policy(tmp_path / "policy.yaml"),
                  "--checkpoint", checkpoint, "--json")
    assert result.code == 1
    (reason,) = json.loads(result.out)["reasons"]
    assert reason.startswith("size: ") and "bytes the format does not explain" in reason and "embed_tokens" in reason


def test_policy_edit_changes_the_verdict(cli, run_dir: Path, tmp_path: Path) -> None:
    candidate = run_dir / "results" / "gptq-int4"
    loose = gate(cli, run_dir, candidate, write_policy(tmp_path / "loose.yaml"))
    assert loose.code == 0 and loose.out.startswith("approved gptq-int4 (4bit thresholds)")
    strict = write_policy(tmp_path / "strict.yaml", TINY_POLICY.replace("min_value: {8bit: 0.90, 4bit: 0.80}", "min_value: {8bit: 0.90, 4bit: 0.9999}"))
    blocked = gate(cli, run_dir, candidate, strict)
    assert blocked.code == 1 and blocked.out.startswith("blocked gptq-int4")
    assert "FAIL  wiki-text top1_agreement" in blocked.out and "is below 0.9999" in blocked.out


def test_ledger_records_verify_and_detect_edits_and_changes(cli, run_dir: Path, tmp_path: Path) -> None:
    checkpoint = Path(shutil.copytree(run_dir / "checkpoints" / "gptq-int4", tmp_path / "deploy"))
    ledger = tmp_path / "ledger.jsonl"
    missing = cli("verify", checkpoint, "--ledger", ledger)  # no ledger yet: bad input, not a verdict
    assert missing.code == 2 and missing.err == f"quantgate: error: ledger {ledger} does not exist\n"
    approved = gate(cli, run_dir, run_dir / "results" / "gptq-int4", write_policy(tmp_path / "policy.yaml"),
                    "--checkpoint", checkpoint, "--ledger", ledger)
    assert approved.code == 0
    ok = cli("verify", checkpoint, "--ledger", ledger)  # signed by this user's own key, made by that first gate
    assert ok.code == 0 and ": approved: approved " in ok.out
    # the run's own ledger approves the run's own checkpoint, under the trust file the run wrote (its
    # key is another QUANTGATE_HOME's: this user's trust file does not hold it)
    own = run_dir / "checkpoints" / "gptq-int4", "--ledger", run_dir / "ledger.jsonl"
    assert cli("verify", *own, "--trust", run_dir / "trusted-keys.pem").code == Exit.APPROVED
    untrusted = cli("verify", *own)
    assert untrusted.code == Exit.UNTRUSTED and ": signed by an unknown key: " in untrusted.out, untrusted.out

    edited = tmp_path / "edited.jsonl"
    record = json.loads(ledger.read_text())
    record["precision"] = "8bit"  # looser thresholds, claimed after the fact
    edited.write_text(json.dumps(record, sort_keys=True) + "\n")
    tampered = cli("verify", checkpoint, "--ledger", edited)
    assert tampered.code == Exit.UNTRUSTED and "ledger tampered" in tampered.out

    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    changed = cli("verify", checkpoint, "--ledger", ledger)
    assert changed.code == Exit.UNTRUSTED and "changed since the verdict" in changed.out and "model.safetensors changed" in changed.out


def test_gate_signs_an_approval_that_model_signing_verifies_alone(cli, run_dir: Path, tmp_path: Path) -> None:
    """`gate --signing-key` on a real checkpoint (weights, config, tokenizer, recipe, quantgate's
    manifest): model.sig lands in the checkpoint, `verify --public-key` accepts it, and so does
    `model_signing verify key` on the directory alone."""
    import subprocess
    import sys

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = tmp_path / "key.pem", tmp_path / "key.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    private.chmod(0o600)  # owner-only, as a private key must be
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    checkpoint = Path(shutil.copytree(run_dir / "checkpoints" / "gptq-int4", tmp_path / "deploy"))
    ledger = tmp_path / "ledger.jsonl"
    signed = gate(cli, run_dir, run_dir / "results" / "gptq-int4", write_policy(tmp_path / "policy.yaml"),
                  "--checkpoint", checkpoint, "--ledger", ledger, "--signing-key", private)
    assert signed.code == 0 and f"signed: {checkpoint.resolve() / 'model.sig'}" in signed.out, signed.out + signed.err
    ok = cli("verify", checkpoint, "--ledger", ledger, "--public-key", public)
    assert ok.code == 0 and "signed by key sha256" in ok.out, ok.out
    alone = subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(checkpoint), "--signature",
                            str(checkpoint / "model.sig"), "--public_key", str(public)], capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
