"""How much memory this process may use, and how much a run's model stages need (docs/models.md,
"Memory"): preflight refuses, in one line, a plan whose model cannot be evaluated within it, and
keeps one model loaded at a time where two do not fit, so that no run is ended half-way by the
kernel's OOM killer.

What this process may use is the least of: the kernel's MemAvailable; for the memory cgroup it
runs in and every cgroup above it (v1 or v2), the limit less what is charged to it, page cache
that can be reclaimed not counted; and the address-space limit (`ulimit -v`, `prlimit --as`) less
what is mapped. Read here rather than through psutil (which reads /proc/meminfo but no cgroup or
rlimit): the project does not depend on psutil, and these are a few small files.
"""

from __future__ import annotations

import enum
import math
import re
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from quantgate.core.errors import InputError
from quantgate.core.headers import CheckpointFiles, read_checkpoint

GB = 1e9
# What a run's process holds besides its models: Python, torch, transformers, llmcompressor,
# lm-eval and datasets imported (0.71 GB resident, measured on x86-64 Linux with torch 2.13's CPU
# build), and the tokenizer, golden sets and records a run keeps: 1.0 GB in all.
BASE_BYTES = int(1.0e9)
FP32_BYTES = 4
# The factors below are measured upper bounds, chosen after seeing the figures they rest on
# (benchmarks/model_cost.py on the 1.5B model, 2026-12-04; docs/models.md, "How cost grows"), each
# the stage's peak less the libraries' 0.8 GB, over the model's FP32 bytes, rounded up. Issue 25's
# goals (1.3 for an evaluation plus its top-k cache, 1.5 for a quantization) are what they should
# come down to; the estimate follows what was measured, so that no run the check lets through dies
# of the kernel's OOM killer.
# An evaluation on the CPU: the model in FP32, and a window's logits over the vocabulary (0.6 MB a
# token in FP32 for a 151,936-token vocabulary, and its log-softmax as much again): the quantized
# checkpoint's evaluation peaked at 1.83 (the baseline's at 1.49).
EVALUATE_FACTOR = 1.85
# A quantization: the model in FP32 on a CPU (its compute dtype), one layer's work at a time
# (llmcompressor's sequential pipelines): smoothquant-w8a8 peaked at 1.73, gptq-int4 at 1.52,
# before three leaks of the quantized model found the same day were fixed.
QUANTIZE_FACTOR = 1.75
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True)
class Allowance:
    """What this process may use, and what limits it (for the refusal's line)."""

    bytes: int
    source: str


def gb(value: float) -> str:
    return f"{value / GB:.1f} GB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, *keys: str) -> int:
    """The first of `keys` found in a cgroup's memory.stat (reclaimable page cache), else 0."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(" ", 1) for line in lines if " " in line)
    return next((int(values[key]) for key in keys if key in values and values[key].strip().isdigit()), 0)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> Allowance | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return Allowance(int(line.split()[1]) * 1024, "the kernel's MemAvailable")
    return None


def cgroup_allowances(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> list[Allowance]:
    """For the memory cgroup this process is in and each one above it: its limit less its usage
    (reclaimable page cache not counted as used). v2 (`0::/path`) and v1 (`N:memory:/path`)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[Allowance] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        files: tuple[str, str, tuple[str, ...]]  # the limit, the usage, the reclaimable cache in memory.stat
        if controllers == "":  # v2: the unified hierarchy, at the root or (hybrid) under unified/
            base = root / "unified" if (root / "unified" / "cgroup.controllers").exists() else root
            files = ("memory.max", "memory.current", ("inactive_file",))
        elif "memory" in controllers.split(","):
            base = root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file"))
        else:
            continue
        folder = base / path.lstrip("/")
        while True:
            limit = _read_int(folder / files[0])
            if limit is not None and limit < _NO_LIMIT:
                used = (_read_int(folder / files[1]) or 0) - _stat(folder / "memory.stat", *files[2])
                found.append(Allowance(max(0, limit - max(0, used)), f"the memory cgroup {folder} (limit {gb(limit)})"))
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return found


