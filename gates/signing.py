"""Signed approvals: an approved checkpoint signed in the OpenSSF model signing format
(`model-signing` 1.x), with the approval bound to the signature as claims of the signed statement.

What is signed: model-signing's own in-toto statement over the sha256 of every file of the
checkpoint directory (`model.sig` and git files excepted, as model-signing does), whose predicate
carries one more field, `quantgate_approval`: the approval's summary (verdict, format, policy,
golden sets, metrics, weights, time) and `claims_sha256`, the sha256 of the whole ledger record
as it is appended (every field but the ledger's own chain fields and the signature itself). The
format reserves the predicate for such extensions: a v1.0 verifier reads `serialization` and
`resources` and ignores any other field (model_signing/_signing/signing.py, `Payload`), so
`model_signing verify key` checks the file itself. It is a DSSE envelope in a Sigstore bundle,
written to `<checkpoint>/model.sig`; the ledger record carries the same bundle (the record, its
signature and the checkpoint are tied together there), the public key's fingerprint and
`claims_sha256`.

The public API of model-signing signs a manifest with no room for claims, so the statement is
built with the classes its `signing.Config.sign` uses (`_signing.signing.Payload`,
`_signing.sign_ec_key.Signer`): no cryptography is written here. Checking the files uses its
public `verifying.Config`, the code `model_signing verify key` runs.
"""

# model_signing (the `signing` extra) is imported inside the functions that use it: it is an
# optional dependency, and importing it costs about a second (it loads sigstore), which
# `quantgate --help` and every run without a key must not pay.

from __future__ import annotations

import base64
import json
import math
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import JsonValue

from quantgate.core.artifacts import atomic_file, remove_temporaries, sha256_bytes, sha256_json
from quantgate.core.errors import InputError
from quantgate.core.models import is_weight_file
from quantgate.gates.ledger_record import LedgerRecord, Signature

SIGNATURE_FILE = "model.sig"  # model-signing's default name for a signature
CLAIMS_FIELD = "quantgate_approval"  # the statement's predicate field that carries the approval
FORMAT = "model-signing v1.0 (in-toto statement in a DSSE envelope in a Sigstore bundle v0.3)"
# What the ledger adds when it appends a record (gates/ledger.py): not part of the signed claims.
LEDGER_FIELDS = frozenset({"schema_version", "quantgate_version", "prev_hash", "record_hash", "signature"})
# The approval's fields a deployment reads in the signature itself (all are bound by claims_sha256).
SUMMARY_FIELDS = ("kind", "format", "precision", "verdict", "split", "policy", "evalsets", "metrics", "baseline",
                  "time", "verdict_sha256")
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing 1.x's key signer accepts
INSTALL = "pip install 'quantgate[signing]'"


@dataclass(frozen=True)
class Key:
    """A key file checked for its role; `fingerprint` is model-signing's key hint: the sha256 of
    the public key's PEM (SubjectPublicKeyInfo), the same for the private key and its public half."""

    path: Path
    fingerprint: str
    public_pem: bytes


class Problem(str, Enum):
    unsigned = "unsigned"
    wrong_key = "signed by another key"
    rewritten = "ledger rewritten"
    changed = "changed since approval"


@dataclass(frozen=True)
class Check:
    """The outcome of checking an approved record's signature: `problem` None when it holds."""

    problem: Problem | None
    reason: str


def _library() -> SimpleNamespace:
    """model_signing's modules, or one line saying how to install them."""
    try:
        # the optional `signing` extra, deferred (see the top of this module)
        from model_signing import hashing, verifying
        from model_signing._signing import sign_ec_key, sign_sigstore_pb
        from model_signing._signing import signing as statement
        from sigstore_models.bundle import v1 as bundle_pb
    except ImportError as error:
        raise InputError(f"signing needs model-signing and pyopenssl, which are not installed ({error}): {INSTALL}") from error

    return SimpleNamespace(hashing=hashing, verifying=verifying, ec_key=sign_ec_key, sigstore_pb=sign_sigstore_pb,
                           statement=statement, bundle_pb=bundle_pb)


