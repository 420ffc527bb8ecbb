"""`quantgate gate` and `quantgate verify`: stage 5 for CI systems that run the stages themselves."""

from __future__ import annotations

from pathlib import Path

import typer

from quantgate.cli.options import print_json
from quantgate.gates.ledger import verify_checkpoint
from quantgate.gates.signing import SIGNATURE_FILE
from quantgate.gates.stage import gate_results

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)


@commands.command("verify")
def verify_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint directory about to be deployed"),
    ledger_path: Path = typer.Option(..., "--ledger", help="the approval ledger (JSONL)"),
    public_key: Path | None = typer.Option(None, "--public-key", help="accept only an approval signed by this key "
                                           "(PEM public key; needs the signing extra)"),
    device_class: str | None = typer.Option(None, "--device-class", help="the device class it will serve on (cpu-avx2, "
                                            "cpu-avx512, cpu-avx512-amx, cuda-smXY): it must have served as gated there; "
                                            "default: any class"),
) -> None:
    """Exit 0 only if the checkpoint's current weight bytes match an approved ledger record.

    Otherwise exit 1 and say why: pending serving (what is missing, the command that attests it),
    blocked (on the device class, where one disagrees), unknown, changed since approval, or ledger tampered.

    With --public-key, only an approval signed by that key: also unsigned, signed by another key, or ledger rewritten.

    A missing ledger or a bad key file is bad input (exit 2).

    Example: quantgate verify ckpt/gptq-int4 --ledger runs/demo/ledger.jsonl --public-key key.pub
    """
    result = verify_checkpoint(checkpoint, ledger_path, public_key, device_class)
    typer.echo(f"{checkpoint}: {result.status.value}: {result.reason}")
    raise typer.Exit(0 if result.deployable else 1)


@commands.command("gate")
def gate_command(
    baseline: Path = typer.Option(..., "--baseline", help="the baseline's evaluation results directory"),
    candidate: Path = typer.Option(..., "--candidate", help="the candidate's results (evaluated with --baseline-results)"),
    policy: str = typer.Option("default", "--policy", help="a policy YAML file, or NAME[@vN] of a built-in one"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="the candidate checkpoint (default: the one its results name); enables the size gate"),
    calibration_dir: Path | None = typer.Option(None, "--calibration", help="its calibration set (default: the one its manifest names); enables the overlap gate"),
    precision: str | None = typer.Option(None, "--precision", help="8bit or 4bit thresholds (default: from the checkpoint's format)"),
    ledger_path: Path | None = typer.Option(None, "--ledger", help="append the verdict to this ledger"),
    signing_key: Path | None = typer.Option(None, "--signing-key", help="sign an approval with this PEM private key "
                                            "(ECDSA P-256/384/521): writes CHECKPOINT/model.sig; needs --ledger"),
    narrow_policy: list[str] | None = typer.Option(None, "--narrow-policy", help="gate only this golden set of the policy "
                                                   "(repeat for each kept); the verdict records the policy as narrowed"),
    served: Path | None = typer.Option(None, "--served", help="its serve record (quantgate serving check --out DIR): for a policy that "
                                       "gates serving"),
    served_baseline: Path | None = typer.Option(None, "--served-baseline", help="the baseline's serve record: the serving gate's bound"),
    as_json: bool = typer.Option(False, "--json", help="print the verdict record as JSON"),
) -> None:
    """Gate one candidate against its baseline under a policy: exit 0 approved, 1 blocked, 2 bad input.

    Example: quantgate gate --baseline run/baselines/fp8-e4m3 --candidate run/results/fp8-e4m3 --policy small-model --ledger ledger.jsonl
    """
    record = gate_results(baseline, candidate, policy, checkpoint=checkpoint, calibration_dir=calibration_dir,
                          precision=precision, ledger=ledger_path, narrow_to=narrow_policy or None, served=served,
                          served_baseline=served_baseline, signing_key=signing_key)
    if as_json:
        print_json(record.to_json())
    else:  # plain lines, one a gate, so a CI log can be searched
        typer.echo(f"{record.verdict} {record.format} ({record.precision} thresholds) "
                   f"under {record.policy.name}@{record.policy.version}"
                   + (f" narrowed to {', '.join(record.policy.narrowed_to)}" if record.policy.narrowed_to else ""))
        for gate in record.gates:
            mark = {"pass": "pass", "fail": "FAIL", "not evaluated": "SKIPPED"}.get(gate.outcome.value, "UNDECIDED")
            typer.echo(f"  {mark}  {gate.reason}")
        signature = Path(record.checkpoint.path) / SIGNATURE_FILE if record.checkpoint else None
        if signing_key is not None and record.verdict == "approved" and signature is not None and signature.is_file():
            typer.echo(f"signed: {signature} (and the ledger's record)")
        elif signing_key is not None and record.verdict == "approved":
            typer.echo("not signed: a later verdict on these weights in the ledger decides (quantgate verify says which)")
    raise typer.Exit(0 if record.verdict == "approved" else 1)
