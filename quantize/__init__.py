"""Stages 2 and 3: quantize a baseline into compressed-tensors checkpoints (`run`), the
formats as data (`PRESETS`), baseline models (`quantize.models`), byte accounting from
safetensors headers (`quantize.accounting.measure`) and decode-time bounds (`quantize.bounds`)."""

from quantize.config import Backend, QuantizeConfig
from quantize.presets import PRESETS, Preset, get_preset
from quantize.checkpoint import QuantizedCheckpoint
from quantize.stage import run

__all__ = ["Backend", "PRESETS", "Preset", "QuantizeConfig", "QuantizedCheckpoint", "get_preset", "run"]
