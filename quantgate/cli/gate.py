"""`quantgate gate` and `quantgate verify`: stage 5 for CI systems that run the stages themselves."""

from __future__ import annotations

from pathlib import Path

import typer

from quantgate.cli.options import print_json
from quantgate.core.exitcodes import Exit
from quantgate.core.formats import PRECISION_CLASSES
from quantgate.gates import keys
from quantgate.gates.ledger import verify_checkpoint
from quantgate.gates.signing import SIGNATURE_FILE
from quantgate.gates.stage import gate_results

# This module's commands; quantgate.cli.app.COMMANDS names each, so `quantgate --help` need not import it.
commands = typer.Typer(add_completion=False)


@commands.command("verify")
def verify_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint directory about to be deployed"),
    ledger_path: Path = typer.Option(..., "--ledger", help="the approval ledger (JSONL)"),
    trust: Path | None = typer.Option(None, "--trust", "--public-key", help="trust file: the PEM public key(s) whose "
                                      "signatures are accepted (a run writes trusted-keys.pem beside its ledger); default: "
                                      "your own, QUANTGATE_HOME/keys/trusted-keys.pem. --public-key is an alias"),
    allow_unsigned: bool = typer.Option(False, "--allow-unsigned", help="accept unsigned records (an explicit opt-out: "
                                        "the output says UNSIGNED); a bad signature or an unknown key is still refused"),
    device_class: str | None = typer.Option(None, "--device-class", help="the device class it will serve on (cpu-avx2, "
                                            "cpu-avx512, cpu-avx512-amx, cuda-smXY): it must have served as gated there; "
                                            "default: any class"),
) -> None:
    """Exit 0 only for an approval, signed by a trusted key, of every file of this checkpoint.

    The exit code says what the ledger holds on these files (quantgate/core/exitcodes.py):

    0 approved: the newest verdict on exactly these files approves them, and it and every record after it are signed by a
    key of the trust file.

    1 blocked: blocked (on the device class, where one disagrees), or no verdict on these files.

    4 pending serving: quality passed, no class has served it as gated (the command that attests it is printed).

    6 untrusted: a file changed, added or removed since the verdict (each named), unsigned, an unknown key, a bad
    signature, the ledger rewritten (a record edited and the chain recomputed) or tampered.

    2 bad input: a missing ledger, a bad trust file, a checkpoint that cannot be read.

    Example: quantgate verify demo-out/checkpoints/smoothquant-w8a8 --ledger demo-out/ledger.jsonl --trust demo-out/trusted-keys.pem
    """
    result = verify_checkpoint(checkpoint, ledger_path, trust, device_class, allow_unsigned=allow_unsigned)
    typer.echo(f"{checkpoint}: {result.status.value}: {result.reason}")
    raise typer.Exit(int(result.exit_code))


@commands.command("gate")
def gate_command(
    baseline: Path = typer.Option(..., "--baseline", help="the baseline's evaluation results directory"),
    candidate: Path = typer.Option(..., "--candidate", help="the candidate's results (evaluated with --baseline-results)"),
    policy: str = typer.Option("default", "--policy", help="a policy YAML file, or NAME[@vN] of a built-in one"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="the candidate checkpoint (default: the one its results name); enables the size gate"),
    calibration_dir: Path | None = typer.Option(None, "--calibration", help="its calibration set (default: the one its manifest names); enables the overlap gate"),
    precision: str | None = typer.Option(None, "--precision", help=f"{' or '.join(PRECISION_CLASSES)} thresholds (default: from the checkpoint's format)"),
    ledger_path: Path | None = typer.Option(None, "--ledger", help="append the verdict to this ledger"),
    signing_key: Path | None = typer.Option(None, "--signing-key", help="sign the ledger record with this PEM private key "
                                            "(ECDSA P-256/384/521; default: your own, made on first use under "
                                            "QUANTGATE_HOME/keys); an approval also writes CHECKPOINT/model.sig; needs --ledger"),
    narrow_policy: list[str] | None = typer.Option(None, "--narrow-policy", help="gate only this golden set of the policy "
                                                   "(repeat for each kept); the verdict records the policy as narrowed"),
    served: Path | None = typer.Option(None, "--served", help="its serve record (quantgate serving check --out DIR): for a policy that "
                                       "gates serving"),
    served_baseline: Path | None = typer.Option(None, "--served-baseline", help="the baseline's serve record: the serving gate's bound"),
    as_json: bool = typer.Option(False, "--json", help="print the verdict record as JSON"),
) -> None:
    """Gate one candidate against its baseline under a policy: exit 0 approved, 4 pending serving, 1 blocked, 2 bad input.

    With --ledger the verdict is appended, signed (by --signing-key, else your own key, made on
    first use); the public key goes into trusted-keys.pem beside the ledger. A ledger found
    tampered is refused (exit 6).

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
        if ledger_path is not None and record.verdict == "approved" and signature is not None and signature.is_file():
            typer.echo(f"signed: {signature} and the ledger's record; the public key is in {keys.beside(ledger_path)}")
        elif ledger_path is not None and record.verdict == "approved":
            typer.echo("no model.sig: a later verdict on these weights in the ledger decides (quantgate verify says which)")
    raise typer.Exit(int(VERDICT_EXIT[record.verdict]))


# A verdict as an exit code (quantgate/core/exitcodes.py): pending is quality passed, serving evidence missing.
VERDICT_EXIT = {"approved": Exit.APPROVED, "pending": Exit.PENDING, "blocked": Exit.BLOCKED}
