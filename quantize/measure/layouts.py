"""Storage layouts of quantized linear layers as data: one class per layout, which knows the
bytes it stores for a layer, the layer's geometry from its tensors, and how to recognise itself.

The layouts and their tensors are those of docs/sources.md ("Checkpoint layouts"). The
accounting iterates over `LAYOUTS`; nothing else branches on a layout's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from quantgate.core.headers import TensorEntry

Roles = Mapping[str, TensorEntry]  # a layer's tensors by role (names.SUFFIX_ROLES)

# The formats' figures assume 16-bit scales (docs/sources.md, "Bits per weight on disk").
NOMINAL_SCALE_BITS = 16
QUANTIZED_WEIGHT_DTYPES = frozenset({"I8", "U8", "F8_E4M3", "F8_E5M2", "F4"})
UNKNOWN = "unknown"  # the layout of a quantized layer no layout recognises


@dataclass(frozen=True)
class Scheme:
    """How a linear layer's weights are quantized, as its format describes them."""

    layout: str  # a name in LAYOUTS, another name a config gave (not checked), or "unknown"
    bits: int
    type: str = "int"  # int | float
    symmetric: bool = True
    strategy: str = "group"  # group | channel | tensor | block
    group_size: int | None = None
    block: tuple[int, int] | None = None
    g_idx: bool = False  # the format stores g_idx for this layer
    static_input: bool = False  # static activation scales are stored (input_scale)
    zero_point_bits: int = 0  # bits per stored zero point (0: none)
    source: str = ""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def packed_words_bytes(values: int, bits: int) -> int:
    """Bytes of `values` bits-wide integers packed into int32 words."""
    return ceil_div(values * bits, 32) * 4


def scale_count(scheme: Scheme, in_features: int, out_features: int, groups: int) -> int:
    if scheme.strategy == "group":
        return out_features * groups
    if scheme.strategy == "channel":
        return out_features
    if scheme.strategy == "block" and scheme.block:
        return ceil_div(out_features, scheme.block[0]) * ceil_div(in_features, scheme.block[1])
    return 1  # per tensor: one scalar


def _matrix(entry: TensorEntry | None) -> TensorEntry | None:
    """`entry` if it is a 2-D tensor."""
    return entry if entry is not None and len(entry.shape) == 2 else None


class Layout:
    """One storage layout. Subclasses say what differs; the base holds what they share."""

    name: ClassVar[str]
    family: ClassVar[str]  # compressed-tensors | gptq | awq
    # Layouts whose tensors carry the same names: a config naming one of them agrees with
    # tensors that look like another (int-/float-quantized and naive; GPTQ and AWQ's qweight).
    tensor_names: ClassVar[str]
    checks_bytes: ClassVar[bool] = True  # measure knows what this layout stores
    number_kind: ClassVar[str] = "INT"
    container_bits: ClassVar[int | None] = None  # bits a weight takes in its container; None: its own bits
    packs_zero_points: ClassVar[bool] = False  # zero points packed into int32 like the weights
    scales_by_row: ClassVar[bool] = False  # scales [groups, out] (GPTQ, AWQ), not [out, groups]

    def recognise(self, roles: Roles, method: str | None) -> Scheme | None:
        """The scheme a layer's tensor names and shapes alone show, if they are this layout's."""
        return None

    def stored(self, scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int) -> dict[str, int]:
        """The bytes this layout stores for one linear layer, by role."""
        raise NotImplementedError(self.name)

    def packed_features(self, bits: int, roles: Roles) -> tuple[int, int] | None:
        """(in_features, out_features) from a packed weight; None: read them from `weight`."""
        return None

    def geometry(self, scheme: Scheme, roles: Roles) -> tuple[int, int, int] | None:
        """(in_features, out_features, groups) recovered from the shapes of a quantized layer."""
        if not 1 <= scheme.bits <= 32:
            return None
        features = self.packed_features(scheme.bits, roles)
        if features is None:
            weight = _matrix(roles.get("weight"))
            if weight is None:
                return None
            features = (weight.shape[1], weight.shape[0])
        return features[0], features[1], self.groups(roles.get("weight_scale"))

    def groups(self, scale: TensorEntry | None) -> int:
        if scale is None or not scale.shape:
            return 1
        if self.scales_by_row:
            return scale.shape[0]
        return scale.shape[1] if len(scale.shape) == 2 else 1

    def storage_bits(self, scheme: Scheme) -> int:
        return self.container_bits if self.container_bits is not None else scheme.bits

    def nominal_bits(self, scheme: Scheme, parameters: int, group_size: int | None) -> Fraction:
        """b*N + (16 + zero-point bits)*N/g: the format's figure without per-layer constants
        (docs/sources.md, "Bits per weight on disk"). Non-grouped strategies: b*N."""
        bits = Fraction(self.storage_bits(scheme))
        if scheme.strategy == "group" and group_size:
            bits += Fraction(NOMINAL_SCALE_BITS + scheme.zero_point_bits, group_size)
        return bits * parameters