def _key_bytes(path: Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InputError(f"{option} {path}: cannot read it ({error.strerror or error})") from error


def _public_pem(public_key: Any) -> bytes:
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.hazmat.primitives import serialization

    return bytes(public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def _check_curve(key: Any, path: Path, option: str) -> None:
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.hazmat.primitives.asymmetric import ec

    public = key.public_key() if hasattr(key, "public_key") else key
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name not in CURVES:
        kind = f"an elliptic-curve key on {public.curve.name}" if isinstance(public, ec.EllipticCurvePublicKey) \
            else f"a key of type {type(public).__name__.removeprefix('_').replace('PublicKey', '')}"
        raise InputError(f"{option} {path}: {kind}; model-signing signs with ECDSA keys on P-256, P-384 or P-521 only "
                         "(make one: openssl ecparam -name prime256v1 -genkey -noout -out key.pem)")


def load_signing_key(path: Path, option: str = "--signing-key") -> Key:
    """The private key (PEM, unencrypted, ECDSA P-256/P-384/P-521) that signs approvals; one
    InputError line for anything else (a public key, an encrypted or foreign key, not PEM)."""
    _library()
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _key_bytes(path, option)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as error:  # cryptography: "Password was not given but private key is encrypted"
        raise InputError(f"{option} {path}: the key is encrypted; quantgate reads an unencrypted PEM key "
                         "(decrypt it to a file only you can read: openssl pkey -in KEY -out key.pem)") from error
    except (ValueError, UnsupportedAlgorithm) as error:
        if _is_public(data):
            raise InputError(f"{option} {path}: that is a public key; signing takes the private key (PEM) "
                             "whose public half verifies") from error
        raise InputError(f"{option} {path}: not a PEM private key ({str(error).splitlines()[0] if str(error) else 'unreadable'})") \
            from error
    _check_curve(key, path, option)
    public = _public_pem(key.public_key())
    return Key(Path(path), sha256_bytes(public), public)


def _is_public(data: bytes) -> bool:
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        return False
    return True


def load_public_key(path: Path, option: str = "--public-key") -> Key:
    """The public key (PEM) that verifies approvals; one InputError line for anything else (a
    private key, which never belongs on a deployment machine, included)."""
    _library()
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _key_bytes(path, option)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as error:
        if b"PRIVATE KEY" in data:
            raise InputError(f"{option} {path}: that is a private key; verifying takes its public half "
                             "(openssl ec -in KEY -pubout -out key.pub), and the private key stays off this machine") from error
        raise InputError(f"{option} {path}: not a PEM public key ({str(error).splitlines()[0] if str(error) else 'unreadable'})") \
            from error
    _check_curve(key, path, option)
    public = _public_pem(key)
    return Key(Path(path), sha256_bytes(public), public)


# The claims of a ledger record (`claims`) and the approval a signature carries (`summary`): JSON
# that is hashed whole, or compared field by field with a record's (`_differing`).
Claims = dict[str, JsonValue]


def _normal(record: LedgerRecord) -> Claims:
    """The record as the ledger's JSON gives it back (what a reader of the ledger hashes)."""
    normal: Claims = json.loads(json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False))
    return normal


def claims(record: LedgerRecord) -> Claims:
    """What a signature binds of a ledger record: all of it but the ledger's own fields."""
    return {key: value for key, value in _normal(record).items() if key not in LEDGER_FIELDS}


def claims_sha256(record: LedgerRecord) -> str:
    return sha256_json(claims(record))


def _json_safe(value: JsonValue) -> JsonValue:
    """A value a protobuf Struct holds: a non-finite number as its name (NaN has no JSON form)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


def summary(record: LedgerRecord) -> Claims:
    """The approval as the signed statement carries it, for a reader of model.sig alone."""
    normal = claims(record)
    found: Claims = {field: normal[field] for field in SUMMARY_FIELDS if field in normal}
    found["weights"] = None if record.weights is None else dict(record.weights)
    safe = _json_safe(found)
    assert isinstance(safe, dict)
    return {**safe, "claims_sha256": sha256_json(normal)}


def _signature_entry(text: str, key: Key, record: LedgerRecord) -> Signature:
    return Signature(format=FORMAT, file=SIGNATURE_FILE, bundle=text, bundle_sha256=sha256_bytes(text.encode("utf-8")),
                     key_sha256=key.fingerprint, claims_sha256=claims_sha256(record))


def _hash_checkpoint(ms: Any, checkpoint: Path) -> Any:
    """model-signing's manifest of the checkpoint: every file but model.sig (and git files)."""
    config = ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE], ignore_git_paths=True)
    try:
        return config.hash(checkpoint)
    except (ValueError, OSError) as error:  # a symlink (refused by default), an unreadable file
        raise InputError(f"cannot sign checkpoint {checkpoint}: {error}") from error


