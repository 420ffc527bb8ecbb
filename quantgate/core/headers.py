"""Read safetensors headers without touching tensor data: 8-byte little-endian length N, then
N bytes of JSON {name: {dtype, shape, data_offsets}} (plus optional __metadata__).

`read_header` returns the raw JSON; `read_safetensors` also checks every entry (known dtype,
offsets inside the data section, no overlaps or gaps, sizes that match the shapes) the way
the safetensors library does, and `read_checkpoint` does so for every shard of a checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeGuard, cast

from quantgate.core.artifacts import unique_keys
from quantgate.core.errors import InputError
from quantgate.core.hf_config import ModelConfig, QuantizationConfig

if TYPE_CHECKING:
    from pydantic import JsonValue

# A header is JSON describing tensors; even a 70B model's is a few MB. A larger claimed
# length is a damaged or hostile file, refused before anything is allocated.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# config.json, quantize_config.json and the shard index are small too.
MAX_JSON_FILE_BYTES = 100 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"

# Bits per element of every dtype the safetensors format defines (safetensors/src/tensor.rs).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOATING_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"})


class HeaderError(InputError):
    """A safetensors file (or shard index) whose header cannot be trusted."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets into the data section, which starts after the header
    end: int
    file: str  # the file's name, for messages and per-file sums

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype]


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    file_bytes: int
    header_bytes: int  # the 8-byte length prefix plus the JSON header
    tensors: dict[str, TensorEntry]
    metadata: dict[str, JsonValue] = field(default_factory=dict)  # __metadata__ as written (read by no one here)


@dataclass(frozen=True)
class CheckpointFiles:
    """Everything `measure` reads from a checkpoint: headers and small JSON configs."""

    root: Path
    files: tuple[SafetensorsFile, ...]
    config: ModelConfig | None
    quantize_config: QuantizationConfig | None  # AutoGPTQ / GPTQModel quantize_config.json
    index: Path | None

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return {name: entry for file in self.files for name, entry in file.tensors.items()}


def _read_raw_header(path: Path) -> tuple[bytes, int, int]:
    """(header bytes, header length, file size), with the length checked before any read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        stream = open(path, "rb")
    except OSError as error:
        raise HeaderError(f"{path}: cannot open ({error.strerror or type(error).__name__})") from error
    with stream:
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise HeaderError(f"{path}: header length {length} exceeds the file ({size} bytes)")
        if length > MAX_HEADER_BYTES:
            raise HeaderError(f"{path}: header length {length} is over the {MAX_HEADER_BYTES} byte limit")
        # The safetensors library wants '{' first; checking it costs one byte, not `length`.
        first = stream.read(1)
        if first != b"{":
            raise HeaderError(f"{path}: invalid header JSON (does not start with '{{')")
        raw = first + stream.read(length - 1)
    return raw, length, size


def _parse_json(raw: bytes, where: Path, what: str) -> Any:
    try:
        return json.loads(raw, object_pairs_hook=unique_keys)
    except RecursionError as error:  # deep nesting: the C decoder stops at the recursion limit
        raise HeaderError(f"{where}: invalid {what} (nested too deeply)") from error
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError, duplicates, huge ints
        detail = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise HeaderError(f"{where}: invalid {what} ({detail})") from error


class HeaderEntry(TypedDict):
    """A tensor's entry in a safetensors header, as the format gives it. `read_header` checks
    none of it (`parse_entries` checks every field): a reader of the raw header checks a value
    before trusting it, or lets a damaged one fail."""

    dtype: str
    shape: list[int]
    data_offsets: list[int]  # [begin, end) in the data section


def read_header(path: Path) -> dict[str, JsonValue]:
    """The header as raw JSON: {name: HeaderEntry} and an optional __metadata__. Use
    `read_safetensors` for a header whose entries are checked."""
    path = Path(path)
    raw, _, _ = _read_raw_header(path)
    header = _parse_json(raw, path, "header JSON")
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    return header


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: JsonValue) -> TypeGuard[list[int]]:
    """A JSON array of integers (no booleans)."""
    return isinstance(value, list) and all(_is_int(item) for item in value)


def parse_entries(header: dict[str, JsonValue], data_bytes: int, where: Path) -> tuple[dict[str, TensorEntry], dict[str, JsonValue]]:
    """Check every tensor entry against the data section's size, as safetensors' own
    `Metadata::validate` does: known dtype, offsets in range, sorted offsets that neither
    overlap nor leave gaps, and byte counts equal to shape x dtype size."""
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise HeaderError(f"{where}: __metadata__ is not a JSON object")
    entries: dict[str, TensorEntry] = {}
    for name, raw in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(raw, dict):
            raise HeaderError(f"{where}: tensor {name!r} is not described by a JSON object")
        dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise HeaderError(f"{where}: tensor {name!r} has unknown dtype {str(dtype)[:40]!r}")
        if not _ints(shape) or not all(dim >= 0 for dim in shape):
            raise HeaderError(f"{where}: tensor {name!r} has an invalid shape")
        if not (_ints(offsets) and len(offsets) == 2):
            raise HeaderError(f"{where}: tensor {name!r} has invalid data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            hint = "; truncated file?" if 0 <= begin <= end and end > data_bytes else ""
            raise HeaderError(f"{where}: tensor {name!r} offsets [{begin}, {end}] are out of range (data section is {data_bytes} bytes{hint})")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != end - begin:
            raise HeaderError(f"{where}: tensor {name!r} {dtype} {shape} needs {bits / 8:g} bytes but its offsets span {end - begin}")
        entries[name] = TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end, file=where.name)
    position = 0
    for entry in sorted(entries.values(), key=lambda item: (item.begin, item.end)):
        if entry.begin < position:
            raise HeaderError(f"{where}: tensor {entry.name!r} offsets [{entry.begin}, {entry.end}] overlap another tensor")
        if entry.begin > position:
            raise HeaderError(f"{where}: bytes {position}..{entry.begin} of the data section belong to no tensor")
        position = entry.end
    if position != data_bytes:
        raise HeaderError(f"{where}: the data section has {data_bytes - position} bytes after the last tensor")
    return entries, metadata


def read_safetensors(path: Path) -> SafetensorsFile:
    """A safetensors file's checked header; reads 8 + N bytes, never tensor data."""
    path = Path(path)
    raw, length, size = _read_raw_header(path)
    header = _parse_json(raw, path, "header JSON")
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    entries, metadata = parse_entries(header, size - 8 - length, path)
    return SafetensorsFile(path, size, 8 + length, entries, metadata)


