"""What this machine's CPU computes natively, from its /proc/cpuinfo flags: the facts that decide a
device class for serving (serving.device) and the dtype evaluation computes in (evalsets.evaluate)."""

from __future__ import annotations

from pathlib import Path

# Flags by which a CPU has BF16 arithmetic in hardware: AVX512_BF16 (VDPBF16PS: Cooper Lake, Zen 4
# and later) or AMX's BF16 tiles (Sapphire Rapids and later). Without either, torch's CPU BF16 matrix
# products are emulated: measured 0.93 s against 0.015 s in FP32 for a 512x576 @ 576x1536 product on
# an AVX-512 CPU without avx512_bf16 (docs/evaluate.md, "Compute dtype").
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo (empty where there is none)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def native_bf16(flags: frozenset[str]) -> str | None:
    """The flag by which a CPU computes BF16 in hardware (None: it does not)."""
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)
