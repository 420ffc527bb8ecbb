"""quantgate's evaluation of the demo model on arc-easy against the plain `lm_eval` command line
on the same task definition and limit, in one run; then a cache hit.

    .venv/bin/python benchmarks/evaluate_overhead.py --limit 100 --repeats 1
    .venv/bin/python benchmarks/evaluate_overhead.py --demo-timing ckpt/gptq-int4 ckpt/awq-int4 ...

Both sides run as fresh processes from their command lines (imports, model load and all):

    quantgate evaluate --model M --evalset arc-easy --limit N --batch-size B --no-cache --out ...
    lm_eval --model hf --model_args pretrained=M,dtype=float32 --tasks quantgate_arc_easy_v1 \\
        --include_path DIR --limit N --batch_size B --device cpu

where DIR holds the task YAML quantgate generates from the set's manifest (the same file its
evaluator runs). The two sides alternate and the medians are compared. Target: quantgate
within 1.1x of lm-eval's wall time, and a repeated request served from the cache in under a
second (timed in-process, where the answer is needed; the CLI figure adds Python start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"benchmark command failed ({completed.returncode}): {' '.join(command)}\n{tail}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model directory or demo model name (pulled)")
    parser.add_argument("--evalset", default="arc-easy")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1, help="the same on both sides (lm_eval's default is 1)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--demo-timing", nargs="+", type=Path, metavar="CHECKPOINT",
                        help="instead: time the demo (the baseline, then these checkpoints against it, on the four "
                        "sets at evalsets/demo_limits.yaml), cold cache, in-process")
    arguments = parser.parse_args()
    if arguments.demo_timing:
        return demo_timing(arguments.model, arguments.demo_timing, arguments.json)

    from quantgate import evalsets
    from quantgate.core.models import resolve_model
    from quantgate.evalsets.lm_eval_tasks import task_name, write_task

    model_dir = resolve_model(arguments.model)
    golden = evalsets.load(arguments.evalset)
    work = Path(tempfile.mkdtemp(prefix="quantgate-evaluate-bench-"))
    task_dir = work / "tasks"
    write_task(golden, task_dir)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "QUANTGATE_HOME": str(work / "home")}
    os.environ.update({key: env[key] for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "QUANTGATE_HOME")})

    quantgate_command = [
        str(BIN / "quantgate"), "evaluate", "--model", str(model_dir), "--evalset", golden.spec,
        "--limit", str(arguments.limit), "--batch-size", str(arguments.batch_size), "--no-cache",
        "--overwrite", "--out", str(work / "results"),
    ]
    lm_eval_command = [
        str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32",
        "--tasks", task_name(golden), "--include_path", str(task_dir), "--limit", str(arguments.limit),
        "--batch_size", str(arguments.batch_size), "--device", "cpu",
    ]
    timings: dict[str, list[float]] = {"quantgate": [], "lm_eval": []}
    for repeat in range(arguments.repeats):
        order = [("quantgate", quantgate_command), ("lm_eval", lm_eval_command)]
        for side, command in order if repeat % 2 == 0 else order[::-1]:
            timings[side].append(timed(command, env))
            print(f"  {side}: {timings[side][-1]:.1f} s", file=sys.stderr)

    # The cache hit: the same request again, in-process (torch and transformers already imported
    # by then in a pipeline) and from the command line (a fresh Python process).
    import torch  # noqa: F401  (what a long-running caller has imported already)

    cfg = evalsets.EvaluateConfig(evalsets=(golden.spec,), limit=arguments.limit, batch_size=arguments.batch_size)
    started = time.perf_counter()
    hit = evalsets.run(cfg, model_dir, work / "hit", overwrite=True)
    in_process = time.perf_counter() - started
    if not all(hit.from_cache.values()):
        raise SystemExit("the repeated request was not served from the cache")
    cli_hit = timed([*quantgate_command[:-4], "--overwrite", "--out", str(work / "hit-cli")], env)

    quantgate, lm_eval = statistics.median(timings["quantgate"]), statistics.median(timings["lm_eval"])
    figures = {
        "evalset": golden.spec,
        "limit": arguments.limit,
        "batch_size": arguments.batch_size,
        "repeats": arguments.repeats,
        "quantgate_seconds": timings["quantgate"],
        "lm_eval_seconds": timings["lm_eval"],
        "ratio": quantgate / lm_eval,
        "cache_hit_seconds_in_process": in_process,
        "cache_hit_seconds_cli": cli_hit,
        "target": {"ratio_at_most": 1.1, "cache_hit_seconds_below": 1.0},
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    print(f"{golden.spec}, first {arguments.limit} items, batch size {arguments.batch_size}, {arguments.repeats} repeat(s)")
    print(f"  quantgate evaluate : {quantgate:7.1f} s (median of {timings['quantgate']})")
    print(f"  lm_eval CLI        : {lm_eval:7.1f} s (median of {timings['lm_eval']})")
    print(f"  ratio              : {figures['ratio']:.3f}x (target <= 1.1x)")
    print(f"  cache hit          : {in_process:.3f} s in-process (target < 1 s), {cli_hit:.2f} s from the command line")
    if arguments.json:
        arguments.json.write_text(json.dumps(figures, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    ok = figures["ratio"] <= 1.1 and in_process < 1.0
    return 0 if ok else 1


def demo_timing(model: str, checkpoints: list[Path], json_path: Path | None) -> int:
    """Per model and per set: seconds, items/s, model load; the whole demo's evaluation time."""
    from quantgate import evalsets
    from quantgate.core.models import resolve_model

    models = [resolve_model(model), *checkpoints]  # before QUANTGATE_HOME moves to the scratch cache
    work = Path(tempfile.mkdtemp(prefix="quantgate-demo-timing-"))
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", QUANTGATE_HOME=str(work / "home"))
    limits = evalsets.demo_limits()
    cfg = evalsets.EvaluateConfig(evalsets=tuple(limits), limits=limits)
    figures: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    baseline = None
    for path in models:
        clock = time.perf_counter()
        results = evalsets.run(cfg, path, work / path.name, baseline_results=baseline)
        baseline = baseline or results.path
        manifest = results.manifest
        figures[path.name] = {
            "seconds": time.perf_counter() - clock,
            "model_load_seconds": manifest.model_load_seconds,
            "sets": {spec: {"items": entry.items, "seconds": entry.seconds,
                            "items_per_second": entry.items / entry.seconds,
                            "metrics": {k: v for k, v in entry.metrics.items() if "stderr" not in k}}
                     for spec, entry in manifest.sets.items()},
        }
        print(f"{path.name}: {figures[path.name]['seconds']:.1f} s (model load {manifest.model_load_seconds or 0:.1f} s)")
        for spec, entry in figures[path.name]["sets"].items():
            shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(entry["metrics"].items()))
            print(f"  {spec:14} {entry['items']:4} items {entry['seconds']:6.1f} s {entry['items_per_second']:6.2f} items/s  {shown}")
    total = time.perf_counter() - started
    print(f"demo evaluation: {len(figures)} models x {len(limits)} sets in {total:.1f} s "
          f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    if json_path:
        json_path.write_text(json.dumps({"limits": limits, "models": figures, "total_seconds": total}, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
