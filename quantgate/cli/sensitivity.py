"""`quantgate sensitivity`: what quantizing each layer group to each format costs, in nats per token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from quantgate.cli.options import config
from quantgate.quantize import sensitivity

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)


@commands.command("sensitivity")
def sensitivity_command(
    model: str = typer.Option(..., "--model", help="baseline model directory or demo model name"),
    calibration_dir: Path = typer.Option(..., "--calibration", help="calibration set directory (quantgate calibrate)"),
    formats: str = typer.Option(..., "--formats", help="comma-separated formats, e.g. gptq-int4,smoothquant-w8a8"),
    out: Path = typer.Option(..., "--out", help="output directory (appears only when complete)"),
    validate: bool = typer.Option(False, "--validate", help="also measure each block's KL and the rank correlation (slower)"),
    rows: int | None = typer.Option(None, "--rows", help="calibration rows to use (default: all)"),
    fisher: str = typer.Option("sampled", "--fisher", help="sampled (labels from the model) or empirical (real next tokens)"),
    seed: int = typer.Option(0, "--seed", help="seed of the sampled labels"),
    group_size: int = typer.Option(128, "--group-size", help="INT4 formats: weights per scale, a multiple of 32"),
    ignore: list[str] | None = typer.Option(None, "--ignore", help="module name or 're:' regex left unscored; repeatable (lm_head always)"),
    top: int = typer.Option(10, "--top", help="groups listed per format"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="accept a model whose weights are pickle files"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing, different result at --out"),
) -> None:
    """Score each layer group's sensitivity to each format: predicted KL in nats per token (diagonal Fisher).

    Example: quantgate sensitivity --model smollm2-135m --calibration calib/ --formats gptq-int4,smoothquant-w8a8 --out sensitivity/
    """
    cfg = config(
        sensitivity.SensitivityConfig,
        formats=tuple(name.strip() for name in formats.split(",") if name.strip()), rows=rows, fisher=fisher,
        seed=seed, group_size=group_size, ignore=("lm_head", *(ignore or [])), validation=validate,
    )
    result = sensitivity.run(cfg, model, calibration_dir, out, overwrite=overwrite, allow_pickle=allow_pickle)
    report = result.report
    for fmt in report["formats"]:
        _print_format(result, fmt, top)
    state = "up to date, reused" if result.reused else "written"
    typer.echo(f"{report['fisher']} Fisher over {report['rows']} rows ({report['tokens']} tokens); "
               f"sensitivity {state}: {result.path}")


def _print_format(result: Any, fmt: str, top: int) -> None:
    total = result.total(fmt)
    ranked = result.ranked(fmt)
    typer.echo(f"{fmt}: {len(ranked)} groups, total {total:.4g} nats/token predicted; the {min(top, len(ranked))} most sensitive:")
    width = max((len(name) for name, _ in ranked[:top]), default=5)
    typer.echo(f"  {'rank':>4}  {'group':<{width}}  {'nats/token':>10}  {'share':>6}")
    for rank, (name, value) in enumerate(ranked[:top], start=1):
        share = value / total if total > 0 else 0.0
        typer.echo(f"  {rank:>4}  {name:<{width}}  {value:>10.3g}  {share:>6.1%}")
    validation = result.report.get("validation")
    if validation:
        figures = validation["formats"][fmt]
        rho = "undefined" if figures["spearman"] is None else f"{figures['spearman']:+.3f}"
        p_value = "" if figures["p_value"] is None else f" (p {figures['p_value']:.2g})"
        typer.echo(f"  validation: Spearman rho {rho}{p_value} between the proxy and the measured KL "
                   f"of each of {len(figures['blocks'])} blocks quantized alone")