class PackQuantized(Layout):
    """compressed-tensors pack-quantized: weight_packed I32 [out, in*b/32], weight_scale
    [out, groups], weight_zero_point I32 [ceil(out*b/32), groups] if asymmetric,
    weight_shape I64[2] (16 B), weight_g_idx I32 [in] with group activation order."""

    name = "pack-quantized"
    family = "compressed-tensors"
    tensor_names = "weight_packed"
    packs_zero_points = True

    def recognise(self, roles: Roles, method: str | None) -> Scheme | None:
        packed, scale = roles.get("packed_weight"), roles.get("weight_scale")
        if packed is None or not packed.name.endswith(".weight_packed"):
            return None
        asymmetric = "weight_zero_point" in roles
        return Scheme(layout=self.name, bits=4, symmetric=not asymmetric,
                      strategy="group" if scale is not None and len(scale.shape) == 2 and scale.shape[1] > 1 else "channel",
                      g_idx="g_idx" in roles, zero_point_bits=4 if asymmetric else 0, source="tensor names (4 bits assumed)")

    def stored(self, scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int) -> dict[str, int]:
        count = scale_count(scheme, in_features, out_features, groups)
        stored = {"packed_weight": out_features * packed_words_bytes(in_features, scheme.bits), "weight_scale": count * scale_bytes}
        if not scheme.symmetric:
            rows = count // out_features if out_features and count >= out_features else 1
            stored["weight_zero_point"] = packed_words_bytes(out_features, scheme.bits) * rows
        stored["weight_shape"] = 16
        if scheme.g_idx:
            stored["g_idx"] = in_features * 4
        return stored

    def packed_features(self, bits: int, roles: Roles) -> tuple[int, int] | None:
        packed = _matrix(roles.get("packed_weight"))
        return (packed.shape[1] * 32 // bits, packed.shape[0]) if packed is not None else None  # 32/b weights per int32


class _WeightAndScale(Layout):
    """compressed-tensors int-/float-/naive-quantized: weight [out, in], weight_scale [out,
    groups] ([out, 1] per channel, [1] per tensor), zero points if asymmetric, g_idx."""

    family = "compressed-tensors"
    tensor_names = "weight"
    floating: ClassVar[bool | None] = None  # the weight dtype it recognises: float, int, or none (naive)

    def weight_bytes(self, scale_bytes: int) -> int:
        return 1  # one weight a byte (I8, F8_E4M3) whatever num_bits says

    def recognise(self, roles: Roles, method: str | None) -> Scheme | None:
        weight, scale = roles.get("weight"), roles.get("weight_scale")
        if weight is None or weight.dtype not in QUANTIZED_WEIGHT_DTYPES or weight.dtype.startswith("F") is not self.floating:
            return None
        asymmetric = "weight_zero_point" in roles
        per_tensor = scale is None or scale.numel == 1
        return Scheme(layout=self.name, bits=8, type="float" if self.floating else "int", symmetric=not asymmetric,
                      strategy="tensor" if per_tensor else "channel", static_input="activation_scale" in roles,
                      zero_point_bits=8 if asymmetric else 0, source="tensor names")

    def stored(self, scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int) -> dict[str, int]:
        count = scale_count(scheme, in_features, out_features, groups)
        stored = {"weight": in_features * out_features * self.weight_bytes(scale_bytes), "weight_scale": count * scale_bytes}
        if not scheme.symmetric:
            stored["weight_zero_point"] = count * scheme.zero_point_bits // 8
        if scheme.g_idx:
            stored["g_idx"] = in_features * 4
        return stored


class IntQuantized(_WeightAndScale):
    name = "int-quantized"
    container_bits = 8
    floating = False


class FloatQuantized(_WeightAndScale):
    name = "float-quantized"
    number_kind = "FP"
    container_bits = 8
    floating = True


class NaiveQuantized(_WeightAndScale):
    """Quantized values kept in the model's dtype: named by a config, never recognised."""

    name = "naive-quantized"

    def weight_bytes(self, scale_bytes: int) -> int:
        return scale_bytes

    def recognise(self, roles: Roles, method: str | None) -> Scheme | None:
        return None


def _packed_and_scale(roles: Roles) -> tuple[TensorEntry, TensorEntry] | None:
    packed, scale = _matrix(roles.get("packed_weight")), _matrix(roles.get("weight_scale"))
    return (packed, scale) if packed is not None and scale is not None else None


def _looks_gptq(packed: TensorEntry, scale: TensorEntry, roles: Roles, method: str | None) -> bool:
    # GPTQ packs along the input ([in*b/32, out], as wide as its scales); AWQ along the output
    return "g_idx" in roles or packed.shape[1] == scale.shape[1] or method == "gptq"


class _QWeight(Layout):
    """qweight, qzeros I32 [groups, out*b/32] and scales F16 [groups, out]: GPTQ and AWQ."""

    tensor_names = "qweight"
    scales_by_row = True

    def _zeros_and_scales(self, scheme: Scheme, out_features: int, groups: int) -> dict[str, int]:
        return {"weight_zero_point": groups * packed_words_bytes(out_features, scheme.bits),
                "weight_scale": groups * out_features * 2}  # F16 by the format


class Gptq(_QWeight):
    """AutoGPTQ / GPTQModel: qweight I32 [in*b/32, out], g_idx I32 [in]; v1 stores zero - 1,
    so symmetric models carry zero points too."""

    name = "gptq"
    family = "gptq"

    def recognise(self, roles: Roles, method: str | None) -> Scheme | None:
        pair = _packed_and_scale(roles)
        if pair is None or not _looks_gptq(*pair, roles, method):
            return None
        packed, g_idx = pair[0], roles.get("g_idx")
        bits = 32 * packed.shape[0] // g_idx.shape[0] if g_idx is not None and g_idx.shape and g_idx.shape[0] else 4
        return Scheme(layout=self.name, bits=bits, g_idx=True, zero_point_bits=bits, source="tensor names (GPTQ layout)")

    def stored(self, scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int) -> dict[str, int]:
        zeros_and_scales = self._zeros_and_scales(scheme, out_features, groups)
        return {"packed_weight": packed_words_bytes(in_features, scheme.bits) * out_features, **zeros_and_scales,
                "g_idx": in_features * 4}

    def packed_features(self, bits: int, roles: Roles) -> tuple[int, int] | None:
        packed = _matrix(roles.get("packed_weight"))
        if packed is None:
            return None
        g_idx = roles.get("g_idx")
        in_features = g_idx.shape[0] if g_idx is not None and len(g_idx.shape) == 1 else packed.shape[0] * 32 // bits
        return in_features, packed.shape[1]


class AwqGemm(_QWeight):
    """AutoAWQ GEMM: qweight I32 [in, out*b/32] (packed along the output), no g_idx."""

    name = "awq-gemm"
    family = "awq"

    def recognise(self, roles: Roles, method: str | None) -> Scheme | None:
        pair = _packed_and_scale(roles)
        if pair is None or _looks_gptq(*pair, roles, method):
            return None
        packed, scale = pair
        bits = 32 * packed.shape[1] // scale.shape[1] if scale.shape[1] else 4
        return Scheme(layout=self.name, bits=bits, symmetric=False, zero_point_bits=bits, source="tensor names (AWQ GEMM layout)")

    def stored(self, scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int) -> dict[str, int]:
        return {"packed_weight": in_features * packed_words_bytes(out_features, scheme.bits),
                **self._zeros_and_scales(scheme, out_features, groups)}

    def packed_features(self, bits: int, roles: Roles) -> tuple[int, int] | None:
        packed = _matrix(roles.get("packed_weight"))
        if packed is None:
            return None
        scale = _matrix(roles.get("weight_scale"))
        return packed.shape[0], scale.shape[1] if scale is not None else packed.shape[1] * 32 // bits


class AwqGemv(_QWeight):
    """AutoAWQ GEMV: qweight tensors like GEMM's in another order; bytes not checked."""

    name = "awq-gemv"
    family = "awq"
    checks_bytes = False


# Recognition tries these in order; the first that recognises a layer's tensors wins.
LAYOUTS: tuple[Layout, ...] = (PackQuantized(), Gptq(), AwqGemm(), IntQuantized(), FloatQuantized(), NaiveQuantized(), AwqGemv())
_BY_NAME = {layout.name: layout for layout in LAYOUTS}


def find_layout(name: str) -> Layout | None:
    return _BY_NAME.get(name)


def checked_layout(name: str) -> Layout | None:
    """The layout called `name` if measure knows what it stores; None: bytes counted, not checked."""
    layout = _BY_NAME.get(name)
    return layout if layout is not None and layout.checks_bytes else None


def recognise_scheme(roles: Roles, method: str | None) -> Scheme:
    """A scheme from tensor names and shapes alone (no usable quantization config)."""
    for layout in LAYOUTS:
        scheme = layout.recognise(roles, method)
        if scheme is not None:
            return scheme
    return Scheme(layout=UNKNOWN, bits=8, source="tensor names (layout not recognised)")


def layouts_agree(configured: str, inferred: str) -> bool:
    """Whether tensors that look like `inferred` can be stored in the `configured` layout."""
    if inferred == UNKNOWN or configured == inferred:
        return True
    one, other = find_layout(configured), find_layout(inferred)
    return one is not None and other is not None and one.tensor_names == other.tensor_names


def family_of(name: str) -> str:
    layout = find_layout(name)
    if layout is not None:
        return layout.family
    return "awq" if name.startswith("awq") else "unknown"  # AutoAWQ's other versions: awq-<version>


def number_kind(name: str) -> str:
    """INT or FP: what the layout's weights are, for the format's name."""
    layout = find_layout(name)
    return layout.number_kind if layout is not None else "INT"


def expected_bytes(scheme: Scheme, in_features: int, out_features: int, groups: int, scale_bytes: int = 2) -> dict[str, int]:
    """What the format stores for one linear layer, by role, with `scale_bytes`-wide scales
    ({} for a layout measure does not check)."""
    layout = checked_layout(scheme.layout)
    if layout is None:
        return {}
    stored = layout.stored(scheme, in_features, out_features, groups, scale_bytes)
    if scheme.static_input:
        stored["activation_scale"] = scale_bytes  # one per-tensor input scale
    return stored
