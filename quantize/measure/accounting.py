"""Stage 3a: byte accounting of a checkpoint from its safetensors headers alone: which format
it is, where every byte goes, bits per weight per layer, and why the total is not the rule.

`account` is pure over parsed headers and config dicts; `measure` is the glue that reads them.
The layouts are data (`layouts`), the explanation one function per cause (`explain`).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from rich.table import Table

from quantgate.core.headers import DTYPE_BITS, FLOATING_DTYPES, CheckpointFiles, TensorEntry, read_checkpoint
from quantgate.core.hf_config import ModelConfig
from quantgate.quantize.measure.causes import Cause
from quantgate.quantize.measure.explain import Placement, explain
from quantgate.quantize.measure.layouts import (
    NOMINAL_SCALE_BITS,
    QUANTIZED_WEIGHT_DTYPES,
    Layout,
    Roles,
    Scheme,
    ceil_div,
    checked_layout,
    expected_bytes,
    family_of,
    layouts_agree,
    number_kind,
    recognise_scheme,
)
from quantgate.quantize.measure.measurement import Gap, LinearLayer, Measurement, rule_bits
from quantgate.quantize.measure.names import (
    QUANTIZATION_ROLES,
    ROLE_CATEGORY,
    Category,
    block_index,
    is_embedding,
    is_lm_head,
    is_norm,
    short_name,
    tensor_role,
)
from quantgate.quantize.measure.record import (
    BaselineComparison,
    BlockBytes,
    CategoryTotals,
    DetectedFormat,
    Explanation,
    FileEntry,
    InputActivations,
    MeasurementRecord,
    QuantizedLinear,
    WeightSchemes,
)
from quantgate.quantize.measure.schemes import KNOWN_METHODS, ConfigSchemes

CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "half": "F16", "float": "F32", "float64": "F64"}
UNEXPLAINED_TEXT = "bytes no line above accounts for (a bug in measure: please report it)"


# --- quantized linear layers: scheme, geometry, gaps -----------------------------------------

def _is_quantized(roles: Roles) -> bool:
    weight = roles.get("weight")
    return "packed_weight" in roles or (weight is not None and ("weight_scale" in roles or weight.dtype in QUANTIZED_WEIGHT_DTYPES))


def _scheme_of(module: str, roles: Roles, schemes: ConfigSchemes) -> tuple[Scheme, list[str]]:
    """The config's scheme for a quantized layer if its tensors agree, else what they show; and notes."""
    configured = schemes.configured(module)
    inferred = recognise_scheme(roles, schemes.method)
    scheme = configured if configured is not None and layouts_agree(configured.layout, inferred.layout) else inferred
    notes = []
    if configured is None and schemes.qc is not None:
        notes.append("quantized, but the quantization config names no scheme for this layer; scheme read from its tensors")
    elif configured is not None and scheme is inferred:
        notes.append(f"the config describes {configured.layout}, the tensors look like {inferred.layout}")
    return scheme, notes


def _observed_group_size(in_features: int, groups: int, configured: int | None) -> int | None:
    if groups <= 0:
        return configured
    if configured and ceil_div(in_features, configured) == groups:
        return configured
    if in_features % groups == 0:
        return in_features // groups
    return ceil_div(in_features, groups)


def _quantized_layer(module: str, roles: Roles, schemes: ConfigSchemes) -> LinearLayer:
    scheme, notes = _scheme_of(module, roles, schemes)
    layout = checked_layout(scheme.layout)
    geometry = layout.geometry(scheme, roles) if layout is not None else None
    if layout is None or geometry is None or not geometry[0] or not geometry[1]:
        return _unchecked_layer(module, roles, scheme, notes)
    in_features, out_features, groups = geometry
    group_size = None
    if scheme.strategy == "group":
        group_size = _observed_group_size(in_features, groups, scheme.group_size)
        if scheme.group_size and group_size != scheme.group_size:
            notes.append(f"config says group size {scheme.group_size}, the scales say {group_size}")
        scheme = replace(scheme, group_size=group_size)
    return _checked_layer(module, roles, scheme, layout=layout, geometry=(in_features, out_features, groups), notes=notes)


