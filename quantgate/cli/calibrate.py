"""`quantgate calibrate` and `quantgate overlap`: stage 1, the calibration set and its leakage check."""

from __future__ import annotations

from pathlib import Path

import typer

from quantgate import calibration
from quantgate.calibration.sources import load_documents
from quantgate.cli.options import config, print_json

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)


@commands.command("calibrate")
def calibrate(
    model: str = typer.Option(..., "--model", help="model directory, demo model name or hub id"),
    source: str = typer.Option(..., "--source", help="'demo', a .txt/.jsonl/.parquet/.arrow file or a datasets directory"),
    samples: int = typer.Option(..., "--samples", help="number of rows"),
    seq_len: int = typer.Option(..., "--seq-len", help="tokens per row"),
    out: Path = typer.Option(..., "--out", help="output directory (appears only when complete)"),
    seed: int = typer.Option(0, "--seed"),
    field: str = typer.Option("text", "--field", help="JSON field or column holding the text"),
    split: str | None = typer.Option(None, "--split", help="split of a datasets DatasetDict"),
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
    cfg = config(
        calibration.CalibrationConfig,
        model=model, source=source, samples=samples, seq_len=seq_len, seed=seed, field=field,
        split=split, packing=packing, chat_template=chat_template, allow_fewer=allow_fewer,
        allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
    )
    built = calibration.run(cfg, out, overwrite=overwrite)
    _report_calibration(built)


def _report_calibration(built: calibration.CalibrationSet) -> None:
    manifest = built.manifest
    state = "up to date, reused" if built.reused else "written"
    typer.echo(f"calibration set {state}: {built.path}")
    typer.echo(
        f"{manifest.samples} samples x {manifest.seq_len} tokens ({manifest.tokens} real tokens) "
        f"from {manifest.source.description}"
    )
    typer.echo(f"fingerprint {built.fingerprint}")
    if manifest.samples < manifest.selection.samples_requested:
        typer.echo(f"note: {manifest.selection.samples_requested} samples were asked, the source gave {manifest.samples}")


@commands.command("overlap")
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
    calibration_set = calibration.load(calibration_dir)
    collection = [text for spec in against for text in load_documents(spec, field).texts if isinstance(text, str)]
    result = calibration.ngram_overlap(calibration_set.texts(), collection, n)
    summary = {"n": result.n, "candidate_ngrams": result.candidate_ngrams, "shared_ngrams": result.shared_ngrams, "share": result.share}
    if as_json:
        print_json(summary)
    else:
        typer.echo(f"{result.shared_ngrams} of {result.candidate_ngrams} calibration {n}-grams occur in the collection ({result.share:.4%})")
