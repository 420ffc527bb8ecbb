"""The measure stage's entry for the pipeline: a checkpoint's byte accounting and the decode-step
lower bounds its stored bytes imply on each hardware profile, as one JSON-ready dict."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

from pydantic import JsonValue

from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.bounds import BoundsConfig, compute, measured_format
from quantgate.quantize.measure.hardware import HardwareProfile
from quantgate.quantize.measure.record import MeasurementRecord

BOUND_BATCHES = (1, 32)  # batch1_ms, batch32_ms


class ProfileBounds(TypedDict):
    """The decode-step lower bounds on one profile at each of BOUND_BATCHES (milliseconds, and
    which roof binds), with the bounds' inputs."""

    batch1_ms: float
    batch1_binds: str  # "memory" | "compute"
    batch32_ms: float
    batch32_binds: str
    context_tokens: int
    kv_bytes_per_element: float
    profile: str


class MeasureStageValue(TypedDict):
    """The measure stage's value: the measurement's JSON (MeasurementRecord, read back through
    `stage_measurement`) and the bounds by profile."""

    measurement: dict[str, JsonValue]
    bounds: dict[str, ProfileBounds]


def measure_and_bound(checkpoint: Path, baseline: Path | None, profiles: Mapping[str, HardwareProfile]) -> MeasureStageValue:
    """`quantgate measure --json` of a checkpoint (under `measurement`), and the decode-step lower
    bounds its stored bytes imply at each of BOUND_BATCHES on each profile (under `bounds`; the
    bounds' defaults: 2048 context tokens a sequence, 16-bit KV cache). The headers are read once
    for both. Its measurement is read back with `stage_measurement`."""
    measured = measure(checkpoint, baseline)
    shape, spec = measured_format(checkpoint, measured)
    table: dict[str, ProfileBounds] = {}
    for name, profile in profiles.items():
        cfg = BoundsConfig(hardware=profile, model=shape, formats=(spec,))
        one, many = (compute(cfg.model_copy(update={"batch": batch}))["formats"][0]["step"] for batch in BOUND_BATCHES)
        table[name] = ProfileBounds(batch1_ms=one["bound_ms"], batch1_binds=one["binds"], batch32_ms=many["bound_ms"],
                                    batch32_binds=many["binds"], context_tokens=cfg.context_tokens,
                                    kv_bytes_per_element=cfg.kv_bytes_per_element, profile=profile.name)
    return MeasureStageValue(measurement=measured.to_json(), bounds=table)


def stage_measurement(value: object, where: str) -> MeasurementRecord:
    """The measurement in a value `measure_and_bound` returned (and a stage cache stored at
    `where`), read as the record; one line when it holds none or a damaged one."""
    measurement = value.get("measurement") if isinstance(value, dict) else None
    return MeasurementRecord.from_json(measurement, f"{where}: measurement")