def sign(checkpoint: Path, record: LedgerRecord, key: Key) -> Signature:
    """Sign the approval `record` (as it will be appended, `time` included) over the checkpoint's
    files: writes `<checkpoint>/model.sig` and returns the record's `signature` entry. The files
    signed must hold the weights the record approves (their sha256s are compared, not hashed twice)."""
    ms = _library()
    checkpoint = Path(checkpoint)
    remove_temporaries(checkpoint, only_stale=True)  # a killed model.sig write's leftover is no file of the checkpoint
    manifest = _hash_checkpoint(ms, checkpoint)
    hashed = {descriptor.identifier: descriptor.digest.digest_hex for descriptor in manifest.resource_descriptors()}
    weights = {name: digest for name, digest in hashed.items() if is_weight_file(name)}
    if weights != record.weights:
        raise InputError(f"checkpoint {checkpoint}: its weight files are not the ones the verdict approved; refusing to sign")
    payload = ms.statement.Payload(manifest)
    # the format's room for extensions: a v1.0 verifier ignores predicate fields it does not know
    payload.statement.pb.predicate.update({CLAIMS_FIELD: summary(record)})
    try:
        bundle = ms.ec_key.Signer(key.path).sign(payload).bundle
    except (ValueError, TypeError, OSError) as error:  # the key file changed since it was checked
        raise InputError(f"--signing-key {key.path}: cannot sign with it ({error})") from error
    text: str = bundle.to_json()
    write_signature(checkpoint, text)
    return _signature_entry(text, key, record)


def write_signature(checkpoint: Path, text: str) -> None:
    """`<checkpoint>/model.sig`, atomically (model-signing's own `write` is a plain write_text)."""
    with atomic_file(Path(checkpoint) / SIGNATURE_FILE) as stream:
        stream.write(text.encode("utf-8"))


def restore(checkpoint: Path, record: LedgerRecord, key: Key) -> bool:
    """If `record` is signed by `key` and its signature still holds for the checkpoint's files,
    make sure `<checkpoint>/model.sig` is that signature (a checkpoint made again, byte for byte,
    lost it) and return True; False when the record cannot stand for these files."""
    signature = record.signature
    if not record.signed or signature is None or signature.key_sha256 != key.fingerprint:
        return False
    if check(checkpoint, record, key).problem is not None:
        return False
    target = Path(checkpoint) / SIGNATURE_FILE
    text = signature.bundle
    if not target.is_file() or target.read_bytes() != text.encode("utf-8"):
        write_signature(checkpoint, text)
    return True


def withdraw(checkpoint: Path) -> bool:
    """Remove `<checkpoint>/model.sig` if it is a signed quantgate approval (a model-signing
    signature that carries `quantgate_approval`; anyone else's is left alone): called when a
    newer verdict blocks the checkpoint. True if removed. Reads JSON only: no library needed."""
    target = Path(checkpoint) / SIGNATURE_FILE
    try:
        envelope = json.loads(target.read_text(encoding="utf-8"))["dsseEnvelope"]
        statement = json.loads(base64.b64decode(envelope["payload"], validate=True))
        ours = CLAIMS_FIELD in statement["predicate"]
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one quantgate wrote
        return False
    if ours:
        target.unlink(missing_ok=True)
    return bool(ours)


def describe(record: LedgerRecord) -> str:
    """How an approval is signed, for `verify` without a key."""
    signature = record.signature
    if record.signed and signature is not None:
        return f"signed (key sha256 {signature.key_sha256[:16]}...; check it with --public-key)"
    return "unsigned (no signing key was given when it was recorded)"


def _bundle(ms: Any, text: Any) -> Any:
    if not isinstance(text, str):
        raise ValueError("no bundle")
    return ms.sigstore_pb.Signature(ms.bundle_pb.Bundle.from_json(text))


def _differing(record: LedgerRecord, signed: dict[str, object]) -> list[str]:
    """The summary fields where the record and its signed approval disagree."""
    mine = summary(record)
    return [field for field in (*SUMMARY_FIELDS, "weights") if mine.get(field) != signed.get(field)]


