"""Workarounds for upstream gaps, each in one place and each with a test that fails once
upstream no longer needs it (tests/test_quantize_compat.py)."""

from __future__ import annotations

# torch, llmcompressor and awq are imported where used: each workaround patches a library only
# while it runs, and importing them here would cost every command seconds.
import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_safe_pinning() -> Iterator[bool]:
    """llmcompressor 0.14's AWQ pins cached activations (`IntermediatesCache.pin_memory`) so
    that host-to-device copies can be asynchronous. Pinning needs an accelerator; on a
    CPU-only machine it raises `RuntimeError: Cannot access accelerator device when none is
    available`. With no accelerator there is no transfer to speed up, so pinning becomes a
    no-op for the duration of the block. With an accelerator nothing changes.

    Yields whether the workaround is active.
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield False
        return
    original = IntermediatesCache.pin_memory

    def pin_memory(self: IntermediatesCache, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = pin_memory  # type: ignore[method-assign]  # a patch for this block only, undone below
    try:
        yield True
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]  # the upstream method, put back


@contextlib.contextmanager
def autoawq_plain_torch_on_cpu() -> Iterator[None]:
    """AutoAWQ 0.2.9's `from_quantized` insists on intel-extension-for-pytorch kernels when
    its best device is the CPU (`use_ipex = True`), and its GEMM layer takes Triton (GPU)
    kernels whenever the triton package is importable, although the layer has a plain torch
    path (dequantize, then matmul) that runs anywhere. Inside this block, on a machine
    without CUDA, AutoAWQ's loader sees no CPU "best device" and its GEMM layer no Triton,
    so the plain path is used."""
    import awq.models.base as awq_base
    import torch
    from awq.modules.linear import gemm

    if torch.cuda.is_available():
        yield
        return
    original_device, original_triton = awq_base.get_best_device, gemm.TRITON_AVAILABLE

    def best_device() -> str:
        device = original_device()
        return "cpu-without-ipex" if device == "cpu" else device

    awq_base.get_best_device, gemm.TRITON_AVAILABLE = best_device, False
    try:
        yield
    finally:
        awq_base.get_best_device, gemm.TRITON_AVAILABLE = original_device, original_triton


@contextlib.contextmanager
def no_traced_namespace_kept() -> Iterator[None]:
    """llmcompressor 0.14's sequential pipelines trace the model with torch.fx after rewriting its
    forward (`pipelines/sequential/ast_helpers.py`): the rewritten code runs in a copy of the
    modeling module's globals that holds the model itself (`self`), and calls `torch.fx.wrap`,
    which registers that namespace in torch.fx's module-level `_wrapped_fns_to_patch` for good
    (`torch/fx/_symbolic_trace.py`). Every quantization so kept its whole model alive until the
    process ended (tests/test_quantize.py follows the model with a weak reference). The registry
    is read only while tracing; what the block added to it is removed when the block ends."""
    from torch.fx import _symbolic_trace

    registry = _symbolic_trace._wrapped_fns_to_patch
    before = set(registry)
    try:
        yield
    finally:
        for key in set(registry) - before:
            del registry[key]
