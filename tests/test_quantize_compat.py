"""The CPU pinning workaround: needed today, inactive with an accelerator, and a canary
that fails once upstream llmcompressor stops pinning on CPU-only machines."""

from __future__ import annotations

import pytest
import torch

from quantgate.quantize.compat import cpu_safe_pinning

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="the workaround only acts without an accelerator")


def cache_with_one_tensor():
    from llmcompressor.pipelines.cache import IntermediatesCache

    return IntermediatesCache.from_dataloader([{"hidden_states": torch.ones(2, 3)}])


def test_upstream_still_pins_memory_without_an_accelerator() -> None:
    """If this fails, llmcompressor no longer needs quantize.compat.cpu_safe_pinning: remove it."""
    cache = cache_with_one_tensor()
    with pytest.raises(RuntimeError, match="accelerator"):
        cache.pin_memory(0)


def test_pinning_is_a_no_op_inside_the_workaround_and_restored_after() -> None:
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    cache = cache_with_one_tensor()
    with cpu_safe_pinning() as active:
        assert active
        cache.pin_memory(0)  # would raise without the workaround
        assert torch.equal(cache.fetch(0)["hidden_states"], torch.ones(2, 3))
    assert IntermediatesCache.pin_memory is original
