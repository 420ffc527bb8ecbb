"""The demo's time budget: `quantgate run demo` (the embedded demo plan, its mixed-precision search
and serve stage included) must finish within 20 minutes on a 2-core CPU machine (`make demo` has
22, set-up included: about 2 minutes go to the virtual environment and, built cold, about 2 to the
serving environment), and a finished run started again must redo nothing.

Runs the demo plan in a fresh process into a temporary run directory, with an empty cache
(so the model conversion and every evaluation are paid for) unless --warm-cache, then once
more; prints each stage's time from run.json and exits 1 if the budget is missed.

    .venv/bin/python benchmarks/demo_time.py [--budget-minutes 20] [--warm-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serving_python() -> str:
    """The serving environment's python, found in the real cache home before the run's is emptied
    (the environment is set-up, built by `make serving`, not part of the run's time)."""
    from quantgate import serving

    found = serving.find()
    if found is None:
        raise SystemExit("the demo's serve stage needs the serving environment: run `make serving` first")
    return str(found.python)


def run_once(out: Path, env: dict[str, str]) -> tuple[float, int]:
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, "-m", "quantgate.cli", "run", "demo",
                                "--out", str(out), "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if completed.returncode not in (0, 1):
        sys.stderr.write(completed.stderr[-4000:])
        raise SystemExit(f"the demo run failed with exit code {completed.returncode}")
    return seconds, completed.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=20.0)
    parser.add_argument("--warm-cache", action="store_true", help="use $QUANTGATE_HOME as it is (model pulled, evaluations cached)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="quantgate-demo-bench-") as scratch:
        env = dict(os.environ, HF_HUB_OFFLINE="1", QUANTGATE_SERVING_PYTHON=serving_python())
        if not args.warm_cache:
            env["QUANTGATE_HOME"] = str(Path(scratch) / "home")
        out = Path(scratch) / "run"
        first, code = run_once(out, env)
        first_run = json.loads((out / "run.json").read_text())
        second, again = run_once(out, env)
        second_run = json.loads((out / "run.json").read_text())
    by_kind: dict[str, float] = {}
    print(f"{'stage':40s} {'status':8s} {'seconds':>8s}")
    for stage in first_run["stages"]:
        print(f"{stage['stage']:40s} {stage['status']:8s} {stage['seconds']:8.1f}")
        by_kind[stage["stage"].split()[0]] = by_kind.get(stage["stage"].split()[0], 0.0) + stage["seconds"]
    print()
    print("by kind: " + ", ".join(f"{kind} {seconds:.0f} s" for kind, seconds in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    print(f"first run: {first:.0f} s ({first / 60:.1f} min, cache {'warm' if args.warm_cache else 'empty'}), exit code {code}")
    print(f"second run: {second:.1f} s, exit code {again}, same verdicts: {first_run['verdicts'] == second_run['verdicts']}")
    for fmt, verdict in second_run["verdicts"].items():
        print(f"  {fmt}: {verdict['verdict']}" + (f" ({verdict['reasons'][0]})" if verdict["reasons"] else ""))
    reused = all(stage["status"] in ("reused", "skipped") for stage in second_run["stages"])
    print(f"second run reused every stage: {reused}")
    if first > args.budget_minutes * 60 or not reused or code != again or first_run["verdicts"] != second_run["verdicts"]:
        raise SystemExit(f"missed: budget {args.budget_minutes} min, first run {first / 60:.1f} min, all reused {reused}")


if __name__ == "__main__":
    main()