def check(checkpoint: Path, record: LedgerRecord, key: Key) -> Check:
    """Does this approved record carry a signature by `key` over its own claims, and do the
    checkpoint's files match the files it signed? The first problem found, in that order."""
    signature = record.signature
    if not record.signed or signature is None:
        return Check(Problem.unsigned, "approved without a signature (no signing key was given when it was recorded)")
    ms = _library()
    try:
        bundle = _bundle(ms, signature.bundle)
        hint = bundle.bundle.verification_material.public_key.hint
    except Exception:  # any bytes a rewriter put there: whatever the parser raises, it is no bundle
        return Check(Problem.rewritten, "the record's signature is not a model-signing bundle: the ledger was rewritten")
    if hint != key.fingerprint:
        return Check(Problem.wrong_key, f"signed by another key (sha256 {str(hint)[:16]}...), not by {key.path} "
                     f"(sha256 {key.fingerprint[:16]}...)")
    with tempfile.TemporaryDirectory(prefix="quantgate-verify-") as scratch:
        public = Path(scratch) / "key.pub"  # the public half as checked (the key given may be the private one)
        public.write_bytes(key.public_pem)
        problem = _check_statement(ms, bundle, public, record, signature=signature, key=key)
        if problem is not None:
            return problem
        return _check_files(ms, Path(checkpoint), signature.bundle, public, key)


def _check_statement(ms: Any, bundle: Any, public: Path, record: LedgerRecord, *, signature: Signature, key: Key) -> Check | None:
    """The signature over the statement, and the statement's approval against the record."""
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import InvalidSignature

    try:
        ms.ec_key.Verifier(public).verify(bundle)
        payload = json.loads(bundle.bundle.dsse_envelope.payload)
        signed = payload["predicate"].get(CLAIMS_FIELD)
    except InvalidSignature:
        return Check(Problem.wrong_key, f"its signature does not verify with {key.path}: made by another key, or altered")
    except Exception as error:  # a bundle a rewriter shaped (no signature, bad base64...): a refusal, not a crash
        return Check(Problem.rewritten, f"its signature holds no model-signing statement ({type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else 'malformed'}): the ledger was rewritten")
    if not isinstance(signed, dict) or signed.get("claims_sha256") != claims_sha256(record) \
            or signature.claims_sha256 != signed.get("claims_sha256") or signature.key_sha256 != key.fingerprint:
        fields = _differing(record, signed) if isinstance(signed, dict) else []
        named = f" ({', '.join(fields)} differ)" if fields else ""
        return Check(Problem.rewritten, f"the record is not the approval its signature carries{named}: the ledger was "
                     "rewritten after signing")
    return None


def _check_files(ms: Any, checkpoint: Path, text: str, public: Path, key: Key) -> Check:
    """model-signing's own verification of the files against the signed statement (what
    `model_signing verify key` runs), on the ledger's copy of the signature."""
    copy = public.parent / SIGNATURE_FILE
    copy.write_text(text, encoding="utf-8")
    try:
        ms.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(checkpoint, copy)
    except (ValueError, OSError) as error:
        return Check(Problem.changed, f"its files differ from the signed ones: {_file_changes(ms, checkpoint, text, error)}")
    beside = checkpoint / SIGNATURE_FILE
    note = "" if beside.is_file() and beside.read_bytes() == text.encode("utf-8") else \
        f"; its {SIGNATURE_FILE} is missing or not this signature, so model_signing alone cannot verify it"
    return Check(None, f"signed by {key.path} (sha256 {key.fingerprint[:16]}...){note}")


def _file_changes(ms: Any, checkpoint: Path, text: str, error: Exception) -> str:
    """Which files differ from the signed ones (model-signing's message prints raw digests)."""
    try:
        predicate = json.loads(ms.bundle_pb.Bundle.from_json(text).dsse_envelope.payload)["predicate"]
        signed = {resource["name"]: resource["digest"] for resource in predicate["resources"]}
        now = {item.identifier: item.digest.digest_hex for item in _hash_checkpoint(ms, checkpoint).resource_descriptors()}
    except (ValueError, KeyError, TypeError, InputError):
        return str(error).splitlines()[0]
    parts = [f"{name} changed" for name in sorted(set(signed) & set(now)) if signed[name] != now[name]]
    parts += [f"{name} missing" for name in sorted(set(signed) - set(now))]
    parts += [f"{name} added" for name in sorted(set(now) - set(signed))]
    return ", ".join(parts) or str(error).splitlines()[0]
