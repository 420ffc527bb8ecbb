"""Why a checkpoint's bytes are not the rule's: file bytes minus rule x parameters, split into
lines by cause (`causes.Cause`) that sum exactly. One function per cause, then `explain`.

Every figure is in bits with exact fractions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from quantgate.core.headers import DTYPE_BITS, FLOATING_DTYPES, TensorEntry
from quantgate.quantize.measure.causes import Cause
from quantgate.quantize.measure.layouts import NOMINAL_SCALE_BITS
from quantgate.quantize.measure.measurement import RULE_GROUP_SIZE, Gap, LinearLayer
from quantgate.quantize.measure.names import QUANTIZATION_CATEGORIES, Category, short_name, tensor_role

HEADER_TEXT = "safetensors headers (8-byte length and JSON) of every file"
# What the format stores beyond its nominal figure, in the order the lines appear.
FORMAT_EXTRAS = {
    Cause.channel_scales: "per-channel or per-tensor weight scales (and zero points)",
    Cause.g_idx: "g_idx, one I32 per input column",
    Cause.shape_metadata: "weight_shape, I64[2] = 16 bytes a packed layer",
    Cause.activation_scales: "static activation (input) scales",
    Cause.partial_groups: "scales and zero points of partial groups, packing to whole int32 words",
}
STORAGE_DEPARTURES = (Cause.wide_scales, Cause.unaccounted_tensors, Cause.missing_tensors)


@dataclass(frozen=True)
class Placement:
    """Where the accounting put every tensor: what the explanation needs of it."""

    assigned: dict[str, tuple[Category, int]]  # tensor name -> (category, parameters)
    in_quantized_layers: frozenset[str]  # tensors of quantized layers, biases excepted
    tied_duplicates: tuple[TensorEntry, ...]  # an lm_head stored although tied to the embedding


@dataclass(frozen=True)
class _Outside:
    """A tensor outside every quantized layer, with its category and parameters."""

    entry: TensorEntry
    category: Category
    parameters: int

    @property
    def quantization_tensor(self) -> bool:
        return self.category in QUANTIZATION_CATEGORIES


def explain(quantized: list[LinearLayer], placement: Placement, tensors: dict[str, TensorEntry], *,
            rule: Fraction, baseline_dtype: str | None, header_bytes: int) -> list[Gap]:
    """File bytes minus the rule's (rule x parameters), split into causes that sum exactly;
    lines of 0 bits are left out, the headers' line is always there."""
    baseline_bits = Fraction(DTYPE_BITS[baseline_dtype]) if baseline_dtype else None
    outside = _outside_quantized_layers(placement, tensors)
    lines = [
        *_format_against_rule(quantized, rule),
        *_other_group_sizes(quantized),
        *_format_extras(quantized),
        *_storage_departures(quantized),
        *_unquantized(outside, rule, baseline_bits, baseline_dtype),
        *_loose_quantization_tensors(outside),
        *_wider_than_baseline(outside, baseline_bits, baseline_dtype),
        *_tied_lm_head_stored(placement.tied_duplicates),
    ]
    return [*(line for line in lines if line.bits), Gap(Cause.header, Fraction(header_bytes * 8), HEADER_TEXT)]


# --- quantized layers: the format against the rule, and what the format adds -----------------

def _format_against_rule(quantized: list[LinearLayer], rule: Fraction) -> list[Gap]:
    """Per scheme: `format_vs_rule` for the layers measure checks, `unknown_format_layers` for the rest."""
    by_scheme: dict[tuple[str, int | None, str | None, bool | None], list[LinearLayer]] = defaultdict(list)
    for layer in quantized:
        by_scheme[(layer.layout, layer.bits, layer.strategy, layer.symmetric)].append(layer)
    lines: list[Gap] = []
    for _, group in sorted(by_scheme.items(), key=lambda item: str(item[0])):
        checked = [layer for layer in group if layer.nominal_bits is not None]
        unchecked = [layer for layer in group if layer.nominal_bits is None]
        if checked:
            lines.append(_format_vs_rule(checked, rule))
        if unchecked:
            lines.append(_unknown_format_layers(unchecked, rule))
    return lines


def _at_rule_group(layer: LinearLayer) -> Fraction:
    """A checked layer's nominal bits at group size 128 (every checked layer has them)."""
    value = layer.nominal_at(RULE_GROUP_SIZE)
    if value is None:
        raise ValueError(f"{layer.name} has no nominal figure")
    return value


