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
