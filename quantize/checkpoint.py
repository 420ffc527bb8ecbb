"""What every quantize backend writes into a checkpoint besides its weights: the baseline's
tokenizer and generation files, and the manifest; the checkpoint type and its failure."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, JsonValue

from quantgate import calibration
from quantgate.core.artifacts import MANIFEST, Stopwatch, file_hashes, provenance
from quantgate.core.errors import QuantgateError
from quantgate.core.memory import Taken
from quantgate.core.models import TOKENIZER_FILES, weights_sha256
from quantgate.core.records import FileTable, Provenance, Record, RecordPart
from quantgate.quantize.config import QuantizeConfig
from quantgate.quantize.presets import Preset

KIND = "quantized-checkpoint"
RECIPE_FILE = "recipe.yaml"
MIXED = "mixed"  # the format a mixed-precision checkpoint's manifest names
# Copied byte for byte from the baseline, so the checkpoint is a whole model that lm-eval and
# vLLM open as is, and its tokenizer hash equals the baseline's.
COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")


class QuantizationFailed(QuantgateError):
    """The quantized checkpoint failed its checks (load failure, NaN/Inf logits)."""

    exit_code = 1


class Identity(RecordPart):
    """What a checkpoint says it is: its format, the backend that made it and the config
    (a QuantizeConfig's or a MixedConfig's JSON, recorded as given: nothing reads it back)."""

    format: str
    backend: str
    config: dict[str, JsonValue]


class LayerFormat(RecordPart):
    """A mixed checkpoint's layer: its format and group size (None: not grouped)."""

    format: str
    group_size: int | None


class RecipeFile(RecordPart):
    """The llmcompressor recipe the checkpoint was made with (also its recipe.yaml)."""

    file: str
    sha256: str
    text: str


class AutoAWQRecipe(RecordPart):
    """AutoAWQ's quant_config, as handed to it."""

    autoawq_quant_config: dict[str, JsonValue]


class GroupSizeFallback(RecordPart):
    """A layer that did not get the requested group size (quantize.groups.GroupPlan.fallbacks)."""

    layer: str
    in_features: int
    requested: int
    group_size: int | None
    quantized: bool


class CommonGroupSize(RecordPart):
    """AutoAWQ's one group size for every layer, where it is not the requested one."""

    layer: str  # "(all)"
    requested: int
    group_size: int
    quantized: bool
    reason: str


class GroupSizes(RecordPart):
    requested: int | None
    fallbacks: list[GroupSizeFallback | CommonGroupSize]
    unquantized_layers: list[str]


class CalibrationUsed(RecordPart):
    path: str
    fingerprint: str
    samples_used: int
    seq_len: int


class BaselineUsed(RecordPart):
    path: str
    weights_sha256: str
    dtype: str


class SmokeCheck(RecordPart):
    """The reloaded checkpoint on the fixed prompt: finite logits, and its greedy completion."""

    prompt: str
    completion: str
    logits_finite: bool


class CheckpointManifest(Record):
    """A quantized checkpoint's manifest.json, the same for every backend. `layers` and
    `smoothed` are a mixed checkpoint's, absent from a uniform one's."""

    KIND = KIND
    WHAT = "quantized checkpoint manifest"

    kind: Literal["quantized-checkpoint"] = "quantized-checkpoint"
    schema_version: Literal[1] = 1
    format: str
    description: str
    backend: str
    config: dict[str, JsonValue]
    layers: dict[str, LayerFormat] | None = Field(default=None, exclude_if=lambda value: value is None)
    smoothed: list[str] | None = Field(default=None, exclude_if=lambda value: value is None)
    recipe: RecipeFile | AutoAWQRecipe
    group_size: GroupSizes
    calibration: CalibrationUsed
    baseline: BaselineUsed
    smoke: SmokeCheck
    # where the quantization kept the model (quantgate.core.memory.Placement): "memory" or
    # "streamed" (from disk); the checkpoint is the same either way
    placement: Taken = "memory"
    files: FileTable
    provenance: Provenance


@dataclass(frozen=True)
class MixedLayers:
    """What a mixed checkpoint's manifest adds: which layer has which format, and the layer
    norms SmoothQuant scaled."""

    layers: dict[str, LayerFormat]
    smoothed: list[str]


@dataclass(frozen=True)
class QuantizedCheckpoint:
    path: Path
    manifest: CheckpointManifest


def copy_baseline_files(model_dir: Path, staging: Path) -> None:
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, staging / name)


def identity(preset: Preset, cfg: QuantizeConfig) -> Identity:
    """What a uniform checkpoint's manifest says it is: its format, backend and config."""
    return Identity(format=preset.name, backend=cfg.backend.value, config=cfg.model_dump(mode="json"))


def write_manifest(staging: Path, stopwatch: Stopwatch, *, what: Identity, description: str,
                   recipe: RecipeFile | AutoAWQRecipe, group_size: GroupSizes, calibration_set: calibration.CalibrationSet, samples_used: int,
                   model_dir: Path, dtype: str, smoke: SmokeCheck, extra: MixedLayers | None = None,
                   placement: Taken = "memory") -> CheckpointManifest:
    """The checkpoint's manifest, the same for every backend; written last, over the final files.
    `what`: format, backend and config (`identity`, or a mixed checkpoint's); `extra`: a mixed
    checkpoint's layer table."""
    manifest = CheckpointManifest(
        format=what.format,
        description=description,
        backend=what.backend,
        config=what.config,
        layers=extra.layers if extra else None,
        smoothed=extra.smoothed if extra else None,
        recipe=recipe,
        group_size=group_size,
        calibration=CalibrationUsed(
            path=str(calibration_set.path),
            fingerprint=calibration_set.fingerprint,
            samples_used=samples_used,
            seq_len=int(calibration_set.input_ids.shape[1]),
        ),
        baseline=BaselineUsed(path=str(model_dir), weights_sha256=weights_sha256(model_dir), dtype=dtype),
        smoke=smoke,
        placement=placement,
        files=file_hashes(staging),
        provenance=Provenance.model_validate(provenance(stopwatch)),
    )
    manifest.write(staging / MANIFEST)
    return manifest
