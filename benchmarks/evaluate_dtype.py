"""Evaluation in FP32 against BF16 on this machine (issue 36): what the compute dtype costs and what
it changes.

    .venv/bin/python benchmarks/evaluate_dtype.py speed [--model smollm2-135m] [--set lambada@v1=120 ...] [--json F]
    .venv/bin/python benchmarks/evaluate_dtype.py gates RUN_FP32 RUN_BF16 [--json F]

`speed`: this machine's FP32 and BF16 matrix-product rates (torch, its current threads, best of
three) at the demo model's shapes and at 1024^3, then the model evaluated on each set (one of each
kind by default: last-word, multiple-choice, text) in FP32 ("before": every CPU's dtype until
issue 36) and in BF16, set by set (FP32 first; `--first bfloat16` turns it round), through `evalsets.run` with the cache off:
items per second per set against the two rates. A text set is evaluated against the model itself
as its own baseline (KL, top-1), each dtype against its own, as a run does.

`gates`: two run directories of one plan, one evaluated with `evaluation: {dtype: float32}` and
one with `dtype: auto` (BF16 where the CPU computes it natively; the recorded dtypes are checked):
every metric gate of every verdict, its estimate in each, the difference as a share of the move
tolerated (a tenth of the bound's distance from no change: 0.015 for KL <= 0.15, 0.02 for top-1 >=
0.80, 0.5 points for a 5-point drop), and each verdict. Exit 1 when a verdict differs or an
estimate on the same items moves by the tolerated amount or more (the acceptance rule of issue
36). A gate decided at another look in the two runs has estimates of different items: it is listed
as not checked, never counted as passing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evaluate_speed import matmul_gflops  # noqa: E402  (this folder is on sys.path: the script's own)

DEFAULT_SETS = ("lambada@v1=120", "arc-easy@v1=60", "wiki-text@v1=25")
# the demo model's matrix products: a batch of 512 positions through q_proj (576 -> 576 is smaller),
# gate/up (576 -> 1536), and 2048 positions through the fused gate/up of a wider model
SHAPES = ((512, 576, 1536), (2048, 576, 6144), (1024, 1024, 1024))
DTYPES = ("float32", "bfloat16")
SHARE_OF_LIMIT = 0.1  # issue 36: every gate's estimate moves by less than a tenth of its bound


def rates() -> dict[str, dict[str, float]]:
    return {dtype: {"x".join(map(str, shape)): matmul_gflops(repeats=10, dtype=dtype, shape=shape) for shape in SHAPES} for dtype in DTYPES}


def speed(arguments: argparse.Namespace) -> dict[str, Any]:
    import torch

    from quantgate import evalsets
    from quantgate.core.cpu import cpu_flags, native_bf16
    from quantgate.core.models import resolve_model
    from quantgate.evalsets.evaluate import compute_dtype_name

    model_dir = resolve_model(arguments.model)
    work = Path(tempfile.mkdtemp(prefix="quantgate-evaluate-dtype-"))
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    before = rates()
    specs = [spec.partition("=") for spec in arguments.sets or DEFAULT_SETS]
    limits = {name: int(count or 60) for name, _, count in specs}
    rows: dict[str, dict[str, Any]] = {name: {"items": limit} for name, limit in limits.items()}
    order = DTYPES if arguments.first == "float32" else tuple(reversed(DTYPES))
    for name, limit in limits.items():  # set by set, both dtypes back to back: a machine's load drifts
        for dtype in order:
            golden = evalsets.load(name)
            cfg = evalsets.EvaluateConfig.model_validate({"evalsets": (name,), "limits": {name: limit}, "dtype": dtype,
                                                          "use_cache": False, "batch_size": arguments.batch_size})
            baseline = None
            if golden.kind is evalsets.Kind.text:  # the model against itself: the KL path as a run pays it
                baseline = evalsets.run(cfg, model_dir, work / f"{golden.name}-{dtype}-reference").path
            started = time.perf_counter()
            results = evalsets.run(cfg, model_dir, work / f"{golden.name}-{dtype}", baseline_results=baseline)
            wall = time.perf_counter() - started
            entry = results.manifest.sets[golden.spec]
            rows[name]["kind"] = golden.kind.value
            rows[name][dtype] = {"seconds": entry.seconds, "wall_seconds": wall, "items_per_second": entry.items / entry.seconds,
                                 "primary": entry.metrics.get(entry.primary)}
            print(f"{golden.spec} in {dtype}: {entry.items} items in {entry.seconds:.1f} s", file=sys.stderr)
    after = rates()
    flags = cpu_flags()
    auto = compute_dtype_name("cpu", "BF16")
    print(f"\nCPU flags: avx512f {'avx512f' in flags}, native BF16 {native_bf16(flags)}, amx_bf16 {'amx_bf16' in flags}; "
          f"{torch.get_num_threads()} torch threads; load average {os.getloadavg()[0]:.1f}; auto picks {auto.dtype} "
          f"({auto.basis})\n")
    print("| product (m x k x n) | FP32 GFLOP/s (before / after the sets) | BF16 GFLOP/s | BF16 / FP32 |")
    print("|---|---|---|---|")
    for shape in before["float32"]:
        fp32 = (before["float32"][shape] + after["float32"][shape]) / 2
        bf16 = (before["bfloat16"][shape] + after["bfloat16"][shape]) / 2
        print(f"| {shape} | {before['float32'][shape]:.1f} / {after['float32'][shape]:.1f} | "
              f"{before['bfloat16'][shape]:.1f} / {after['bfloat16'][shape]:.1f} | x{bf16 / fp32:.2f} |")
    print("\n| set | kind | items | FP32 s | BF16 s | FP32 items/s | BF16 items/s | speedup | primary metric FP32 / BF16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        fp32, bf16 = row["float32"], row["bfloat16"]
        print(f"| {name} | {row['kind']} | {row['items']} | {fp32['seconds']:.1f} | {bf16['seconds']:.1f} | "
              f"{fp32['items_per_second']:.2f} | {bf16['items_per_second']:.2f} | x{fp32['seconds'] / bf16['seconds']:.2f} | "
              f"{fp32['primary']:.4g} / {bf16['primary']:.4g} |")
    return {"model": str(model_dir), "threads": torch.get_num_threads(), "native_bf16": native_bf16(flags),
            "avx512f": "avx512f" in flags, "amx_bf16": "amx_bf16" in flags, "auto": auto.dtype, "auto_basis": auto.basis,
            "matmul_gflops": {"before": before, "after": after}, "sets": rows, "load_average": os.getloadavg()}


def verdicts(run: Path) -> dict[str, dict[str, Any]]:
    """Checkpoint name -> its verdict record (the run's verdicts/*.json)."""
    found = {}
    for path in sorted((run / "verdicts").glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        found[path.stem] = record.get("value", record)
    if not found:
        raise SystemExit(f"{run}: no verdicts/*.json (not a run directory?)")
    return found


def dtypes(run: Path) -> set[str]:
    """The dtypes the run's reference evaluations computed in (every set's recorded settings)."""
    return {json.loads(path.read_text(encoding="utf-8"))["settings"].get("dtype", "?")
            for path in run.glob("results/*/*/record.json")}


def tolerated_move(gate: dict[str, Any]) -> float | None:
    """What issue 36 lets a gate's estimate move by: a tenth of its bound's distance from "no
    change" (0 for a change or a divergence, 1 for an agreement: top-1 >= 0.80 tolerates 0.02);
    None for a gate that is not a metric's (size, integrity: computed without the model)."""
    from quantgate.core.metrics import METRICS

    metric = METRICS.get(gate["gate"].rsplit(" ", 1)[-1])
    if metric is None or "@" not in gate["gate"]:
        return None
    no_change = metric.baseline_value if metric.baseline_value is not None else 0.0
    return SHARE_OF_LIMIT * abs(float(gate["limit"]) - no_change)


def gates(arguments: argparse.Namespace) -> dict[str, Any]:
    before, after = verdicts(arguments.before), verdicts(arguments.after)
    computed = {"before": sorted(dtypes(arguments.before)), "after": sorted(dtypes(arguments.after))}
    rows, failures, unchecked = [], [], []
    if computed["before"] != ["float32"] or computed["after"] != ["bfloat16"]:
        failures.append(f"the runs computed in {computed['before']} and {computed['after']}, not float32 and bfloat16")
    print(f"dtypes: {computed['before']} against {computed['after']}\n")
    print("| checkpoint | gate | limit | FP32: estimate (items), outcome | BF16: estimate (items), outcome | difference "
          "| of the tolerated move |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            failures.append(f"{name}: a verdict in one run only")
            continue
        if old["verdict"] != new["verdict"]:
            failures.append(f"{name}: {old['verdict']} in FP32, {new['verdict']} in BF16")
        new_gates = {gate["gate"]: gate for gate in new["gates"]}
        for gate in old["gates"]:
            other = new_gates.get(gate["gate"])
            if other is None or gate.get("estimate") is None or other.get("estimate") is None:
                continue
            allowed = tolerated_move(gate)
            if allowed is None:
                continue
            difference = other["estimate"] - gate["estimate"]
            share = abs(difference) / allowed if allowed else float("inf")
            same_items = gate.get("items") == other.get("items")
            row = {"checkpoint": name, "gate": gate["gate"], "limit": gate["limit"], "fp32": gate["estimate"], "bf16": other["estimate"],
                   "items": [gate.get("items"), other.get("items")], "outcomes": [gate["outcome"], other["outcome"]],
                   "difference": difference, "tolerated": allowed, "share_of_tolerated": share, "same_items": same_items}
            rows.append(row)
            if not same_items:  # decided at another look: estimates of different items, not comparable
                unchecked.append(f"{name} {gate['gate']}: {gate.get('items')} items in FP32, {other.get('items')} in BF16")
            elif share >= 1.0:
                failures.append(f"{name} {gate['gate']}: moved by {abs(difference):.4g}, {share:.1f}x the tolerated {allowed:.4g}")
            note = "" if same_items else " (other items: not checked)"
            print(f"| {name} | {gate['gate']} | {gate['limit']:.4g} | {gate['estimate']:.4g} ({gate.get('items')}), {gate['outcome']} | "
                  f"{other['estimate']:.4g} ({other.get('items')}), {other['outcome']} | {difference:+.4g} | {share:.0%}{note} |")
    print("\nverdicts: " + ", ".join(f"{name} {before[name]['verdict']} / {after[name]['verdict']}"
                                     for name in sorted(before.keys() & after.keys())))
    for line in unchecked:
        print(f"NOT CHECKED: {line}", file=sys.stderr)
    for failure in failures:
        print(f"FAILS: {failure}", file=sys.stderr)
    return {"before": str(arguments.before), "after": str(arguments.after), "dtypes": computed, "gates": rows,
            "not_checked": unchecked, "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    timed = commands.add_parser("speed", help="items/s per set kind in FP32 and BF16, against the matrix-product rates")
    timed.add_argument("--model", default="smollm2-135m", help="model directory or demo model name (pulled)")
    timed.add_argument("--set", dest="sets", action="append", metavar="SPEC=N",
                       help=f"a golden set and its items (repeatable; default {' '.join(DEFAULT_SETS)})")
    timed.add_argument("--batch-size", type=int, default=4, help="quantgate's default")
    timed.add_argument("--first", choices=DTYPES, default="float32", help="which dtype is evaluated first")
    compared = commands.add_parser("gates", help="every gate's estimate and verdict in two runs of one plan")
    compared.add_argument("before", type=Path, help="the run evaluated in FP32")
    compared.add_argument("after", type=Path, help="the run evaluated in BF16")
    for command in (timed, compared):
        command.add_argument("--json", type=Path, help="also write the figures here")
    arguments = parser.parse_args()
    figures = speed(arguments) if arguments.command == "speed" else gates(arguments)
    if arguments.json:
        arguments.json.write_text(json.dumps(figures, indent=2, default=str), encoding="utf-8")
    return 1 if figures.get("failures") else 0


if __name__ == "__main__":
    raise SystemExit(main())
