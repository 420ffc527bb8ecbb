"""What a measurement is: the detected format, every linear layer with its bytes and exact
figure, the explanation's lines, and `Measurement.record()`, the documented, versioned record
(quantize.measure.record) every reader reads.

Every figure is in bits with exact fractions, so the explanation sums to the byte; the record
writes them as numbers (`as_number`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from quantgate.quantize.measure.causes import Cause
from quantgate.quantize.measure.layouts import NOMINAL_SCALE_BITS
from quantgate.quantize.measure.names import LINEAR_CATEGORIES, Category
from quantgate.quantize.measure.record import (
    BaselineComparison,
    BaselineDtype,
    BlockBytes,
    CategoryTotals,
    DetectedFormat,
    Explanation,
    ExplanationLine,
    FileEntry,
    LayerGap,
    LinearLayerRecord,
    MeasurementRecord,
    ModelBitsPerParameter,
    QuantizedBitsPerWeight,
    QuantizedLinear,
    Rule,
    SchemeSummary,
    Totals,
    WholeModel,
)

# The rule the report compares against: GPTQ (Frantar et al., 2022, §5) puts INT4 with one
# 16-bit scale (and zero point) per 128 weights at about 4.15 bits per weight; 8-bit formats
# are 8, unquantized models their dtype's width (docs/sources.md, "The 4.15-bit rule").
RULE_GROUP_SIZE = 128


def rule_bits(bits: int) -> Fraction:
    """The rule's bits per weight for `bits`-bit weights: 4 -> 4.15 (4 + 0.15 of group-128
    overhead, GPTQ's estimate), 8 -> 8, 16 -> 16."""
    return Fraction(bits) + (Fraction(15, 100) if bits < 8 else 0)


def as_number(value: Fraction | float | int | None) -> float | int | None:
    """A JSON number: whole fractions as ints, the rest as floats."""
    if value is None:
        return None
    if isinstance(value, Fraction):
        return value.numerator if value.denominator == 1 else float(value)
    return value


@dataclass
class Gap:
    cause: Cause
    bits: Fraction  # signed: bits above (positive) or below the reference
    detail: str
    role: str | None = None  # for a layer's gap: the tensor role it is about

    def record(self) -> LayerGap:
        return LayerGap(cause=self.cause, bytes=_figure(self.bits / 8), detail=self.detail)


@dataclass
class LinearLayer:
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
    bytes_by_role: dict[str, int]
    exact_bits: Fraction | None  # what the format implies, with 16-bit scales
    nominal_bits: Fraction | None  # b + (16 + zero-point bits)/g, without per-layer constants
    gaps: list[Gap] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    storage_bits: int | None = None  # bits a weight takes in its container (8 for int-quantized INT4)
    zero_point_bits: int = 0

    def nominal_at(self, group_size: int) -> Fraction | None:
        """The nominal figure this layer would have at another group size."""
        if self.nominal_bits is None or self.storage_bits is None:
            return None
        if self.strategy != "group" or not self.group_size:
            return self.nominal_bits
        return (self.storage_bits + Fraction(NOMINAL_SCALE_BITS + self.zero_point_bits, group_size)) * self.parameters

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_role.values())

    @property
    def bits_per_weight(self) -> float:
        return self.bytes * 8 / self.parameters if self.parameters else 0.0

    def record(self) -> LinearLayerRecord:
        exact = self.exact_bits / self.parameters if self.exact_bits is not None and self.parameters else None
        nominal = self.nominal_bits / self.parameters if self.nominal_bits is not None and self.parameters else None
        return LinearLayerRecord(
            name=self.name, block=self.block, quantized=self.quantized, layout=self.layout,
            bits=self.bits, group_size=self.group_size, symmetric=self.symmetric, strategy=self.strategy,
            in_features=self.in_features, out_features=self.out_features, parameters=self.parameters,
            bytes=self.bytes, bytes_by_role=dict(sorted(self.bytes_by_role.items())),
            bits_per_weight=self.bits_per_weight,
            exact_bits_per_weight=_optional_figure(exact), nominal_bits_per_weight=_optional_figure(nominal),
            gaps=[gap.record() for gap in self.gaps], notes=list(self.notes),
        )


def _figure(value: Fraction) -> int | float:
    """`as_number` of a figure that is there."""
    return value.numerator if value.denominator == 1 else float(value)


def _optional_figure(value: Fraction | None) -> int | float | None:
    return None if value is None else _figure(value)


def _scheme_key(layer: LinearLayer) -> str:
    return f"{layer.bits}-bit {layer.strategy}" + (f" g{layer.group_size}" if layer.group_size else "")


def _by_scheme(layers: list[LinearLayer]) -> dict[str, SchemeSummary]:
    """The quantized layers summed per scheme ("4-bit group g64"), with their figures."""
    grouped: dict[str, list[LinearLayer]] = {}
    for layer in layers:
        grouped.setdefault(_scheme_key(layer), []).append(layer)
    summaries = {}
    for key, members in sorted(grouped.items()):
        first = members[0]
        weights = sum(layer.parameters for layer in members)
        stored = sum(layer.bytes for layer in members)
        exact = sum((layer.exact_bits or Fraction(0) for layer in members), Fraction(0))
        nominal = sum((layer.nominal_bits or Fraction(0) for layer in members), Fraction(0))
        # no weights: a layout measure cannot size, so no figure per weight
        summaries[key] = SchemeSummary(
            bits=first.bits, strategy=first.strategy, group_size=first.group_size,
            layers=len(members), parameters=weights, bytes=stored,
            bits_per_weight=stored * 8 / weights if weights else None,
            exact_bits_per_weight=_figure(exact / weights) if weights and exact else None,
            nominal_bits_per_weight=_figure(nominal / weights) if weights and nominal else None,
        )
    return summaries


