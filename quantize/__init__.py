"""Stages 2 and 3: quantize a baseline into compressed-tensors checkpoints (`run`), the
formats as data (`PRESETS`), and baseline models (`quantize.models`). Byte accounting and
decode-time bounds join in a later issue."""

from quantize.config import Backend, QuantizeConfig
from quantize.presets import PRESETS, Preset, get_preset
from quantize.stage import QuantizedCheckpoint, run

__all__ = ["Backend", "PRESETS", "Preset", "QuantizeConfig", "QuantizedCheckpoint", "get_preset", "run"]
