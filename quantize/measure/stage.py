"""The measure stage's entry for the pipeline: a checkpoint's byte accounting and the decode-step
lower bounds its stored bytes imply on each hardware profile, as one JSON-ready dict."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.bounds import BoundsConfig, compute, measured_format
from quantgate.quantize.measure.hardware import HardwareProfile
from quantgate.quantize.measure.record import MeasurementRecord

BOUND_BATCHES = (1, 32)


def measure_and_bound(checkpoint: Path, baseline: Path | None, profiles: Mapping[str, HardwareProfile],
                      batches: tuple[int, ...] = BOUND_BATCHES) -> dict[str, Any]:
    """`quantgate measure --json` of a checkpoint (under `measurement`), and the decode-step lower
    bounds its stored bytes imply at each of `batches` on each profile (under `bounds`; the
    bounds' defaults: 2048 context tokens a sequence, 16-bit KV cache). The headers are read once
    for both. Its measurement is read back with `stage_measurement`."""
    measured = measure(checkpoint, baseline)
    shape, spec = measured_format(checkpoint, measured)
    table: dict[str, dict[str, Any]] = {}
    for name, profile in profiles.items():
        cfg = BoundsConfig(hardware=profile, model=shape, formats=(spec,))
        entry: dict[str, Any] = {}
        for batch in batches:
            step = compute(cfg.model_copy(update={"batch": batch}))["formats"][0]["step"]
            entry[f"batch{batch}_ms"], entry[f"batch{batch}_binds"] = step["bound_ms"], step["binds"]
        entry.update(context_tokens=cfg.context_tokens, kv_bytes_per_element=cfg.kv_bytes_per_element, profile=profile.name)
        table[name] = entry
    return {"measurement": measured.to_json(), "bounds": table}


def stage_measurement(value: object, where: str) -> MeasurementRecord:
    """The measurement in a value `measure_and_bound` returned (and a stage cache stored at
    `where`), read as the record; one line when it holds none or a damaged one."""
    measurement = value.get("measurement") if isinstance(value, dict) else None
    return MeasurementRecord.from_json(measurement, f"{where}: measurement")
