"""Signed records (gates/signing.py): an approval signed with a key verifies with `quantgate
verify --trust` (alias --public-key) and with model-signing's own verify; a ledger rewritten with a
recomputed chain, a record signed by another key, a changed byte and an unsigned approval are each
refused with the reason and exit 6; a blocked record (signed too) is refused with exit 1; bad keys
are bad input. tests/test_trust.py covers the default key, the trust file and each exit code."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from quantgate.core.errors import InputError
from quantgate.core.exitcodes import Exit
from quantgate.gates import ledger, signing
from quantgate.gates.ledger_record import LedgerRecord
from quantgate.gates.stage import checkpoint_ref, record_verdict
from quantgate.gates.verdict_record import VerdictRecord
from tests.helpers import plan_mapping


def write_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-256 key pair in PEM: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    private.chmod(0o600)  # owner-only, as a private key must be (others' read is refused)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    directory = tmp_path / "keys"
    directory.mkdir()
    (ours, ours_pub), (theirs, theirs_pub) = write_keys(directory, "ours"), write_keys(directory, "theirs")
    return {"private": ours, "public": ours_pub, "other": theirs, "other_public": theirs_pub}


def checkpoint(path: Path, weights: bytes = b"quantized weights") -> Path:
    """What a deployment receives: weights, config, and quantgate's own manifest."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    (path / "manifest.json").write_text('{"kind": "quantized-checkpoint", "format": "gptq-int4"}\n')
    return path


def verdict(ckpt: Path, outcome: str = "approved", policy_version: str = "v2", kl: float = 0.012) -> VerdictRecord:
    return VerdictRecord.from_json({
        "kind": "verdict",
        "format": "gptq-int4",
        "precision": "4bit",
        "checkpoint": checkpoint_ref(ckpt, "gptq-int4").to_json(),
        "policy": {"name": "small-model", "version": policy_version, "sha256": "a" * 64},
        "evalsets": [{"name": "wiki-text", "version": "v1", "sha256": "b" * 64, "limit": 100, "items": 100}],
        "metrics": {"wiki-text@v1 kl_divergence": {"outcome": "pass", "estimate": kl, "low": 0.01, "high": 0.02, "limit": 0.15,
                                                   "unit": "nats"}},
        "verdict": outcome,
        "reasons": [] if outcome == "approved" else ["wiki-text kl_divergence 0.3 above 0.15"],
        "baseline": {"model": "/m", "weights_sha256": "c" * 64},
        "gates": [],
    }, "a test's verdict")


def rewrite(book: Path, edit) -> None:
    """What whoever can write the ledger can do: edit records and recompute the whole chain."""
    records = [json.loads(line) for line in book.read_text().splitlines()]
    records = edit(records)
    previous = ledger.GENESIS
    for record in records:
        record["prev_hash"] = previous
        record["record_hash"] = ledger.record_hash(record)
        previous = record["record_hash"]
    book.write_text("".join(json.dumps(record, sort_keys=True) + "\n" for record in records))
    ledger.read(book)  # the chain holds: only the signature can tell


def model_signing_verify(ckpt: Path, public: Path) -> subprocess.CompletedProcess[str]:
    """model-signing's own command line, as a deployment runs it on the checkpoint alone."""
    return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(ckpt), "--signature",
                           str(ckpt / "model.sig"), "--public_key", str(public)], capture_output=True, text=True, timeout=120)


