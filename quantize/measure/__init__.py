"""Stage 3: measure. Byte accounting of a checkpoint from its safetensors headers (`measure`),
the 4.15-bit comparison and the decode-time lower bounds its bytes imply (`bounds`).

Entry: `measure_and_bound(checkpoint, baseline, profiles)`. Modules: `accounting` (the steps),
`layouts` (storage layouts as data), `schemes` (quantization configs), `names` (tensor roles and
categories), `explain` and `causes` (the gap, one function per cause), `measurement` (the JSON),
`bounds` and `hardware` (decode-time bounds).
"""

from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.stage import measure_and_bound

__all__ = ["measure", "measure_and_bound"]
