"""How long `quantgate --help` takes in a fresh process, and which heavy libraries it loads.

    .venv/bin/python benchmarks/cli_startup.py [--repeats 3] [--budget-seconds 1.0]

Runs the installed `quantgate` entry point (or `python -c "from quantgate.cli import main; main()"`
when the script is not next to this interpreter) --repeats times, prints every wall time and the
median, then imports the CLI once more to list the heavy libraries that came with it (none are
expected: tests/test_imports.py asserts that). Exits 1 when the median misses the budget.
Target: under 1 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "llmcompressor", "compressed_tensors", "lm_eval", "awq", "datasets")


def help_command() -> list[str]:
    script = Path(sys.executable).with_name("quantgate")
    if script.is_file():
        return [str(script), "--help"]
    return [sys.executable, "-c", "import sys; sys.argv = ['quantgate', '--help']; from quantgate.cli import main; main()"]


def time_help(command: list[str]) -> float:
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if completed.returncode != 0 or "Usage" not in completed.stdout:
        sys.stderr.write(completed.stderr[-4000:])
        raise SystemExit(f"`quantgate --help` failed with exit code {completed.returncode}")
    return seconds


def heavy_modules_loaded() -> list[str]:
    probe = f"import json, sys\nimport quantgate.cli\nprint(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    completed = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(completed.stdout)
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-seconds", type=float, default=1.0)
    args = parser.parse_args()

    command = help_command()
    times = [time_help(command) for _ in range(args.repeats)]
    median = statistics.median(times)
    print(f"command: {' '.join(command[:1])} --help")
    print("runs: " + ", ".join(f"{seconds:.3f} s" for seconds in times))
    print(f"median: {median:.3f} s (budget {args.budget_seconds:.2f} s)")
    heavy = heavy_modules_loaded()
    print(f"heavy libraries imported with quantgate.cli: {', '.join(heavy) if heavy else 'none'}")
    if median >= args.budget_seconds or heavy:
        raise SystemExit(f"missed: median {median:.3f} s against {args.budget_seconds:.2f} s, heavy libraries {heavy}")


if __name__ == "__main__":
    main()