def _checked_layer(module: str, roles: Roles, scheme: Scheme, *, layout: Layout, geometry: tuple[int, int, int],
                   notes: list[str]) -> LinearLayer:
    in_features, out_features, groups = geometry
    parameters = in_features * out_features
    expected = expected_bytes(scheme, in_features, out_features, groups if scheme.strategy == "group" else 1)
    return LinearLayer(
        name=module, block=block_index(module), quantized=True, layout=scheme.layout, bits=scheme.bits,
        group_size=scheme.group_size if scheme.strategy == "group" else None, symmetric=scheme.symmetric, strategy=scheme.strategy,
        in_features=in_features, out_features=out_features, parameters=parameters,
        bytes_by_role={role: entry.nbytes for role, entry in roles.items() if role != "bias"},
        exact_bits=Fraction(sum(expected.values()) * 8),
        nominal_bits=layout.nominal_bits(scheme, parameters, scheme.group_size if scheme.strategy == "group" else None),
        gaps=_layer_gaps(module, roles, expected, scheme), notes=notes,
        storage_bits=layout.storage_bits(scheme), zero_point_bits=scheme.zero_point_bits if scheme.strategy == "group" else 0,
    )


def _unchecked_layer(module: str, roles: Roles, scheme: Scheme, notes: list[str]) -> LinearLayer:
    """A quantized layer in a layout measure does not check: bytes counted, no exact figure."""
    some = roles.get("packed_weight") or roles.get("weight") or next(iter(roles.values()))
    weight = roles.get("weight")
    out_features, in_features = weight.shape if weight is not None and len(weight.shape) == 2 else (0, 0)
    return LinearLayer(
        name=module, block=block_index(module), quantized=True, layout=scheme.layout, bits=None, group_size=None,
        symmetric=None, strategy=None, in_features=in_features, out_features=out_features, parameters=in_features * out_features,
        bytes_by_role={role: entry.nbytes for role, entry in roles.items() if role != "bias"}, exact_bits=None, nominal_bits=None,
        notes=[*notes, f"layout {scheme.layout!r} not one measure checks ({some.name} {some.dtype} {list(some.shape)}); "
                       "bytes counted, no exact figure"],
    )


def _layer_gaps(module: str, roles: Roles, expected: dict[str, int], scheme: Scheme) -> list[Gap]:
    """Measured minus exact, by role: each difference named by its cause."""
    gaps: list[Gap] = []
    for role in sorted(set(expected) | {role for role in roles if role != "bias"}):
        stored, want = roles.get(role), expected.get(role)
        if want is None:
            if stored is not None:
                gaps.append(Gap(Cause.unaccounted_tensors, Fraction(stored.nbytes * 8),
                                f"{stored.name} ({stored.dtype} {list(stored.shape)}) is not part of the {scheme.layout} format", role))
            continue
        if stored is None:
            gaps.append(Gap(Cause.missing_tensors, Fraction(-want * 8),
                            f"the {scheme.layout} format stores a {role} for {short_name(module)}; the checkpoint does not", role))
            continue
        difference = stored.nbytes - want
        if difference and role in ("weight_scale", "activation_scale") and stored.bits > NOMINAL_SCALE_BITS:
            wide = stored.numel * (stored.bits - NOMINAL_SCALE_BITS) // 8
            gaps.append(Gap(Cause.wide_scales, Fraction(wide * 8),
                            f"{stored.name} is {stored.dtype}, {stored.bits} bits a scale where the format's figure assumes 16", role))
            difference -= wide
        if difference:
            gaps.append(Gap(Cause.unaccounted_tensors, Fraction(difference * 8),
                            f"{stored.name} ({stored.dtype} {list(stored.shape)}) is {stored.nbytes} bytes, the format implies {want}", role))
    return gaps