def address_space(status: Path = Path("/proc/self/status")) -> Allowance | None:
    """RLIMIT_AS (`ulimit -v`, `prlimit --as`) less this process's mapped size."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = 0
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmSize:"):
                mapped = int(line.split()[1]) * 1024
    except OSError:
        pass
    return Allowance(max(0, soft - mapped), f"the address-space limit (RLIMIT_AS {gb(soft)})")


# What the run's process imported for its units before forking them (pipeline.executor.preload),
# in bytes of its resident set: a forked child shares those pages, which the allowance it reads has
# already taken off (MemAvailable, a cgroup's usage), so its estimates count that much less of
# BASE_BYTES. Zero until a run in this process preloaded (a single command, a run's first preflight).
_preloaded = {"bytes": 0}


def note_preloaded(grown: int) -> None:
    """The run's process grew by `grown` bytes importing its units' libraries (executor.preload)."""
    _preloaded["bytes"] += grown


def resident_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's resident set (VmRSS), in bytes; 0 where it cannot be read (not Linux)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def allowance() -> Allowance | None:
    """The least of what limits this process; None where nothing could be read (not Linux)."""
    found = [item for item in (mem_available(), address_space(), *cgroup_allowances()) if item is not None]
    return min(found, key=lambda item: item.bytes) if found else None


# ---- where a stage keeps the model: in memory, or streamed from disk ---------------------------


class Placement(str, enum.Enum):
    """Where a quantization or an evaluation keeps the model's weights (docs/models.md, "Streamed
    stages"). Both compute the same numbers (tests/test_placement.py): only memory and time differ."""

    auto = "auto"  # in memory where this process's allowance holds the stage's estimate, else streamed
    memory = "memory"  # the whole model loaded, in the compute dtype (FP32 on a CPU)
    # compressed-tensors' disk offload: the weights stay in their safetensors files (those a stage
    # writes, such as decompressed or quantized weights, in a scratch directory); each module's
    # tensors are read, in the compute dtype, when it runs, and dropped after
    streamed = "streamed"

    def __str__(self) -> str:
        return self.value


# The decoder layers' tensors, by the index in their names ("model.layers.12.mlp.up_proj.weight").
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")
# A streamed stage holds, besides the libraries (BASE_BYTES), the larger of its phases' needs
# (what one phase holds is freed before the next). An evaluation, in a forward: one decoder layer
# onloaded in FP32 (its weights, and the copies a forward makes of them: STREAMED_LAYERS of them)
# and the largest tensor outside the layers (the embedding or the output layer) onloaded in FP32;
# in scoring: one item's distributions, SCORED_COPIES of tokens x vocabulary in FP32 (this model's
# log-softmax, the baseline's logits rebuilt from its cache and their log-softmax); in both, the
# output layer's weight kept in FP32 to score with, and a candidate's baseline's output layer in
# FP32 (evalsets.evaluate.load_side; counted for every evaluation: a plan's candidates are its
# baseline's size). The model's own [batch, tokens, vocabulary] logits are not made where the model
# takes `logits_to_keep` (evalsets.text_eval; the serve check's greedy reference still makes a few
# prompts' logits). A quantization: the onloaded layer and largest tensor, and the larger of
# calibrating (its calibration rows through one layer: inputs, outputs and the MLP's inner width,
# FP32; GPTQ's Hessians, ModelShape.hessian_bytes, every expert's in a mixture of experts) and saving (the checkpoint shard
# being written, at most SHARD_BYTES: transformers gathers a shard before it writes it); its smoke
# check holds what an evaluation's forward does. A quantization's libraries (llmcompressor, its
# tracing and calibration data) hold QUANTIZE_LIBRARIES more than an evaluation's: a streamed
# quantization of the demo model peaked at 1.43 GB anonymous, 1.74 GB VmHWM, against 1.29 GB of
# the other terms (chosen after seeing it). What these come to against measured peaks is in
# docs/models.md, "Streamed stages" (issue 37's goal: 1.5x the 16-bit bytes plus 1 GiB).
STREAMED_LAYERS = 3
SCORED_COPIES = 3
SHARD_BYTES = 2 * 10**9
QUANTIZE_LIBRARIES = 5 * 10**8
# 4-bit weights packed eight to an int32 (compressed-tensors' pack-quantized `weight_packed`)
_PACKED = {"I32": 8}


