"""The measurement as a record: `quantgate measure --json`, the measure stage's artifact, and
what the size gate and the mixed-precision search read. One class writes it
(`Measurement.record()`) and every reader reads it (`MeasurementRecord.from_json`, `.read`);
the schema is docs/measure-and-bounds.md, "measure JSON, schema_version 1".

Figures are written as `measurement.as_number` gives them: an int where the exact fraction is
whole, else a float; so those fields are `int | float` (a float field would turn 4 into 4.0).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, JsonValue

from quantgate.core.records import Record, RecordPart
from quantgate.quantize.measure.causes import Cause

KIND: Final = "measurement"
SCHEMA_VERSION: Final = 1

# An exact figure: an int when whole, else a float (see the module docstring).
Figure = int | float
# A cause is written as its value; read back as the enum (a cause this quantgate does not know is
# a record it cannot explain, refused).
CauseField = Annotated[Cause, Field(strict=False)]


class FileEntry(RecordPart):
    """One weight file: its bytes, its header's and how many tensors it holds."""

    name: str
    bytes: int
    header_bytes: int
    tensors: int


class WeightSchemes(RecordPart):
    """The quantized layers' weight schemes, each value sorted and listed once."""

    bits: list[int]
    group_sizes: list[int]
    strategies: list[str]
    symmetric: bool | None  # None: layers differ, or no layer says


class InputActivations(RecordPart):
    """The first compressed-tensors config group's input activations, copied from the checkpoint's
    config as it states them (measure checks none of them: they are the config's, not a count)."""

    num_bits: JsonValue
    type: JsonValue
    strategy: JsonValue
    dynamic: JsonValue
    symmetric: JsonValue


class DetectedFormat(RecordPart):
    """The checkpoint's format as measure detected it (`format` in the JSON)."""

    family: str  # compressed-tensors | gptq | awq | dense | unknown
    layout: str
    name: str
    detected_from: str
    quant_method: str | None
    weights: WeightSchemes | None
    activations: InputActivations | None
    tie_word_embeddings: bool | None
    config_dtype: str | None


class Totals(RecordPart):
    file_bytes: int
    header_bytes: int
    tensor_bytes: int
    parameters: int
    bits_per_parameter: float | None


class CategoryTotals(RecordPart):
    """Bytes, parameters and tensors of one category (quantize.measure.names.Category)."""

    bytes: int
    parameters: int
    tensors: int


class BlockBytes(RecordPart):
    """One decoder block's bytes by category (or, with `index` None, everything outside them)."""

    index: int | None
    bytes: dict[str, int]
    total_bytes: int
    parameters: int


class LayerGap(RecordPart):
    """Bytes of one layer above (or below) what its format implies, and why."""

    cause: CauseField
    bytes: Figure
    detail: str


class LinearLayerRecord(RecordPart):
    name: str
    block: int | None
    quantized: bool
    layout: str
    bits: int | None
    group_size: int | None
    symmetric: bool | None
    strategy: str | None
    in_features: int
    out_features: int
    parameters: int
    bytes: int
    bytes_by_role: dict[str, int]
    bits_per_weight: float
    exact_bits_per_weight: Figure | None
    nominal_bits_per_weight: Figure | None
    gaps: list[LayerGap]
    notes: list[str]


class QuantizedBitsPerWeight(RecordPart):
    """Over every quantized layer, weighted by parameters (None where nothing is quantized)."""

    measured: float | None
    exact: Figure | None
    format_at_g128: Figure | None
    rule: Figure | None
    unweighted_mean: float | None


class SchemeSummary(RecordPart):
    """The quantized layers of one scheme ("4-bit group g64"), summed."""

    bits: int | None
    strategy: str | None
    group_size: int | None
    layers: int
    parameters: int
    bytes: int
    bits_per_weight: float | None
    exact_bits_per_weight: Figure | None
    nominal_bits_per_weight: Figure | None


class QuantizedLinear(RecordPart):
    layers: int
    parameters: int
    bytes: int
    bits_per_weight: QuantizedBitsPerWeight
    by_scheme: dict[str, SchemeSummary]


class ModelBitsPerParameter(RecordPart):
    measured: float | None
    exact: Figure | None
    rule: Figure


class WholeModel(RecordPart):
    bits_per_parameter: ModelBitsPerParameter


class Rule(RecordPart):
    """The rule the figures are compared against (4.15 bits a weight for INT4, ...)."""

    bits_per_weight: Figure
    group_size: int
    source: str


class BaselineDtype(RecordPart):
    dtype: str | None
    source: str


class ExplanationLine(RecordPart):
    cause: CauseField
    bytes: Figure
    detail: str
    bits_per_parameter: Figure | None


class Explanation(RecordPart):
    """The gap between the checkpoint's bytes and the rule's, line by line (they sum exactly)."""

    expected_bytes: Figure
    measured_bytes: int
    gap_bytes: Figure
    lines: list[ExplanationLine]
    unexplained_bytes: Figure


class BaselineComparison(RecordPart):
    """The checkpoint's bytes against the baseline's: all of them, and the linear layers'."""

    checkpoint: str
    dtype: str | None
    file_bytes: int
    tensor_bytes: int
    parameters: int
    linear_bytes: int
    checkpoint_linear_bytes: int
    ratio_total: float | None
    ratio_linear: float | None
    parameters_match: bool


class MeasurementRecord(Record):
    """The accounting of one checkpoint (docs/measure-and-bounds.md, "measure JSON")."""

    KIND = KIND
    WHAT = "measurement"
    READS = (SCHEMA_VERSION,)

    kind: Literal["measurement"] = "measurement"
    schema_version: Literal[1] = SCHEMA_VERSION
    checkpoint: str
    index: str | None
    files: list[FileEntry]
    format: DetectedFormat
    totals: Totals
    categories: dict[str, CategoryTotals]
    blocks: list[BlockBytes]
    outside_blocks: BlockBytes
    linear_layers: list[LinearLayerRecord]
    quantized_linear: QuantizedLinear
    whole_model: WholeModel
    rule: Rule
    baseline_dtype: BaselineDtype
    explanation: Explanation
    baseline: BaselineComparison | None
    notes: list[str]
    wall_seconds: float

    def layers_by_name(self) -> dict[str, LinearLayerRecord]:
        return {layer.name: layer for layer in self.linear_layers}