def _format_vs_rule(layers: list[LinearLayer], rule: Fraction) -> Gap:
    """The format's own figure at group 128 (or per channel / tensor) against the rule's estimate."""
    first = layers[0]
    at_128 = sum((_at_rule_group(layer) for layer in layers), Fraction(0))
    weights = sum(layer.parameters for layer in layers)
    where = f"at group size {RULE_GROUP_SIZE} " if first.strategy == "group" else f"per {first.strategy} "
    return Gap(Cause.format_vs_rule, at_128 - rule * weights,
               f"{len(layers)} {first.layout} {first.bits}-bit {'symmetric' if first.symmetric else 'asymmetric'} layers: "
               f"the format {where}is {float(at_128 / weights):.4g} bits/weight, the rule says {float(rule):g} ({weights:,} weights)")


def _unknown_format_layers(layers: list[LinearLayer], rule: Fraction) -> Gap:
    stored = sum(layer.bytes for layer in layers)
    return Gap(Cause.unknown_format_layers, Fraction(stored * 8) - rule * sum(layer.parameters for layer in layers),
               f"{len(layers)} quantized layers in a layout measure cannot check ({layers[0].name}, ...)")


def _other_group_sizes(quantized: list[LinearLayer]) -> list[Gap]:
    """Layers that got another group size than 128, one line per size."""
    by_size: dict[int, list[LinearLayer]] = defaultdict(list)
    for layer in quantized:
        if layer.strategy == "group" and layer.group_size and layer.group_size != RULE_GROUP_SIZE and layer.nominal_bits is not None:
            by_size[layer.group_size].append(layer)
    lines = []
    for size, group in sorted(by_size.items(), key=lambda item: item[0]):
        extra = sum(((layer.nominal_bits or 0) - _at_rule_group(layer) for layer in group), Fraction(0))
        weights = sum(layer.parameters for layer in group)
        lines.append(Gap(Cause.other_group_size, extra,
                         f"{len(group)} layers got group size {size}, not {RULE_GROUP_SIZE} ({_examples(group)}): "
                         f"{float(extra / weights):+.4g} bits/weight on {weights:,} weights"))
    return lines


def _checked(quantized: list[LinearLayer]) -> list[LinearLayer]:
    return [layer for layer in quantized if layer.exact_bits is not None and layer.nominal_bits is not None]


def _format_extras(quantized: list[LinearLayer]) -> list[Gap]:
    """What the format stores beyond its nominal figure: channel scales, g_idx, weight_shape,
    activation scales, partial groups."""
    extras: dict[Cause, Fraction] = defaultdict(Fraction)
    for layer in _checked(quantized):
        for cause, bits in _extras_by_role(layer).items():
            extras[cause] += bits
        residual = Fraction(layer.bytes * 8) - (layer.exact_bits or 0) - sum((gap.bits for gap in layer.gaps), Fraction(0))
        if residual:  # cannot happen: the layer's gaps are measured minus exact by role
            extras[Cause.partial_groups] += residual
    return [Gap(cause, extras[cause], text) for cause, text in FORMAT_EXTRAS.items() if extras.get(cause)]


def _extras_by_role(layer: LinearLayer) -> dict[Cause, Fraction]:
    """Exact minus nominal bits of a quantized layer, split by the role that causes it. The
    nominal figure is b*N for the weights and (16 + zp)*N/g for scales and zero points (0 for
    non-grouped strategies), so the parts always sum to exact - nominal."""
    extras: dict[Cause, Fraction] = defaultdict(Fraction)
    exact = _exact_roles(layer)
    n = layer.parameters
    weight_bits = Fraction(layer.storage_bits or 8) * n
    grouped = layer.strategy == "group" and bool(layer.group_size)
    scale_nominal = Fraction(NOMINAL_SCALE_BITS * n, layer.group_size or 1) if grouped else Fraction(0)
    zero_nominal = layer.nominal_bits - weight_bits - scale_nominal if grouped and layer.nominal_bits is not None else Fraction(0)
    extras[Cause.partial_groups] += exact.pop("packed_weight", 0) + exact.pop("weight", 0) - weight_bits
    scales = exact.pop("weight_scale", 0) - scale_nominal + exact.pop("weight_zero_point", 0) - zero_nominal
    extras[Cause.partial_groups if grouped else Cause.channel_scales] += scales
    for role, bits in exact.items():
        extras[{"weight_shape": Cause.shape_metadata, "g_idx": Cause.g_idx}.get(role, Cause.activation_scales)] += bits
    return extras


def _exact_roles(layer: LinearLayer) -> dict[str, Fraction]:
    """The exact per-role bits of a quantized layer: measured minus its gaps, by role."""
    exact = {role: Fraction(nbytes * 8) for role, nbytes in layer.bytes_by_role.items()}
    for gap in layer.gaps:
        role = gap.role or "other"
        exact[role] = exact.get(role, Fraction(0)) - gap.bits
    return exact