def read_json_file(path: Path, what: str) -> Any:
    """A small JSON file (config, index), size-capped, every failure one HeaderError line."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_FILE_BYTES:
            raise HeaderError(f"{path}: {what} is {size} bytes, over the {MAX_JSON_FILE_BYTES} byte limit")
        raw = path.read_bytes()
    except OSError as error:
        raise HeaderError(f"{path}: cannot read {what} ({error.strerror or type(error).__name__})") from error
    return _parse_json(raw, path, what)


# Shard names in an index are plain file names next to it: nothing that climbs out.
_SHARD_NAME = re.compile(r"^[^/\\]+\.safetensors$")


def _read_index(index: Path) -> tuple[list[str], dict[str, str]]:
    value = read_json_file(index, "shard index JSON")
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HeaderError(f"{index}: shard index has no weight_map")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.match(shard) or shard in (".", ".."):
            raise HeaderError(f"{index}: tensor {tensor!r} names an invalid shard {str(shard)[:80]!r}")
    return sorted(set(weight_map.values())), weight_map


def _weight_files(path: Path) -> tuple[Path, list[str], dict[str, str] | None, Path | None]:
    """(root, weight file names, the index's weight map, the index) of a checkpoint directory
    (one file, or the shards its index names) or of one .safetensors file."""
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            raise HeaderError(f"{path}: not a .safetensors file or a checkpoint directory")
        return path.parent, [path.name], None, None
    if not path.is_dir():
        raise InputError(f"{path}: no such checkpoint (not a directory or a .safetensors file)")
    index = path / INDEX_FILE
    if index.is_file():
        names, weight_map = _read_index(index)
        return path, names, weight_map, index
    names = sorted(child.name for child in path.glob("*.safetensors") if child.is_file())
    if not names:
        raise InputError(f"{path}: no safetensors weights (no *.safetensors, no {INDEX_FILE})")
    return path, names, None, None


def _check_shards(files: list[SafetensorsFile], weight_map: dict[str, str] | None, index: Path | None) -> None:
    """No tensor in two shards; every tensor the index names in the shard it names."""
    seen: dict[str, str] = {}
    for file in files:
        for tensor in file.tensors:
            if tensor in seen:
                raise HeaderError(f"{file.path}: tensor {tensor!r} is also in {seen[tensor]}")
            seen[tensor] = file.path.name
    if weight_map is not None:
        for tensor, shard in weight_map.items():
            if seen.get(tensor) != shard:
                raise HeaderError(f"{index}: names tensor {tensor!r} in {shard}, but {shard} has no such tensor")


def read_checkpoint(path: Path) -> CheckpointFiles:
    """Headers of every weight file of a checkpoint directory (one file, or the shards its
    index names) or of one .safetensors file, plus config.json and quantize_config.json."""
    root, names, weight_map, index = _weight_files(Path(path))
    files = []
    for name in names:
        shard = root / name
        if not shard.is_file():
            raise HeaderError(f"{index}: names shard {name}, which is missing")
        files.append(read_safetensors(shard))
    _check_shards(files, weight_map, index)
    # third-party JSON objects, their fields checked where read (quantgate.core.hf_config)
    config = cast("ModelConfig | None", _optional_json(root / "config.json", "config JSON"))
    quantize_config = cast("QuantizationConfig | None", _optional_json(root / "quantize_config.json", "quantize config JSON"))
    return CheckpointFiles(root, tuple(files), config, quantize_config, index)


def _optional_json(path: Path, what: str) -> dict[str, JsonValue] | None:
    if not path.is_file():
        return None
    value = read_json_file(path, what)
    if not isinstance(value, dict):
        raise HeaderError(f"{path}: {what} is not a JSON object")
    return value
