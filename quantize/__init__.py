"""Stage 2: quantize a baseline into a compressed-tensors checkpoint (`run`), the formats as
data (`PRESETS`). Stage 3, measuring what a checkpoint stores, is `quantize.measure`."""

from quantgate.quantize.checkpoint import QuantizedCheckpoint
from quantgate.quantize.config import UNQUANTIZED, Backend, MixedConfig, QuantizeConfig
from quantgate.quantize.presets import PRESETS, Preset, get_preset
from quantgate.quantize.stage import run, run_mixed

__all__ = ["Backend", "MixedConfig", "PRESETS", "Preset", "QuantizeConfig", "QuantizedCheckpoint", "UNQUANTIZED", "get_preset", "run",
           "run_mixed"]
