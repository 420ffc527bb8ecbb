"""The key of each stage's artifact: the hash of every input that decides it, so that the stage
cache redoes a stage exactly when one of them changed. The key of an earlier stage stands for
that stage's inputs; each key names its stage."""

from __future__ import annotations

from typing import Any

from quantgate.core.artifacts import library_versions, sha256_json
from quantgate.evalsets.evaluate import EVALUATOR_VERSION
from quantgate.evalsets.served import SERVE_CHECK_VERSION, machine
from quantgate.pipeline.resolve import ResolvedPlan, SplitKey


def overlap_key(plan: ResolvedPlan, calibration_fingerprint: str) -> str:
    return sha256_json({"stage": "overlap", "calibration": calibration_fingerprint, "sets": plan.golden_shas,
                        "quantgate": plan.version})


def baseline_measure_key(plan: ResolvedPlan) -> str:
    return sha256_json({"stage": "measure", "model": plan.identity_key, "hardware": plan.profile_key, "quantgate": plan.version})


def baseline_evaluate_key(plan: ResolvedPlan) -> str:
    """The baseline at every set's first look: the sets, the settings, the evaluator and the libraries."""
    return sha256_json({"stage": "evaluate", "model": plan.identity_key, "config": plan.first_look_cfg.model_dump(mode="json"),
                        "sets": plan.golden_shas, "evaluator": EVALUATOR_VERSION, "libraries": library_versions(),
                        "quantgate": plan.version})


def quantize_key(plan: ResolvedPlan, fmt: str, calibration_fingerprint: str) -> str:
    """The checkpoint's inputs, the quantization libraries' versions among them."""
    return sha256_json({"stage": "quantize", "baseline": plan.identity_key, "calibration": calibration_fingerprint,
                        "config": plan.quantize_cfgs[fmt].model_dump(mode="json"), "quantgate": plan.version,
                        "libraries": library_versions()})


def blocked_gate_key(plan: ResolvedPlan, quantize: str, failure: str) -> str:
    """The verdict on a checkpoint that failed its own checks: the failure decides it."""
    return sha256_json({"stage": "gate", "quantize": quantize, "failed": failure, "policy": plan.policy.identity})


def measure_key(plan: ResolvedPlan, checkpoint_sha: str) -> str:
    """`checkpoint_sha`: the sha256 of the checkpoint's manifest (which hashes its files)."""
    return sha256_json({"stage": "measure", "checkpoint": checkpoint_sha, "baseline": plan.identity_key,
                        "hardware": plan.profile_key, "quantgate": plan.version})


# Bump when what the looks record changes (2: every decided gate carries its stability).
SEQUENTIAL_VERSION = 2


def sequential_key(plan: ResolvedPlan, checkpoint_sha: str, *, precision: str, blocked_before: str | None,
                   split: SplitKey | None = None) -> str:
    """A candidate's looks: its checkpoint, the settings and each set's looks, the baseline, and
    the policy (its bounds decide when a look settles a gate), the precision class, and the size
    or integrity gate that blocks it before any evaluation, if one does."""
    key: dict[str, object] = {"stage": "sequential", "checkpoint": checkpoint_sha, "config": plan.eval_settings,
                             "looks": plan.looks_json, "sets": plan.golden_shas,
                             "baseline": plan.identity_key, "policy": plan.policy.identity, "precision": precision,
                             "blocked_before": blocked_before, "evaluator": EVALUATOR_VERSION, "libraries": library_versions(),
                             "quantgate": plan.version, "version": SEQUENTIAL_VERSION}
    if split is not None:  # a search trial's split (absent otherwise: a format's key stays what it was)
        key["split"] = split
    return sha256_json(key)


def serve_key(plan: ResolvedPlan, *, checkpoint: dict[str, str], results: str | None) -> str:
    """A serve check: the checkpoint's identity, the sha256 of the results manifest its gate saw
    (None: none to compare with), the serve settings, the serving engine's identity, the serve
    check's version and the machine (its decode rates are this machine's)."""
    assert plan.serve_cfg is not None and plan.serving_env is not None
    return sha256_json({"stage": "serve", "checkpoint": checkpoint, "results": results, "config": plan.serve_cfg.model_dump(mode="json"),
                        "engine": plan.serving_env.identity(), "version": SERVE_CHECK_VERSION, "machine": machine(),
                        "quantgate": plan.version, "libraries": library_versions()})


def served_results_key(plan: ResolvedPlan, *, checkpoint: str, results: str, settings: dict[str, str], device_class: str) -> str:
    """A checkpoint's golden sets evaluated as a device class serves it: its quantize key, the
    sha256 of the gated results whose items it evaluates again, the device class (its kernels
    decide the numerics), the engine settings and identity, the policy's gated sets (the sets evaluated)."""
    assert plan.serving_env is not None
    return sha256_json({"stage": "served-results", "checkpoint": checkpoint, "results": results, "device_class": device_class,
                        "sets": sorted(plan.policy.policy.metrics), "settings": dict(sorted(settings.items())),
                        "engine": plan.serving_env.identity(), "quantgate": plan.version, "libraries": library_versions()})


def gate_key(plan: ResolvedPlan, *, precision: str, evidence: str, measure: str, overlap: str, results: list[str],
             allocation: dict[str, int] | None = None, serve: list[str | None] | None = None,
             as_served: list[list[str]] | None = None) -> str:
    """A verdict: the policy, the precision class, the key of the looks, the sha256s of the
    candidate's and the paired baseline's results manifests, and the keys of the measurement and
    the overlap."""
    key: dict[str, Any] = {"stage": "gate", "policy": plan.policy.identity, "precision": precision, "evidence": evidence,
           "results": results, "measure": measure, "overlap": overlap, "quantgate": plan.version}
    if allocation is not None:  # a search trial: the bytes its size gate holds it to
        key["allocation"] = allocation
    if serve is not None:  # the sha256s of its serve record and the baseline's (absent without a serve stage)
        key["serve"] = serve
    if as_served:  # its golden sets as a device class serves it: which numerics, the results' manifest sha256 (absent: none)
        key["as_served"] = as_served
    return sha256_json(key)


def sensitivity_key(plan: ResolvedPlan, cfg: Any, calibration_fingerprint: str) -> str:
    """The per-layer sensitivity: the baseline, the calibration set, its config, the libraries."""
    return sha256_json({"stage": "sensitivity", "baseline": plan.identity_key, "calibration": calibration_fingerprint,
                        "config": cfg.model_dump(mode="json"), "quantgate": plan.version, "libraries": library_versions()})


def trial_quantize_key(plan: ResolvedPlan, cfg: Any, calibration_fingerprint: str) -> str:
    """A search trial's checkpoint: every layer's format and each format's knobs (a MixedConfig)."""
    return sha256_json({"stage": "quantize", "baseline": plan.identity_key, "calibration": calibration_fingerprint,
                        "mixed": cfg.model_dump(mode="json"), "quantgate": plan.version, "libraries": library_versions()})