@dataclass(frozen=True)
class ModelShape:
    """What a stage's memory depends on, read from the checkpoint's safetensors headers and config.json."""

    parameters: int  # weights as the model computes them (a packed INT4 tensor counts its unpacked weights)
    largest_layer: int  # parameters of the largest decoder layer
    largest_other: int  # the largest tensor outside the decoder layers (the embedding, the output layer)
    vocabulary: int = 0  # config.json's vocab_size (0: not given)
    hidden: int = 0  # hidden_size
    intermediate: int = 0  # intermediate_size (the MLP's inner width)
    experts: int = 0  # routed experts in a mixture-of-experts layer (0: every MLP is dense)
    expert_intermediate: int = 0  # one expert's inner width (moe_intermediate_size, else intermediate_size)
    shared_intermediate: int = 0  # the shared experts' inner width, all of them together (0: none)

    def hessian_bytes(self) -> int:
        """GPTQ's Hessians for the largest decoder layer, FP32: one an input width square for each
        linear layer (attention's four and a dense MLP's two take the hidden width in, the MLP's last
        its inner width), every expert's at once in a mixture of experts (llmcompressor calibrates a
        whole layer before it compresses any of its modules), and two more copies of the largest
        while it is inverted."""
        dense = 6 * self.hidden**2 + self.intermediate**2 + 2 * max(self.hidden, self.intermediate) ** 2
        if not self.experts:
            return FP32_BYTES * dense
        mlps = [(self.experts, self.expert_intermediate)] + ([(1, self.shared_intermediate)] if self.shared_intermediate else [])
        widest = max(self.hidden, self.expert_intermediate, self.shared_intermediate)
        moe = 4 * self.hidden**2 + sum(count * (2 * self.hidden**2 + inner**2) for count, inner in mlps) + 2 * widest**2
        return FP32_BYTES * max(dense, moe)  # a model may keep dense MLPs in some layers (DeepSeek's first)


def shape(model_dir: Path, found: CheckpointFiles | None = None) -> ModelShape:
    """The model's ModelShape (no tensor is read; `found`: its headers where already read)."""
    found = found if found is not None else read_checkpoint(model_dir)
    layers: dict[int, int] = {}
    other = 0
    total = 0
    for name, entry in found.tensors.items():
        count = math.prod(entry.shape) * (_PACKED.get(entry.dtype, 1) if name.endswith("weight_packed") else 1)
        total += count
        index = _LAYER.search(name)
        if index:
            layers[int(index.group(1))] = layers.get(int(index.group(1)), 0) + count
        else:
            other = max(other, count)
    config: dict[str, object] = dict(found.config or {})
    inner = config.get("text_config")
    text: dict[str, object] = dict(inner) if isinstance(inner, dict) else config

    def number(key: str) -> int:
        value = text.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    # the names the families' configs give a mixture of experts: Qwen2/3-MoE and OLMoE num_experts,
    # Mixtral and gpt-oss num_local_experts, DeepSeek n_routed_experts (with n_shared_experts of
    # moe_intermediate_size each); Qwen2-MoE's shared expert its own shared_expert_intermediate_size
    experts = number("num_experts") or number("num_local_experts") or number("n_routed_experts")
    expert_inner = number("moe_intermediate_size") or number("intermediate_size")
    shared = number("shared_expert_intermediate_size") or number("n_shared_experts") * expert_inner
    return ModelShape(parameters=total, largest_layer=max(layers.values(), default=0), largest_other=other,
                      vocabulary=number("vocab_size"), hidden=number("hidden_size"), intermediate=number("intermediate_size"),
                      experts=experts, expert_intermediate=expert_inner if experts else 0, shared_intermediate=shared if experts else 0)


