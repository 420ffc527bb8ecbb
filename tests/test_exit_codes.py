"""`quantgate run`'s exit codes are an interface a CI branches on (quantgate/core/exitcodes.py):
approved 0 and a tampered ledger 6 through the command on real runs (blocked 1: test_pipeline.py;
pending 4 and a failed unit 5: test_unit_failures.py and test_no_unit_ends_run.py; bad input 2 and
a crash 3: test_cli.py and test_pipeline.py), and `--help`, the README, docs/usage.md and the
Makefile's demo target say (and do) the same."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from quantgate.core.exitcodes import Exit
from tests.helpers import plan_mapping

ROOT = Path(__file__).resolve().parent.parent
# what each run exit code is called where the docs name it
WORDS = {Exit.APPROVED: "approved", Exit.BLOCKED: "blocked", Exit.BAD_INPUT: "bad input", Exit.CRASHED: "crash",
         Exit.PENDING: "pending", Exit.UNIT_FAILED: "unit failed", Exit.UNTRUSTED: "tampered", Exit.INTERRUPTED: "interrupted"}


def test_a_run_appending_to_a_tampered_ledger_exits_6_in_one_line(cli, quant_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    ledger = tmp_path / "ledger.jsonl"  # the plan's own ledger, shared by its runs
    plan.write_text(yaml.safe_dump({**plan_mapping(quant_model, tmp_path, formats=["fp8-e4m3"]), "ledger": str(ledger)}))
    approved = cli("run", plan, "--quiet")
    assert approved.code == Exit.APPROVED, approved.err[-3000:]
    first = ledger.read_text().splitlines()[0]
    assert '"approved"' in first
    ledger.write_text(first.replace('"approved"', '"blocked"', 1) + "\n")  # an edit the chain catches
    again = cli("run", plan, "--quiet", "--out", tmp_path / "again")
    assert again.code == Exit.UNTRUSTED, again.err[-3000:]
    (line,) = [line for line in again.err.splitlines() if line.startswith("quantgate: error:")]
    assert "tampered" in line and "Traceback" not in again.err
    assert not (tmp_path / "again").exists()  # refused before any work: no run directory made


def test_run_help_says_every_run_exit_code() -> None:
    from typer.testing import CliRunner

    from quantgate.cli.app import app

    shown = " ".join(CliRunner().invoke(app, ["run", "--help"], terminal_width=400).output.split())
    for code, word in WORDS.items():
        assert re.search(rf"\b{int(code)} [^;.]*{word}", shown), (code, word)


def test_docs_usage_has_a_row_per_exit_code_and_the_readme_line_says_the_run_codes() -> None:
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    section = usage.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {int(match.group(1)): match.group(2) for match in re.finditer(r"^\| (\d+) \| ([a-z ]+) \|", section, re.MULTILINE)}
    assert rows == {int(code): code.name.lower().replace("_", " ") for code in Exit}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (line,) = [line for line in readme.splitlines() if line.startswith(".venv/bin/quantgate run my-plan.yaml")]
    for code in (Exit.APPROVED, Exit.BLOCKED, Exit.PENDING, Exit.UNIT_FAILED, Exit.BAD_INPUT, Exit.UNTRUSTED):
        assert re.search(rf"\b{int(code)} [^;]*{WORDS[code]}", line), (code, line)


def test_make_demo_accepts_blocked_and_pending_and_fails_on_every_other_code() -> None:
    """The demo target's recipe, run by sh with `quantgate run demo` exiting each code in turn."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\ndemo:", 1)[1].splitlines()[1].strip()
    assert recipe.startswith("$(VENV)/bin/quantgate run demo")
    accepted = set()
    for code in Exit:
        command = recipe.replace("$(VENV)/bin/quantgate run demo", f"(exit {int(code)})").replace("$$", "$")
        if subprocess.run(["sh", "-c", command], check=False).returncode == 0:
            accepted.add(code)
    assert accepted == {Exit.APPROVED, Exit.BLOCKED, Exit.PENDING}
