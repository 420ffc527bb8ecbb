"""Typed ids for what quantgate names in strings: a golden set version (`arc-easy@v1`) and a
gate (`arc-easy@v1 acc`, `size bits_per_weight`), parsed once instead of split where used."""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantgate.core.errors import InputError

_SET = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._-]*)(?:@v(?P<version>[1-9][0-9]{0,8}))?$")

# The scopes of the gates that are not a metric on a golden set.
SIZE = "size"
INTEGRITY = "integrity"
SERVING = "serving"  # the serving engine loads the checkpoint and computes what was gated


@dataclass(frozen=True, order=True)
class SetRef:
    """A golden set by name, with a version (`arc-easy@v1`) or without one (`arc-easy`: the
    latest, or in a policy: whichever version is evaluated)."""

    name: str
    version: int | None = None

    @classmethod
    def parse(cls, text: str) -> SetRef:
        match = _SET.match(text.strip())
        if not match:
            raise InputError(f"evalset {text!r} is not NAME or NAME@vN (e.g. arc-easy or arc-easy@v1)")
        version = match["version"]
        return cls(match["name"], int(version) if version else None)

    def matches(self, other: SetRef) -> bool:
        """Whether `other` is this set, at this version when this one names a version."""
        return self.name == other.name and (self.version is None or self.version == other.version)

    @property
    def tag(self) -> str:
        """The version as written in a manifest ('v1'); '' when none is named."""
        return "" if self.version is None else f"v{self.version}"

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@v{self.version}"


@dataclass(frozen=True)
class GateId:
    """One gate of a verdict: a metric on a golden set, or a named size, integrity or serving
    check (`scope` is then SIZE, INTEGRITY or SERVING)."""

    scope: str  # "arc-easy@v1", "size", "integrity", "serving"
    check: str  # "acc", "bits_per_weight", "loads"

    @classmethod
    def parse(cls, text: str) -> GateId:
        scope, separator, check = text.partition(" ")
        if not separator or not scope or not check:
            raise InputError(f"gate {text!r} is not 'SCOPE CHECK' (e.g. 'arc-easy@v1 acc')")
        return cls(scope, check)

    @property
    def on_golden_set(self) -> bool:
        """A metric gate (its scope a golden set), not a size, integrity or serving check."""
        return self.scope not in (SIZE, INTEGRITY, SERVING)

    @property
    def golden_set(self) -> SetRef | None:
        return SetRef.parse(self.scope) if self.on_golden_set else None

    def __str__(self) -> str:
        return f"{self.scope} {self.check}"
