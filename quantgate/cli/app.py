"""The root of the `quantgate` command: every command by name, its module and its one-line
summary. A command's module, and through it the stage it calls, is imported only when that
command runs or shows its own help, so `quantgate --help` loads no stage (it starts in about
the time Python and Typer take; `benchmarks/cli_startup.py`). This is Click's documented lazy
subcommand pattern; `tests/test_cli.py` checks each summary against the command's docstring.

One command per job: a name that named a job another command does now (REMOVED) is refused
with one line naming its replacement, exit 2, before any module is imported."""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from quantgate.core.errors import InputError


class Entry(NamedTuple):
    module: str  # defines `commands`, a typer.Typer holding this command
    summary: str  # the first line of the command's help, shown by `quantgate --help`


# In the order of the release process; `quantgate --help` lists them so.
COMMANDS: dict[str, Entry] = {
    "models": Entry("quantgate.cli.models", "Provision and list baseline models."),
    "calibrate": Entry("quantgate.cli.calibrate", "Build a reproducible calibration set: token ids plus a manifest with its fingerprint."),
    "overlap": Entry("quantgate.cli.calibrate", "Share of a calibration set's word n-grams that occur in a text collection (leakage check)."),
    "quantize": Entry("quantgate.cli.quantize", "Quantize a baseline into a compressed-tensors checkpoint that transformers and vLLM load."),
    "sensitivity": Entry("quantgate.cli.sensitivity", "Score each layer group's sensitivity to each format: predicted KL in nats per token "
                         "(diagonal Fisher)."),
    "measure": Entry("quantgate.cli.measure", "Account for every byte of a checkpoint from its safetensors headers, never its tensor data."),
    "bounds": Entry("quantgate.cli.measure", "Lower bounds on decode step time per weight format, and what speculative decoding buys."),
    "evalsets": Entry("quantgate.cli.evaluate", "Versioned golden sets: list, show, audit, add your own, plan their items."),
    "evaluate": Entry("quantgate.cli.evaluate", "Evaluate a model on golden sets: metrics, per-item results, agreement with a baseline."),
    "serving": Entry("quantgate.cli.serve", "Serving in vLLM, in a virtual environment of its own: build it (setup, info, resources), "
                     "and serve a checkpoint in it to compare with what was gated (check)."),
    "gate": Entry("quantgate.cli.gate", "Gate one candidate against its baseline under a policy: exit 0 approved, 4 pending serving, "
                  "1 blocked, 2 bad input."),
    "verify": Entry("quantgate.cli.gate", "Exit 0 only for an approval, signed by a trusted key, of every file of this checkpoint."),
    "keys": Entry("quantgate.cli.keys", "Your signing key and trust file: show them, make a new key (rotation), trust or untrust a public key."),
    "run": Entry("quantgate.cli.run", "Run every stage for one model: calibrate, quantize each format, measure and bound, "
                 "evaluate the baseline and each candidate, gate, append to the ledger, write the report."),
    "report": Entry("quantgate.cli.run", "Write the size-vs-accuracy report of a run again from its artifacts (or from a report.json alone), "
                    "and print its summary."),
}

# Names that overlapped another command's job, each with the command that does it now
# (CHANGELOG.md). A script calling one fails at once with the new name, never runs something else.
REMOVED: dict[tuple[str, ...], str] = {
    ("demo",): "quantgate run demo",
    ("serve-check",): "quantgate serving check",
    ("evalsets", "verify"): "quantgate evalsets audit",
}


def replaced(args: list[str]) -> str | None:
    """The one line that refuses a removed command at the start of `args`; None for any other."""
    for old, new in REMOVED.items():
        if tuple(args[: len(old)]) == old:
            return f"`quantgate {' '.join(old)}` is now `{new}` (the same arguments)"
    return None


def load(name: str) -> Any:
    """The command `name` (a Typer command or group), from its module's `commands`, imported now
    with what it imports."""
    module = importlib.import_module(COMMANDS[name].module)
    command = typer.main.get_command(module.commands)
    return command.commands[name] if isinstance(command, TyperGroup) else command


class LazyCommands(TyperGroup):
    """Lists every command from COMMANDS without importing it; resolves a command to run (or to
    show its own help) by importing its module."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        # A summary stub per name: what --help lists and a typo's "did you mean" draws on.
        self.commands = {name: TyperCommand(name, short_help=entry.summary) for name, entry in COMMANDS.items()}

    # ctx: Any, as the base class takes the Context of the click that typer runs on (recent typer
    # releases carry a private copy of click, older ones use click's); typer.Context would narrow it.
    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
        if (line := replaced(args)) is not None:  # quantgate.cli.main prints it, exit 2
            raise InputError(line)
        name, command, rest = super().resolve_command(ctx, args)  # an unknown name fails here, as usual
        return name, load(name) if name in COMMANDS else command, rest


app = typer.Typer(
    name="quantgate",
    cls=LazyCommands,
    help="Quantize an LLM and gate every format against its baseline before it ships.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def root() -> None:
    """Quantize an LLM and gate every format against its baseline before it ships."""
