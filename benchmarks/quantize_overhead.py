"""quantgate's quantization against a direct `llmcompressor.oneshot` call with the same recipe
and calibration data, on the demo model, in one run: wall time and peak memory ratios.

    .venv/bin/python benchmarks/quantize_overhead.py --format gptq-int4 --repeats 3

Each measurement runs in a fresh child process (peak RSS is per process), the two sides
alternate, and the medians are compared. Target: quantgate within 1.05x on both.
quantgate's side includes what the direct call does not: loading and verifying the
calibration set, the reload-and-generate smoke check, hashing every file, the manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child_quantgate(model: str, calibration_dir: str, fmt: str, out: str) -> None:
    from quantgate import quantize

    quantize.run(quantize.QuantizeConfig(format=fmt), model, calibration_dir, out, overwrite=True)


def child_direct(model: str, calibration_dir: str, recipe: str, out: str) -> None:
    """What a user of llmcompressor would write: load, oneshot with the recipe, save."""
    import datasets
    import torch
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantgate.quantize.compat import cpu_safe_pinning

    tokens = load_file(Path(calibration_dir) / "tokens.safetensors")
    dataset = datasets.Dataset.from_dict({
        "input_ids": tokens["input_ids"].long().tolist(),
        "attention_mask": tokens["attention_mask"].long().tolist(),
    })
    # FP32 compute on a CPU, as quantgate does (BF16 products are ~60x slower here).
    dtype = torch.bfloat16 if torch.accelerator.is_available() else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    with cpu_safe_pinning():  # without it AWQ cannot run on a CPU at all
        oneshot(model=loaded, recipe=recipe, dataset=dataset, num_calibration_samples=len(dataset),
                max_seq_length=tokens["input_ids"].shape[1], shuffle_calibration_samples=False)
    loaded.to(torch.bfloat16)
    loaded.save_pretrained(out, save_compressed=True)


def measure(arguments: list[str]) -> dict[str, float]:
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, __file__, "--child", *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"benchmark child failed: {' '.join(arguments)}")
    return {"wall_seconds": elapsed, "peak_rss_bytes": usage.ru_maxrss * 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="gptq-int4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        side, *rest = arguments.child
        (child_quantgate if side == "quantgate" else child_direct)(*rest)
        return 0

    from quantgate import calibration
    from quantgate.core.models import pull

    model = str(pull("smollm2-135m").path)
    with tempfile.TemporaryDirectory(prefix="quantgate-bench-") as work:
        work_dir = Path(work)
        calibration_dir = work_dir / "calibration"
        calibration.run(calibration.CalibrationConfig(model=model, source="demo", samples=arguments.samples,
                                                      seq_len=arguments.seq_len), calibration_dir)
        # The direct call uses the very recipe quantgate wrote (first, unmeasured run).
        child_quantgate(model, str(calibration_dir), arguments.format, str(work_dir / "recipe-source"))
        recipe = str(work_dir / "recipe-source" / "recipe.yaml")
        runs: dict[str, list[dict[str, float]]] = {"quantgate": [], "direct": []}
        for repeat in range(arguments.repeats):
            order = ["quantgate", "direct"] if repeat % 2 == 0 else ["direct", "quantgate"]
            for side in order:
                source = arguments.format if side == "quantgate" else recipe
                figures = measure([side, model, str(calibration_dir), source, str(work_dir / f"out-{side}")])
                runs[side].append(figures)
                print(f"run {repeat + 1} {side:9s} {figures['wall_seconds']:7.1f} s  {figures['peak_rss_bytes'] / 2**30:5.2f} GiB", flush=True)
    medians = {side: {key: statistics.median(run[key] for run in results) for key in results[0]} for side, results in runs.items()}
    ratios = {key: medians["quantgate"][key] / medians["direct"][key] for key in medians["direct"]}
    print(f"\n{arguments.format} on smollm2-135m, {arguments.samples} x {arguments.seq_len} calibration tokens, "
          f"median of {arguments.repeats}:")
    print(f"  wall time   quantgate {medians['quantgate']['wall_seconds']:.1f} s, direct {medians['direct']['wall_seconds']:.1f} s, ratio {ratios['wall_seconds']:.3f} (target <= 1.05)")
    print(f"  peak memory quantgate {medians['quantgate']['peak_rss_bytes'] / 2**30:.2f} GiB, direct {medians['direct']['peak_rss_bytes'] / 2**30:.2f} GiB, ratio {ratios['peak_rss_bytes']:.3f} (target <= 1.05)")
    if arguments.json:
        arguments.json.write_text(json.dumps({"format": arguments.format, "runs": runs, "medians": medians, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
