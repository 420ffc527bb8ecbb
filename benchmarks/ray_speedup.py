"""Scale-out speed: the same multi-format plan run in one go, locally on one CPU and on a local Ray
cluster of two one-CPU nodes (standing for one machine against two), and the ratio of the two
wall times. Target (issue 14): the cluster at least 1.6x faster.

The local run is pinned to CPU 0 (`taskset -c 0`), with torch at one thread; the cluster's head
is pinned to CPU 0 and its second node to CPU 1, one CPU each (`ray start --num-cpus=1`), so
every task's torch runs one thread (the ray executor sets a task's threads to its CPUs); the
driver is pinned to CPU 0 beside the head. The cluster runs in a network namespace of its own
that has only loopback (`unshare -n`, `ip link set lo up`; run as root). Each run starts from an
empty cache home (no evaluation cached) and an empty run directory; the cluster's start-up is
timed apart and not counted, its workers' start-up (importing torch in each) is.

AWQ runs a 10-point grid (default 20) so that no one format's chain is the whole run's critical
path. The model is a random Llama made here (hidden 512, 4 layers by default: big enough that the
formats' quantizations and evaluations, the work that runs side by side, outweigh the fixed
costs), calibrated on the demo source, evaluated on wiki-text and lambada, gated under
small-model@v3 narrowed to them; the verdicts of the two runs are checked to be the same.

    .venv/bin/python benchmarks/ray_speedup.py [--formats gptq-int4 awq-int4 smoothquant-w8a8 fp8-e4m3]
                                               [--hidden 512] [--layers 4] [--samples 64] [--min-ratio 1.6] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
PORT = 6379


def write_plan(scratch: Path, model: Path, formats: list[str], samples: int) -> Path:
    plan = {
        "model": str(model), "formats": formats,
        # AWQ's scale search at 10 grid points (default 20): with 20 its quantization alone (106 s of a
        # 201 s local run, measured) is the run's critical path, which no number of nodes shortens
        "quantize": {"awq-int4": {"awq_n_grid": 10}} if "awq-int4" in formats else {},
        "calibration": {"samples": samples, "seq_len": 256},
        "evaluation": {"sets": ["wiki-text@v1", "lambada@v1"], "items": {"wiki-text@v1": 25, "lambada@v1": 120}},
        "policy": "small-model@v3", "narrow_policy": ["wiki-text", "lambada"], "hardware": ["reference"],
        "out": str(scratch / "unused"),
    }
    path = scratch / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{' '.join(command[:6])} ... failed with exit code {done.returncode}")
    return seconds


def start_cluster(scratch: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], float]:
    common = f"--port={PORT} --node-ip-address=127.0.0.1 --num-cpus=1 --disable-usage-stats"
    script = (f"ip link set lo up && taskset -c 0 {BIN}/ray start --head {common} --include-dashboard=false "
              f"--temp-dir={scratch}/ray-temp >{scratch}/head.log 2>&1 && "
              f"taskset -c 1 {BIN}/ray start --address=127.0.0.1:{PORT} --node-ip-address=127.0.0.1 --num-cpus=1 "
              f"--disable-usage-stats >{scratch}/node.log 2>&1 && echo ready && exec sleep infinity")
    started = time.perf_counter()
    anchor = subprocess.Popen(["unshare", "-n", "sh", "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert anchor.stdout is not None
    if anchor.stdout.readline().strip() != "ready":
        raise SystemExit(f"the Ray cluster did not start; see {scratch}/head.log and node.log")
    return anchor, time.perf_counter() - started


def verdicts(out: Path) -> dict[str, str]:
    return {fmt: entry["verdict"] for fmt, entry in json.loads((out / "run.json").read_text())["verdicts"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["gptq-int4", "awq-int4", "smoothquant-w8a8", "fp8-e4m3"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64, help="calibration rows of 256 tokens (every quantization's work)")
    parser.add_argument("--min-ratio", type=float, default=1.6)
    parser.add_argument("--keep", type=Path, help="keep the scratch directory here (the two run directories, the cluster's logs)")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two CPUs")
    from tests.factories import build_tiny_llama

    scratch = Path(tempfile.mkdtemp(prefix="qg-speedup-", dir="/tmp"))  # short: Ray's socket paths
    try:
        model = build_tiny_llama(scratch / "model", vocab_size=2048, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                 layers=args.layers, heads=args.hidden // 64, kv_heads=2, max_positions=512)
        plan = write_plan(scratch, model, args.formats, args.samples)
        base = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        run = [str(BIN / "python"), "-m", "quantgate.cli", "run", str(plan), "--quiet", "--out"]

        local_env = {**base, "QUANTGATE_HOME": str(scratch / "home-local")}
        local = timed(["taskset", "-c", "0", *run, str(scratch / "local-run")], local_env)
        print(f"local, one CPU:             {local:7.1f} s", flush=True)

        ray_env = {**base, "QUANTGATE_HOME": str(scratch / "home-ray")}
        anchor, start_up = start_cluster(scratch, ray_env)
        try:
            inside = ["nsenter", "-t", str(anchor.pid), "-n", "--", "taskset", "-c", "0"]
            cluster = timed([*inside, *run, str(scratch / "cluster-run"), "--address", f"127.0.0.1:{PORT}"], ray_env)
        finally:
            subprocess.run(["nsenter", "-t", str(anchor.pid), "-n", "--", str(BIN / "ray"), "stop", "--force"],
                           capture_output=True, env=ray_env)
            anchor.kill()
        print(f"ray, two one-CPU nodes:     {cluster:7.1f} s  (cluster start-up {start_up:.1f} s, not counted)")
        ratio = local / cluster
        same = verdicts(scratch / "local-run") == verdicts(scratch / "cluster-run")
        print(f"speed-up: {ratio:.2f}x ({len(args.formats)} formats, hidden {args.hidden}, {args.layers} layers, "
              f"{args.samples} calibration rows); "
              f"same verdicts: {same} {verdicts(scratch / 'cluster-run')}")
    finally:
        if args.keep:
            shutil.copytree(scratch, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("ray-temp"))
        shutil.rmtree(scratch, ignore_errors=True)
    if ratio < args.min_ratio or not same:
        raise SystemExit(f"missed: {ratio:.2f}x (target {args.min_ratio}x), same verdicts {same}")


if __name__ == "__main__":
    main()
