"""The key of each stage's artifact: the hash of every input that decides it, so that the stage
cache redoes a stage exactly when one of them changed. The key of an earlier stage stands for
that stage's inputs; each key names its stage."""

from __future__ import annotations

from quantgate.core.artifacts import library_versions, sha256_json
from quantgate.pipeline.resolve import ResolvedPlan


def overlap_key(plan: ResolvedPlan, calibration_fingerprint: str) -> str:
    return sha256_json({"stage": "overlap", "calibration": calibration_fingerprint, "sets": plan.golden_shas,
                        "quantgate": plan.version})


def baseline_measure_key(plan: ResolvedPlan) -> str:
    return sha256_json({"stage": "measure", "model": plan.identity_key, "hardware": plan.profile_key, "quantgate": plan.version})


def baseline_evaluate_key(plan: ResolvedPlan) -> str:
    return sha256_json({"stage": "evaluate", "model": plan.identity_key, "config": plan.eval_settings, "quantgate": plan.version})


def quantize_key(plan: ResolvedPlan, fmt: str, calibration_fingerprint: str) -> str:
    """The checkpoint's inputs, the quantization libraries' versions among them."""
    return sha256_json({"stage": "quantize", "baseline": plan.identity_key, "calibration": calibration_fingerprint,
                        "config": plan.quantize_cfgs[fmt].model_dump(mode="json"), "quantgate": plan.version,
                        "libraries": library_versions()})


def blocked_gate_key(plan: ResolvedPlan, quantize: str, failure: str) -> str:
    """The verdict on a checkpoint that failed its own checks: the failure decides it."""
    return sha256_json({"stage": "gate", "quantize": quantize, "failed": failure, "policy": plan.policy.sha256})


def measure_key(plan: ResolvedPlan, checkpoint_sha: str) -> str:
    """`checkpoint_sha`: the sha256 of the checkpoint's manifest (which hashes its files)."""
    return sha256_json({"stage": "measure", "checkpoint": checkpoint_sha, "baseline": plan.identity_key,
                        "hardware": plan.profile_key, "quantgate": plan.version})


def evaluate_key(plan: ResolvedPlan, checkpoint_sha: str, baseline_results_sha: str) -> str:
    """A candidate's results: its checkpoint, the settings, and the baseline's results (KL and
    top-1 agreement are measured against them)."""
    return sha256_json({"stage": "evaluate", "checkpoint": checkpoint_sha, "config": plan.eval_settings,
                        "baseline": baseline_results_sha, "quantgate": plan.version})


def gate_key(plan: ResolvedPlan, *, precision: str, baseline: str, candidate: str, measure: str, overlap: str) -> str:
    """A verdict: the policy, the precision class, the sha256s of the baseline's and the
    candidate's results manifests, and the keys of the measurement and the overlap."""
    return sha256_json({"stage": "gate", "policy": plan.policy.sha256, "precision": precision, "baseline": baseline,
                        "candidate": candidate, "measure": measure, "overlap": overlap, "quantgate": plan.version})
