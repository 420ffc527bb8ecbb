"""Decode rates in vLLM on this machine: the baseline and a run's checkpoints, each served in a
fresh worker `--repeats` times (the serve check's throughput task: decode tokens/s at each batch
size, prefill excluded, median of `--runs` timed runs), so that a difference between formats can
be told from run-to-run noise. Prints, per checkpoint and batch size, the median over repeats,
the range, the ratio to the baseline's median and the bandwidth bound.

    .venv/bin/python benchmarks/serve_decode.py [--run demo-out] [--formats gptq-int4,smoothquant-w8a8]
        [--repeats 3] [--tokens 32] [--runs 3] [--batch-sizes 1,8] [--json PATH]

Needs the serving environment (`make serving`) and a finished run (`make demo`). On 2 cores each
worker takes about 20 s, FP8 (no FP8 instructions here) minutes: leave it out unless asked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from quantgate import serving
from quantgate.core.artifacts import read_json
from quantgate.evalsets.served import ServeCheckConfig, check


def rates(model: Path, cfg: ServeCheckConfig, env: serving.ServingEnv, repeats: int) -> dict[str, list[dict[str, float]]]:
    """Per batch size, each repeat's decode rate and bound (load and throughput only: no gated side)."""
    per_batch: dict[str, list[dict[str, float]]] = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="quantgate-serve-bench-") as work:
            record = check(model, None, cfg, env, Path(work))
        if not record.served or record.throughput is None:
            raise SystemExit(f"{model}: {record.reason}")
        for batch, entry in record.throughput.batches.items():
            per_batch.setdefault(batch, []).append({"tokens_per_s": entry.tokens_per_s, "bound": entry.bound_tokens_per_s})
    return per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("demo-out"))
    parser.add_argument("--formats", default="gptq-int4,smoothquant-w8a8,search-1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = serving.require()
    cfg = ServeCheckConfig(decode_tokens=args.tokens, runs=args.runs, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")))
    baseline = Path(read_json(args.run / "run.json")["model"])
    models = {"baseline": baseline} | {name: args.run / "checkpoints" / name for name in args.formats.split(",") if name}
    table: dict[str, Any] = {name: rates(path, cfg, env, args.repeats) for name, path in models.items()}
    print(f"{env.label}; {args.repeats} fresh workers a checkpoint, {args.runs} timed runs of {args.tokens} new tokens each")
    print(f"{'checkpoint':20s} {'batch':>5s} {'tokens/s median':>16s} {'range':>15s} {'x baseline':>10s} {'bound':>8s}")
    summary: dict[str, Any] = {}
    for name, per_batch in table.items():
        for batch, entries in per_batch.items():
            values = [entry["tokens_per_s"] for entry in entries]
            median = statistics.median(values)
            base = statistics.median(entry["tokens_per_s"] for entry in table["baseline"][batch])
            bound = statistics.median(entry["bound"] for entry in entries)
            summary.setdefault(name, {})[batch] = {"median": median, "min": min(values), "max": max(values),
                                                  "ratio_to_baseline": median / base, "bound": bound}
            print(f"{name:20s} {batch:>5s} {median:16.1f} {f'{min(values):.1f}-{max(values):.1f}':>15s} {median / base:10.2f} {bound:8.0f}")
    if args.json:
        args.json.write_text(json.dumps({"engine": env.identity(), "settings": vars(args) | {"run": str(args.run), "json": str(args.json)},
                                         "rates": summary}, indent=2))


if __name__ == "__main__":
    main()
