"""Read a safetensors header without touching tensor data: 8-byte little-endian length N,
then N bytes of JSON {name: {dtype, shape, data_offsets}} (plus optional __metadata__)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gates.errors import InputError

# A header is JSON describing tensors; even a 70B model's is a few MB. A larger claimed
# length is a damaged or hostile file, refused before anything is allocated.
MAX_HEADER_BYTES = 100 * 1024 * 1024


class HeaderError(InputError):
    """A safetensors file whose header cannot be trusted."""


def read_header(path: Path) -> dict[str, Any]:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as stream:
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise HeaderError(f"{path}: header length {length} exceeds the file ({size} bytes)")
        raw = stream.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise HeaderError(f"{path}: invalid header JSON ({type(error).__name__})") from error
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    return header


def tensor_dtypes(path: Path) -> dict[str, str]:
    return {name: entry["dtype"] for name, entry in read_header(path).items() if name != "__metadata__"}
