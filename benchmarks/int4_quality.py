"""INT4 quality at equal bits: GPTQ, GPTQ with llmcompressor's importance-matrix observer,
AWQ and AutoRound side by side on one model (the demo model unless --model), with the same
calibration tokens and the same group-size plan (group 128; a smaller group where a layer's width
needs it, quantize/groups.py: 64 for the demo model's width-576 layers).

    .venv/bin/python benchmarks/int4_quality.py [--methods gptq,gptq-imatrix,awq,autoround,...]
        [--model smollm2-135m] [--items 50] [--out /tmp/int4-quality] [--autoround-iters 200]
        [--resume] [--json PATH]

On 2 quiet CPU cores the default set takes about half an hour (evaluations are cached, so a rerun
pays only for the quantizations). AutoRound's default 200 iterations per block would take about
20 minutes there alone: docs/int4-quality.md ran it with --autoround-iters 20.

For each method: the KL divergence (mean per token, nats) and top-1 agreement against the
baseline on the first --items of wiki-text@v1, the perplexity change, the quantization's wall
time (the whole `quantize.stage.run`: load, algorithm, save, reload-and-generate smoke check;
and `oneshot` alone) and CPU seconds, its peak RSS, and the checkpoint's bits per quantized weight
(quantize.measure.accounting). Each quantization runs in a fresh child process, one at a time;
peak RSS is the child's own high-water mark (VmHWM), CPU seconds come from wait4. Evaluation uses
the project's Evaluator (cached by model identity: a rerun re-evaluates only changed weights).

Methods (all W4A16, the gptq-int4/awq-int4 presets' QuantizationArgs and group plan):
  gptq          the gptq-int4 preset with the minmax weight observer (its default until the
                measurements of docs/int4-quality.md)
  gptq-imatrix  the same GPTQModifier, weights' observer="imatrix_mse" (E[x^2]-weighted range
                search): the gptq-int4 preset as quantgate runs it now
  gptq-mse      control: the same GPTQModifier, observer="mse" with imatrix_mse's search grid
                (shrink to 5% in steps of 5%, |error|^3): the same range search, unweighted
  awq           the awq-int4 preset with awq_n_grid=5 (the demo's setting)
  awq-g20       the awq-int4 preset with awq_n_grid=20 (llmcompressor's default)
  awq-imatrix   the awq-int4 preset (awq_n_grid=5), weights' observer="imatrix_mse"
  autoround     AutoRoundModifier, symmetric like gptq-int4, --autoround-iters iterations per block
  rtn           reference: round-to-nearest, minmax observer (QuantizationModifier alone)
  rtn-imatrix   reference: round-to-nearest with observer="imatrix_mse" (llama.cpp-like imatrix quant)
Checkpoints, logs and results stay under --out; the calibration set there is reused, checkpoints
are rebuilt unless --resume.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from quantgate.core.hf_config import QuantizationArgs
    from quantgate.quantize.config import QuantizeConfig
    from quantgate.quantize.groups import GroupPlan
    from quantgate.quantize.presets import Observer, Preset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METHODS = ("gptq", "gptq-imatrix", "gptq-mse", "awq", "awq-g20", "awq-imatrix", "autoround", "rtn", "rtn-imatrix")
DEFAULT_METHODS = ("gptq", "gptq-imatrix", "gptq-mse", "awq", "awq-g20", "autoround", "rtn-imatrix")
EVALSET = "wiki-text@v1"
ONESHOT_SECONDS: list[float] = []  # the child's oneshot call, timed by the patched backend
IMATRIX_FALLBACK = "Falling back to uniform MSE"  # the observer's warning when it had no importance data


# ---- child: one quantization ----------------------------------------------------------------


def _patch_recipe(method: str, autoround_iters: int) -> None:
    """Make quantize.stage.run build `method`'s recipe: the stage looks the backend's functions up
    at call time, so everything else (loading, FP32 calibration, storage dtype, saving, the smoke
    check, the manifest) stays quantgate's own."""
    from dataclasses import replace

    from quantgate.quantize import llmcompressor_backend as backend
    from quantgate.quantize.presets import Algorithm

    original = backend.build_recipe

    def observer(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16",
                 model: Any = None) -> list[Any]:
        if method == "gptq-mse":  # llmcompressor runs "mse" on weights as memoryless_mse
            weights = {**preset.weights, "observer": "mse", "observer_kwargs": {"maxshrink": 0.95, "grid": 20, "norm": 3.0}}
        else:
            weights = {**preset.weights, "observer": "imatrix_mse"}
        preset = replace(preset, weights=cast("QuantizationArgs", weights))  # the observer's own keys besides the scheme's
        if method == "rtn-imatrix":
            preset = replace(preset, algorithm=Algorithm.round_to_nearest)
        return original(preset, cfg, plan, storage_dtype, model)

    def rtn(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16",
                 model: Any = None) -> list[Any]:
        return original(replace(preset, algorithm=Algorithm.round_to_nearest), cfg, plan, storage_dtype, model)

    def autoround(preset: Preset, cfg: QuantizeConfig, plan: GroupPlan | None, storage_dtype: str = "bfloat16",
                 model: Any = None) -> list[Any]:
        from llmcompressor.modifiers.autoround import AutoRoundModifier

        ignore = [*cfg.ignore, *(plan.unquantized if plan else [])]
        groups = backend.config_groups(preset, cfg, plan, storage_dtype)
        # AutoRoundModifier matches the targets against names *inside* a decoder layer
        # ("mlp.down_proj") to give each layer its scheme; the plan's suffix regexes
        # ("re:.*\.mlp\.down_proj$") need a dot before the suffix, so nothing matched and every
        # layer got the first group's size (a reshape error on the group-64 layers). An optional
        # prefix matches both the full and the in-layer names.
        for scheme in groups.values():
            scheme.targets = [target.replace("re:.*\\.", "re:(?:.*\\.)?", 1) for target in scheme.targets]
        return [AutoRoundModifier(
            config_groups=groups, ignore=ignore,
            iters=autoround_iters,
            enable_torch_compile=False,  # compiling each block costs more than it saves on a CPU
        )]

    patched = {"gptq-imatrix": observer, "gptq-mse": observer, "awq-imatrix": observer, "rtn-imatrix": observer, "rtn": rtn,
               "autoround": autoround}.get(method)
    if patched is not None:
        backend.build_recipe = patched

    quantize_in_place = backend.quantize_in_place

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return quantize_in_place(*args, **kwargs)
        finally:
            ONESHOT_SECONDS.append(time.perf_counter() - started)

    backend.quantize_in_place = timed