# --- every tensor to a category ----------------------------------------------------------------

@dataclass
class _Placed:
    """Where the tensors went, built module by module."""

    tie: bool | None
    embeddings_stored: bool
    assigned: dict[str, tuple[Category, int]] = field(default_factory=dict)  # tensor -> (category, parameters)
    layers: list[LinearLayer] = field(default_factory=list)
    in_quantized_layers: set[str] = field(default_factory=set)
    tied_duplicates: list[TensorEntry] = field(default_factory=list)

    def placement(self) -> Placement:
        return Placement(self.assigned, frozenset(self.in_quantized_layers), tuple(self.tied_duplicates))

    def quantized(self, roles: Roles, layer: LinearLayer) -> None:
        self.layers.append(layer)
        # the packed weight carries the layer's parameters; a plain `weight` beside it is a stray
        weight_role = "packed_weight" if "packed_weight" in roles else "weight"
        for role, entry in roles.items():
            if role != "bias":  # a bias stays unquantized: explained with the other unquantized tensors
                self.in_quantized_layers.add(entry.name)
            if role == weight_role:
                self.assigned[entry.name] = (Category.quantized_weights, layer.parameters)
            elif role == "weight":
                self.assigned[entry.name] = (Category.other, 0)
            else:
                self.assigned[entry.name] = (ROLE_CATEGORY.get(role, Category.other), entry.numel if role == "bias" else 0)

    def plain(self, module: str, roles: Roles) -> None:
        for role, entry in roles.items():
            if role in QUANTIZATION_ROLES:
                self.assigned[entry.name] = (ROLE_CATEGORY[role], 0)
                continue
            category = _plain_category(module, role, entry)
            parameters = entry.numel
            if category is Category.lm_head and self.tie and self.embeddings_stored:
                self.tied_duplicates.append(entry)
                parameters = 0  # a copy of the embedding: bytes, not parameters
            self.assigned[entry.name] = (category, parameters)
        weight = roles.get("weight")
        if weight is not None and len(weight.shape) == 2 and not is_embedding(module) and not is_norm(module):
            out_features, in_features = weight.shape
            self.layers.append(LinearLayer(
                name=module, block=block_index(module), quantized=False, layout="unquantized", bits=weight.bits, group_size=None,
                symmetric=None, strategy=None, in_features=in_features, out_features=out_features, parameters=weight.numel,
                bytes_by_role={role: entry.nbytes for role, entry in roles.items()}, exact_bits=None, nominal_bits=None,
            ))


def _plain_category(module: str, role: str, entry: TensorEntry) -> Category:
    if is_embedding(module):
        return Category.embeddings
    if is_lm_head(module):
        return Category.lm_head
    if is_norm(module):
        return Category.norms
    if role == "bias":
        return Category.biases
    if role == "weight" and len(entry.shape) == 2:
        return Category.unquantized_linear
    return Category.other


def _modules(tensors: dict[str, TensorEntry]) -> tuple[dict[str, dict[str, TensorEntry]], list[TensorEntry]]:
    """Tensors by module and role; a tensor with no known role, or a second of a role, is "other"."""
    modules: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    others: list[TensorEntry] = []
    for name, entry in tensors.items():
        module, role = tensor_role(name)
        if role == "other" or role in modules[module]:
            others.append(entry)
        else:
            modules[module][role] = entry
    return modules, others


def _place(modules: dict[str, dict[str, TensorEntry]], others: list[TensorEntry], schemes: ConfigSchemes,
           tie: bool | None) -> _Placed:
    """Tensor -> (category, parameters), and the linear layers with their roles."""
    placed = _Placed(tie=tie, embeddings_stored=any(is_embedding(module) for module in modules))
    for module, roles in sorted(modules.items()):
        if _is_quantized(roles):
            placed.quantized(roles, _quantized_layer(module, roles, schemes))
        else:
            placed.plain(module, roles)
    for entry in others:
        placed.assigned[entry.name] = (Category.other, entry.numel if entry.dtype in FLOATING_DTYPES else 0)
    return placed


