"""Every cause a measurement's explanation can name, and where each one's bytes come from: what
the format or the rule implies, storage the format does not call for, or bytes nobody can place.

The size gate (`gates.verdict`) and the whole-model exact figure both read their cause lists
from here, so they cannot disagree.
"""

from __future__ import annotations

from enum import Enum


class Origin(Enum):
    implied = "implied"  # the format (or an unquantized tensor at the baseline's width) calls for these bytes
    storage = "storage"  # storage departing from the format: bytes it does not call for (or lacks)
    unplaced = "unplaced"  # bytes measure cannot check against any format it knows


class Cause(str, Enum):
    """One line of the explanation; its value is the `cause` in the measure JSON."""

    _value_: str
    origin: Origin

    format_vs_rule = ("format_vs_rule", Origin.implied)
    unknown_format_layers = ("unknown_format_layers", Origin.unplaced)
    other_group_size = ("other_group_size", Origin.implied)
    channel_scales = ("channel_scales", Origin.implied)
    g_idx = ("g_idx", Origin.implied)
    shape_metadata = ("shape_metadata", Origin.implied)
    activation_scales = ("activation_scales", Origin.implied)
    partial_groups = ("partial_groups", Origin.implied)
    wide_scales = ("wide_scales", Origin.storage)
    unaccounted_tensors = ("unaccounted_tensors", Origin.storage)
    missing_tensors = ("missing_tensors", Origin.storage)  # always negative: bytes the checkpoint lacks
    kv_cache_scales = ("kv_cache_scales", Origin.implied)
    # unquantized tensors at the baseline's width instead of the rule's bits, by category
    unquantized_unquantized_linear = ("unquantized_unquantized_linear", Origin.implied)
    unquantized_biases = ("unquantized_biases", Origin.implied)
    unquantized_embeddings = ("unquantized_embeddings", Origin.implied)
    unquantized_lm_head = ("unquantized_lm_head", Origin.implied)
    unquantized_norms = ("unquantized_norms", Origin.implied)
    unquantized_other = ("unquantized_other", Origin.implied)
    wider_than_baseline = ("wider_than_baseline", Origin.storage)
    tied_lm_head_stored = ("tied_lm_head_stored", Origin.storage)
    header = ("header", Origin.implied)
    unexplained = ("unexplained", Origin.unplaced)  # a bug in measure if it ever appears

    def __new__(cls, value: str, origin: Origin) -> Cause:
        member = str.__new__(cls, value)
        member._value_ = value
        member.origin = origin
        return member

    @property
    def is_storage(self) -> bool:
        """Storage the format does not call for: left out of the whole model's exact figure."""
        return self.origin is Origin.storage

    @property
    def is_unexplained(self) -> bool:
        """Bytes the format does not explain: each one blocks under `forbid_unexplained_bytes`."""
        return self.origin is not Origin.implied


STORAGE_CAUSES: frozenset[str] = frozenset(cause.value for cause in Cause if cause.is_storage)
UNEXPLAINED_CAUSES: frozenset[str] = frozenset(cause.value for cause in Cause if cause.is_unexplained)
