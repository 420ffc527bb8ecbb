"""Serving evidence from where a checkpoint will serve: `quantgate serving check CKPT --run RUN_DIR`
serves the run's baseline and the checkpoint on this machine's engine, judges them with the
serving gates of the policy the run gated under, and appends a serving record to the run's ledger
(the same hash chain; signed when a key is given and it makes the checkpoint deployable).
`quantgate verify` then reads the checkpoint's newest verdict with the serving records after it:
a verdict pending serving is deployable once a class the policy accepts has served it as gated.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from quantgate import evalsets, serving
from quantgate.core.artifacts import sibling_lock
from quantgate.core.errors import InputError
from quantgate.core.models import weight_hashes
from quantgate.core.rundir import BASELINE, RunDir
from quantgate.evalsets.served import ServeCheckConfig, check
from quantgate.gates import ledger as ledger_module
from quantgate.gates import signing
from quantgate.gates.ledger_record import SERVING_KIND, LedgerRecord
from quantgate.gates.policy import LoadedPolicy, load_policy
from quantgate.gates.run_record import RunRecord
from quantgate.gates.verdict import APPROVED, ServingEvidence, Verdict, serving_gates


@dataclass(frozen=True)
class Attested:
    """A serving record as appended, and the ledger it was appended to."""

    record: LedgerRecord
    ledger: Path


def _run_record(run_dir: Path) -> RunRecord:
    file = RunDir(run_dir).run_file
    if not file.is_file():
        raise InputError(f"--run {run_dir}: no run.json there (a `quantgate run` output directory)")
    return RunRecord.read(file)


def run_policy(run: RunRecord) -> LoadedPolicy:
    """The policy the run gated under: its file where it still is, else the built-in name@version."""
    policy = run.policy
    path = Path(policy.path or "")
    return load_policy(path if path.is_file() else f"{policy.name}@{policy.version}")


def verdict_of(records: list[LedgerRecord], weights: dict[str, str]) -> LedgerRecord | None:
    """The newest verdict (not a serving record, not a search trial's) on these weights."""
    verdicts = [record for record in records if (record.kind or "verdict") != SERVING_KIND and record.split != "search"
                and record.weights == weights]
    return verdicts[-1] if verdicts else None


def _verdict(ledger: Path, weights: dict[str, str], checkpoint: Path) -> LedgerRecord:
    found = verdict_of(ledger_module.read(ledger), weights)
    if found is None:
        raise InputError(f"ledger {ledger} holds no verdict on {checkpoint}'s weights: gate it first (quantgate run)")
    return found


def attest(checkpoint: Path, run_dir: Path, work: Path, *, baseline: Path | None = None, ledger: Path | None = None,
           signing_key: Path | None = None) -> Attested:
    """Serve the run's baseline and `checkpoint` here, judge them with the run's serving gates, and
    append the serving record to the ledger; returns it (its `serving_status`: approved, pending, blocked)."""
    run_dir = Path(run_dir).absolute()
    run = _run_record(run_dir)
    ledger = Path(ledger or run.ledger)
    if not ledger.is_file():
        raise InputError(f"ledger {ledger} does not exist (the run's ledger; name another with --ledger)")
    policy = run_policy(run)
    if policy.policy.serving is None:
        raise InputError(f"policy {policy.policy.name}@{policy.policy.version} gates no serving: nothing to attest")
    weights = weight_hashes(checkpoint)
    verdict = _verdict(ledger, weights, checkpoint)
    layout = RunDir(run_dir)
    name = str(verdict.format)
    baseline_model = Path(baseline or run.model)
    if not baseline_model.is_dir():
        raise InputError(f"the run's baseline {baseline_model} is not on this machine: name it with --baseline")
    cfg = ServeCheckConfig.model_validate(run.plan.serving or {})
    env = serving.require()
    reference = check(baseline_model, evalsets.load_results(layout.results(BASELINE)), cfg, env, work / BASELINE)
    results = evalsets.load_results(layout.results(name))
    record = check(Path(checkpoint), results, cfg, env, work / name, reference_probe=reference.probe_seconds())
    gates = serving_gates(policy, ServingEvidence(record, reference))
    status = Verdict(all(gate.outcome.value == "pass" for gate in gates), gates, quality_passed=True).serving or APPROVED
    # a serving record: what verify reads typed (LedgerRecord), its gates and both serve checks' summaries as written
    entry = LedgerRecord.model_validate({
        "kind": SERVING_KIND, "format": name, "verdict": None, "serving_status": status, "device_class": record.device_class,
        "checkpoint": {"path": str(Path(checkpoint).resolve()), "format": name, "weights": weights},
        "policy": policy.identity, "attests": verdict.verdict_sha256,
        "reasons": [gate.reason for gate in gates], "gates": [gate.as_dict() for gate in gates],
        "serving": record.summary().to_json(), "baseline_serving": reference.summary().to_json(),
    })
    key = signing.load_signing_key(signing_key) if signing_key is not None else None
    with sibling_lock(ledger):
        if _verdict(ledger, weights, checkpoint).verdict_sha256 != verdict.verdict_sha256:
            raise InputError(f"ledger {ledger}: a newer verdict on {checkpoint}'s weights was appended while it was served; "
                             "run the same command again to attest that one")
        if key is not None and status == APPROVED and verdict.verdict in (APPROVED, "pending"):
            # the time is signed with the rest
            entry = entry.with_fields(signed=True, time=datetime.now(timezone.utc).isoformat(timespec="seconds"))
            entry = entry.with_fields(signature=signing.sign(Path(checkpoint), entry, key))
        else:
            entry = entry.with_fields(signed=False)
        return Attested(ledger_module.append(ledger, entry), ledger)