@dataclass
class _BlockTally:
    """One block's bytes by category, added up tensor by tensor (then written as BlockBytes)."""

    index: int | None
    bytes: dict[str, int] = field(default_factory=lambda: {category.value: 0 for category in Category})
    total_bytes: int = 0
    parameters: int = 0

    def add(self, category: Category, nbytes: int, parameters: int) -> None:
        self.bytes[category.value] += nbytes
        self.total_bytes += nbytes
        self.parameters += parameters

    def record(self) -> BlockBytes:
        return BlockBytes(index=self.index, bytes=self.bytes, total_bytes=self.total_bytes, parameters=self.parameters)


def _tally(assigned: dict[str, tuple[Category, int]], tensors: dict[str, TensorEntry]
           ) -> tuple[dict[str, CategoryTotals], list[BlockBytes], BlockBytes]:
    """(bytes, parameters and tensors by category; the same per decoder block; outside the blocks)."""
    categories = {category.value: [0, 0, 0] for category in Category}  # bytes, parameters, tensors
    blocks: dict[int, _BlockTally] = {}
    outside = _BlockTally(None)
    for name, (category, parameters) in assigned.items():
        entry = tensors[name]
        totals = categories[category.value]
        totals[0] += entry.nbytes
        totals[1] += parameters
        totals[2] += 1
        index = block_index(name)
        target = outside if index is None else blocks.setdefault(index, _BlockTally(index))
        target.add(category, entry.nbytes, parameters)
    return ({name: CategoryTotals(bytes=nbytes, parameters=parameters, tensors=count)
             for name, (nbytes, parameters, count) in categories.items()},
            [blocks[index].record() for index in sorted(blocks)], outside.record())


# --- the reference: baseline dtype and the rule ------------------------------------------------

def _baseline_dtype(baseline: Measurement | None, config: ModelConfig, tensors: dict[str, TensorEntry]) -> tuple[str | None, str]:
    """The dtype unquantized tensors should have: the baseline's, else config.json's, else
    the commonest floating dtype among the checkpoint's own unquantized tensors."""
    if baseline is not None and baseline.baseline_dtype:
        return baseline.baseline_dtype, f"the baseline at {baseline.checkpoint}"
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if isinstance(value, str) and value.replace("torch.", "") in CONFIG_DTYPES:
            return CONFIG_DTYPES[value.replace("torch.", "")], f"config.json {key}"
    counts: Counter[str] = Counter()
    for entry in tensors.values():
        if entry.dtype in ("BF16", "F16", "F32"):
            counts[entry.dtype] += entry.nbytes
    if counts:
        return counts.most_common(1)[0][0], "the commonest floating dtype in the checkpoint"
    return None, "unknown"


def _rule_for(quantized: list[LinearLayer], baseline_dtype: str | None) -> Fraction:
    if quantized:
        weights: Counter[int] = Counter()
        for layer in quantized:
            weights[layer.bits or 8] += layer.parameters
        return rule_bits(weights.most_common(1)[0][0])
    return Fraction(DTYPE_BITS[baseline_dtype]) if baseline_dtype else Fraction(16)


# --- format detection ----------------------------------------------------------------------

def _tie(config: ModelConfig) -> bool | None:
    value = config.get("tie_word_embeddings")
    return value if isinstance(value, bool) else None


def _config_dtype(config: ModelConfig) -> str | None:
    return next((str(config[key]) for key in ("torch_dtype", "dtype") if isinstance(config.get(key), str)), None)


