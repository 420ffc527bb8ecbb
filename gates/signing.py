"""Signed ledger records, in the OpenSSF model signing format (`model-signing` 1.x): every record
of the ledger (approved, pending and blocked verdicts, a search trial's, a serving attestation) is
signed, and an approval's signature is also written to `<checkpoint>/model.sig`, so that
`model_signing verify key` checks the directory alone.

What is signed: model-signing's own in-toto statement whose resources are the sha256 of every file
of the checkpoint the record judges (`model.sig` and git files excepted, as model-signing does; none
for a record that names no checkpoint, e.g. a quantization that failed), and whose predicate carries
one more field, `quantgate_record`: the record's summary (verdict, format, policy, golden sets,
metrics, weights, time) and `claims_sha256`, the sha256 of the whole ledger line but its own
`record_hash` and `signature`: its chain position (`prev_hash`) included, so a record deleted or
moved breaks the signature of the record after it (docs/reliability.md, "Threat model"). The format
reserves the predicate for such extensions: a v1.0 verifier reads `serialization` and `resources` and
ignores any other field (model_signing/_signing/signing.py, `Payload`). It is a DSSE envelope in a
Sigstore bundle; the ledger record carries the bundle, the key's fingerprint and `claims_sha256`.

The public API of model-signing signs a manifest with no room for claims, so the statement is
built with the classes its `signing.Config.sign` uses (`_signing.signing.Payload`,
`_signing.sign_ec_key.Signer` and `Verifier`): no cryptography is written here.
"""

# model_signing is imported inside the functions that use it: importing it costs about a second
# (it loads sigstore), which `quantgate --help` must not pay.

from __future__ import annotations

import base64
import json
import math
import stat
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import JsonValue

from quantgate.core.artifacts import atomic_file, remove_temporaries, sha256_bytes, sha256_json
from quantgate.core.errors import InputError, ModelError
from quantgate.core.models import SIGNATURE_FILE as SIGNATURE_FILE
from quantgate.core.models import checkpoint_files
from quantgate.gates.ledger_record import LedgerRecord, Signature

CLAIMS_FIELD = "quantgate_record"  # the statement's predicate field that carries the record
OLD_CLAIMS_FIELDS = ("quantgate_approval",)  # what quantgate 0.x wrote there: still recognised as ours by `withdraw`
FORMAT = "model-signing v1.0 (in-toto statement in a DSSE envelope in a Sigstore bundle v0.3)"
# What a signature cannot bind of its own line: the line's hash (made after the signature) and the
# signature itself. Everything else is a claim, the chain position (`prev_hash`) included.
LEDGER_FIELDS = frozenset({"record_hash", "signature"})
# The record's fields a deployment reads in the signature itself (all are bound by claims_sha256).
SUMMARY_FIELDS = ("kind", "format", "precision", "verdict", "split", "policy", "evalsets", "metrics", "baseline",
                  "time", "verdict_sha256", "serving_status", "device_class", "attests", "prev_hash")
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model-signing 1.x's key signer accepts
# model-signing's file serialization as `hashing.Config().set_ignored_paths([model.sig])` records it:
# the statement of a record that lists its files without hashing them again says the same
IGNORED = (SIGNATURE_FILE, ".git", ".gitattributes", ".github", ".gitignore")


@dataclass(frozen=True)
class Key:
    """A key file checked for its role; `fingerprint` is model-signing's key hint: the sha256 of
    the public key's PEM (SubjectPublicKeyInfo), the same for the private key and its public half."""

    path: Path
    fingerprint: str
    public_pem: bytes


class Problem(str, Enum):
    unsigned = "unsigned"
    unknown_key = "signed by an unknown key"
    bad_signature = "bad signature"
    rewritten = "ledger rewritten"


@dataclass(frozen=True)
class Check:
    """The outcome of checking a record's signature: `problem` None when it holds."""

    problem: Problem | None
    reason: str


def _library() -> SimpleNamespace:
    """model_signing's modules (a dependency, imported when first needed)."""
    from model_signing import hashing, manifest
    from model_signing._signing import sign_ec_key, sign_sigstore_pb
    from model_signing._signing import signing as statement
    from sigstore_models.bundle import v1 as bundle_pb

    return SimpleNamespace(hashing=hashing, manifest=manifest, ec_key=sign_ec_key, sigstore_pb=sign_sigstore_pb,
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
    """The private key (PEM, unencrypted, ECDSA P-256/P-384/P-521) that signs records; one
    InputError line for anything else (a public key, an encrypted or foreign key, not PEM)."""
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
    _check_owner_only(Path(path), option)
    public = _public_pem(key.public_key())
    return Key(Path(path), sha256_bytes(public), public)


def _check_owner_only(path: Path, option: str) -> None:
    """A private key others can read is refused, as ssh refuses one (`UNPROTECTED PRIVATE KEY
    FILE`): whoever reads it signs as its owner."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise InputError(f"{option} {path}: permissions {mode:04o} let others read this private key; "
                         f"make it owner-only: chmod 600 {path}")


def _is_public(data: bytes) -> bool:
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        return False
    return True


def public_key_of(data: bytes, path: Path, option: str) -> Key:
    """One PEM public key (bytes) read from `path`; one InputError line for anything else (a
    private key, which never belongs on a deployment machine, included)."""
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

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


def load_public_key(path: Path, option: str = "--trust") -> Key:
    """The public key (PEM) in the file at `path` (see public_key_of)."""
    return public_key_of(_key_bytes(path, option), path, option)


# The claims of a ledger record (`claims`) and the record a signature carries (`summary`): JSON
# that is hashed whole, or compared field by field with a record's (`_differing`).
Claims = dict[str, JsonValue]


def _normal(record: LedgerRecord) -> Claims:
    """The record as the ledger's JSON gives it back (what a reader of the ledger hashes)."""
    normal: Claims = json.loads(json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False))
    return normal


