"""benchmarks/memory_cap.py, the run under a memory cap (docs/models.md, "Memory"): a command's exit
status, its error line and the cgroup's verdict are reported, and its output still reaches the
terminal. Needs root and a memory cgroup controller; skipped, saying so, where there is neither."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "memory_cap.py"


def _cgroups_writable() -> bool:
    """Whether memory_cap can run a command here: root, and a memory cgroup it may make a child of
    and move a process into (tried once, with a command that does nothing)."""
    if os.geteuid() != 0 or not Path("/proc/self/cgroup").exists():
        return False
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), "--cap", "1e9", "--", sys.executable, "-c", "pass"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and '"exit": 0' in done.stdout


pytestmark = pytest.mark.skipif(not _cgroups_writable(), reason="memory_cap needs root and a memory cgroup it may make a child of")


def _capped(tmp_path: Path, cap: str, code: str) -> tuple[dict[str, object], subprocess.CompletedProcess[str]]:
    report = tmp_path / "cap.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--cap", cap, "--json", str(report), "--", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(report.read_text()), done


def test_a_commands_error_line_is_reported_and_its_output_passes_through(tmp_path: Path) -> None:
    result, done = _capped(tmp_path, "1e9", "import sys; print('made'); sys.stderr.write('noise\\nquantgate: error: the plan is bad\\n'); sys.exit(2)")
    assert (result["exit"], result["error"], result["stderr_lines"], result["oom_kills"]) == (2, "quantgate: error: the plan is bad", 2, 0)
    assert not result["killed_by_signal"]
    assert "made" in done.stdout and "quantgate: error: the plan is bad" in done.stderr


def test_a_command_past_the_cap_is_reported_as_killed(tmp_path: Path) -> None:
    # 400 MB touched under a 200 MB cap with swap counted: the kernel's OOM killer ends it
    result, _ = _capped(tmp_path, "2e8", "b = bytearray(400_000_000); print(sum(b[::4096]))")
    assert result["killed_by_signal"] and result["exit"] == -9, result
    assert result["oom_kills"] in (1, None), result  # None: this kernel's cgroup does not count them
    assert result["error"] is None