@dataclass(frozen=True)
class StageNeeds:
    """One stage's estimated peak on each path, libraries included."""

    memory: int
    streamed: int


@dataclass(frozen=True)
class Work:
    """What a stage's activations depend on: an evaluation's batch of windows, a quantization's calibration rows."""

    batch: int = 4
    tokens: int = 512
    rows: int = 16
    row_tokens: int = 256


def stage_needs(found: ModelShape, stage: str, work: Work = Work()) -> StageNeeds:
    """`stage` ("quantize" or "evaluate"): its estimated peak in memory (the measured factors on the
    FP32 bytes) and streamed (the terms above)."""
    onloaded = FP32_BYTES * (STREAMED_LAYERS * found.largest_layer + found.largest_other)
    if stage == "quantize":
        in_memory = math.ceil(QUANTIZE_FACTOR * FP32_BYTES * found.parameters)
        rows = work.rows * work.row_tokens * FP32_BYTES * (4 * found.hidden + 2 * found.intermediate)
        hessians = found.hessian_bytes()
        shard = min(SHARD_BYTES, found.parameters)  # the shard being written: at most a byte a weight (8-bit)
        streamed = QUANTIZE_LIBRARIES + onloaded + max(rows + hessians, shard)
    else:
        in_memory = math.ceil(EVALUATE_FACTOR * FP32_BYTES * found.parameters)
        heads = 2 * FP32_BYTES * found.largest_other  # this model's, kept to score with, and its baseline's
        streamed = heads + max(onloaded, FP32_BYTES * SCORED_COPIES * work.tokens * found.vocabulary)
    base = max(0, BASE_BYTES - _preloaded["bytes"])  # the libraries the run already holds are shared, not counted again
    return StageNeeds(base + in_memory, base + streamed)


def scratch_needs(found: ModelShape) -> int:
    """Disk a streamed quantization or a streamed evaluation of a compressed checkpoint writes to its
    scratch directory at most: every weight it changes or decompresses, once, in FP32. Counted as
    the whole model's FP32 bytes: the decoder layers' are what is written (measured on the demo
    model: 488 MB quantizing, 431 MB evaluating its gptq-int4 checkpoint, against 538 MB; on the 7B
    shape 26 GB evaluating, against 30.5 GB; docs/models.md)."""
    return FP32_BYTES * found.parameters


# ---- the serve stage: vLLM's CPU worker --------------------------------------------------------
# vLLM's CPU worker serving the serve check's request (docs/models.md, "Serving"), measured as the
# anonymous memory of its process, sampled every 100 ms, on AVX-512 without AMX, vLLM 0.32, a 512 MiB
# KV cache, 16 wiki-text prompts (1,817 positions) scored at once: SmolLM2-135M in BF16 peaked at
# 2.11 GB (0.27 GB of weights), Qwen2.5-Coder-1.5B in BF16 at 6.65 GB (3.55 GB), its
# smoothquant-w8a8 checkpoint at 5.75 GB (2.24 GB) and its gptq-int4 checkpoint at 4.96 GB (1.60 GB).
# What it holds: vLLM, torch and the engine with the load's transients (SERVE_BASE_BYTES: each
# peak less its other terms leaves 0.89 GB at 135M and 0.99 GB at the 1.5B model in BF16; the larger,
# rounded up, with 0.2 GB to spare); the weights as the file holds them; the
# quantized layers a second time (the CPU kernels repack them: the W8A8 and W4A16 checkpoints'
# steady state holds about twice their integer bytes); the output layer again, packed for oneDNN
# beside its weight (vLLM's vocab_parallel_embedding keeps both); the KV cache; and the FP32 logits
# of the positions it scores at once (prompt log-probabilities: up to the scheduler's
# VLLM_BATCHED_TOKENS, the max_num_batched_tokens vLLM's CPU build logs). Chosen after seeing these
# four peaks: the estimate is 3% to 19% over each of them. Not measured: an FP8 checkpoint (its F8
# tensors are counted as repacked, as the integer ones are) and an FP32 one (its output layer's
# packed copy is counted at 2 bytes an element).
SERVE_BASE_BYTES = int(1.2e9)
VLLM_BATCHED_TOKENS = 4096
_INTEGER_DTYPES = frozenset({"I8", "U8", "I32", "F8_E4M3", "F8_E5M2"})


