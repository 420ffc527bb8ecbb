"""Stage 2: quantize a baseline into a compressed-tensors checkpoint (`run`), the formats as
data (`PRESETS`). Stage 3, measuring what a checkpoint stores, is `quantize.measure`."""

from quantize.checkpoint import QuantizedCheckpoint
from quantize.config import Backend, QuantizeConfig
from quantize.presets import PRESETS, Preset, get_preset
from quantize.stage import run

__all__ = ["Backend", "PRESETS", "Preset", "QuantizeConfig", "QuantizedCheckpoint", "get_preset", "run"]
