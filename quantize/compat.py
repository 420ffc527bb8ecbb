"""Workarounds for upstream gaps, each in one place and each with a test that fails once
upstream no longer needs it (tests/test_quantize_compat.py)."""

from __future__ import annotations

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

    def pin_memory(self, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = pin_memory
    try:
        yield True
    finally:
        IntermediatesCache.pin_memory = original
