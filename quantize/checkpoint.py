"""What every quantize backend writes into a checkpoint besides its weights: the baseline's
tokenizer and generation files, and the manifest; the checkpoint type and its failure."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.core.artifacts import MANIFEST, Stopwatch, file_hashes, provenance, write_json
from quantgate.core.errors import QuantgateError
from quantgate.core.models import TOKENIZER_FILES, weights_sha256
from quantgate.quantize.config import QuantizeConfig

KIND = "quantized-checkpoint"
RECIPE_FILE = "recipe.yaml"
MIXED = "mixed"  # the format a mixed-precision checkpoint's manifest names
# Copied byte for byte from the baseline, so the checkpoint is a whole model that lm-eval and
# vLLM open as is, and its tokenizer hash equals the baseline's.
COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")


class QuantizationFailed(QuantgateError):
    """The quantized checkpoint failed its checks (load failure, NaN/Inf logits)."""

    exit_code = 1


@dataclass(frozen=True)
class QuantizedCheckpoint:
    path: Path
    manifest: dict[str, Any]


def copy_baseline_files(model_dir: Path, staging: Path) -> None:
    for name in COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, staging / name)


def identity(preset: Any, cfg: QuantizeConfig) -> dict[str, Any]:
    """What a uniform checkpoint's manifest says it is: its format, backend and config."""
    return {"format": preset.name, "backend": cfg.backend.value, "config": cfg.model_dump(mode="json")}


def write_manifest(staging: Path, stopwatch: Stopwatch, *, what: dict[str, Any], description: str,
                   recipe: dict[str, Any], group_size: dict[str, Any], calibration_set: Any, samples_used: int,
                   model_dir: Path, dtype: str, smoke: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's manifest, the same for every backend; written last, over the final files.
    `what`: format, backend and config (`identity`, or a mixed checkpoint's); `extra`: more keys
    (a mixed checkpoint's layer table)."""
    manifest = {
        "kind": KIND,
        "schema_version": 1,
        "format": what["format"],
        "description": description,
        "backend": what["backend"],
        "config": what["config"],
        **(extra or {}),
        "recipe": recipe,
        "group_size": group_size,
        "calibration": {
            "path": str(calibration_set.path),
            "fingerprint": calibration_set.fingerprint,
            "samples_used": samples_used,
            "seq_len": int(calibration_set.input_ids.shape[1]),
        },
        "baseline": {"path": str(model_dir), "weights_sha256": weights_sha256(model_dir), "dtype": dtype},
        "smoke": smoke,
        "files": file_hashes(staging),
        "provenance": provenance(stopwatch),
    }
    write_json(staging / MANIFEST, manifest)
    return manifest
