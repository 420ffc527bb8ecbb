"""How a run's cost grows with the model: the same stages on each demo model, each stage a fresh
child process, its wall time, CPU seconds and peak memory against the model's parameters.

    .venv/bin/python benchmarks/model_cost.py [--models smollm2-135m,qwen2.5-coder-1.5b]
        [--items 25] [--placement auto|memory|streamed] [--formats gptq-int4,smoothquant-w8a8]
        [--out /tmp/model-cost] [--json PATH]

The models must be pulled (`quantgate models pull smollm2-135m`; the 1.5B model:
`make pull-qwen2.5-coder-1.5b`), or be local model directories (a 7B-shaped model with random
weights: benchmarks/shaped_model.py; run it under a cap with benchmarks/memory_cap.py --cap 20e9 -- ...). Stages, each the `quantgate` command a user would type:
calibrate (16 x 256 tokens of the demo source), quantize gptq-int4, quantize smoothquant-w8a8,
measure (the gptq-int4 checkpoint, headers only), evaluate the baseline on the first --items of
wiki-text@v1, evaluate gptq-int4 against it (KL from the baseline's top-k cache), both with the
evaluation cache bypassed (--no-cache).

Peak memory is the child's own RSS high-water mark (VmHWM, written by the child as it exits): not
ru_maxrss, which Linux carries across fork and exec from the parent. CPU seconds come from wait4.
--placement is passed to every quantize and evaluate command (core.memory.Placement: streamed
keeps the model on disk, a module's weights read when it runs). The goals (checked here, not by a
timed test): issue 37's, every stage's peak at most 1.5x the model's 16-bit bytes plus 1 GiB of
libraries; issue 25's, quantization's peak at most 1.5x the FP32 bytes, evaluation's at most 1.3x
the FP32 bytes plus its top-k cache; measure's independent of the model's size. On a shared machine the load average is printed beside the
figures: wall time is only as good as the quiet it was measured in.
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
from typing import TypedDict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quantgate.core.artifacts import read_json, write_json  # noqa: E402 - after the path above
from quantgate.core.memory import shape  # noqa: E402 - after the path above
from quantgate.core.models import demo_model_dir  # noqa: E402 - after the path above

EVALSET = "wiki-text@v1"


class StageCost(TypedDict):
    stage: str
    command: list[str]
    exit_code: int
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    peak_anon_bytes: int  # the largest RssAnon sampled every ANON_EVERY_S: what the stage must keep resident
    load_average: list[float]


class ModelCost(TypedDict):
    model: str
    parameters: int
    fp32_bytes: int
    placement: str  # --placement as given to every quantize and evaluate command
    stages: list[StageCost]


ANON_EVERY_S = 0.05


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def child(figures: Path, arguments: list[str]) -> int:
    """Run one quantgate command in this process and write its VmHWM, and the largest RssAnon a
    thread sampled, as it ends. VmHWM counts file pages mapped into the process too: a streamed
    load maps the model's safetensors files and reads every tensor through the mapping (the 7B
    shape's load: 14.3 GiB of them at its end), clean page cache that the kernel
    takes back under a memory cap; the anonymous peak is what the stage must keep resident, and
    a run under a cgroup cap (benchmarks/memory_cap.py) is what shows it fits. Sampled every
    ANON_EVERY_S, the anonymous peak is a lower bound: a tensor that lives less long is missed."""
    import threading

    from quantgate.cli import main

    peak_anon = [status_bytes("RssAnon")]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(ANON_EVERY_S):
            peak_anon[0] = max(peak_anon[0], status_bytes("RssAnon"))

    threading.Thread(target=sample, daemon=True).start()
    sys.argv = ["quantgate", *arguments]
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        done.set()
        peak_anon[0] = max(peak_anon[0], status_bytes("RssAnon"))
        figures.write_text(json.dumps({"peak_rss_bytes": status_bytes("VmHWM"), "peak_anon_bytes": peak_anon[0]}))
    return code


def run_stage(stage: str, arguments: list[str], work: Path) -> StageCost:
    figures = work / "figures" / f"{stage}.json"
    log = work / "logs" / f"{stage}.log"
    figures.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    figures.unlink(missing_ok=True)
    before = os.getloadavg()[0]
    started = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, __file__, "--child", str(figures), *arguments], stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1) or not figures.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"model_cost: {stage} exited {code} (log {log}):\n{tail}")
    peaks = json.loads(figures.read_text())
    return StageCost(stage=stage, command=["quantgate", *arguments], exit_code=code, wall_s=round(wall, 2),
                     cpu_s=round(usage.ru_utime + usage.ru_stime, 2), peak_rss_bytes=peaks["peak_rss_bytes"], peak_anon_bytes=peaks["peak_anon_bytes"],
                     load_average=[round(before, 2), round(os.getloadavg()[0], 2)])


def measure_model(name: str, items: int, out: Path, placement: str = "auto",
                  formats: tuple[str, ...] = ("gptq-int4", "smoothquant-w8a8")) -> ModelCost:
    if Path(name).is_dir():  # a local model directory (benchmarks/shaped_model.py's): its parameters from its headers
        model = Path(name).resolve()
        parameters = shape(model).parameters
    else:
        model = demo_model_dir(name)
        parameters = int(read_json(model / "manifest.json")["conversion"]["parameters"])
    work = out / model.name
    calibration, checkpoints, results = work / "calibration", work / "checkpoints", work / "results"
    where = ["--placement", placement]
    stages: list[tuple[str, list[str]]] = [
        ("calibrate", ["calibrate", "--model", name, "--source", "demo", "--samples", "16", "--seq-len", "256", "--out", str(calibration),
                       "--overwrite"]),
        *[(f"quantize {fmt}", ["quantize", "--model", name, "--format", fmt, "--calibration", str(calibration),
                               "--out", str(checkpoints / fmt), "--overwrite", *where]) for fmt in formats],
        ("measure gptq-int4", ["measure", str(checkpoints / "gptq-int4"), "--json"]),
        ("evaluate baseline", ["evaluate", "--model", name, "--evalset", EVALSET, "--limit", str(items), "--no-cache",
                               "--out", str(results / "baseline"), *where]),
        ("evaluate gptq-int4", ["evaluate", "--model", str(checkpoints / "gptq-int4"), "--evalset", EVALSET, "--limit", str(items),
                                "--no-cache", "--baseline-results", str(results / "baseline"), "--out", str(results / "gptq-int4"),
                                *where]),
    ]
    costs: list[StageCost] = []
    for stage, arguments in stages:
        if stage.startswith("evaluate"):
            # results directories appear only when complete, and a second run must not find the first's
            target = Path(arguments[arguments.index("--out") + 1])
            if target.exists():
                shutil.rmtree(target)
        print(f"{name}: {stage} ...", flush=True)
        cost = run_stage(f"{model.name}-{stage.replace(' ', '-')}", arguments, work)
        cost["stage"] = stage
        costs.append(cost)
        print(f"{name}: {stage}: {cost['wall_s']:.1f} s, {cost['cpu_s']:.1f} CPU s, peak {cost['peak_rss_bytes'] / 2**30:.2f} GiB "
              f"(load {cost['load_average'][0]:.1f} -> {cost['load_average'][1]:.1f})", flush=True)
    return ModelCost(model=model.name, parameters=parameters, fp32_bytes=4 * parameters, placement=placement, stages=costs)


def table(models: list[ModelCost], items: int) -> str:
    names = [model["model"] for model in models]
    head = "| stage | " + " | ".join(f"{name}: wall s, peak GiB (anonymous), peak / FP32" for name in names)
    if len(models) == 2:
        head += " | ratio of wall times, of peaks"
    lines = [head + " |", "|---" * (1 + len(models) + (len(models) == 2)) + "|"]
    for index, stage in enumerate(models[0]["stages"]):
        cells = [f"{stage['stage']}"]
        for model in models:
            cost = model["stages"][index]
            cells.append(f"{cost['wall_s']:.1f}, {cost['peak_rss_bytes'] / 2**30:.2f} ({cost['peak_anon_bytes'] / 2**30:.2f}), "
                         f"{cost['peak_rss_bytes'] / model['fp32_bytes']:.2f}x")
        if len(models) == 2:
            small, large = models[0]["stages"][index], models[1]["stages"][index]
            cells.append(f"{large['wall_s'] / small['wall_s']:.1f}x, {large['peak_rss_bytes'] / small['peak_rss_bytes']:.1f}x")
        lines.append("| " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{model['model']} {model['parameters'] / 1e9:.3f}B parameters ({model['fp32_bytes'] / 2**30:.2f} GiB FP32)"
                      for model in models)
    return "\n".join(lines) + f"\n\n{sizes}; evaluation on the first {items} items of {EVALSET}."


def goals(models: list[ModelCost], items: int) -> list[str]:
    """Each goal per model: holds, or by how much it misses."""
    said: list[str] = []
    for model in models:
        by_stage = {cost["stage"]: cost for cost in model["stages"]}
        bound = 1.5 * model["fp32_bytes"] / 2 + 2**30  # issue 37: 1.5x the 16-bit bytes plus 1 GiB of libraries
        for cost in model["stages"]:
            said.append(f"{model['model']} {cost['stage']} ({model['placement']}): peak {cost['peak_rss_bytes'] / 2**30:.2f} GiB, "
                        f"anonymous {cost['peak_anon_bytes'] / 2**30:.2f} GiB (goal {bound / 2**30:.2f} GiB: 1.5x the 16-bit bytes + 1 GiB): "
                        f"{'holds' if cost['peak_rss_bytes'] <= bound else 'anonymous holds' if cost['peak_anon_bytes'] <= bound else 'misses'}")
        for quantized in [name for name in ("quantize gptq-int4", "quantize smoothquant-w8a8") if name in by_stage]:
            ratio = by_stage[quantized]["peak_rss_bytes"] / model["fp32_bytes"]
            said.append(f"{model['model']} {quantized}: peak {ratio:.2f}x FP32 (goal 1.5x): {'holds' if ratio <= 1.5 else 'misses'}")
        for stage in ("evaluate baseline", "evaluate gptq-int4"):
            ratio = by_stage[stage]["peak_rss_bytes"] / model["fp32_bytes"]
            said.append(f"{model['model']} {stage}: peak {ratio:.2f}x FP32 (goal 1.3x plus the top-k cache): "
                        f"{'holds' if ratio <= 1.3 else 'see the cache size in docs/models.md'}")
    if len(models) > 1:
        peaks = [{cost["stage"]: cost for cost in model["stages"]}["measure gptq-int4"]["peak_rss_bytes"] for model in models]
        said.append(f"measure's peak: {', '.join(f'{peak / 2**20:.0f} MiB' for peak in peaks)} (goal: independent of the model's size)")
    return said


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["--child"]:
        return child(Path(arguments[1]), arguments[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    parser.add_argument("--items", type=int, default=25, help=f"items of {EVALSET} each evaluation scores")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "model-cost")
    parser.add_argument("--json", type=Path, help="where the figures go (default: OUT/model-cost.json)")
    parser.add_argument("--placement", choices=("auto", "memory", "streamed"), default="auto",
                        help="where quantize and evaluate keep the model (default: auto, in memory where it fits)")
    parser.add_argument("--formats", default="gptq-int4,smoothquant-w8a8", help="the quantizations measured (gptq-int4 first: "
                        "measure and evaluate read it)")
    args = parser.parse_args(arguments)
    missing = [name for name in args.models.split(",") if not Path(name).is_dir() and not (demo_model_dir(name) / "manifest.json").is_file()]
    if missing:
        print(f"model_cost: not pulled: {', '.join(missing)} (quantgate models pull NAME; the 1.5B model: make pull-qwen2.5-coder-1.5b)",
              file=sys.stderr)
        return 2
    formats = tuple(args.formats.split(","))
    if formats[0] != "gptq-int4":
        print("model_cost: --formats starts with gptq-int4 (the checkpoint measure and evaluate read)", file=sys.stderr)
        return 2
    measured = [measure_model(name, args.items, args.out, args.placement, formats) for name in args.models.split(",")]
    target: Path = args.json or args.out / "model-cost.json"
    write_json(target, {"items": args.items, "evalset": EVALSET, "cpu_flags": cpu_flags(), "models": measured})
    print(table(measured, args.items))
    for line in goals(measured, args.items):
        print(line)
    print(f"written: {target}")
    return 0


def cpu_flags() -> list[str]:
    """The flags that decide this machine's class (docs/serving.md): avx512f, amx_bf16."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return sorted({"avx2", "avx512f", "amx_bf16"} & set(flags))


if __name__ == "__main__":
    sys.exit(main())
