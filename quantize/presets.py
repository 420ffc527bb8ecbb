"""The formats quantgate exists for, as the quantize stage reads them: the registry of
quantgate.core.formats (one entry a format), under the names this package has always used."""

from __future__ import annotations

from quantgate.core.formats import FORMATS, Algorithm, Format, Observer, get_format

Preset = Format
PRESETS: dict[str, Format] = FORMATS
get_preset = get_format

__all__ = ["PRESETS", "Algorithm", "Observer", "Preset", "get_preset"]
