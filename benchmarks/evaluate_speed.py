"""Evaluation speed of the lm-eval sets on the HF backend (CPU, FP32), before (HFLM's own
loglikelihood loop) and after (evalsets.loglikelihood: a shared context run once, the output
layer only where scored), against this machine's FP32 matrix-product rate, with the scores
checked equal.

    .venv/bin/python benchmarks/evaluate_speed.py                      # arc-easy=60, lambada=60
    .venv/bin/python benchmarks/evaluate_speed.py --set hellaswag=20 --repeats 2 --json speed.json

Both sides run the same lm-eval task (`evalsets.lm_eval_tasks.run_task`) on the same loaded
model (loaded as `quantgate evaluate` loads it: FP32, one warm-up forward pass), alternating
which goes first. Tokens are the requests' tokens as HFLM feeds them (context + continuation
- 1 each): the same count on both sides, so tokens per second compare directly; "model
GFLOP/s" is that rate times the FLOPs HFLM spends on a token (2 x the decoder's weights
outside the embedding, plus 2 x the output layer's; attention scores left out) and "of matmul"
that as a share of a 1024^3 FP32 torch matmul's rate, measured before and after the sets (in
brackets after: the FLOPs the scorer itself ran, its positions and output rows, per second).
The scores must be equal: every item's accuracy fields identical (acc, acc_norm, the
predicted choices, the greedy flag), every log-likelihood within 1e-4 nats. Target:
multiple-choice items at least 2x faster. Exit 1 when the scores differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-4  # nats, per log-likelihood
DEFAULT_SETS = ("arc-easy@v1=60", "lambada@v1=60")


def matmul_gflops(size: int = 1024, repeats: int = 20, dtype: str = "float32", shape: tuple[int, int, int] | None = None) -> float:
    """This machine's matrix-product rate in `dtype` ([m, k] @ [k, n], `shape`; default size^3), as
    torch reaches it with its current threads (best of three)."""
    import torch

    m, k, n = shape or (size, size, size)
    a, b = torch.randn(m, k).to(getattr(torch, dtype)), torch.randn(k, n).to(getattr(torch, dtype))
    a @ b
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - started) / 1e9)
    return best


def flops(model: Any) -> tuple[float, float]:
    """FLOPs of a position through the decoder (every weight outside the embedding once: a multiply
    and an add) and of a row through the output layer. HFLM spends both on every token."""
    embedding = model.get_input_embeddings().weight
    decoder = sum(p.numel() for p in model.get_decoder().parameters() if p is not embedding)
    return 2.0 * decoder, 2.0 * model.get_output_embeddings().weight.numel()


def cpu_class() -> str:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        return "unknown"
    return "+".join(flag for flag in ("avx512f", "amx_bf16") if flag in flags) or ("avx2" if "avx2" in flags else "x86/other")


def timed_side(lm: Any, golden: Any, limit: int, work: Path) -> dict[str, Any]:
    """One lm-eval run of a set: wall seconds, the seconds and tokens of its loglikelihood calls,
    and its per-item records."""
    from quantgate.evalsets import lm_eval_tasks

    counted = {"seconds": 0.0, "tokens": 0, "requests": 0}
    inner = lm._loglikelihood_tokens

    def counting(requests: Any, *args: Any, **kwargs: Any) -> Any:
        counted["tokens"] += sum(len(context) + len(continuation) - 1 for _, context, continuation in requests)
        counted["requests"] += len(requests)
        started = time.perf_counter()
        answers = inner(requests, *args, **kwargs)
        counted["seconds"] += time.perf_counter() - started
        return answers

    lm._loglikelihood_tokens = counting  # an instance attribute: lm-eval calls self._loglikelihood_tokens
    started = time.perf_counter()
    try:
        results = lm_eval_tasks.run_task(lm, golden, work, limit, bootstrap_iters=0)
    finally:
        del lm._loglikelihood_tokens
    wall = time.perf_counter() - started
    records = lm_eval_tasks.per_item(golden, results["samples"][lm_eval_tasks.task_name(golden)])
    return {"wall": wall, **counted, "items": records}


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> tuple[bool, float]:
    """(every accuracy field identical, the largest log-likelihood difference in nats)."""
    same, worst = len(before) == len(after), 0.0
    for old, new in zip(before, after, strict=False):
        for field in ("metrics", "predicted", "predicted_norm", "greedy", "index"):
            same = same and old.get(field) == new.get(field)
        values_old = old.get("loglikelihoods", [old.get("loglikelihood")])
        values_new = new.get("loglikelihoods", [new.get("loglikelihood")])
        worst = max([worst, *(abs(a - b) for a, b in zip(values_old, values_new, strict=True))])
    return same, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model directory or demo model name (pulled)")
    parser.add_argument("--set", dest="sets", action="append", metavar="SPEC=N",
                        help=f"a golden set and its items (repeatable; default {' '.join(DEFAULT_SETS)})")
    parser.add_argument("--batch-size", type=int, default=4, help="quantgate's default")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side per set (medians reported)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, as `quantgate evaluate`); on a "
                        "machine shared with other work, 1 thread times steadily where 2 wait on each other")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    arguments = parser.parse_args()

    import torch

    from quantgate import evalsets
    from quantgate.core.models import resolve_model
    from quantgate.evalsets import lm_eval_tasks
    from quantgate.evalsets.evaluate import _LoadedModel

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    model_dir = resolve_model(arguments.model)  # from the real cache home; lm-eval's datasets cache in ours
    work = Path(tempfile.mkdtemp(prefix="quantgate-evaluate-speed-"))
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "QUANTGATE_HOME": str(work / "home")})
    rate_before = matmul_gflops()
    model, tokenizer = _LoadedModel(model_dir, "cpu", "float32").transformers()
    decoder_flops, head_flops = flops(model)
    per_token = decoder_flops + head_flops
    before_lm = lm_eval_tasks.hf_model(model, tokenizer, arguments.batch_size, shared_context=False)
    after_lm = lm_eval_tasks.hf_model(model, tokenizer, arguments.batch_size)
    started = time.perf_counter()
    after_lm._shared_context_scorer()  # its probe, once per loaded model: timed apart
    probe_seconds = time.perf_counter() - started
    rows, equal = [], True
    for spec in arguments.sets or DEFAULT_SETS:
        name, _, count = spec.partition("=")
        golden, limit = evalsets.load(name), int(count or 60)
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for repeat in range(arguments.repeats):
            order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
            for side in order:
                lm = before_lm if side == "before" else after_lm
                runs[side].append(timed_side(lm, golden, limit, work / f"{golden.name}-{side}-{repeat}"))
        same, worst = compare(runs["before"][0]["items"], runs["after"][0]["items"])
        equal = equal and same and worst <= TOLERANCE
        row: dict[str, Any] = {"set": golden.spec, "kind": golden.kind.value, "items": limit,
                               "requests": runs["before"][0]["requests"], "tokens": runs["before"][0]["tokens"],
                               "accuracy_identical": same, "max_loglikelihood_difference": worst}
        for side in ("before", "after"):
            seconds = statistics.median(run["seconds"] for run in runs[side])
            row[side] = {"seconds": seconds, "wall_seconds": statistics.median(run["wall"] for run in runs[side]),
                         "tokens_per_second": row["tokens"] / seconds}
        row["speedup"] = row["before"]["seconds"] / row["after"]["seconds"]
        if after_lm.scorer is not None:  # what the scorer ran: positions (padding included) and output rows
            done = {key: value / arguments.repeats for key, value in after_lm.scorer.work.items()}
            row["after"]["scorer_work"] = done
            row["after"]["flops"] = done["positions"] * decoder_flops + done["head_rows"] * head_flops
            after_lm.scorer.work = dict.fromkeys(after_lm.scorer.work, 0)
        rows.append(row)
        print(f"{golden.spec}: before {row['before']['seconds']:.1f} s, after {row['after']['seconds']:.1f} s "
              f"(x{row['speedup']:.2f}); accuracy identical {same}, max |d loglikelihood| {worst:.1e}", file=sys.stderr)
    rate_after = matmul_gflops()
    rate = (rate_before + rate_after) / 2
    print(f"\nCPU: {cpu_class()}, {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f}; "
          f"FP32 matmul {rate_before:.1f} / {rate_after:.1f} GFLOP/s (before / after the sets); "
          f"model {per_token / 1e6:.0f} MFLOP per token; batch size {arguments.batch_size}; "
          f"loglikelihood scorer: {after_lm.get_model_info()['loglikelihood_scorer']} (its probe: {probe_seconds:.2f} s "
          "once per loaded model, not in the table)\n")
    header = ("set", "kind", "items", "tokens", "before s", "after s", "before tok/s", "after tok/s",
              "before of matmul", "after of matmul (its own work)", "speedup", "acc equal", "max |d ll|")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        # before: HFLM's work per second as a share of the matmul rate; after: the same tokens
        # (HFLM's work) per second, and in brackets the FLOPs the scorer itself ran
        shares = [row[side]["tokens_per_second"] * per_token / 1e9 / rate for side in ("before", "after")]
        own = row["after"].get("flops", 0.0) / row["after"]["seconds"] / 1e9 / rate
        print(f"| {row['set']} | {row['kind']} | {row['items']} | {row['tokens']} | {row['before']['seconds']:.1f} | "
              f"{row['after']['seconds']:.1f} | {row['before']['tokens_per_second']:.0f} | "
              f"{row['after']['tokens_per_second']:.0f} | {shares[0]:.0%} | {shares[1]:.0%} ({own:.0%}) | x{row['speedup']:.2f} | "
              f"{'yes' if row['accuracy_identical'] else 'NO'} | {row['max_loglikelihood_difference']:.1e} |")
    if arguments.json:
        arguments.json.write_text(json.dumps({
            "cpu": cpu_class(), "threads": torch.get_num_threads(), "matmul_gflops": [rate_before, rate_after],
            "flops_per_token": per_token, "probe_seconds": probe_seconds, "batch_size": arguments.batch_size, "model": str(model_dir),
            "load_average": os.getloadavg(), "sets": rows, "scores_equal": equal,
        }, indent=2), encoding="utf-8")
    if not equal:
        print(f"scores differ: an accuracy field changed or a log-likelihood moved by more than {TOLERANCE}", file=sys.stderr)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
