"""How long `measure` takes on a checkpoint the size of a 70B Llama in BF16 (about 141 GB).

    .venv/bin/python benchmarks/measure_speed.py --repeats 7

The checkpoint is header-only: valid safetensors headers, each shard extended to its full
size with truncate, so no tensor data is written and the files take almost no disk (sparse).
Shapes of Llama-2/3 70B: 80 layers, hidden 8192, intermediate 28672, 64 heads and 8 KV heads
of dim 128, vocabulary 128256, untied lm_head, sharded at 5 GB with an index like
transformers' save_pretrained. Target: well under a second per measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 8192, 28672, 80, 64, 8, 128256
HEAD_DIM = HIDDEN // HEADS
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size "5GB"


def llama_70b_tensors() -> dict[str, tuple[str, list[int]]]:
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [VOCAB, HIDDEN])}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": ("BF16", [HIDDEN]),
            f"{prefix}.self_attn.q_proj.weight": ("BF16", [HEADS * HEAD_DIM, HIDDEN]),
            f"{prefix}.self_attn.k_proj.weight": ("BF16", [KV_HEADS * HEAD_DIM, HIDDEN]),
            f"{prefix}.self_attn.v_proj.weight": ("BF16", [KV_HEADS * HEAD_DIM, HIDDEN]),
            f"{prefix}.self_attn.o_proj.weight": ("BF16", [HIDDEN, HEADS * HEAD_DIM]),
            f"{prefix}.post_attention_layernorm.weight": ("BF16", [HIDDEN]),
            f"{prefix}.mlp.gate_proj.weight": ("BF16", [INTERMEDIATE, HIDDEN]),
            f"{prefix}.mlp.up_proj.weight": ("BF16", [INTERMEDIATE, HIDDEN]),
            f"{prefix}.mlp.down_proj.weight": ("BF16", [HIDDEN, INTERMEDIATE]),
        }
    tensors["model.norm.weight"] = ("BF16", [HIDDEN])
    tensors["lm_head.weight"] = ("BF16", [VOCAB, HIDDEN])
    return tensors


def build_checkpoint(root: Path) -> int:
    """A sharded header-only 70B checkpoint in `root`; returns its apparent size in bytes."""
    from tests.helpers import write_header_only

    tensors = llama_70b_tensors()
    shards: list[dict[str, tuple[str, list[int]]]] = [{}]
    size = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = 2 * math.prod(shape)
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = (dtype, shape)
        size += nbytes
    total, weight_map = 0, dict[str, str]()
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        total += write_header_only(root / name, shard, {"format": "pt"})
        weight_map |= {tensor: name for tensor in shard}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from quantgate.quantize.measure.accounting import measure

    root = Path(tempfile.mkdtemp(prefix="quantgate-70b-"))
    try:
        apparent = build_checkpoint(root)
        on_disk = sum(os.stat(path).st_blocks * 512 for path in root.iterdir())
        shards = len(list(root.glob("*.safetensors")))
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            measurement = measure(root)
            times.append(time.perf_counter() - started)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantgate.cli", "measure", str(root), "--json"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        cli_seconds = time.perf_counter() - started
        print(f"checkpoint: {apparent / 1e9:.1f} GB apparent in {shards} shards ({on_disk / 1e6:.1f} MB on disk), "
              f"{measurement.parameters:,} parameters, {len(measurement.linear_layers)} linear layers")
        print(f"measure (library): median {statistics.median(times) * 1e3:.1f} ms over {args.repeats} runs "
              f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
        print(f"quantgate measure --json (new process, imports included): {cli_seconds * 1e3:.0f} ms")
        if measurement.file_bytes != apparent or measurement.unexplained_bits:
            raise SystemExit("measure did not account for every byte of the checkpoint")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