def serve_needs(model_dir: Path, *, kv_bytes: int, scored_positions: int) -> int:
    """The peak of vLLM's CPU worker serving `model_dir` with a KV cache of `kv_bytes`, scoring
    `scored_positions` prompt positions in all (the terms are above SERVE_BASE_BYTES)."""
    found = read_checkpoint(model_dir)
    tensors = found.tensors.values()
    weights = sum(entry.nbytes for entry in tensors)
    repacked = sum(entry.nbytes for entry in tensors if entry.dtype in _INTEGER_DTYPES)
    found_shape = shape(model_dir, found)
    head = 2 * found_shape.vocabulary * found_shape.hidden
    logits = FP32_BYTES * found_shape.vocabulary * min(scored_positions, VLLM_BATCHED_TOKENS)
    return SERVE_BASE_BYTES + weights + repacked + head + kv_bytes + logits


def disk_free(folder: Path) -> Allowance:
    """Free space on the disk `folder` is on (or will be on: its nearest existing parent)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return Allowance(shutil.disk_usage(existing).free, f"the disk of {folder}")


def check_scratch_disk(found: ModelShape, scratch: Path, what: str) -> None:
    """InputError (one line, starting with `what`) where the disk of `scratch` has less free than
    a streamed stage may write there (scratch_needs): refused before the work, rather than after
    hours of quantizing."""
    written, free = scratch_needs(found), disk_free(scratch)
    if free.bytes < written:
        raise InputError(f"{what}: streamed from disk, a stage writes up to about {gb(written)} (4 bytes a weight) to its "
                         f"scratch directory {scratch}, and {free.source} has {gb(free.bytes)} free: free some, or set "
                         "QUANTGATE_HOME to a larger disk")


Taken = Literal["memory", "streamed"]  # a Placement as records keep the one a stage took


@dataclass(frozen=True)
class Chosen:
    """The path a stage takes, and why (a line for the run's notes)."""

    placement: Placement
    reason: str

    @property
    def taken(self) -> Taken:
        return taken(self.placement)


def taken(placement: Placement) -> Taken:
    """A resolved placement as records keep it (auto, not resolved, reads as memory: where nothing limits)."""
    return "streamed" if placement is Placement.streamed else "memory"


def choose(requested: Placement, needs: StageNeeds, limit: Allowance | None, stage: str) -> Chosen:
    """`requested` as it is, unless auto: in memory where `limit` holds its estimate (or nothing
    limits this process), else streamed. Streamed needing more than `limit` is still chosen: the
    caller refuses the plan where even that does not fit (resolve), a single command tries."""
    if requested is not Placement.auto:
        return Chosen(requested, f"{stage}: {requested} (asked for)")
    if limit is None or needs.memory <= limit.bytes:
        return Chosen(Placement.memory, f"{stage}: in memory (about {gb(needs.memory)})")
    return Chosen(Placement.streamed, f"{stage}: streamed from disk, about {gb(needs.streamed)} "
                                      f"(in memory it needs about {gb(needs.memory)}, and {limit.source} leaves {gb(limit.bytes)})")
