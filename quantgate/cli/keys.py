"""`quantgate keys show|new|trust|untrust`: the user's signing key and trust file (gates/keys.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from quantgate.gates import keys, signing

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)
keys_group = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Your signing key and trust file: show them, make a new key (rotation), trust or untrust a public key.")
commands.add_typer(keys_group, name="keys")


def _trust_file(trust: Path | None) -> Path:
    return trust if trust is not None else keys.default_trust_file()


@keys_group.command("show")
def show_command(
    trust: Path | None = typer.Option(None, "--trust", help="the trust file to list (default: your own)"),
) -> None:
    """Where your signing key and trust file are, each key's fingerprint, and your public key (PEM).

    Copy the public key (or the trust file) to the deploy side: `quantgate verify --trust FILE` accepts its signatures.

    Example: quantgate keys show > my-key.pub.txt
    """
    path = keys.default_key_path()
    if path.is_file():
        key = signing.load_signing_key(path, "the signing key")
        typer.echo(f"signing key: {path} (sha256 {key.fingerprint})")
    else:
        key = None
        typer.echo(f"signing key: none yet ({path} is made by the first run, gate or `quantgate keys new`)")
    trust_file = _trust_file(trust)
    if trust_file.is_file():
        found = keys.load_trust(trust_file, "--trust" if trust is not None else "trust file")
        typer.echo(f"trust file: {trust_file} ({len(found.keys)} key{'s' if len(found.keys) != 1 else ''})")
        for fingerprint in found.keys:
            typer.echo(f"  trusted: sha256 {fingerprint}" + (" (your signing key)" if key and fingerprint == key.fingerprint else ""))
    else:
        typer.echo(f"trust file: none at {trust_file}")
    if key is not None:
        typer.echo(key.public_pem.decode("ascii").rstrip())


@keys_group.command("new")
def new_command(
    replace: bool = typer.Option(False, "--replace", help="rotate: keep the old key as signing-key.pem.retired-<time> and "
                                 "make a new one (its public key is added to your trust file; the old one stays there "
                                 "until `quantgate keys untrust`)"),
) -> None:
    """Make your signing key (ECDSA P-256, owner-only), or a new one with --replace (key rotation).

    Example: quantgate keys new --replace && quantgate keys untrust OLD_FINGERPRINT
    """
    key, retired = keys.new_key(replace=replace)
    typer.echo(f"signing key: {key.path} (sha256 {key.fingerprint}); its public key added to {keys.default_trust_file()}")
    if retired is not None:
        typer.echo(f"the old key is kept as {retired}: records it signed verify while a trust file holds its public key")


@keys_group.command("trust")
def trust_command(
    public_key: Path = typer.Argument(..., help="a PEM public key (or a trust file: each of its keys)"),
    trust: Path | None = typer.Option(None, "--trust", help="the trust file to add it to (default: your own)"),
) -> None:
    """Add a public key (or each key of a trust file) to a trust file: `verify` accepts what it signed.

    Example: quantgate keys trust demo-out/trusted-keys.pem
    """
    found = keys.load_trust(public_key, "public key")
    target = _trust_file(trust)
    for fingerprint, key in found.keys.items():
        added = keys.trust(target, key)
        typer.echo(f"sha256 {fingerprint}: {'trusted' if added else 'already trusted'} in {target}")


@keys_group.command("untrust")
def untrust_command(
    fingerprint: str = typer.Argument(..., help="the key's sha256 fingerprint, or its first 8+ hex digits (quantgate keys show)"),
    trust: Path | None = typer.Option(None, "--trust", help="the trust file to remove it from (default: your own)"),
) -> None:
    """Remove a key from a trust file (a retired or stolen key): `verify` refuses what it signed (exit 6).

    Example: quantgate keys untrust 3f9a1c0e
    """
    target = _trust_file(trust)
    key = keys.untrust(target, fingerprint)
    typer.echo(f"sha256 {key.fingerprint}: removed from {target}")