def quantize_config(method: str) -> QuantizeConfig:
    """The method's config, its observer named (gptq-int4's own default is imatrix_mse since the
    measurements of docs/int4-quality.md: the other methods ask for minmax, the range itself)."""
    from quantgate.quantize.config import QuantizeConfig

    observer: Observer = "imatrix_mse" if method.endswith("imatrix") else "mse" if method.endswith("-mse") else "minmax"
    if method.startswith("awq"):
        return QuantizeConfig(format="awq-int4", awq_n_grid=20 if method == "awq-g20" else 5, observer=observer)
    # gptq, the observers, rtn and autoround: symmetric, as gptq-int4
    return QuantizeConfig(format="gptq-int4", observer=observer)


def child(method: str, model: str, calibration_dir: str, out: str, figures: str, autoround_iters: str) -> None:
    _patch_recipe(method, int(autoround_iters))
    from quantgate.quantize import stage

    started = time.perf_counter()
    stage.run(quantize_config(method), model, calibration_dir, out, overwrite=True)
    Path(figures).write_text(json.dumps({"stage_seconds": time.perf_counter() - started,
                                         "oneshot_seconds": ONESHOT_SECONDS[-1],
                                         "peak_rss_bytes": peak_rss_bytes()}))


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark since its exec (VmHWM). Not ru_maxrss: Linux carries the
    forking parent's high-water mark across fork and exec into it, so a child of a parent that
    holds evaluated models would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource  # not Linux: the best there is

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def quantize_in_child(method: str, model: Path, calibration_dir: Path, work: Path, autoround_iters: int,
                      resume: bool = False) -> dict[str, Any]:
    checkpoint, figures, log = work / "checkpoints" / method, work / "figures" / f"{method}.json", work / "logs" / f"{method}.log"
    saved = figures.with_suffix(".result.json")  # the whole measurement, for --resume
    if resume and saved.is_file() and (checkpoint / "config.json").is_file():
        result: dict[str, Any] = json.loads(saved.read_text())
        same = result.get("model") == str(model)  # a checkpoint of another --model in the same --out is made again
        if same and (method != "autoround" or result.get("autoround_iters") == autoround_iters):
            return {**result, "resumed": True}
    for path in (figures, log):
        path.parent.mkdir(parents=True, exist_ok=True)
    figures.unlink(missing_ok=True)
    saved.unlink(missing_ok=True)
    load_before = os.getloadavg()[0]
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, __file__, "--child", method, str(model), str(calibration_dir),
                                    str(checkpoint), str(figures), str(autoround_iters)], stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{method}: quantization failed (log {log}):\n" + "\n".join(tail))
    result = json.loads(figures.read_text())
    # The machine may be shared: CPU seconds and the load average say how far wall time is to be trusted.
    result.update(model=str(model), checkpoint=str(checkpoint), log=str(log),
                  cpu_seconds=usage.ru_utime + usage.ru_stime, load_average=[load_before, os.getloadavg()[0]],
                  imatrix_fell_back=IMATRIX_FALLBACK in log.read_text(errors="replace"),
                  **({"autoround_iters": autoround_iters} if method == "autoround" else {}))
    saved.write_text(json.dumps(result))
    return result


# ---- parent: calibration, baseline, quantize and evaluate each method -----------------------


def evaluate(model_dir: Path, out: Path, items: int, baseline: Path | None = None) -> dict[str, Any]:
    from quantgate.evalsets.config import EvaluateConfig
    from quantgate.evalsets.evaluate import Evaluator

    results = Evaluator(model_dir).run(EvaluateConfig(evalsets=(EVALSET,), limit=items), out,
                                       baseline_results=baseline, overwrite=True)
    return cast(dict[str, Any], results.record(EVALSET)["metrics"])