def detect_format(quantized: list[LinearLayer], schemes: ConfigSchemes, config: ModelConfig,
                  tensors: dict[str, TensorEntry]) -> DetectedFormat:
    """The checkpoint's format: the commonest layout of its quantized layers, or its commonest dtype."""
    if not quantized:
        counts: Counter[str] = Counter()
        for entry in tensors.values():
            counts[entry.dtype] += entry.nbytes
        dtype = counts.most_common(1)[0][0] if counts else "unknown"
        source = f"{schemes.source} (quant_method {schemes.method})" if schemes.qc else "tensor dtypes (no quantization config)"
        return DetectedFormat(family="dense", layout=dtype.lower(), name=f"unquantized {dtype}", detected_from=source,
                              quant_method=schemes.method, weights=None, activations=None, tie_word_embeddings=_tie(config),
                              config_dtype=_config_dtype(config))
    layout = Counter(layer.layout for layer in quantized).most_common(1)[0][0]
    family = family_of(layout)
    bits = sorted({layer.bits for layer in quantized if layer.bits})
    groups = sorted({layer.group_size for layer in quantized if layer.group_size})
    strategies = sorted({layer.strategy for layer in quantized if layer.strategy})
    symmetric = sorted({layer.symmetric for layer in quantized if layer.symmetric is not None})
    name = f"{family} {layout} {number_kind(layout)}{'/'.join(map(str, bits))}"
    name += f" {'symmetric' if symmetric == [True] else 'asymmetric' if symmetric == [False] else 'mixed symmetry'}"
    name += f", group size {'/'.join(map(str, groups))}" if groups else f", per {'/'.join(strategies)}"
    activations = _activations(schemes)
    if activations is not None:
        name += (f", {activations.type}{activations.num_bits} "
                 f"{'dynamic' if activations.dynamic else 'static'} activations")
    detected = f"{schemes.source} (quant_method {schemes.method}) and tensor names" if schemes.qc else "tensor names (no quantization config)"
    weights = WeightSchemes(bits=bits, group_sizes=groups, strategies=strategies, symmetric=symmetric[0] if len(symmetric) == 1 else None)
    return DetectedFormat(family=family, layout=layout, name=name, detected_from=detected, quant_method=schemes.method,
                          weights=weights, activations=activations, tie_word_embeddings=_tie(config), config_dtype=_config_dtype(config))


def _activations(schemes: ConfigSchemes) -> InputActivations | None:
    """The first compressed-tensors config group's input activations, if any."""
    if schemes.method != "compressed-tensors" or not schemes.qc:
        return None
    for group in (schemes.qc.get("config_groups") or {}).values():
        stated = group.get("input_activations") if isinstance(group, dict) else None
        if isinstance(stated, dict):
            return InputActivations(num_bits=stated.get("num_bits"), type=stated.get("type"), strategy=stated.get("strategy"),
                                    dynamic=stated.get("dynamic"), symmetric=stated.get("symmetric"))
    return None


# --- the accounting --------------------------------------------------------------------------

def _notes(config: ModelConfig, schemes: ConfigSchemes, placed: _Placed, modules: dict[str, dict[str, TensorEntry]]) -> list[str]:
    notes = []
    quantized = any(layer.quantized for layer in placed.layers)
    if placed.tie and any(is_lm_head(module) for module in modules) and not placed.embeddings_stored:
        notes.append("tie_word_embeddings is true but only lm_head is stored")
    if placed.tie is None and config:
        notes.append("config.json does not say tie_word_embeddings; a stored lm_head is counted as its own parameters")
    if schemes.qc is not None and schemes.method not in KNOWN_METHODS:
        notes.append(f"quant_method {schemes.method!r} is not one measure knows; layouts were read from tensor names")
    if schemes.qc is not None and not quantized:
        notes.append(f"{schemes.source} says quant_method {schemes.method!r}, but no layer is stored in a quantized layout measure recognises")
    return notes


