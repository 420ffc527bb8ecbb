"""`quantgate quantize`: stage 2, one format into a compressed-tensors checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from quantgate import quantize
from quantgate.cli.options import config, placement_option
from quantgate.core.artifacts import peak_memory_bytes
from quantgate.core.formats import FORMATS
from quantgate.quantize.checkpoint import CommonGroupSize

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)


@commands.command("quantize")
def quantize_command(
    model: str = typer.Option(..., "--model", help="baseline model directory or demo model name"),
    format: str = typer.Option(..., "--format", help=" or ".join([", ".join(list(FORMATS)[:-1]), list(FORMATS)[-1]])),
    calibration_dir: Path = typer.Option(..., "--calibration", help="calibration set directory (quantgate calibrate)"),
    out: Path = typer.Option(..., "--out", help="output checkpoint directory (appears only when complete)"),
    group_size: int = typer.Option(128, "--group-size", help="INT4 formats: weights per scale, a multiple of 32"),
    ignore: list[str] | None = typer.Option(None, "--ignore", help="module name or 're:' regex to leave unquantized; repeatable (lm_head always)"),
    backend: str = typer.Option("llmcompressor", "--backend", help="llmcompressor, or autoawq (reference AWQ, extra 'autoawq')"),
    samples: int | None = typer.Option(None, "--samples", help="calibration rows to use (default: all)"),
    dampening_frac: float = typer.Option(0.01, "--dampening-frac", help="GPTQ dampening"),
    actorder: str = typer.Option("static", "--actorder", help="GPTQ activation order: static, group, weight or none"),
    smoothing_strength: float = typer.Option(0.8, "--smoothing-strength", help="SmoothQuant alpha"),
    awq_n_grid: int = typer.Option(20, "--awq-grid", help="AWQ scale search grid points"),
    fp8_dynamic: bool = typer.Option(False, "--fp8-dynamic", help="FP8: per-token dynamic activations"),
    observer: str | None = typer.Option(None, "--observer", help="weights' scale observer: imatrix_mse (gptq-int4's default), mse, or minmax (the other formats')"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="accept a model whose weights are pickle files"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing checkpoint at --out"),
    placement: str = typer.Option("auto", "--placement", help="where the model is kept: auto (in memory where it fits, else "
                                  "streamed), memory, or streamed (from disk, one module's weights at a time; the same checkpoint)"),
) -> None:
    """Quantize a baseline into a compressed-tensors checkpoint that transformers and vLLM load.

    Example: quantgate quantize --model smollm2-135m --format gptq-int4 --calibration calib/ --out ckpt/gptq-int4
    """
    cfg = config(
        quantize.QuantizeConfig,
        format=format, group_size=group_size, ignore=("lm_head", *(ignore or [])), backend=backend,
        num_calibration_samples=samples, dampening_frac=dampening_frac,
        actorder=None if actorder == "none" else actorder, smoothing_strength=smoothing_strength,
        awq_n_grid=awq_n_grid, fp8_dynamic=fp8_dynamic, observer=observer,
    )
    checkpoint = quantize.run(cfg, model, calibration_dir, out, overwrite=overwrite, allow_pickle=allow_pickle,
                              placement=placement_option(placement))
    manifest = checkpoint.manifest.to_json()
    fallbacks = checkpoint.manifest.group_size.fallbacks
    for fallback in fallbacks[:3]:
        got = fallback.group_size or "unquantized"
        if isinstance(fallback, CommonGroupSize):  # AutoAWQ: one group size for every layer
            typer.echo(f"note: every layer got group size {got}, not {fallback.requested}: {fallback.reason}")
        else:
            typer.echo(f"note: {fallback.layer} (width {fallback.in_features}) got group size {got}")
    if len(fallbacks) > 3:
        typer.echo(f"note: {len(fallbacks)} layers in all got another group size; see manifest.json")
    if checkpoint.manifest.placement == "streamed":
        typer.echo("note: quantized streamed from disk (--placement; the checkpoint is the same as in memory)")
    typer.echo(f"smoke prompt completion: {manifest['smoke']['completion']!r}")
    typer.echo(
        f"{manifest['format']} checkpoint written to {checkpoint.path} in "
        f"{manifest['provenance']['wall_seconds']:.1f} s, peak memory {peak_memory_bytes() / 2**30:.2f} GiB"
    )
