"""The user's signing key and trust files: the key every ledger record is signed with by default
(made on first use under QUANTGATE_HOME/keys, owner-only, as ssh-keygen makes ~/.ssh/id_*), and
the trust file `quantgate verify` accepts signatures under (one or more PEM public keys).

Layout (docs/reliability.md, "Threat model"):
  QUANTGATE_HOME/keys/              0700
  QUANTGATE_HOME/keys/signing-key.pem   0600  ECDSA P-256, PKCS#8 PEM, unencrypted
  QUANTGATE_HOME/keys/trusted-keys.pem  0644  the public keys this user's `verify` trusts
A run also writes the public key it signed with beside its ledger (`TRUST_FILE`), the file the
user copies to the deploy side."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from quantgate.core.artifacts import atomic_file, sibling_lock
from quantgate.core.errors import InputError
from quantgate.core.models import quantgate_home
from quantgate.gates import signing

KEYS_DIR = "keys"
KEY_FILE = "signing-key.pem"
TRUST_FILE = "trusted-keys.pem"  # the same name in QUANTGATE_HOME/keys and beside a run's ledger
_PUBLIC_BLOCK = re.compile(rb"-----BEGIN PUBLIC KEY-----.*?-----END PUBLIC KEY-----", re.DOTALL)


def keys_dir() -> Path:
    return quantgate_home() / KEYS_DIR


def default_key_path() -> Path:
    return keys_dir() / KEY_FILE


def default_trust_file() -> Path:
    return keys_dir() / TRUST_FILE


def beside(ledger: Path) -> Path:
    """The trust file a run writes next to its ledger: the public keys that signed it."""
    return Path(ledger).parent / TRUST_FILE


@dataclass(frozen=True)
class Trust:
    """The keys a trust file holds, by fingerprint (signing.Key.fingerprint)."""

    path: Path
    keys: dict[str, signing.Key]


def signing_key(named: Path | None) -> signing.Key:
    """The key that signs: `named` (a plan's `signing_key`, a command's --signing-key), else the
    user's own, made now if this is the first signing command. A bad key is one InputError line."""
    if named is not None:
        return signing.load_signing_key(named)
    return signing.load_signing_key(ensure_default_key(), "the signing key")


def ensure_default_key() -> Path:
    """The user's signing key, made on first use (its public key added to the user's trust file).
    Refused, as ssh refuses it, when others can read it."""
    path = default_key_path()
    _make_keys_dir()
    with sibling_lock(path):  # two first runs at once make one key
        if not path.exists():
            _write_new_key(path)
            trust(default_trust_file(), signing.load_signing_key(path, "the signing key"))
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise InputError(f"signing key {path}: permissions {mode:04o} let others read it; make it owner-only: chmod 600 {path}")
    return path


def new_key(*, replace: bool = False) -> tuple[signing.Key, Path | None]:
    """A new default signing key (rotation): the old one, if any, is kept beside it as
    signing-key.pem.retired-<UTC time> (never deleted: records it signed still verify under its
    public key while the trust file holds it). Its public key is added to the user's trust file.
    Without `replace`, an existing key is an InputError."""
    path = default_key_path()
    _make_keys_dir()
    retired = None
    with sibling_lock(path):
        if path.exists():
            if not replace:
                raise InputError(f"signing key {path} exists; rotate it with `quantgate keys new --replace`")
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            retired = path.with_name(f"{KEY_FILE}.retired-{stamp}")
            os.replace(path, retired)
        _write_new_key(path)
    key = signing.load_signing_key(path, "the signing key")
    trust(default_trust_file(), key)
    return key, retired


def _make_keys_dir() -> None:
    # owner-only from its creation (mkdir's mode, less the umask); an existing directory is the user's choice
    directory = keys_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise InputError(f"cannot make the key directory {directory} ({error.strerror or error})") from error


def _write_new_key(path: Path) -> None:
    """An ECDSA P-256 private key (the curve model-signing and cosign default to), PKCS#8 PEM,
    written atomically and 0600 from its creation (a temporary file mkstemp makes 0600)."""
    # cryptography comes with model-signing (its key signer is built on it)
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        with atomic_file(path, durable=True, mode=0o600) as stream:
            stream.write(pem)
    except OSError as error:
        raise InputError(f"cannot write the signing key {path} ({error.strerror or error})") from error


def load_trust(path: Path, option: str = "--trust") -> Trust:
    """The public keys of a trust file (one or more PEM public keys, nothing else); one InputError
    line for a missing file, one that holds a private key or no public key, or a key model-signing
    cannot verify with."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise InputError(f"{option} {path}: cannot read it ({error.strerror or error})") from error
    if b"PRIVATE KEY" in data:
        raise InputError(f"{option} {path}: it holds a private key; a trust file holds public keys only "
                         "(quantgate keys show prints the public half), and the private key stays off the deploy side")
    blocks = _PUBLIC_BLOCK.findall(data)
    if not blocks:
        raise InputError(f"{option} {path}: no PEM public key in it (-----BEGIN PUBLIC KEY-----)")
    # anything else (a certificate, a truncated key, stray text) would be skipped in silence: the
    # file trusts fewer keys than its owner thinks, or is not the file they meant
    rest = _PUBLIC_BLOCK.sub(b"", data).strip()
    if rest:
        shown = rest.splitlines()[0][:60].decode("ascii", errors="replace")
        raise InputError(f"{option} {path}: holds something besides PEM public keys ({shown!r}); a trust file holds "
                         "-----BEGIN PUBLIC KEY----- blocks only")
    keys = [signing.public_key_of(block, Path(path), option) for block in blocks]
    return Trust(Path(path), {key.fingerprint: key for key in keys})


def trust(path: Path, key: signing.Key) -> bool:
    """Add `key`'s public half to the trust file at `path` (made if missing); True if added."""
    path = Path(path)
    with sibling_lock(path):
        # a file `untrust` emptied holds no key yet: the new one is its first
        before = path.read_bytes() if path.exists() else b""
        existing = load_trust(path, "trust file") if before.strip() else None
        if existing is not None and key.fingerprint in existing.keys:
            return False
        with atomic_file(path, durable=True) as stream:
            stream.write(before + (b"" if not before or before.endswith(b"\n") else b"\n") + key.public_pem)
    return True


def untrust(path: Path, fingerprint: str) -> signing.Key:
    """Remove the key whose fingerprint starts with `fingerprint` (at least 8 hex digits) from
    the trust file; the key removed. Records it signed no longer verify there."""
    path = Path(path)
    if len(fingerprint) < 8:
        raise InputError(f"fingerprint {fingerprint!r}: give at least its first 8 hex digits (quantgate keys show)")
    with sibling_lock(path):
        found = load_trust(path, "trust file")
        matching = [key for name, key in found.keys.items() if name.startswith(fingerprint.lower())]
        if len(matching) != 1:
            raise InputError(f"trust file {path}: {'no key' if not matching else 'several keys'} with a fingerprint starting "
                             f"{fingerprint}; its keys: {', '.join(name[:16] for name in found.keys)}")
        kept = b"".join(key.public_pem for name, key in found.keys.items() if key is not matching[0])
        with atomic_file(path, durable=True) as stream:
            stream.write(kept)
    return matching[0]