def test_a_signed_approval_verifies_with_quantgate_and_with_model_signing_alone(cli, keys, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    assert record_verdict(book, verdict(ckpt), keys["private"])
    (record,) = ledger.read(book)
    assert record.signed is True and record.signature is not None
    assert record.signature.key_sha256 == signing.load_public_key(keys["public"]).fingerprint
    assert (ckpt / "model.sig").read_text() == record.signature.bundle

    ok = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert ok.code == 0 and ": approved: approved " in ok.out and "signed by key sha256" in ok.out, ok.out + ok.err
    # the run's trust file beside the ledger holds the key that signed
    assert cli("verify", ckpt, "--ledger", book, "--trust", book.parent / "trusted-keys.pem").code == 0
    plain = cli("verify", ckpt, "--ledger", book)  # no trust file of one's own, none named: nothing is trusted
    assert plain.code == Exit.BAD_INPUT and "give --trust FILE" in plain.err

    # model-signing alone: its Python API and its command line, on the checkpoint directory as shipped
    from model_signing import verifying

    verifying.Config().use_elliptic_key_verifier(public_key=keys["public"]).verify(ckpt, ckpt / "model.sig")
    alone = model_signing_verify(ckpt, keys["public"])
    assert alone.returncode == 0 and "Verification succeeded" in alone.stdout, alone.stderr
    # the approval travels in the signed statement, readable without quantgate
    statement = json.loads(base64.b64decode(json.loads((ckpt / "model.sig").read_text())["dsseEnvelope"]["payload"]))
    approval = statement["predicate"]["quantgate_record"]
    assert approval["verdict"] == "approved" and approval["policy"]["version"] == "v2"
    assert approval["claims_sha256"] == signing.claims_sha256(record)
    assert {resource["name"] for resource in statement["predicate"]["resources"]} == {"model.safetensors", "config.json",
                                                                                      "manifest.json"}
    # a copy elsewhere, under another name, is the same signed files
    copy = Path(shutil.copytree(ckpt, tmp_path / "deployed" / "model"))
    assert cli("verify", copy, "--ledger", book, "--public-key", keys["public"]).code == 0
    assert model_signing_verify(copy, keys["public"]).returncode == 0


def test_a_changed_byte_is_refused_by_both(cli, keys, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt), keys["private"])
    config = ckpt / "config.json"  # not a weight file: only the signature covers it
    original = config.read_bytes()
    config.write_bytes(original[:-2] + b"}\n" if original[-2:] != b"}\n" else original[:-3] + b" }\n")
    refused = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert refused.code == Exit.UNTRUSTED and "changed since the verdict" in refused.out and "config.json changed" in refused.out
    assert model_signing_verify(ckpt, keys["public"]).returncode != 0
    config.write_bytes(original)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    changed = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert changed.code == Exit.UNTRUSTED and "changed since the verdict" in changed.out and "model.safetensors changed" in changed.out