@dataclass
class Measurement:
    """The accounting of one checkpoint, with exact fractions; `record()` is the documented,
    versioned record every reader reads."""

    checkpoint: str
    files: list[FileEntry]
    index: str | None
    format: DetectedFormat
    file_bytes: int
    header_bytes: int
    parameters: int
    categories: dict[str, CategoryTotals]
    blocks: list[BlockBytes]
    outside_blocks: BlockBytes
    linear_layers: list[LinearLayer]
    rule_bits_per_weight: Fraction
    baseline_dtype: str | None
    baseline_dtype_source: str
    explanation: list[Gap]
    unexplained_bits: Fraction
    notes: list[str]
    baseline: BaselineComparison | None = None
    wall_seconds: float = 0.0

    @property
    def rule_source(self) -> str:
        if not self.quantized_layers:
            return f"unquantized: the width of the baseline dtype {self.baseline_dtype or '(assumed 16-bit)'}"
        if self.rule_bits_per_weight < 8:
            return "GPTQ (Frantar et al., 2022): INT4 with group-128 scales is about 4.15 bits per weight"
        return f"{int(self.rule_bits_per_weight)}-bit weights"

    @property
    def tensor_bytes(self) -> int:
        return self.file_bytes - self.header_bytes

    @property
    def quantized_layers(self) -> list[LinearLayer]:
        return [layer for layer in self.linear_layers if layer.quantized]

    def category_bytes(self, categories: tuple[Category, ...]) -> int:
        return sum(self.categories[category.value].bytes for category in categories)

    @property
    def linear_bytes(self) -> int:
        return self.category_bytes(LINEAR_CATEGORIES)

    def quantized_summary(self) -> QuantizedLinear:
        layers = self.quantized_layers
        weights = sum(layer.parameters for layer in layers)
        stored = sum(layer.bytes for layer in layers)
        exact_layers = [layer for layer in layers if layer.exact_bits is not None]
        exact_bits = sum((layer.exact_bits for layer in exact_layers if layer.exact_bits is not None), Fraction(0))
        nominal_g128 = [layer.nominal_at(RULE_GROUP_SIZE) for layer in layers]
        known_g128 = [value for value in nominal_g128 if value is not None]
        return QuantizedLinear(
            layers=len(layers), parameters=weights, bytes=stored,
            bits_per_weight=QuantizedBitsPerWeight(
                # weighted by parameters: total bits over total weights
                measured=stored * 8 / weights if weights else None,
                exact=_figure(exact_bits / sum(layer.parameters for layer in exact_layers)) if exact_layers else None,
                format_at_g128=_figure(sum(known_g128, Fraction(0)) / weights) if weights and len(known_g128) == len(layers) else None,
                rule=_figure(self.rule_bits_per_weight) if weights else None,
                unweighted_mean=sum(layer.bits_per_weight for layer in layers) / len(layers) if layers else None,
            ),
            by_scheme=_by_scheme(layers),
        )

    def _totals(self) -> Totals:
        return Totals(file_bytes=self.file_bytes, header_bytes=self.header_bytes, tensor_bytes=self.tensor_bytes,
                      parameters=self.parameters,
                      bits_per_parameter=self.file_bytes * 8 / self.parameters if self.parameters else None)

    def _explanation(self) -> Explanation:
        expected_bits = self.rule_bits_per_weight * self.parameters
        lines = [ExplanationLine(cause=gap.cause, bytes=_figure(gap.bits / 8), detail=gap.detail,
                                 bits_per_parameter=_figure(gap.bits / self.parameters) if self.parameters else None)
                 for gap in self.explanation]
        return Explanation(
            expected_bytes=_figure(expected_bits / 8),
            measured_bytes=self.file_bytes,
            gap_bytes=_figure((self.file_bytes * 8 - expected_bits) / 8),
            lines=lines,
            unexplained_bytes=_figure(self.unexplained_bits / 8),
        )

    def record(self) -> MeasurementRecord:
        """The measurement as written and read (docs/measure-and-bounds.md, "measure JSON")."""
        # summed from int 0, as it always was: with no storage line the figure is a float, with
        # one an exact fraction (an int when whole); the record keeps writing it the same way
        storage_bits = sum(gap.bits for gap in self.explanation if gap.cause.is_storage)
        exact_model_bits = self.file_bytes * 8 - storage_bits
        return MeasurementRecord(
            checkpoint=self.checkpoint,
            index=self.index,
            files=list(self.files),
            format=self.format,
            totals=self._totals(),
            categories=dict(self.categories),
            blocks=list(self.blocks),
            outside_blocks=self.outside_blocks,
            linear_layers=[layer.record() for layer in self.linear_layers],
            quantized_linear=self.quantized_summary(),
            whole_model=WholeModel(bits_per_parameter=ModelBitsPerParameter(
                measured=self.file_bytes * 8 / self.parameters if self.parameters else None,
                exact=as_number(exact_model_bits / self.parameters) if self.parameters else None,
                rule=_figure(self.rule_bits_per_weight),
            )),
            rule=Rule(bits_per_weight=_figure(self.rule_bits_per_weight), group_size=RULE_GROUP_SIZE, source=self.rule_source),
            baseline_dtype=BaselineDtype(dtype=self.baseline_dtype, source=self.baseline_dtype_source),
            explanation=self._explanation(),
            baseline=self.baseline,
            notes=list(self.notes),
            wall_seconds=self.wall_seconds,
        )

    def to_json(self) -> dict[str, Any]:
        """The record's JSON (`quantgate measure --json`)."""
        return self.record().to_json()