def bits(checkpoint: Path, baseline: Path) -> dict[str, Any]:
    from quantgate.quantize.measure.accounting import measure

    data = measure(checkpoint, baseline).record()
    return {"file_bytes": data.totals.file_bytes,
            "bits_per_weight": data.quantized_linear.bits_per_weight.measured,
            "bits_per_parameter": data.whole_model.bits_per_parameter.measured}


def table(rows: list[dict[str, Any]]) -> str:
    header = (f"{'method':<13} {'KL (nats)':>10} {'top-1':>7} {'ppl chg':>8} {'quant s':>8} {'oneshot s':>9} "
              f"{'peak MB':>8} {'bits/w':>7} {'MB file':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['method']:<13} {row['kl_divergence']:>10.4f} {row['top1_agreement']:>7.2%} "
                     f"{row['perplexity_change_pct']:>+7.2f}% {row['stage_seconds']:>8.1f} {row['oneshot_seconds']:>9.1f} "
                     f"{row['peak_rss_bytes'] / 2**20:>8.0f} {row['bits_per_weight']:>7.3f} {row['file_bytes'] / 1e6:>8.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    parser.add_argument("--model", default="smollm2-135m",
                        help="a registry model (`quantgate models list`); qwen2.5-coder-1.5b needs `make pull-qwen2.5-coder-1.5b` first")
    parser.add_argument("--items", type=int, default=50, help=f"first N items of {EVALSET}")
    parser.add_argument("--out", type=Path, default=Path("/tmp/int4-quality"), help="work directory (kept)")
    parser.add_argument("--autoround-iters", type=int, default=200, help="AutoRound tuning steps per decoder block")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the checkpoints (and their time and memory figures) that an earlier run in --out completed")
    parser.add_argument("--json", type=Path, help="where to write the table as JSON (default: OUT/int4-quality.json)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        child(*arguments.child)
        return 0
    methods = [name.strip() for name in arguments.methods.split(",") if name.strip()]
    if unknown := [name for name in methods if name not in METHODS]:
        parser.error(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")

    import torch

    from quantgate import calibration
    from quantgate.core.models import pull

    work = arguments.out
    work.mkdir(parents=True, exist_ok=True)
    model = pull(arguments.model).path
    calibration_dir = work / "calibration"  # the demo plan's: 16 x 256 tokens of the demo text, seed 0
    calibration.run(calibration.CalibrationConfig(model=str(model), source="demo", samples=16, seq_len=256, seed=0),
                    calibration_dir, overwrite=True)
    baseline_results = work / "results" / "baseline"
    base = evaluate(model, baseline_results, arguments.items)
    print(f"baseline: perplexity {base['perplexity']:.3f} on the first {arguments.items} items of {EVALSET}", flush=True)

    rows = []
    for method in methods:
        try:
            quantized = quantize_in_child(method, model, calibration_dir, work, arguments.autoround_iters, arguments.resume)
        except RuntimeError as error:
            print(error, file=sys.stderr, flush=True)
            rows.append({"method": method, "error": str(error)})
            continue
        metrics = evaluate(Path(quantized["checkpoint"]), work / "results" / method, arguments.items, baseline_results)
        row = {"method": method, "kl_divergence": metrics["kl_divergence"], "top1_agreement": metrics["top1_agreement"],
               "perplexity": metrics["perplexity"],
               "perplexity_change_pct": 100 * (metrics["perplexity"] / base["perplexity"] - 1),
               **quantized, **bits(Path(quantized["checkpoint"]), model)}
        rows.append(row)
        print(f"{method}: KL {row['kl_divergence']:.4f}, top-1 {row['top1_agreement']:.2%}, "
              f"ppl {row['perplexity_change_pct']:+.2f}%, {row['stage_seconds']:.1f} s", flush=True)

    done = [row for row in rows if "error" not in row]
    print(f"\n{arguments.model}, W4A16 group 128 (the group plan's fallback where a width needs it), 16 x 256 calibration tokens, "
          f"first {arguments.items} items of {EVALSET}, {torch.get_num_threads()} CPU threads; "
          f"baseline perplexity {base['perplexity']:.3f}")
    print(table(done))
    for row in rows:
        if "error" in row:
            print(f"{row['method']}: FAILED (see its log)")
        elif row.get("imatrix_fell_back"):
            print(f"{row['method']}: warning: the imatrix observer fell back to uniform MSE for some layers (see {row['log']})")
    path = arguments.json or work / "int4-quality.json"
    path.write_text(json.dumps({"model": arguments.model, "evalset": EVALSET, "items": arguments.items,
                                "calibration": {"source": "demo", "samples": 16, "seq_len": 256, "seed": 0},
                                "baseline": {"perplexity": base["perplexity"]}, "threads": torch.get_num_threads(),
                                "autoround_iters": arguments.autoround_iters, "rows": rows}, indent=2))
    print(f"\nwritten: {path}")
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
