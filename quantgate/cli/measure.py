"""`quantgate measure` and `quantgate bounds`: stage 3, bytes from headers and decode-time bounds.
What turns the options a user typed into a `BoundsConfig` lives here; the math is the library's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console

from quantgate.cli.options import print_json
from quantgate.core.errors import InputError
from quantgate.quantize.measure import bounds
from quantgate.quantize.measure.accounting import measure, render
from quantgate.quantize.measure.bounds import DEFAULT_FORMATS, BoundsConfig, ModelShape, WeightFormat
from quantgate.quantize.measure.hardware import load_profile

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)

M = TypeVar("M", bound=BaseModel)

# config field -> the CLI option a user typed, for one-line messages
OPTION_NAMES = {"context_tokens": "context", "kv_bytes_per_element": "kv-bytes", "draft_cost": "draft-cost",
                "plain_step_ms": "plain-step-ms", "gamma_range": "gamma-range", "compare_kv_bytes": "compare-kv-bytes",
                "bits_per_weight": "format", "hbm_bytes_per_second": "hardware bandwidth"}
SHAPE_OPTIONS = ("parameters", "layers", "kv_heads", "head_dim")


@commands.command("measure")
def measure_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint directory (one file or sharded with an index) or a .safetensors file"),
    as_json: bool = typer.Option(False, "--json", help="print the measurement as JSON (schema: docs/measure-and-bounds.md)"),
    baseline: Path | None = typer.Option(None, "--baseline", help="baseline directory: report bytes as a ratio of its bytes"),
) -> None:
    """Account for every byte of a checkpoint from its safetensors headers, never its tensor data.

    States the format (compressed-tensors, GPTQ, AWQ GEMM or unquantized), the bytes of
    quantized weights, scales, zero points, g_idx, embeddings, lm_head, norms and the rest,
    per block and in all; bits per weight of every quantized linear layer against the
    format's exact figure and the 4.15-bit rule, and the gap explained line by line.

    Example: quantgate measure ckpt/gptq-int4 --baseline ~/.cache/quantgate/models/smollm2-135m
    """
    measurement = measure(checkpoint, baseline)
    if as_json:
        print_json(measurement.to_json())
        return

    console = Console()
    for item in render(measurement):
        console.print(item)


# --- options to a BoundsConfig ------------------------------------------------------------------

class ShapeOptions(TypedDict):
    """The model's numbers as typed (None: not given)."""

    parameters: float | None
    layers: int | None
    kv_heads: int | None
    head_dim: int | None


class BoundsSettings(TypedDict):
    """The BoundsConfig settings as typed (None: not given, the default or the reference case's stands)."""

    batch: int | None
    context_tokens: int | None
    kv_bytes_per_element: float | None
    alpha: float | None
    gamma: int | None
    draft_cost: float | None
    plain_step_ms: float | None
    alphas: list[float] | None
    compare_kv_bytes: list[float] | None


def _validated(model: type[M], values: Mapping[str, object]) -> M:
    """`model` from values not checked yet (what a user typed, over a starting point): one line naming the option when one is bad."""
    return bounds.checked(model, values, names=OPTION_NAMES)


def parse_format(text: str) -> WeightFormat:
    """'int4_g128=4.15' -> WeightFormat(name='int4_g128', bits_per_weight=4.15)."""
    name, separator, value = text.partition("=")
    try:
        bits: float | None = float(value)
    except ValueError:
        bits = None
    if not separator or not name or bits is None:
        raise InputError(f"invalid --format {text!r}: expected NAME=BITS_PER_WEIGHT, e.g. int4_g128=4.15")
    return _validated(WeightFormat, {"name": name, "bits_per_weight": bits, "source": "given"})


def parse_gamma_range(text: str) -> tuple[int, int]:
    low, separator, high = text.partition(":")
    try:
        return int(low), int(high if separator else low)
    except ValueError as error:
        raise InputError(f"invalid --gamma-range {text!r}: expected LOW:HIGH, e.g. 1:8") from error