def account(checkpoint: CheckpointFiles, baseline: Measurement | None = None) -> Measurement:
    """Every byte of `checkpoint` by category, per block and per linear layer; bits per weight
    against the format's exact figure and the rule; the gap explained line by line."""
    config = checkpoint.config or {}
    schemes = ConfigSchemes.of(checkpoint.config, checkpoint.quantize_config)
    tensors = checkpoint.tensors
    modules, others = _modules(tensors)
    placed = _place(modules, others, schemes, _tie(config))
    baseline_dtype, baseline_source = _baseline_dtype(baseline, config, tensors)
    categories, blocks, outside = _tally(placed.assigned, tensors)
    parameters = sum(value.parameters for value in categories.values())
    file_bytes = sum(file.file_bytes for file in checkpoint.files)
    header_bytes = sum(file.header_bytes for file in checkpoint.files)
    quantized = [layer for layer in placed.layers if layer.quantized]
    rule = _rule_for(quantized, baseline_dtype)
    explanation = explain(quantized, placed.placement(), tensors, rule=rule, baseline_dtype=baseline_dtype, header_bytes=header_bytes)
    unexplained = Fraction(file_bytes * 8) - rule * parameters - sum((gap.bits for gap in explanation), Fraction(0))
    if unexplained:
        explanation.append(Gap(Cause.unexplained, unexplained, UNEXPLAINED_TEXT))
    measurement = Measurement(
        checkpoint=str(checkpoint.root),
        files=[FileEntry(name=file.path.name, bytes=file.file_bytes, header_bytes=file.header_bytes, tensors=len(file.tensors))
               for file in checkpoint.files],
        index=checkpoint.index.name if checkpoint.index else None,
        format=detect_format(quantized, schemes, config, tensors),
        file_bytes=file_bytes, header_bytes=header_bytes, parameters=parameters,
        categories=categories, blocks=blocks, outside_blocks=outside, linear_layers=placed.layers,
        rule_bits_per_weight=rule, baseline_dtype=baseline_dtype, baseline_dtype_source=baseline_source,
        explanation=explanation, unexplained_bits=unexplained, notes=_notes(config, schemes, placed, modules),
    )
    if baseline is not None:
        measurement.baseline = compare_to_baseline(measurement, baseline)
    return measurement


def compare_to_baseline(measurement: Measurement, baseline: Measurement) -> BaselineComparison:
    """Bytes against the baseline's: the whole checkpoint, and the linear layers alone."""
    linear, baseline_linear = measurement.linear_bytes, baseline.linear_bytes
    result = BaselineComparison(
        checkpoint=baseline.checkpoint,
        dtype=baseline.baseline_dtype,
        file_bytes=baseline.file_bytes,
        tensor_bytes=baseline.tensor_bytes,
        parameters=baseline.parameters,
        linear_bytes=baseline_linear,
        checkpoint_linear_bytes=linear,
        ratio_total=measurement.file_bytes / baseline.file_bytes if baseline.file_bytes else None,
        ratio_linear=linear / baseline_linear if baseline_linear else None,
        parameters_match=baseline.parameters == measurement.parameters,
    )
    if not result.parameters_match:
        measurement.notes.append(f"the baseline has {baseline.parameters:,} parameters, this checkpoint {measurement.parameters:,}")
    return result


def measure(checkpoint: str | Path, baseline: str | Path | None = None) -> Measurement:
    """Read the headers of `checkpoint` (and `baseline`) and account for every byte.

    Reads the 8-byte length and the JSON header of each safetensors file plus config.json,
    never tensor data, so any size is measured in milliseconds.
    """
    started = time.perf_counter()
    base = account(read_checkpoint(Path(baseline))) if baseline is not None else None
    measurement = account(read_checkpoint(Path(checkpoint)), base)
    measurement.wall_seconds = round(time.perf_counter() - started, 6)
    return measurement


# --- presentation (rich), kept apart from the math ------------------------------------------

