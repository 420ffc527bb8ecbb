"""What running a unit in a child process of its own costs (quantgate.pipeline.executor.run_forked,
the local executor's quantize, evaluate and sensitivity units; docs/reliability.md, "No unit ends
the run"):

1. the fork itself: a unit that does nothing, its value pickled back, per unit: forked from a
   process that imported torch and quantgate's stages, and again after it imported what the units
   import (llmcompressor, lm-eval, datasets: a larger process to fork);
2. what a child pays that the run's own process did not: the model it loads again (a child's kept
   evaluator dies with it), timed as the evaluator loads it, in a fresh child each time;
3. the libraries a quantization and an evaluation import (llmcompressor, lm-eval, datasets), timed
   in a child forked before the run imported them and in one forked after (what the executor's
   `preload` does before a run's first unit of each kind, on a torch without an accelerator build),
   and the preload itself.

    .venv/bin/python benchmarks/unit_fork_overhead.py [--model smollm2-135m] [--units 20] [--loads 3]

Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import resource
import time

from quantgate.core.models import resolve_model
from quantgate.evalsets import lm_eval_tasks
from quantgate.pipeline import units  # noqa: F401 - quantgate's own modules, which a run's process has imported
from quantgate.pipeline.executor import LocalExecutor, run_forked
from quantgate.quantize import llmcompressor_backend


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _imports() -> float:
    """Seconds to import what a quantization and an evaluation import, in this process."""
    started = time.perf_counter()
    llmcompressor_backend.preload()
    lm_eval_tasks.preload()
    return time.perf_counter() - started


def _load(model: str) -> float:
    """Seconds to make an evaluator of `model` and load it on the CPU, as a sequential evaluation does."""
    from quantgate import evalsets
    from quantgate.evalsets.evaluate import compute_dtype_name

    started = time.perf_counter()
    evaluator = evalsets.Evaluator(resolve_model(model))
    evaluator.loaded("cpu", compute_dtype_name("cpu", evaluator.identity.storage_dtype).dtype)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a demo model's name or a model directory")
    parser.add_argument("--units", type=int, default=20, help="empty units forked, for the per-unit cost")
    parser.add_argument("--loads", type=int, default=3, help="model loads timed, each in a child of its own")
    args = parser.parse_args()
    executor = LocalExecutor()  # as a run makes it: torch here on one thread, the children on the run's
    try:
        started = time.perf_counter()
        for _ in range(args.units):
            run_forked("empty", lambda: None, executor.threads)
        empty = (time.perf_counter() - started) / args.units
        imports_before = run_forked("imports", _imports, executor.threads)
        preload = _imports()  # in the run, as the executor's preload does before the first unit of a kind
        imports_after = run_forked("imports", _imports, executor.threads)
        started = time.perf_counter()
        for _ in range(args.units):
            run_forked("empty", lambda: None, executor.threads)
        empty_after = (time.perf_counter() - started) / args.units
        loads = [run_forked("load", lambda: _load(args.model), executor.threads) for _ in range(args.loads)]
    finally:
        executor.close()
    print(json.dumps({"parent_peak_rss_mib": round(_rss_mib(), 1), "threads": executor.threads,
                      "empty_unit_ms": round(empty * 1000, 2), "empty_unit_ms_after_preload": round(empty_after * 1000, 2),
                      "unit_imports_s": {"without_preload": round(imports_before, 2), "preload_in_the_run": round(preload, 2),
                                         "with_preload": round(imports_after, 3)},
                      "model": args.model,
                      "model_load_s": [round(load, 3) for load in loads]}, indent=2))


if __name__ == "__main__":
    main()
