"""The CLI is thin and documented: every command has help with an example, errors are one line."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

import quantgate.cli
from quantgate import calibration
from quantgate.cli.app import COMMANDS, REMOVED, load


def all_commands() -> list[list[str]]:
    """Every command path, the root's commands loaded from their modules."""
    found: list[list[str]] = []

    def walk(command: Any, path: list[str]) -> None:
        # typer vendors its own click, so test for a group by its subcommands
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
        else:
            found.append(path)

    for name in COMMANDS:
        walk(load(name), [name])
    return found


def test_every_command_has_help_with_an_example(cli) -> None:
    commands = all_commands()
    assert ["calibrate"] in commands and ["models", "pull"] in commands and ["serving", "check"] in commands
    for path in commands:
        result = cli(*path, "--help")
        assert result.code == 0, path
        assert "Example: quantgate " + " ".join(path) in " ".join(result.out.split()), path


def test_root_help_lists_each_command_with_its_own_summary(cli) -> None:
    """The root lists commands from a table, without importing them: each summary there must be
    the command's own short help (its docstring's first paragraph), so the two cannot drift."""
    root = cli("--help")
    assert root.code == 0
    for name, entry in COMMANDS.items():
        assert load(name).get_short_help_str(300) == entry.summary, name
        assert name in root.out


def test_root_help_imports_no_stage() -> None:
    """`quantgate --help` loads the command table only; a command's module and the stage it calls
    are imported when that command is asked for."""
    code = ("import sys\nfrom quantgate.cli import app\n"
            "try:\n    app(['--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
            "print('STAGES', sorted({name.split('.')[0] for name in sys.modules} & {'calibration', 'quantize', 'evalsets', 'gates'}))\n"
            "app(['measure', '--help'], standalone_mode=False)\n"
            "print('MEASURE', 'quantgate.quantize.measure.accounting' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    marked = [line for line in done.stdout.splitlines() if line.startswith(("STAGES", "MEASURE"))]
    assert marked == ["STAGES []", "MEASURE True"], done.stdout[-2000:]


def registered_modules(group: typer.Typer) -> set[str]:
    found = {command.callback.__module__ for command in group.registered_commands if command.callback}
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            found |= registered_modules(sub.typer_instance)
    return found


def test_every_command_module_is_in_the_command_table() -> None:
    """One module per command group: each module in quantgate/cli/ (but the root, the shared
    options and the entry points) defines the commands the table names for it, no more, no less."""
    folder = Path(quantgate.cli.__file__).parent
    modules = {f"quantgate.cli.{path.stem}" for path in folder.glob("*.py") if path.stem not in {"__init__", "__main__", "app", "options"}}
    assert modules == {entry.module for entry in COMMANDS.values()}
    for module in modules:
        commands = importlib.import_module(module).commands
        names = {command.name for command in commands.registered_commands} | {group.name for group in commands.registered_groups}
        assert names == {name for name, entry in COMMANDS.items() if entry.module == module}, module
        assert registered_modules(commands) == {module}


def test_one_command_per_job_and_a_removed_name_says_what_replaces_it(cli, tmp_path) -> None:
    """A name whose job another command does now is refused before anything runs (or is imported),
    in one line naming the command that does it, exit 2: with its old arguments, and with --help."""
    commands = [" ".join(path) for path in all_commands()]
    assert len(commands) == len(set(commands)) and not {" ".join(old) for old in REMOVED} & set(commands)
    lines = {
        ("demo", "--out", tmp_path / "demo"): "`quantgate demo` is now `quantgate run demo`",
        ("serve-check", tmp_path, "--out", tmp_path / "serve"): "`quantgate serve-check` is now `quantgate serving check`",
        ("evalsets", "verify"): "`quantgate evalsets verify` is now `quantgate evalsets audit`",
        ("serve-check", "--help"): "`quantgate serve-check` is now `quantgate serving check`",
    }
    for args, line in lines.items():
        result = cli(*args)
        assert result.code == 2 and result.out == "", (args, result.out)
        assert result.err == f"quantgate: error: {line} (the same arguments)\n", (args, result.err)
    assert not (tmp_path / "demo").exists() and not (tmp_path / "serve").exists()
    for new in REMOVED.values():  # each replacement is a command, with help
        assert cli(*new.split()[1:], "--help").code == 0, new


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
