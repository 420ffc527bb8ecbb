"""What a CUDA machine without vLLM's CUDA build can still measure (docs/serving.md, "The GPU
run"): for random-weight models of the demo's and the 1.5B model's shapes (their own configs and
tokenizers, no weights: a machine with no registry cannot fetch any), decode at batch 1 in
transformers (BF16, eager, dynamic cache) against the decode-step bound, and calibration plus
quantization (gptq-int4, smoothquant-w8a8) through quantgate with the model on the device.

    python benchmarks/gpu_stages.py --configs DIR [--json PATH] [--device cuda] [--tokens 128] [--runs 5]

DIR holds one folder per model with its config.json and tokenizer files (quantgate's converted
models have them: `quantgate models pull NAME`, then its folder in the cache home). Timing does
not depend on the weights' values; the step's bytes are the model's unique parameters, less an
untied input table (one row read per token). `--device cpu` runs the same steps on the CPU for a
column beside the GPU's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The h200 profile's bandwidth (quantize/measure/hardware/h200.yaml): the bound the GPU run uses.
H200_BYTES_PER_S = 4.8e12
FORMATS = ("gptq-int4", "smoothquant-w8a8")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (mean of ten)."""
    size = 2 * 1024**3 if device == "cuda" else 256 * 1024**2
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    _sync(device)
    seconds = (time.perf_counter() - start) / 10
    return 2 * size / seconds


def build(folder: Path, device: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def step_bytes(model: Any) -> int:
    """The bytes one decode step reads at batch 1 and a short context: each unique parameter once,
    an untied input table one row."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel() * parameter.element_size()
    table = model.get_input_embeddings().weight
    if not model.config.tie_word_embeddings:
        total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    return total


def decode(folder: Path, device: str, tokens: int, runs: int, bandwidth: float, cache: str = "dynamic") -> dict[str, Any]:
    """`cache`: transformers' dynamic cache (eager), or its static one, with which generate compiles
    the decode step (torch.compile, CUDA graphs on a GPU); the first call's compilation is timed
    on its own."""
    model = build(folder, device)
    prompt = torch.randint(100, 1000, (1, 16), device=device)
    static = None
    if cache == "static":  # one cache of one length for every call: the compiled step is compiled once
        from transformers import StaticCache

        static = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + tokens + 8)
    options: dict[str, Any] = {"past_key_values": static} if static is not None else {}

    def timed(loaded: Any, new: int) -> float:
        if static is not None:
            static.reset()
        _sync(device)
        start = time.perf_counter()
        loaded.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **options)
        _sync(device)
        return time.perf_counter() - start

    first = timed(model, tokens)  # warm-up (with the static cache: the compilation)
    prefill = sorted(timed(model, 1) for _ in range(3))[1]
    medians = sorted(timed(model, tokens) for _ in range(runs))
    ms = (medians[runs // 2] - prefill) / (tokens - 1) * 1e3
    size = step_bytes(model)
    bound_ms = size / H200_BYTES_PER_S * 1e3
    row = {"parameters": sum(p.numel() for p in model.parameters()), "step_bytes": size, "ms_per_token": ms,
           "bound_ms_h200_profile": bound_ms, "bound_ms_measured_copy": size / bandwidth * 1e3,
           "measured_over_bound": ms / bound_ms, "tokens": tokens, "runs": runs, "first_call_s": first,
           "path": f"transformers generate, bf16, {'eager, dynamic cache' if cache == 'dynamic' else 'static cache (the step compiled on a GPU)'}, batch 1"}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def quantize_all(folder: Path, device: str, work: Path) -> dict[str, Any]:
    """Calibrate (the demo source, 16 x 256 tokens: the 1.5B plan's) and quantize each format with
    quantgate; llmcompressor onloads each layer to the first GPU where there is one."""
    from transformers import AutoTokenizer

    from quantgate import calibration, quantize

    model_dir = work / folder.name
    model = build(folder, "cpu")
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(folder).save_pretrained(model_dir)
    del model
    calib = work / f"{folder.name}-calibration"
    start = time.perf_counter()
    calibration.run(calibration.CalibrationConfig(model=str(model_dir), source="demo", samples=16, seq_len=256), calib)
    entry: dict[str, Any] = {"calibrate_s": time.perf_counter() - start}
    for name in FORMATS:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        quantize.run(quantize.QuantizeConfig(format=name), model_dir, calib, work / f"{folder.name}-{name}")
        entry[name] = {"seconds": time.perf_counter() - start,
                       "device_peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=Path, required=True, help="one folder per model: config.json and tokenizer files")
    parser.add_argument("--json", type=Path, default=Path("gpu-stages.json"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per timed decode")
    parser.add_argument("--runs", type=int, default=5, help="timed decodes per model (the median is reported)")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                        help="transformers' KV cache: dynamic (eager) or static (the step compiled)")
    parser.add_argument("--decode-only", action="store_true", help="no calibration or quantization")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_stages: torch {torch.__version__} sees no CUDA device (--device cpu runs the same steps on the CPU)", file=sys.stderr)
        return 2
    folders = sorted(path.parent for path in args.configs.glob("*/config.json"))
    if not folders:
        print(f"gpu_stages: {args.configs} holds no folder with a config.json", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
                               "copy_bytes_per_s": copy_bandwidth(args.device), "decode": {}, "quantize": {}}

    def save() -> None:  # after every step: a run cut short keeps what it measured
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")

    steps: list[tuple[str, str, Callable[[], dict[str, Any]]]] = []
    with tempfile.TemporaryDirectory(prefix="quantgate-gpu-stages-") as work:
        for folder in folders:
            steps.append(("decode", folder.name, functools.partial(decode, folder, args.device, args.tokens, args.runs,
                                                                   results["copy_bytes_per_s"], args.cache)))
        for folder in ([] if args.decode_only else folders):
            steps.append(("quantize", folder.name, functools.partial(quantize_all, folder, args.device, Path(work))))
        for kind, name, step in steps:
            try:
                results[kind][name] = step()
            except Exception as error:  # a row that failed is recorded, and the next one still runs
                results[kind][name] = {"error": repr(error)[:500]}
            print(kind, name, json.dumps(results[kind][name]), flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
