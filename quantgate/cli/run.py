"""`quantgate run` (a plan, or `demo`: the embedded demo plan) and `quantgate report`: the whole
pipeline and its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from quantgate.core.errors import Interrupted
from quantgate.gates.keys import beside
from quantgate.gates.report import build, data_key, read, write
from quantgate.gates.report_model import Report, Serving
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import load_plan, with_executor, with_signing_key

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)


@commands.command("run")
def run_command(
    plan: str = typer.Argument(..., help="a plan YAML file, or 'demo': the embedded demo plan (quantgate/pipeline/plans/demo.yaml)"),
    out: Path | None = typer.Option(None, "--out", help="run directory (default: the plan's `out`)"),
    quiet: bool = typer.Option(False, "--quiet", help="no stage lines, only the summary"),
    verbose: bool = typer.Option(False, "--verbose", help="other libraries' output on the terminal too (always in the run's logs/libraries.log)"),
    executor: str | None = typer.Option(None, "--executor", help="where the stages run: local or ray (default: the plan's `executor`)"),
    address: str | None = typer.Option(None, "--address", help="the Ray cluster: auto, HOST:PORT of its head, or ray://HOST:10001 "
                                       "(implies --executor ray; none: a Ray of this machine's own)"),
    signing_key: Path | None = typer.Option(None, "--signing-key", help="sign every ledger record with this PEM private key "
                                            "(ECDSA; default: the plan's `signing_key`, else your own, made on first use)"),
) -> None:
    """Run every stage for one model: calibrate, quantize each format, measure and bound,
    evaluate the baseline and each candidate, gate, append to the ledger, write the report.

    `quantgate run demo` runs the embedded demo plan (quantgate/pipeline/plans/demo.yaml, what
    `make demo` runs): SmolLM2-135M, two formats and a mixed-precision search, two golden sets in
    looks, the small-model policy, served in vLLM.

    Resumable: every artifact is keyed by its inputs' hashes, so a run started again redoes
    only what is missing. No unit ends the run: a quantization, evaluation, serve, calibration,
    sensitivity or search trial that fails (or whose child process is killed) is that unit's
    record in run.json and the report, and the run goes on to the report.

    Exit codes (the most urgent one where there are several; docs/usage.md, "Exit codes"):
    0 every format approved; 1 a format blocked by its gates; 4 approved pending serving
    (quality passed, no device class served it as gated yet); 5 a unit failed (the summary and
    run.json's failed_units say which and why; the same command tries it again); 2 bad input or
    configuration; 6 the ledger found tampered; 3 a crash (a bug); 130 interrupted.

    With --executor ray each format's quantization, evaluation and serve check is a Ray task,
    side by side on the cluster (docs/scale-out.md); `out` must be on storage every node sees.

    Every ledger record is signed in the OpenSSF model signing format, with --signing-key (or the
    plan's `signing_key`), else your own key (QUANTGATE_HOME/keys, made on the first run); an
    approved checkpoint carries model.sig, and OUT/trusted-keys.pem the public key to verify with
    (`quantgate verify CKPT --ledger OUT/ledger.jsonl --trust OUT/trusted-keys.pem`; docs/gates.md).

    Example: quantgate run my-plan.yaml --executor ray --address 10.0.0.1:6379
    """
    loaded = load_plan(plan)
    loaded = with_executor(loaded, executor, address) if executor or address else loaded
    loaded = with_signing_key(loaded, signing_key) if signing_key is not None else loaded
    try:
        result = pipeline.run(loaded, out, show_progress=not quiet, verbose=verbose)
    except KeyboardInterrupt:  # typer would exit 130 without a word
        raise Interrupted("interrupted: the run's tasks were cancelled and every artifact written so far is whole; "
                          "the same command resumes where it stopped") from None
    _print_summary(build(result.out), result)
    raise typer.Exit(int(result.exit_code))


def _print_summary(report: Report, result: Any = None) -> None:
    policy = report.policy
    table = Table(title=f"quantgate: {Path(report.model).name} under policy {policy.name}@{policy.version}")
    served = any(row.serving for row in report.rows)
    metric = report.plot.y
    columns = ["format", "MB", "x baseline", "bits/weight", "KL", metric or "metric"]
    columns += ["served: |logprob diff|, tokens/s b1"] if served else []
    for column in [*columns, "verdict", "reasons"]:
        table.add_column(column, overflow="fold")
    for row in report.rows:
        entry = row.metrics.get(metric or "")
        shown = entry.value if entry is not None else None
        # a search trial's own verdict approves nothing: "passed the search split" (gates.report)
        colour = "green" if row.deployable else "red" if row.verdict == "blocked" else "yellow"
        verdict = f"[{colour}]{row.verdict_text}[/{colour}]" if row.verdict in ("approved", "blocked", "pending") else row.verdict_text
        reasons = row.reasons
        cells = [row.format, f"{row.bytes / 1e6:.1f}" if row.bytes else "-",
                 f"{row.ratio_to_baseline:.3f}" if row.ratio_to_baseline else "-",
                 f"{row.bits_per_weight_layers:.3f}" if row.bits_per_weight_layers else "-",
                 f"{row.kl_divergence:.4f}" if row.kl_divergence is not None else "-",
                 f"{shown:.4f}" if isinstance(shown, float) else "-"]
        cells += [_served_cell(row.serving)] if served else []
        table.add_row(*cells, verdict, "; ".join(reasons[:2]) + (f"; and {len(reasons) - 2} more" if len(reasons) > 2 else ""))
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for profile, choice in report.recommendation.items():
        console.print(f"recommended on {profile}: {choice or 'none (no format approved)'}")
    if report.summary.measured:
        console.print(report.summary.measured)
    if report.search is not None:
        console.print(f"search: {report.search.conclusion}")
    for row in report.rows:  # per device class: approved, pending (what to run next) or blocked
        for line in row.class_lines if row.verdict != "blocked" else []:
            console.print(f"{row.display_name} serving on {line}", highlight=False, soft_wrap=True)
    for sentence in report.summary.engine_defaults:  # the engine's default differs from what was gated
        console.print(sentence, highlight=False, soft_wrap=True)
    if report.no_verdict:
        console.print(f"[red]no verdict[/red]: {report.no_verdict}", highlight=False, soft_wrap=True)
    for failed in report.failed_units:
        console.print(f"[red]failed unit[/red] (the run went on without it; the same command tries it again): {failed.reason}",
                      highlight=False, soft_wrap=True)
    if result is not None:
        redone = len(result.redone)
        console.print(f"run directory {result.out} ({redone} of {len(result.stages)} stages run, {len(result.stages) - redone} reused) "
                      f"in {result.seconds:.0f} s; report {result.out / 'report' / 'report.html'}; ledger {report.ledger}")
        if report.ledger:  # what the deploy side runs, with the trust file the run wrote beside its ledger
            trust = beside(Path(report.ledger))
            for row in report.rows:
                if row.deployable:
                    name = row.search.checkpoint if row.search is not None else row.format
                    console.print(f"before deploying {row.display_name}: quantgate verify {result.out / 'checkpoints' / name} "
                                  f"--ledger {report.ledger} --trust {trust}", highlight=False, soft_wrap=True)


def _served_cell(serving: Serving | None) -> str:
    """'yes: 0.043 nats, 47.7 tok/s', 'no: <reason>', or '-' (not served: a trial, or no serve stage)."""
    if serving is None:
        return "-"
    if not serving.served:
        return f"no: {serving.reason or '?'}"
    rate = serving.throughput.get("1")
    parts = [f"{serving.agreement.mean_abs_logprob_difference:.3f} nats" if serving.agreement else "not compared",
             f"{rate.tokens_per_s:.1f} tok/s" if rate else "no rate"]
    return "yes: " + ", ".join(parts)


@commands.command("report")
def report_command(
    run_dir: Path = typer.Argument(..., help="a run directory (quantgate run), or a report.json (or the folder holding one) "
                                   "to render again on its own"),
    out: Path | None = typer.Option(None, "--out", help="where to write report.{md,json,html} (default: RUN_DIR/report; "
                                    "for a report.json, its own folder)"),
) -> None:
    """Write the size-vs-accuracy report of a run again from its artifacts (or from a report.json alone), and print its summary.

    Given a report.json (or a folder with one and no run.json: a report copied off the machine
    that ran), report.md and report.html are rendered again from it alone.

    Example: quantgate report demo-out
    """
    saved = _saved_report(run_dir)
    if saved is not None:
        report, default_out = read(saved), saved.parent
    else:
        built = build(run_dir)
        report, default_out = built.model_copy(update={"key": data_key(built)}), run_dir / "report"
    target = write(report, out or default_out)
    _print_summary(report)
    typer.echo(f"report written to {target}/report.html, report.md, report.json")


def _saved_report(path: Path) -> Path | None:
    """The report.json `path` names: the file itself, or the one in a folder that holds no run
    (no run.json); None for a run directory, whose report is made from its artifacts."""
    if path.is_file():
        return path
    if path.is_dir() and not (path / "run.json").is_file() and (path / "report.json").is_file():
        return path / "report.json"
    return None
