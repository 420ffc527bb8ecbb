"""A console a person can read: `quantgate run` shows its own stage lines, bars and summary; what
other libraries print (llmcompressor's per-layer lines, weight-loading bars, warnings) goes to the
run's logs: each unit's own (logs/<kind>-<name>.log), the rest to logs/libraries.log; `--verbose`
shows it on the terminal too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import plan_mapping

# a line llmcompressor prints for every run of its compression lifecycle (loguru, to a descriptor)
LIBRARY_LINE = "Compression lifecycle"


def _run(quant_model: Path, root: Path, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    root.mkdir(parents=True, exist_ok=True)
    plan = root / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, root, formats=["gptq-int4"])))
    env = {**os.environ, "QUANTGATE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", "from quantgate.cli import main; main()", "run", str(plan), *extra],
                          capture_output=True, text=True, env=env, check=False, timeout=900)


def test_other_libraries_output_goes_to_the_run_log_and_verbose_shows_it(quant_model: Path, tmp_path: Path) -> None:
    quiet = _run(quant_model, tmp_path / "quiet", tmp_path / "home")
    assert quiet.returncode in (0, 1), quiet.stderr[-3000:]
    terminal = quiet.stdout + quiet.stderr
    logs = tmp_path / "quiet" / "run" / "logs"
    quantized = (logs / "quantize-gptq-int4.log").read_text(errors="replace")  # the unit's own log
    assert LIBRARY_LINE in quantized and LIBRARY_LINE not in terminal
    log = "".join(path.read_text(errors="replace") for path in sorted(logs.glob("*.log")))
    assert "run directory" in quiet.stdout and "quantize gptq-int4" in quiet.stderr  # quantgate's own lines stay
    assert len(terminal.splitlines()) < len(log.splitlines())
    verbose = _run(quant_model, tmp_path / "verbose", tmp_path / "home", "--verbose")
    assert verbose.returncode in (0, 1), verbose.stderr[-3000:]
    assert LIBRARY_LINE in verbose.stdout + verbose.stderr


NESTED = """
import os, sys
from pathlib import Path
from quantgate.core.console import library_output, stderr
root = Path(sys.argv[1])
with library_output(root / "run.log"):
    stderr.print("STAGE one")
    with library_output(root / "unit.log"):
        print("a library inside the unit", flush=True)
        os.write(2, b"a C library inside the unit\\n")
    stderr.print("STAGE two, after the unit")
    print("a library between units", flush=True)
stderr.print("STAGE three, after the run")
"""


def test_a_units_log_inside_the_runs_keeps_quantgates_lines_on_the_terminal(tmp_path: Path) -> None:
    """Real descriptors, nested as a run nests them (the run's libraries.log, then a unit's own
    log): what the libraries print goes to the innermost log, quantgate's own lines to the
    terminal before, during and after a unit."""
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        subprocess.run([sys.executable, "-c", NESTED, str(tmp_path)], stdout=out, stderr=err, check=True, timeout=120)
    terminal = (tmp_path / "out.txt").read_text() + (tmp_path / "err.txt").read_text()
    assert [line for line in terminal.splitlines() if line.startswith("STAGE")] == [
        "STAGE one", "STAGE two, after the unit", "STAGE three, after the run"]
    assert (tmp_path / "unit.log").read_text().splitlines() == ["a library inside the unit", "a C library inside the unit"]
    assert (tmp_path / "run.log").read_text().splitlines() == ["a library between units"]


BAR = """
from quantgate.core.console import progress_bar
with progress_bar(items_per_second=True) as bar:
    bar.advance(bar.add_task("evaluating", total=2))
"""


def test_a_progress_bar_where_stderr_is_no_terminal_prints_nothing() -> None:
    """A transient bar on a pipe or a CI log draws nothing, and must not leave an empty line
    behind either (it did: 23 of a first `make demo`'s 159 terminal lines)."""
    # rich takes FORCE_COLOR or TTY_COMPATIBLE=1 for a terminal: a CI that sets them gets bars
    env = {name: value for name, value in os.environ.items() if name not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    done = subprocess.run([sys.executable, "-c", BAR], capture_output=True, text=True, check=True, timeout=300, env=env)
    assert (done.stdout, done.stderr) == ("", "")
