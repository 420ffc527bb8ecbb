"""A run under a memory cap (issue 25, docs/models.md "Memory"): `quantgate run PLAN` in a memory
cgroup of its own limited to --cap bytes, which must either run to its verdicts or refuse in
preflight in one line (exit 2), and never be ended by the kernel's OOM killer.

    sudo .venv/bin/python benchmarks/memory_cap.py --cap 6e9 benchmarks/plans/qwen-1.5b.yaml [--out DIR] [--json PATH]
    sudo .venv/bin/python benchmarks/memory_cap.py --cap 20e9 [--json PATH] -- COMMAND...   # any command, its output passed through (stderr kept for its error line)

Needs root and a cgroup memory controller (v1 at /sys/fs/cgroup/memory, or v2): the cgroup is made
under the one this process is in, the run's process moved into it before it execs, and removed
afterwards. Prints the exit status, the wall time, the error line where there is one, the peak
the cgroup charged and whether its OOM killer ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CGROUP = Path("/sys/fs/cgroup")


def make_cgroup(cap: int) -> tuple[Path, str]:
    """A child of this process's memory cgroup with the cap; its version ("v1" or "v2")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = CGROUP / "memory" / path.lstrip("/") / f"quantgate-cap-{os.getpid()}"
            folder.mkdir()
            (folder / "memory.limit_in_bytes").write_text(str(cap))
            swap = folder / "memory.memsw.limit_in_bytes"  # with swap accounting, swap counts too
            if swap.exists():
                swap.write_text(str(cap))
            return folder, "v1"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            base = CGROUP / "unified" if (CGROUP / "unified" / "cgroup.controllers").exists() else CGROUP
            folder = base / line[3:].lstrip("/") / f"quantgate-cap-{os.getpid()}"
            folder.mkdir()
            (folder / "memory.max").write_text(str(cap))
            (folder / "memory.swap.max").write_text("0")
            return folder, "v2"
    raise SystemExit("memory_cap: no memory cgroup controller here (v1 or v2)")


def peak_and_oom(folder: Path, version: str) -> tuple[int | None, int | None]:
    def number(name: str) -> int | None:
        try:
            return int((folder / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    if version == "v1":
        oom = None
        try:
            for line in (folder / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    oom = int(line.split()[1])
        except OSError:
            pass
        return number("memory.max_usage_in_bytes"), oom
    events = {}
    try:
        events = dict(line.split() for line in (folder / "memory.events").read_text().splitlines())
    except OSError:
        pass
    return number("memory.peak"), int(events.get("oom_kill", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", nargs="?")
    parser.add_argument("--cap", type=float, required=True, help="bytes the run may use (6e9: 6 GB)")
    parser.add_argument("--out", type=Path, help="the run directory (default: the plan's)")
    parser.add_argument("--json", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    given = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if bool(given) == bool(args.plan):
        parser.error("give a plan or, after --, a command (one of the two)")
    folder, version = make_cgroup(int(args.cap))
    procs = folder / "cgroup.procs"
    command = given or [sys.executable, "-m", "quantgate.cli", "run", args.plan, *(["--out", str(args.out)] if args.out else [])]
    start = time.perf_counter()
    try:
        # a command's stderr is passed through as it comes and kept, so its error line is reported
        with subprocess.Popen(command, cwd=ROOT, stdout=None if given else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: procs.write_text(str(os.getpid()))) as process:
            assert process.stderr is not None
            stderr = []
            for line in process.stderr:
                stderr.append(line.rstrip("\n"))
                if given:
                    sys.stderr.write(line)
        seconds = time.perf_counter() - start
        peak, oom = peak_and_oom(folder, version)
    finally:
        folder.rmdir()
    errors = [line for line in stderr if line.startswith("quantgate: error:")]
    result = {"plan": args.plan, "command": given or None, "cap_bytes": int(args.cap), "cgroup": version, "exit": process.returncode,
              "seconds": round(seconds, 1), "error": errors[-1] if errors else None, "stderr_lines": len(stderr), "peak_bytes": peak,
              "oom_kills": oom, "killed_by_signal": process.returncode < 0}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
