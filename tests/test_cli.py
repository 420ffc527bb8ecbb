"""The CLI is thin and documented: every command has help with an example, errors are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
import typer.main

import calibration
import quantgate.cli
from quantgate.cli import app


def all_commands() -> list[list[str]]:
    root = typer.main.get_command(app)
    found: list[list[str]] = []

    def walk(command: Any, path: list[str]) -> None:
        # typer vendors its own click, so test for a group by its subcommands
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            found.append(path)

    walk(root, [])
    return found


def test_every_command_has_help_with_an_example(cli) -> None:
    commands = all_commands()
    assert ["calibrate"] in commands and ["models", "pull"] in commands and ["demo"] in commands
    for path in commands:
        result = cli(*path, "--help")
        assert result.code == 0, path
        assert "Example: quantgate " + " ".join(path) in " ".join(result.out.split()), path


def registered_modules(group: typer.Typer) -> set[str]:
    found = {command.callback.__module__ for command in group.registered_commands if command.callback}
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            found |= registered_modules(sub.typer_instance)
    return found


def test_every_command_module_registers_its_commands() -> None:
    """One module per command group: each module in quantgate/cli/ (but the app and the entry
    points) is imported by the package and has commands on the app, so none is forgotten."""
    folder = Path(quantgate.cli.__file__).parent
    modules = {f"quantgate.cli.{path.stem}" for path in folder.glob("*.py") if path.stem not in {"__init__", "__main__", "app"}}
    assert modules and registered_modules(app) == modules


def test_library_errors_become_one_line_and_exit_code_two(cli, tmp_path) -> None:
    result = cli("overlap", "--calibration", tmp_path, "--against", tmp_path)
    assert result.code == 2
    assert result.err.strip().count("\n") == 0
    assert result.err.startswith("quantgate: error:") and "not a calibration set" in result.err


def test_overlap_command_reports_the_share(cli, tiny_model, tmp_path) -> None:
    cfg = calibration.CalibrationConfig(model=str(tiny_model), source="demo", samples=4, seq_len=64)
    built = calibration.run(cfg, tmp_path / "set")
    leaked = tmp_path / "golden.jsonl"
    leaked.write_text(json.dumps({"text": built.texts()[0]}) + "\n")
    result = cli("overlap", "--calibration", tmp_path / "set", "--against", leaked, "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)
    assert summary["n"] == 13 and 0.1 < summary["share"] < 0.5  # one of four rows leaked