def test_a_record_signed_by_another_key_is_refused(cli, keys, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt), keys["other"])
    refused = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert refused.code == Exit.UNTRUSTED and ": signed by an unknown key: " in refused.out and "trust file does not hold" in refused.out
    assert model_signing_verify(ckpt, keys["public"]).returncode != 0
    assert cli("verify", ckpt, "--ledger", book, "--public-key", keys["other_public"]).code == 0

    # the key hint is not signed: naming our key in it does not make their signature ours
    def forge_hint(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        bundle = json.loads(records[0]["signature"]["bundle"])
        bundle["verificationMaterial"]["publicKey"]["hint"] = signing.load_public_key(keys["public"]).fingerprint
        records[0]["signature"]["bundle"] = json.dumps(bundle)
        return records

    rewrite(book, forge_hint)
    forged = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert forged.code == Exit.UNTRUSTED and ": bad signature: " in forged.out and "does not verify" in forged.out


def test_a_ledger_rewritten_with_a_recomputed_chain_is_refused(cli, keys, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt, policy_version="v1"), keys["private"])
    record_verdict(book, verdict(ckpt, "blocked", policy_version="v2", kl=0.3), keys["private"])
    assert cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"]).code == Exit.BLOCKED  # blocked under v2

    def flip(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The newer block turned into an approval, wearing the older approval's signature."""
        records[1].update(verdict="approved", reasons=[], signed=True, signature=records[0]["signature"])
        return records

    rewrite(book, flip)  # the chain holds (rewrite checks it): only the signature tells
    refused = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert refused.code == Exit.UNTRUSTED and ": ledger rewritten: " in refused.out and "(policy, metrics" in refused.out

    def better_metrics(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[0]["metrics"]["wiki-text@v1 kl_divergence"]["estimate"] = 0.001
        return records[:1]

    rewrite(book, better_metrics)
    metrics = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert metrics.code == Exit.UNTRUSTED and ": ledger rewritten: " in metrics.out and "(metrics differ)" in metrics.out

    def no_bundle(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[0]["signature"]["bundle"] = "{not a bundle"
        return records

    rewrite(book, no_bundle)
    garbage = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert garbage.code == Exit.UNTRUSTED and ": bad signature: " in garbage.out and "not a model-signing bundle" in garbage.out


def mangle(bundle: dict[str, Any], how: str) -> dict[str, Any]:
    envelope = bundle["dsseEnvelope"]
    if how == "no-signatures":
        envelope["signatures"] = []
    elif how == "payload-not-base64":
        envelope["payload"] = "%%% not base64 %%%"
    elif how == "payload-not-json":
        envelope["payload"] = base64.b64encode(b"not json").decode()
    elif how == "payload-swapped":  # a valid statement, but not the one that was signed
        statement = json.loads(base64.b64decode(envelope["payload"]))
        statement["predicate"]["quantgate_record"]["verdict"] = "approved!"
        envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    elif how == "media-type":
        bundle["mediaType"] = "application/octet-stream"
    elif how == "no-hint":
        del bundle["verificationMaterial"]["publicKey"]
    return bundle


@pytest.mark.parametrize("how", ["no-signatures", "payload-not-base64", "payload-not-json", "payload-swapped", "media-type",
                                 "no-hint"])
def test_a_mangled_signature_is_refused_never_a_traceback(cli, keys, tmp_path: Path, how: str) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt), keys["private"])

    def edit(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[0]["signature"]["bundle"] = json.dumps(mangle(json.loads(records[0]["signature"]["bundle"]), how))
        return records

    rewrite(book, edit)
    result = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert result.code == Exit.UNTRUSTED and result.err == "", result.out + result.err
    assert any(f": {status}: " in result.out for status in ("ledger rewritten", "bad signature", "signed by an unknown key")), \
        result.out


def test_an_unsigned_approval_is_refused_and_signed_when_gated_again(cli, keys, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    ledger.append(book, LedgerRecord.of_verdict(verdict(ckpt)))  # as an older quantgate appended it: no key
    assert ledger.read(book)[0].signed is False and not (ckpt / "model.sig").exists()
    refused = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert refused.code == Exit.UNTRUSTED and ": unsigned: " in refused.out

    # the same verdict again with a key is signed and appended; once signed, a rerun appends nothing
    assert record_verdict(book, verdict(ckpt), keys["private"])
    assert not record_verdict(book, verdict(ckpt), keys["private"])
    assert cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"]).code == 0
    # a checkpoint made again, byte for byte, lost its model.sig: the rerun puts the ledger's back
    signed = ledger.read(book)[-1]
    (ckpt / "model.sig").unlink()
    assert not record_verdict(book, verdict(ckpt), keys["private"])
    assert signed.signature is not None
    assert (ckpt / "model.sig").read_text() == signed.signature.bundle and len(ledger.read(book)) == 2


def test_a_blocked_verdict_is_signed_without_model_sig_and_is_refused(cli, keys, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt, "blocked"), keys["private"])
    (record,) = ledger.read(book)
    assert record.signed is True and not (ckpt / "model.sig").exists()
    assert signing.check(record, {signing.load_public_key(keys["public"]).fingerprint: signing.load_public_key(keys["public"])}) \
        .problem is None
    refused = cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"])
    assert refused.code == Exit.BLOCKED and ": blocked: blocked " in refused.out and "kl_divergence 0.3" in refused.out


def test_a_newer_block_takes_the_signature_out_of_the_checkpoint(cli, keys, tmp_path: Path) -> None:
    """Approved under v1 and signed, then blocked under v2: model.sig leaves the checkpoint, so
    model-signing alone no longer accepts what the ledger now blocks."""
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt, policy_version="v1"), keys["private"])
    assert model_signing_verify(ckpt, keys["public"]).returncode == 0
    record_verdict(book, verdict(ckpt, "blocked", policy_version="v2"), keys["private"])
    assert not (ckpt / "model.sig").exists()
    assert cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"]).code == Exit.BLOCKED
    # a signature quantgate did not write is someone else's: left alone
    foreign = checkpoint(tmp_path / "theirs")
    from model_signing import signing as model_signing

    model_signing.Config().use_elliptic_key_signer(private_key=keys["other"]).sign(foreign, foreign / "model.sig")
    record_verdict(book, verdict(foreign, "blocked"), keys["private"])
    assert (foreign / "model.sig").exists()
    # the first approval gated again: the ledger holds it, the block after it decides; no model.sig comes back
    assert not record_verdict(book, verdict(ckpt, policy_version="v1"), keys["private"])
    assert not (ckpt / "model.sig").exists() and len(ledger.read(book)) == 3
    assert ": blocked: " in cli("verify", ckpt, "--ledger", book, "--public-key", keys["public"]).out


def test_a_search_trial_approval_is_signed_in_the_ledger_only(keys, tmp_path: Path) -> None:
    """A trial approved on the search split deploys nothing (docs/search.md): its record is signed
    like every record, but it writes no model.sig; the held-out gate's approval does."""
    ckpt, book = checkpoint(tmp_path / "search-1"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt).with_fields(split="search"), keys["private"])
    assert ledger.read(book)[0].signed is True and not (ckpt / "model.sig").exists()
    record_verdict(book, verdict(ckpt).with_fields(format="search-1@held-out", split="held-out"), keys["private"])
    assert ledger.read(book)[1].signed is True and (ckpt / "model.sig").exists()


def other_keys(directory: Path) -> dict[str, Path]:
    """Key files that are not what the option takes."""
    ed = ed25519.Ed25519PrivateKey.generate()
    k1 = ec.generate_private_key(ec.SECP256K1())
    encrypted = ec.generate_private_key(ec.SECP256R1())
    files = {
        "ed25519.pub": ed.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        "ed25519.pem": ed.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        "secp256k1.pem": k1.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()),
        "encrypted.pem": encrypted.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.BestAvailableEncryption(b"secret")),
        "garbage.pem": b"\xff\xfenot a key\n",
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return {name: directory / name for name in files}


