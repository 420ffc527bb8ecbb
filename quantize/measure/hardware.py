"""Hardware profiles for the decode-time bounds: memory bandwidth and peak dense FLOP/s, each
with its source and whether it is a spec-sheet figure or an assumption. Built-ins are YAML
data in quantize/measure/hardware/; a user's own profile is a YAML file of the same shape."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal, TypedDict

from pydantic import Field

from quantgate.core.artifacts import read_yaml
from quantgate.core.errors import InputError, did_you_mean
from quantgate.core.validation import Strict, is_path, validated


class ProfileFigures(TypedDict):
    """What decides a bound computed on a profile (`HardwareProfile.figures`): a cache key's part."""

    name: str
    kind: Literal["spec sheet", "assumption"]
    hbm_bytes_per_second: float
    peak_dense_flops: float
    flops_dtype: str


class HardwareProfile(Strict):
    """Peak figures of one accelerator. Bounds from them are lower bounds, never predictions."""

    name: str = Field(min_length=1)
    kind: Literal["spec sheet", "assumption"]
    description: str = ""
    # finite: 1e999 in YAML is inf, and a bound of zero seconds divides by zero
    hbm_bytes_per_second: float = Field(gt=0, allow_inf_nan=False, description="peak memory bandwidth, bytes per second")
    peak_dense_flops: float = Field(gt=0, allow_inf_nan=False, description="peak dense (not sparse) FLOP/s in flops_dtype")
    flops_dtype: str = "bf16"
    source: str = Field(min_length=1, description="where the figures come from")

    def figures(self) -> ProfileFigures:
        """What decides a bound computed on this profile: every field but the prose (`description`,
        `source`), so that a cache keyed by it is not redone when only the words change."""
        return ProfileFigures(name=self.name, kind=self.kind, hbm_bytes_per_second=self.hbm_bytes_per_second,
                              peak_dense_flops=self.peak_dense_flops, flops_dtype=self.flops_dtype)


def builtin_profiles() -> dict[str, Path]:
    folder = resources.files("quantgate.quantize.measure") / "hardware"
    return {Path(str(entry)).stem: Path(str(entry)) for entry in folder.iterdir() if str(entry).endswith(".yaml")}


def load_profile(spec: str | Path) -> HardwareProfile:
    """A built-in profile by name (reference, h100-sxm, h200) or a YAML file."""
    text = str(spec)
    builtins = builtin_profiles()
    if text in builtins:
        path = builtins[text]
    else:
        path = Path(text).expanduser()
        if not is_path(str(path)) or not path.is_file():
            valid = sorted(builtins)
            shown = text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"
            raise InputError(f"unknown hardware profile {shown!r}{did_you_mean(text, valid)}; built in: {', '.join(valid)}, or a YAML file")
    data = read_yaml(path, "hardware profile")
    if not isinstance(data, dict):
        raise InputError(f"hardware profile {path}: expected a YAML mapping of hbm_bytes_per_second, peak_dense_flops, ...")
    return validated(HardwareProfile, data,
                     message=lambda problem: f"hardware profile {path}: invalid {problem.location or 'profile'}: {problem.message}")
