"""Stage 3: measure. Byte accounting of a checkpoint from its safetensors headers (`measure`),
the 4.15-bit comparison and the decode-time lower bounds its bytes imply (`bounds`).

Entry: `measure_and_bound(checkpoint, baseline, profiles)`. Modules: `accounting` (the steps),
`layouts` (storage layouts as data), `schemes` (quantization configs), `names` (tensor roles and
categories), `explain` and `causes` (the gap, one function per cause), `measurement` (the
accounting with exact fractions), `record` (the measurement as written and read:
`MeasurementRecord`), `bounds` and `hardware` (decode-time bounds).
"""

from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.record import MeasurementRecord
from quantgate.quantize.measure.stage import measure_and_bound, stage_measurement

__all__ = ["MeasurementRecord", "measure", "measure_and_bound", "stage_measurement"]