def claims(record: LedgerRecord) -> Claims:
    """What a signature binds of a ledger record: all of it but its own hash and signature."""
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
    """The record as the signed statement carries it, for a reader of model.sig alone."""
    normal = claims(record)
    found: Claims = {field: normal[field] for field in SUMMARY_FIELDS if field in normal}
    found["weights"] = None if record.weights is None else dict(record.weights)
    safe = _json_safe(found)
    if not isinstance(safe, dict):  # a dict stays a dict through _json_safe
        raise TypeError("a record's summary is a JSON object")
    return {**safe, "claims_sha256": sha256_json(normal)}


def _manifest(ms: Any, name: str, files: dict[str, str]) -> Any:
    """model-signing's manifest of files already hashed (a record's `files`), in its file
    serialization: the statement lists what the record names, without hashing it again."""
    serialization = ms.manifest._FileSerialization("sha256", allow_symlinks=False, ignore_paths=list(IGNORED))
    items = [ms.manifest.FileManifestItem(path=Path(path), digest=ms.hashing.hashing.Digest("sha256", bytes.fromhex(digest)))
             for path, digest in sorted(files.items())]
    return ms.manifest.Manifest(name, items, serialization)


def _changes(signed: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between two file manifests, by file: changed, added, missing."""
    parts = [f"{name} changed" for name in sorted(set(signed) & set(now)) if signed[name] != now[name]]
    parts += [f"{name} added" for name in sorted(set(now) - set(signed))]
    parts += [f"{name} missing" for name in sorted(set(signed) - set(now))]
    return parts


def describe_changes(recorded: dict[str, str], now: dict[str, str]) -> str:
    """'config.json changed, chat_template.jinja added': how a checkpoint differs from a record."""
    return ", ".join(_changes(recorded, now)) or "no file differs"


def sign(record: LedgerRecord, key: Key, checkpoint: Path | None = None) -> Signature:
    """Sign the ledger line `record` (as it will be appended: its `time`, `prev_hash` and
    `signed` set) over the files it names (`checkpoint.files`; none for a record that names no
    checkpoint). With `checkpoint` (an approval), the directory is hashed again and must hold
    exactly those files; the signature is then also written to `<checkpoint>/model.sig`."""
    ms = _library()
    files = dict(record.files or {})
    name = Path(record.checkpoint_path).name if record.checkpoint_path else str(record.format or "record")
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        remove_temporaries(checkpoint, only_stale=True)  # a killed model.sig write's leftover is no file of the checkpoint
        try:
            now = checkpoint_files(checkpoint)
        except ModelError as error:
            raise InputError(f"cannot sign checkpoint {checkpoint}: {error}") from error
        if now != files:
            raise InputError(f"checkpoint {checkpoint}: its files are not the ones the verdict judged "
                             f"({describe_changes(files, now)}); refusing to sign")
    payload = ms.statement.Payload(_manifest(ms, name, files))
    # the format's room for extensions: a v1.0 verifier ignores predicate fields it does not know
    payload.statement.pb.predicate.update({CLAIMS_FIELD: summary(record)})
    try:
        bundle = ms.ec_key.Signer(key.path).sign(payload).bundle
    except (ValueError, TypeError, OSError) as error:  # the key file changed since it was checked
        raise InputError(f"signing key {key.path}: cannot sign with it ({error})") from error
    text: str = bundle.to_json()
    if checkpoint is not None:
        write_signature(checkpoint, text)
    return Signature(format=FORMAT, file=SIGNATURE_FILE, bundle=text, bundle_sha256=sha256_bytes(text.encode("utf-8")),
                     key_sha256=key.fingerprint, claims_sha256=claims_sha256(record))


def write_signature(checkpoint: Path, text: str) -> None:
    """`<checkpoint>/model.sig`, atomically (model-signing's own `write` is a plain write_text)."""
    with atomic_file(Path(checkpoint) / SIGNATURE_FILE) as stream:
        stream.write(text.encode("utf-8"))


def restore(checkpoint: Path, record: LedgerRecord, key: Key) -> bool:
    """If `record` is an approval signed by `key` whose signature holds and whose files are the
    checkpoint's now, make sure `<checkpoint>/model.sig` is that signature (a checkpoint made
    again, byte for byte, lost it) and return True; False when the record cannot stand for these
    files."""
    signature = record.signature
    if not record.signed or signature is None or signature.key_sha256 != key.fingerprint:
        return False
    if check(record, {key.fingerprint: key}).problem is not None:
        return False
    try:
        if record.files is None or checkpoint_files(Path(checkpoint)) != record.files:
            return False
    except ModelError:
        return False
    target = Path(checkpoint) / SIGNATURE_FILE
    text = signature.bundle
    if not target.is_file() or target.read_bytes() != text.encode("utf-8"):
        write_signature(checkpoint, text)
    return True


def withdraw(checkpoint: Path) -> bool:
    """Remove `<checkpoint>/model.sig` if it is a signature quantgate wrote (a model-signing
    signature that carries `quantgate_record`; anyone else's is left alone): called when a newer
    verdict does not approve the checkpoint. True if removed. Reads JSON only."""
    target = Path(checkpoint) / SIGNATURE_FILE
    try:
        envelope = json.loads(target.read_text(encoding="utf-8"))["dsseEnvelope"]
        statement = json.loads(base64.b64decode(envelope["payload"], validate=True))
        ours = any(field in statement["predicate"] for field in (CLAIMS_FIELD, *OLD_CLAIMS_FIELDS))
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one quantgate wrote
        return False
    if ours:
        target.unlink(missing_ok=True)
    return bool(ours)


def _bundle(ms: Any, text: Any) -> Any:
    if not isinstance(text, str):
        raise ValueError("no bundle")
    return ms.sigstore_pb.Signature(ms.bundle_pb.Bundle.from_json(text))


def _differing(record: LedgerRecord, signed: dict[str, object]) -> list[str]:
    """The summary fields where the record and its signed statement disagree."""
    mine = summary(record)
    return [field for field in (*SUMMARY_FIELDS, "weights") if mine.get(field) != signed.get(field)]


def check(record: LedgerRecord, trusted: dict[str, Key]) -> Check:
    """Does this ledger record carry a signature, by a key in `trusted` (by fingerprint), over
    its own claims (its chain position included) and the files it names? The first problem found."""
    signature = record.signature
    if not record.signed or signature is None:
        return Check(Problem.unsigned, "no signature")
    ms = _library()
    try:
        bundle = _bundle(ms, signature.bundle)
        hint = str(bundle.bundle.verification_material.public_key.hint)
    except Exception:  # any bytes a rewriter put there: whatever the parser raises, it is no bundle
        return Check(Problem.bad_signature, "its signature is not a model-signing bundle")
    key = trusted.get(hint)
    if key is None:
        return Check(Problem.unknown_key, f"signed by key sha256 {hint[:16]}..., which the trust file does not hold")
    return _check_statement(ms, bundle, record, signature=signature, key=key)


def _check_statement(ms: Any, bundle: Any, record: LedgerRecord, *, signature: Signature, key: Key) -> Check:
    """The signature over the statement, and the statement against the record."""
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.exceptions import InvalidSignature

    with tempfile.TemporaryDirectory(prefix="quantgate-verify-") as scratch:
        public = Path(scratch) / "key.pub"  # model-signing's verifier reads its key from a file
        public.write_bytes(key.public_pem)
        verifier = ms.ec_key.Verifier(public)
    try:
        manifest = verifier.verify(bundle)
        payload = json.loads(bundle.bundle.dsse_envelope.payload)
        signed = payload["predicate"].get(CLAIMS_FIELD)
        resources = {item.identifier: item.digest.digest_hex for item in manifest.resource_descriptors()}
    except InvalidSignature:
        return Check(Problem.bad_signature, f"its signature does not verify with key sha256 {key.fingerprint[:16]}...: "
                     "made by another key, or altered")
    except Exception as error:  # a bundle a rewriter shaped (no signature, bad base64...): a refusal, not a crash
        return Check(Problem.bad_signature, f"its signature holds no model-signing statement ({type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else 'malformed'})")
    if not isinstance(signed, dict) or signed.get("claims_sha256") != claims_sha256(record) \
            or signature.claims_sha256 != signed.get("claims_sha256") or signature.key_sha256 != key.fingerprint:
        fields = _differing(record, signed) if isinstance(signed, dict) else []
        named = f" ({', '.join(fields)} differ)" if fields else ""
        return Check(Problem.rewritten, f"the record is not the one its signature carries{named}: edited after signing")
    if resources != (record.files or {}):
        return Check(Problem.rewritten, "the files its signature covers are not the record's "
                     f"({describe_changes(resources, record.files or {})}): edited after signing")
    return Check(None, f"signed by key sha256 {key.fingerprint[:16]}...")