def render(measurement: Measurement) -> list[Any]:
    """Rich renderables for the terminal: format, categories, layers by scheme, the gap."""
    data = measurement.record()
    totals = data.totals
    out: list[Any] = [f"[bold]{data.checkpoint}[/]: {data.format.name}",
                      f"  detected from {data.format.detected_from}",
                      f"  {len(data.files)} file(s), {totals.file_bytes:,} bytes, {totals.parameters:,} parameters, "
                      f"{_fmt(totals.bits_per_parameter)} bits/parameter",
                      _categories_table(data)]
    summary = data.quantized_linear
    if summary.layers:
        out.append(_schemes_table(summary))
        out.append(f"  rule: {_fmt(summary.bits_per_weight.rule)} bits/weight ({data.rule.source})")
    figures = data.whole_model.bits_per_parameter
    out.append(f"  whole model: {_fmt(figures.measured)} bits/parameter measured, {_fmt(figures.exact)} as the format implies, "
               f"{_fmt(figures.rule)} by the rule")
    out.append(_gap_table(data.explanation, totals.file_bytes or 1))
    if data.baseline:
        base = data.baseline
        out.append(f"  against the baseline ({base.dtype}, {base.file_bytes:,} bytes): {base.ratio_total:.4f} of its bytes in all, "
                   f"{base.ratio_linear:.4f} for the linear layers alone")
    for note in data.notes:
        out.append(f"  note: {note}")
    return out


def _categories_table(data: MeasurementRecord) -> Table:
    totals = data.totals
    table = Table(title="bytes by category", title_justify="left")
    for column in ("category", "bytes", "share", "parameters", "tensors"):
        table.add_column(column, justify="left" if column == "category" else "right")
    total = totals.file_bytes or 1
    for name, value in data.categories.items():
        if value.bytes or value.tensors:
            cells = (name, f"{value.bytes:,}", f"{value.bytes / total:.2%}", f"{value.parameters:,}", str(value.tensors))
            table.add_row(*cells)
    table.add_row("header", f"{totals.header_bytes:,}", f"{totals.header_bytes / total:.2%}", "", str(len(data.files)))
    table.add_row("[bold]total[/]", f"[bold]{total:,}[/]", "100%", f"{totals.parameters:,}", "")
    return table


def _schemes_table(summary: QuantizedLinear) -> Table:
    table = Table(title="quantized linear layers (bits per weight)", title_justify="left")
    for column in ("scheme", "layers", "weights", "measured", "exact (format)", "nominal"):
        table.add_column(column, justify="left" if column == "scheme" else "right")
    for key, entry in summary.by_scheme.items():
        cells = (key, str(entry.layers), f"{entry.parameters:,}", _fmt(entry.bits_per_weight),
                 _fmt(entry.exact_bits_per_weight), _fmt(entry.nominal_bits_per_weight))
        table.add_row(*cells)
    bpw = summary.bits_per_weight
    cells = ("[bold]all (weighted mean)[/]", str(summary.layers), f"{summary.parameters:,}", _fmt(bpw.measured),
             _fmt(bpw.exact), _fmt(bpw.format_at_g128) + " at g128")
    table.add_row(*cells)
    return table


def _gap_table(explanation: Explanation, total: int) -> Table:
    table = Table(title=f"why {total:,} bytes, not the rule's {explanation.expected_bytes:,.0f}", title_justify="left")
    for column in ("cause", "bytes", "bits/param", "detail"):
        table.add_column(column, justify="right" if column in ("bytes", "bits/param") else "left", overflow="fold")
    for line in explanation.lines:
        per_parameter = f"{line.bits_per_parameter:+.4f}" if line.bits_per_parameter is not None else ""
        table.add_row(line.cause.value, f"{line.bytes:+,.1f}", per_parameter, line.detail)
    table.add_row("[bold]gap[/]", f"[bold]{explanation.gap_bytes:+,.1f}[/]", "", "")
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
