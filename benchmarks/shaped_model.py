"""A model of a released model's shape with RANDOM weights, made locally, for measuring cost.

Issue 37 measures how time and memory grow with a model's size on a model of a real 7B shape
(Qwen2.5-7B's: 28 decoder layers, 3,584 wide, 18,944 intermediate, 28 query and 4 key-value heads,
a 152,064-entry vocabulary, an untied output head; the numbers are Qwen2.5-7B's config.json on
the Hugging Face hub, docs/models.md). No hub is reachable here and the weights would mean
nothing to a cost measurement, so the weights are drawn from N(0, 0.02) (the config's
initializer_range; norms 1, biases 0) with a fixed seed. **Its quality numbers mean nothing; its
times and peaks do.** The tokenizer is copied from a local model of the same family
(`--tokenizer-from`, Qwen2.5's 151,643 tokens fit the larger vocabulary).

The weights are written tensor by tensor into BF16 safetensors shards of at most 2 GB with their
index, so making a 15 GB model needs one shard in memory, not the model:

    .venv/bin/python benchmarks/shaped_model.py --out /tmp/qwen2.5-7b-shaped
    .venv/bin/python benchmarks/shaped_model.py --layers 2 --out /tmp/qwen2.5-7b-2-layers  # a layer's cost

`--layers N` keeps the shape but N decoder layers: per-layer cost is the difference between two
such models, measured in minutes rather than hours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Qwen2.5-7B's config.json (hub: Qwen/Qwen2.5-7B), the fields that decide the tensors' shapes.
SHAPES = {
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
    },
}
SHARD_BYTES = 2 * 10**9
MARKER = "RANDOM-WEIGHTS.txt"  # what this script writes into every model it makes, and looks for before replacing one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def build(shape: str, layers: int | None, tokenizer_from: Path, out: Path, seed: int = 0) -> int:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.dtype = "bfloat16"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        total = _write(tensors, config, generator, staging, save_file)
        for file in TOKENIZER_FILES:
            if (tokenizer_from / file).exists():
                shutil.copy2(tokenizer_from / file, staging / file)
        (staging / MARKER).write_text(
            f"Random weights (N(0, {config.initializer_range}), seed {seed}) in {shape}'s shape with "
            f"{config.num_hidden_layers} layers, made by benchmarks/shaped_model.py: for cost measurements only; "
            "its quality numbers mean nothing.\n")
        staging.chmod(0o755)
        for written in staging.iterdir():
            written.chmod(0o644)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # the old model (one this script made: main checks) set aside, the new one renamed in, the old removed
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent)) / "model" if out.exists() else None
    if old is not None:
        out.rename(old)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old.parent)
    return total


def _write(tensors: dict[str, tuple[int, ...]], config: Any, generator: Any, staging: Path, save_file: Any) -> int:
    """The weights, tensor by tensor, into shards of at most SHARD_BYTES with their index; config.json."""
    import torch

    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    shard_bytes = 0
    shards: list[list[str]] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"part-{len(shards):05d}.safetensors"
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            shards.append(list(shard))
            weight_map.update({key: name for key in shard})
            shard, shard_bytes = {}, 0

    total = 0
    for name, size in tensors.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(size, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            tensor = torch.zeros(size, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(size, dtype=torch.float32).normal_(0.0, config.initializer_range, generator=generator).to(torch.bfloat16)
        if shard_bytes + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.numel()
    flush()
    # The shards' final names (model-0000i-of-0000n) once their number is known.
    final = {f"part-{i:05d}.safetensors": f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))}
    for old, new in final.items():
        (staging / old).rename(staging / new)
    index = {"metadata": {"total_size": 2 * total}, "weight_map": {key: final[value] for key, value in weight_map.items()}}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    config.save_pretrained(staging)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--tokenizer-from", type=Path, default=Path.home() / ".cache/quantgate/models/qwen2.5-coder-1.5b",
                        help="a local model of the same family whose tokenizer files are copied")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args(argv)
    if not (arguments.tokenizer_from / "tokenizer.json").exists():
        print(f"error: no tokenizer.json in {arguments.tokenizer_from} (pass --tokenizer-from)", file=sys.stderr)
        return 2
    if arguments.layers is not None and arguments.layers < 1:
        print("error: --layers must be at least 1", file=sys.stderr)
        return 2
    out = arguments.out.resolve()
    if out.exists() and not (out / MARKER).is_file():
        print(f"error: {arguments.out} exists and is not a model this script made (no {MARKER}): not replaced", file=sys.stderr)
        return 2
    arguments.out = out
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    total = build(arguments.shape, arguments.layers, arguments.tokenizer_from, arguments.out, arguments.seed)
    print(f"{arguments.out}: {total / 1e9:.2f}B parameters, random weights in {arguments.shape}'s shape")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