@pytest.mark.parametrize(("name", "message"), [
    ("private", "it holds a private key"),
    ("ed25519.pub", "model-signing signs with ECDSA keys"),
    ("garbage.pem", "no PEM public key in it"),
    ("missing.pub", "cannot read it"),
])
def test_a_bad_public_key_is_bad_input(cli, keys, tmp_path: Path, name: str, message: str) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt), keys["private"])
    path = keys.get(name) or other_keys(keys["private"].parent).get(name) or tmp_path / name
    result = cli("verify", ckpt, "--ledger", book, "--public-key", path)
    assert result.code == 2 and result.err.startswith("quantgate: error: --trust ") and message in result.err
    assert len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize(("name", "message"), [
    ("public", "that is a public key"),
    ("ed25519.pem", "model-signing signs with ECDSA keys"),
    ("secp256k1.pem", "an elliptic-curve key on secp256k1"),
    ("encrypted.pem", "the key is encrypted"),
    ("garbage.pem", "not a PEM private key"),
])
def test_a_bad_signing_key_is_bad_input_before_anything_is_written(keys, tmp_path: Path, name: str, message: str) -> None:
    ckpt, book = checkpoint(tmp_path / "gptq-int4"), tmp_path / "ledger.jsonl"
    path = keys.get(name) or other_keys(keys["private"].parent)[name]
    with pytest.raises(InputError, match=message):
        record_verdict(book, verdict(ckpt), path)
    assert not book.exists() and not (ckpt / "model.sig").exists()


def test_gate_refuses_a_signing_key_without_a_ledger(cli, keys, tmp_path: Path) -> None:
    result = cli("gate", "--baseline", tmp_path, "--candidate", tmp_path, "--signing-key", keys["private"])
    assert result.code == 2 and "give --ledger too" in result.err


def test_model_signing_is_imported_only_when_a_record_is_signed_or_checked() -> None:
    """model-signing is a dependency now, imported where it is used: `quantgate --help`, and the
    modules of `verify` and `gate`, do not pay its second of import time."""
    code = ("import sys\nimport quantgate.cli.gate, quantgate.gates.ledger, quantgate.gates.keys\n"
            "print('LOADED', 'model_signing' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LOADED False" in done.stdout, done.stdout + done.stderr


def test_a_run_signs_its_approvals_and_refuses_a_bad_key_before_any_work(quant_model: Path, keys: dict[str, Path], cli,
                                                                        tmp_path: Path) -> None:
    """`quantgate run --signing-key`: the approved checkpoint carries model.sig, its ledger record
    is signed, and `verify --public-key` accepts it; the plan's own `signing_key` that is no key is
    refused in one line before anything is written."""
    plan = tmp_path / "plan.yaml"
    mapping = plan_mapping(quant_model, tmp_path, formats=["fp8-e4m3"], narrow_policy=["wiki-text"],
                           evaluation={"sets": ["wiki-text"], "items": 4}, calibration={"samples": 4, "seq_len": 32})
    plan.write_text(yaml.safe_dump({**mapping, "signing_key": str(keys["public"])}))
    refused = cli("run", str(plan), "--quiet")
    assert refused.code == 2 and "that is a public key" in refused.err and not (tmp_path / "run").exists()

    result = cli("run", str(plan), "--quiet", "--signing-key", str(keys["private"]))
    assert result.code == 0, result.err
    ckpt = tmp_path / "run" / "checkpoints" / "fp8-e4m3"
    assert (ckpt / signing.SIGNATURE_FILE).is_file()
    [record] = ledger.read(tmp_path / "run" / "ledger.jsonl")
    assert record.verdict == "approved" and record.signed is True
    verified = cli("verify", str(ckpt), "--ledger", str(tmp_path / "run" / "ledger.jsonl"), "--public-key", str(keys["public"]))
    assert verified.code == 0, verified.out
    other = cli("verify", str(ckpt), "--ledger", str(tmp_path / "run" / "ledger.jsonl"), "--public-key", str(keys["other_public"]))
    assert other.code == Exit.UNTRUSTED and "signed by an unknown key" in other.out
    assert cli("verify", str(ckpt), "--ledger", str(tmp_path / "run" / "ledger.jsonl"), "--trust",
               str(tmp_path / "run" / "trusted-keys.pem")).code == Exit.APPROVED
    # the summary prints, per approved checkpoint, the command the deploy side runs: it verifies
    [printed] = [line for line in result.out.splitlines() if line.startswith("before deploying fp8-e4m3: quantgate verify ")]
    command = printed.split(": quantgate ", 1)[1].split()
    assert command[:2] == ["verify", str(ckpt)] and command[-1] == str(tmp_path / "run" / "trusted-keys.pem")
    assert cli(*command).code == Exit.APPROVED
