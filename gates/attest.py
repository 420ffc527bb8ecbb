"""Serving evidence from where a checkpoint will serve: `quantgate serving check CKPT --run RUN_DIR`
serves the run's baseline and the checkpoint on this machine's engine, judges them with the
serving gates of the policy the run gated under, and appends a signed serving record to the run's
ledger (the same hash chain). It reads nothing it has not verified: the verdict it attests must be
signed by a trusted key (and every record after it), the checkpoint's files must be the verdict's,
and the policy, the baseline and the serve check's settings are checked against (or taken from)
the signed verdict, never from the run's run.json alone. It signs only its own record: a pending
verdict keeps its own signature. `quantgate verify` then reads the checkpoint's newest verdict with
the serving records after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantgate import evalsets, serving
from quantgate.core.artifacts import MANIFEST, sha256_file, sibling_lock
from quantgate.core.errors import InputError
from quantgate.core.models import checkpoint_files, weights_sha256
from quantgate.core.rundir import BASELINE, RunDir
from quantgate.evalsets.served import ServeCheckConfig, check
from quantgate.gates import keys
from quantgate.gates import ledger as ledger_module
from quantgate.gates.ledger_record import SERVING_KIND, LedgerRecord
from quantgate.gates.policy import LoadedPolicy, load_policy
from quantgate.gates.run_record import RunRecord
from quantgate.gates.verdict import APPROVED, ServingEvidence, Verdict, serving_gates

# The serve check's settings that belong to the machine that serves, not to what was gated: taken
# from run.json (or the defaults); every other setting comes from the signed verdict.
MACHINE_SETTINGS = frozenset({"timeout_s", "kv_cache_mib", "bandwidth_mib", "tensor_parallel"})


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


def verdict_of(records: list[LedgerRecord], files: dict[str, str]) -> LedgerRecord | None:
    """The newest verdict (not a serving record, not a search trial's) on exactly these files."""
    verdicts = [record for record in records if (record.kind or "verdict") != SERVING_KIND and record.split != "search"
                and ledger_module.matches(record, files)]
    return verdicts[-1] if verdicts else None


def _verdict(ledger: Path, files: dict[str, str], checkpoint: Path) -> tuple[list[LedgerRecord], LedgerRecord]:
    records = ledger_module.read(ledger)
    found = verdict_of(records, files)
    if found is None:
        raise InputError(f"ledger {ledger} holds no verdict on {checkpoint}'s files (every file, as gated): gate it first "
                         "(quantgate run), or `quantgate verify` says which file changed")
    return records, found


def _check_policy(policy: LoadedPolicy, verdict: LedgerRecord) -> None:
    signed = verdict.policy
    if signed is None or (signed.name, signed.version, signed.sha256) != (policy.policy.name, policy.policy.version, policy.sha256):
        raise ledger_module.Untrusted(f"the policy the run names ({policy.label}, sha256 {policy.sha256[:12]}...) is not the one "
                                      f"its signed verdict was reached under ({signed.name if signed else '?'}@"
                                      f"{signed.version if signed else '?'}, sha256 {str(signed.sha256 if signed else '')[:12]}...)")


def _check_baseline(model: Path, verdict: LedgerRecord) -> None:
    baseline = verdict.to_json().get("baseline")
    signed = baseline.get("weights_sha256") if isinstance(baseline, dict) else None
    if signed is not None and weights_sha256(model) != signed:
        raise ledger_module.Untrusted(f"baseline {model}: its weights are not those of the baseline the signed verdict names "
                                      f"(sha256 {str(signed)[:12]}...); name the right one with --baseline")


def _check_results(verdict: LedgerRecord, **folders: Path) -> None:
    """Each results directory (by role: candidate, baseline) must be the one the signed verdict
    was reached on: its manifest's sha256 (the manifest hashes its files; load_results checks them)."""
    signed = verdict.results_sha256 or {}
    for role, folder in folders.items():
        if role not in signed:
            raise ledger_module.Untrusted(f"the signed verdict names no {role} results (recorded by an older quantgate, or "
                                          "outside a run): gate it again with `quantgate run`")
        manifest = folder / MANIFEST
        if not manifest.is_file() or sha256_file(manifest) != signed[role]:
            raise ledger_module.Untrusted(f"{folder}: not the {role} evaluation results the signed verdict was reached on "
                                          f"(manifest sha256 {signed[role][:12]}...)")


def serve_settings(run: RunRecord, verdict: LedgerRecord) -> ServeCheckConfig:
    """The serve check's settings: what decides (items, probe...) from the signed verdict, what
    belongs to this machine (MACHINE_SETTINGS) from the run's plan; the defaults for a verdict that
    carries none (a run without a serve stage)."""
    local = {name: value for name, value in (run.plan.serving or {}).items() if name in MACHINE_SETTINGS}
    signed = verdict.serving_settings.to_json() if verdict.serving_settings is not None else {}
    return ServeCheckConfig.model_validate({**{name: value for name, value in signed.items() if name not in MACHINE_SETTINGS},
                                            **local})


def attest(checkpoint: Path, run_dir: Path, work: Path, *, baseline: Path | None = None, ledger: Path | None = None,
           signing_key: Path | None = None, trust: Path | None = None) -> Attested:
    """Serve the run's baseline and `checkpoint` here, judge them with the run's serving gates, and
    append the serving record to the ledger, signed with `signing_key` (else the user's own key);
    returns it (its `serving_status`: approved, pending, blocked). The verdict attested must be
    signed by a key of `trust` (else the user's trust file): Untrusted (exit 6) otherwise."""
    run_dir = Path(run_dir).absolute()
    run = _run_record(run_dir)
    ledger = Path(ledger or run.ledger)
    if not ledger.is_file():
        raise InputError(f"ledger {ledger} does not exist (the run's ledger; name another with --ledger)")
    key = keys.signing_key(signing_key)  # a bad key is refused before anything is served
    trusted = ledger_module.trusted_keys(trust)
    policy = run_policy(run)
    if policy.policy.serving is None:
        raise InputError(f"policy {policy.policy.name}@{policy.policy.version} gates no serving: nothing to attest")
    checkpoint = Path(checkpoint)
    files = checkpoint_files(checkpoint)
    records, verdict = _verdict(ledger, files, checkpoint)
    ledger_module.require_signed(ledger, records, verdict, trusted)
    _check_policy(policy, verdict)
    layout = RunDir(run_dir)
    name = str(verdict.format)
    baseline_model = Path(baseline or run.model)
    if not baseline_model.is_dir():
        raise InputError(f"the run's baseline {baseline_model} is not on this machine: name it with --baseline")
    _check_baseline(baseline_model, verdict)
    _check_results(verdict, candidate=layout.results(name), baseline=layout.results(BASELINE))
    cfg = serve_settings(run, verdict)
    env = serving.require()
    reference = check(baseline_model, evalsets.load_results(layout.results(BASELINE)), cfg, env, work / BASELINE)
    results = evalsets.load_results(layout.results(name))
    record = check(checkpoint, results, cfg, env, work / name, reference_probe=reference.probe_seconds(),
                   reference_load=reference.cold_start_seconds)  # the baseline's cold start here: the load deadline's base
    gates = serving_gates(policy, ServingEvidence(record, reference))
    status = Verdict(all(gate.outcome.value == "pass" for gate in gates), gates, quality_passed=True).serving or APPROVED
    # a serving record: what verify reads typed (LedgerRecord), its gates and both serve checks' summaries as written
    entry = LedgerRecord.model_validate({
        "kind": SERVING_KIND, "format": name, "verdict": None, "serving_status": status, "device_class": record.device_class,
        "checkpoint": {"path": str(checkpoint.resolve()), "format": name,
                       "weights": verdict.weights or {}, "files": files},
        "policy": policy.identity, "attests": verdict.verdict_sha256,
        "reasons": [gate.reason for gate in gates], "gates": [gate.as_dict() for gate in gates],
        "serving": record.summary().to_json(), "baseline_serving": reference.summary().to_json(),
    })
    with sibling_lock(ledger):
        now, newest = _verdict(ledger, files, checkpoint)
        if newest.verdict_sha256 != verdict.verdict_sha256:
            raise InputError(f"ledger {ledger}: a newer verdict on {checkpoint}'s files was appended while it was served; "
                             "run the same command again to attest that one")
        ledger_module.require_signed(ledger, now, newest, trusted)
        # an approval of these files: model.sig is written too, so model-signing alone accepts the directory
        deployable = status == APPROVED and verdict.verdict in (APPROVED, "pending")
        appended = ledger_module.append(ledger, entry, key, model_sig=checkpoint if deployable else None, records=now)
    keys.trust(keys.beside(ledger), key)
    return Attested(appended, ledger)