def _parse_list(text: str | None, kind: type[float], option: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [kind(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as error:
        raise InputError(f"invalid {option} {text!r}: expected comma-separated numbers") from error


def _model(model: ModelShape | None, given: ShapeOptions, from_checkpoints: bool) -> ModelShape:
    """The model: the reference case's or the checkpoints', with the options given over it."""
    if any(value is not None for value in given.values()):
        merged: dict[str, object] = (model.model_dump() if model else {}) | {key: value for key, value in given.items() if value is not None}
        missing = [key for key in given if key not in merged]
        if missing:
            raise InputError(f"the model needs {', '.join('--' + key.replace('_', '-') for key in missing)} (or --checkpoint DIR)")
        merged["source"] = "given" if not from_checkpoints else f"{merged.get('source')}, with given overrides"
        return _validated(ModelShape, merged)
    if model is None:
        raise InputError("give a model: --checkpoint DIR, or --parameters, --layers, --kv-heads and --head-dim (or --reference-case)")
    return _validated(ModelShape, model.model_dump())


def bounds_config(*, hardware: str, checkpoints: list[Path], shape: ShapeOptions, formats: list[str],
                  reference: bool, gamma_range: str | None, settings: BoundsSettings) -> BoundsConfig:
    """A BoundsConfig from what a user typed: a hardware name or YAML, the model as numbers or
    checkpoints (shape from config.json, parameters and stored bytes from `measure`), formats as
    NAME=BPW, the reference case as a starting point; unset (None) settings keep defaults."""
    profile = load_profile(hardware)
    start = bounds.reference_case(profile) if reference else None
    values: dict[str, object] = start.model_dump() if start else {}
    values["hardware"] = profile
    specs = [parse_format(text) for text in formats]
    model = start.model if start else None
    if checkpoints:
        model, measured = bounds.measured_model(checkpoints)
        specs = [*(specs or DEFAULT_FORMATS), *measured]
    values["model"] = _model(model, shape, bool(checkpoints))
    if specs:
        values["formats"] = tuple(specs)
    if gamma_range is not None:
        values["gamma_range"] = parse_gamma_range(gamma_range)
    for key, value in settings.items():
        if value is not None:
            values[key] = tuple(value) if isinstance(value, list) else value
    return _validated(BoundsConfig, values)


@commands.command("bounds")
def bounds_command(
    hardware: str = typer.Option("reference", "--hardware", help="reference, h100-sxm, h200 or a YAML profile"),
    checkpoint: list[Path] | None = typer.Option(None, "--checkpoint", help="measure this checkpoint: its shape, parameters and stored bytes; repeatable"),
    parameters: float | None = typer.Option(None, "--parameters", help="model parameters, e.g. 70e9"),
    layers: int | None = typer.Option(None, "--layers"),
    kv_heads: int | None = typer.Option(None, "--kv-heads"),
    head_dim: int | None = typer.Option(None, "--head-dim"),
    formats: list[str] | None = typer.Option(None, "--format", help="NAME=BITS_PER_WEIGHT; repeatable (default bf16=16, fp8_e4m3=8, int4_g128=4.15)"),
    batch: int | None = typer.Option(None, "--batch", help="sequences decoded together (default 1)"),
    context: int | None = typer.Option(None, "--context", help="context tokens per sequence (default 2048)"),
    kv_bytes: float | None = typer.Option(None, "--kv-bytes", help="bytes per KV element (default 2)"),
    alpha: float | None = typer.Option(None, "--alpha", help="draft acceptance rate in [0, 1) (default 0.8)"),
    gamma: int | None = typer.Option(None, "--gamma", help="draft length >= 1 (default 4)"),
    draft_cost: float | None = typer.Option(None, "--draft-cost", help="c: a draft step over a target step (default 0.1)"),
    plain_step_ms: float | None = typer.Option(None, "--plain-step-ms", help="measured plain step (default: each format's bound)"),
    alphas: str | None = typer.Option(None, "--alphas", help="alpha sweep, comma-separated: 0.5,0.6,0.7"),
    gamma_range: str | None = typer.Option(None, "--gamma-range", help="find the best gamma in LOW:HIGH"),
    compare_kv_bytes: str | None = typer.Option(None, "--compare-kv-bytes", help="also bound with these KV bytes per element, e.g. 1"),
    reference_case: bool = typer.Option(False, "--reference-case", help="start from the reference case of docs/sources.md (70B, batch 32, ...)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (schema: docs/measure-and-bounds.md)"),
) -> None:
    """Lower bounds on decode step time per weight format, and what speculative decoding buys.

    step >= max((weights + batch x KV) / bandwidth, 2 x parameters x batch x positions / FLOP/s).
    Every time printed is a lower bound from peak figures, never a measurement.

    Example: quantgate bounds --reference-case --gamma-range 1:8 --alphas 0.6,0.7,0.9 --compare-kv-bytes 1
    """
    cfg = bounds_config(
        hardware=hardware, checkpoints=checkpoint or [],
        shape={"parameters": parameters, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
        formats=formats or [], reference=reference_case, gamma_range=gamma_range,
        settings={"batch": batch, "context_tokens": context, "kv_bytes_per_element": kv_bytes, "alpha": alpha, "gamma": gamma,
                  "draft_cost": draft_cost, "plain_step_ms": plain_step_ms, "alphas": _parse_list(alphas, float, "--alphas"),
                  "compare_kv_bytes": _parse_list(compare_kv_bytes, float, "--compare-kv-bytes")},
    )
    result = bounds.compute(cfg)
    if as_json:
        print_json(result)
        return

    console = Console()
    for item in bounds.render(result):
        console.print(item)