def _storage_departures(quantized: list[LinearLayer]) -> list[Gap]:
    """The layers' own gaps (wide scales, tensors the format does not store or lacks), one line a cause."""
    storage: dict[Cause, list[Gap]] = defaultdict(list)
    for layer in _checked(quantized):
        for gap in layer.gaps:
            storage[gap.cause].append(gap)
    lines = []
    for cause in STORAGE_DEPARTURES:
        gaps = storage.get(cause)
        if gaps:
            more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
            lines.append(Gap(cause, sum((gap.bits for gap in gaps), Fraction(0)), f"{gaps[0].detail}{more}"))
    return lines


# --- tensors outside the quantized layers ---------------------------------------------------

def _outside_quantized_layers(placement: Placement, tensors: dict[str, TensorEntry]) -> list[_Outside]:
    duplicates = {entry.name for entry in placement.tied_duplicates}
    return [_Outside(tensors[name], category, parameters) for name, (category, parameters) in placement.assigned.items()
            if name not in placement.in_quantized_layers and name not in duplicates]


def _wider(entry: TensorEntry, baseline_bits: Fraction | None) -> bool:
    return baseline_bits is not None and entry.dtype in FLOATING_DTYPES and Fraction(entry.bits) > baseline_bits


def _unquantized(outside: list[_Outside], rule: Fraction, baseline_bits: Fraction | None, baseline_dtype: str | None) -> list[Gap]:
    """Unquantized tensors at the baseline's width (at most) against the rule, one line a category."""
    per_category: dict[Category, list[Fraction]] = defaultdict(lambda: [Fraction(0), Fraction(0), Fraction(0)])
    for tensor in outside:
        if tensor.quantization_tensor:
            continue
        entry = tensor.entry
        width = baseline_bits if baseline_bits is not None and _wider(entry, baseline_bits) else Fraction(entry.bits)
        totals = per_category[tensor.category]
        totals[0] += width * entry.numel - rule * tensor.parameters
        totals[1] += tensor.parameters
        totals[2] += 1
    width_text = f"stored at {baseline_dtype}" if baseline_dtype else "stored unquantized"
    lines = []
    for category, (bits, parameters, count) in sorted(per_category.items(), key=lambda item: item[0].value):
        if bits:
            lines.append(Gap(Cause[f"unquantized_{category.value}"], bits,
                             f"{category.value.replace('_', ' ')}: {int(count)} tensor{'s' if count != 1 else ''}, "
                             f"{int(parameters):,} parameters, {width_text}, not at the rule's {float(rule):g} bits"))
    return lines


def _loose_quantization_tensors(outside: list[_Outside]) -> list[Gap]:
    """Quantization tensors outside any quantized layer: KV-cache scales, or strays."""
    loose: dict[Cause, list[TensorEntry]] = defaultdict(list)
    for tensor in outside:
        if tensor.quantization_tensor:
            kv_scale = tensor_role(tensor.entry.name)[1] == "kv_scale"
            loose[Cause.kv_cache_scales if kv_scale else Cause.unaccounted_tensors].append(tensor.entry)
    lines = []
    for cause, entries in sorted(loose.items(), key=lambda item: item[0].value):
        what = ("KV-cache quantization scales (k_scale, v_scale)" if cause is Cause.kv_cache_scales
                else f"quantization tensors outside any quantized layer ({_examples(entries)})")
        lines.append(Gap(cause, Fraction(sum(entry.nbytes for entry in entries) * 8), f"{len(entries)} {what}"))
    return lines


def _wider_than_baseline(outside: list[_Outside], baseline_bits: Fraction | None, baseline_dtype: str | None) -> list[Gap]:
    """Unquantized tensors stored wider than the baseline's dtype (e.g. FP32 norms)."""
    wider = [tensor.entry for tensor in outside if not tensor.quantization_tensor and _wider(tensor.entry, baseline_bits)]
    if not wider or baseline_bits is None:
        return []
    bits = sum(((Fraction(entry.bits) - baseline_bits) * entry.numel for entry in wider), Fraction(0))
    dtypes = sorted({entry.dtype for entry in wider})
    return [Gap(Cause.wider_than_baseline, bits,
                f"{len(wider)} unquantized tensors stored as {'/'.join(dtypes)}, wider than the baseline's {baseline_dtype} "
                f"({_examples(wider)})")]


def _tied_lm_head_stored(duplicates: tuple[TensorEntry, ...]) -> list[Gap]:
    """An lm_head stored although tie_word_embeddings is true."""
    if not duplicates:
        return []
    stored = sum(entry.nbytes for entry in duplicates)
    return [Gap(Cause.tied_lm_head_stored, Fraction(stored * 8),
                f"{duplicates[0].name} is stored although tie_word_embeddings is true: a duplicate of the embedding")]


def _examples(items: Sequence[LinearLayer | TensorEntry], limit: int = 2) -> str:
    names = sorted({short_name(item.name) for item in items})
    shown = ", ".join(names[:limit])
    return shown + (", ..." if len(names) > limit else "")
