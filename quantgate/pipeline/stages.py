"""Every stage of a run, declared once: its name (the `stage` its key names, and its records in
`stages/`), its kind (its stage lines, its units' logs, and the executor's resources for it:
`plan.StageKind`), what its key hashes, where it writes in the run directory
(a `quantgate.core.rundir.RunDir` path), its unit of work (what the executor runs, here or
as a Ray task) and its typed output (the record its cached value is read back through).

The runner reads all of it from here (`_Run.stored` for a JSON artifact, `_Run.made` for a
directory); docs/architecture.md, "Adding a stage or a command", adds one as an example.

Each key hashes every input that decides its stage's artifact, so that the stage cache redoes a
stage exactly when one of them changed; the key of an earlier stage stands for that stage's
inputs, and each key names its stage. What a key hashes never changes without a reason: a run
directory made by an earlier quantgate is reused only if its keys are the same bytes
(tests/test_stage_keys.py pins them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from quantgate import evalsets
from quantgate.core.artifacts import MANIFEST, library_versions, sha256_json, verify_files
from quantgate.core.records import RecordPart
from quantgate.core.rundir import RunDir
from quantgate.evalsets.evaluate import EVALUATOR_VERSION
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.evalsets.served import SERVE_CHECK_VERSION, machine
from quantgate.gates.verdict_record import GateRecord, Number, OverlapSummary, TraceEntry, VerdictRecord, read_part
from quantgate.pipeline.resolve import ResolvedPlan, SplitKey
from quantgate.quantize.checkpoint import CheckpointManifest, QuantizationFailed
from quantgate.quantize.measure import stage_measurement
from quantgate.quantize.sensitivity import load as load_sensitivity

P = ParamSpec("P")
V = TypeVar("V")

# Bump when what the looks record changes (2: every decided gate carries its stability).
SEQUENTIAL_VERSION = 2


@dataclass(frozen=True)
class Unit:
    """A unit of work, by its module and function: looked up where and when it runs (in this
    process, or in a Ray worker, where it travels by name), so that it pickles as two strings."""

    module: str
    function: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.function)(*args, **kwargs)


@dataclass(frozen=True)
class Stage:
    """A stage: `name` (its key's `stage`, its records' names), `kind` (its stage lines; with a
    unit, the executor's StageKind), `where` (its artifact in the run directory, from the names
    the runner gives) and `unit` (its work; None: the driver's own, as a gate is)."""

    name: str
    kind: str
    where: Callable[..., Path]
    unit: Unit | None

    def task(self, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """Its unit on these arguments: what the executor runs (picklable when they are)."""
        assert self.unit is not None, f"the {self.name} stage is the driver's own work"
        return partial(self.unit, *args, **kwargs)


@dataclass(frozen=True)
class JsonStage(Stage, Generic[P, V]):
    """A stage whose artifact is one JSON file (its value stored with its key, core.stagecache):
    `keyed` computes its key, `read` reads its value back as its record (given the artifact's
    path, which its errors name)."""

    keyed: Callable[Concatenate[ResolvedPlan, P], str]
    read: Callable[[object, str], V]

    def key(self, plan: ResolvedPlan, *args: P.args, **kwargs: P.kwargs) -> str:
        return self.keyed(plan, *args, **kwargs)


@dataclass(frozen=True)
class DirectoryStage(Stage, Generic[P, V]):
    """A stage whose artifact is a directory with a manifest (its key in `stages/`): `load`
    reads it back, verified; `failures`: the errors its unit raises that are this stage's
    outcome for these inputs (recorded, not raised)."""

    keyed: Callable[Concatenate[ResolvedPlan, P], str]
    load: Callable[[Path], V | None]
    failures: tuple[type[Exception], ...] = ()

    def key(self, plan: ResolvedPlan, *args: P.args, **kwargs: P.kwargs) -> str:
        return self.keyed(plan, *args, **kwargs)

    def record(self, *names: str) -> str:
        """Its record's name in `stages/`: `quantize-gptq-int4`, `evaluate-baseline`, `sensitivity`."""
        return "-".join((self.name, *names))


class SequentialStage(RecordPart):
    """The sequential stage's value (quantgate.pipeline.units.sequential): the looks' gates, the
    items evaluated per set, every gate at every look, what stopped them, the split's looks."""

    gates: list[GateRecord]
    depths: dict[str, int]
    trace: list[TraceEntry]
    blocked_by: str | None
    looks: dict[str, list[int]]
    offsets: dict[str, int] = {}
    error_control: str
    confidence: Number


def verified_checkpoint(path: Path) -> CheckpointManifest:
    """A checkpoint's manifest, after checking its files against it."""
    manifest = CheckpointManifest.read(path / MANIFEST)
    verify_files(path, manifest.files, f"checkpoint {path}")
    return manifest


# ---- what each key hashes -------------------------------------------------------------------

def overlap_key(plan: ResolvedPlan, calibration_fingerprint: str) -> str:
    return sha256_json({"stage": "overlap", "calibration": calibration_fingerprint, "sets": plan.golden_shas,
                        "quantgate": plan.version})


def baseline_measure_key(plan: ResolvedPlan) -> str:
    return sha256_json({"stage": "measure", "model": plan.identity_key, "hardware": plan.profile_key, "quantgate": plan.version})


def baseline_evaluate_key(plan: ResolvedPlan) -> str:
    """The baseline at every set's first look: the sets, the settings, the evaluator and the libraries."""
    return sha256_json({"stage": "evaluate", "model": plan.identity_key, "config": plan.first_look_cfg.keyed(),
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


# ---- the registry -----------------------------------------------------------------------------

def _units(function: str) -> Unit:
    return Unit("quantgate.pipeline.units", function)


# A JSON stage's typed output: its stored value read as its record (`path`: the artifact, for errors).

def _read_overlap(value: object, path: str) -> OverlapSummary:
    return read_part(OverlapSummary, value, f"{path}: value")


def _read_sequential(value: object, path: str) -> SequentialStage:
    return read_part(SequentialStage, value, f"{path}: value")


def _read_serve(value: object, path: str) -> ServeRecord:
    return ServeRecord.from_json(value, f"{path}: value")


def _read_verdict(value: object, path: str) -> VerdictRecord:
    return VerdictRecord.from_json(value, f"{path}: value")


# The calibration set keys itself (calibration.run reuses a set made from the same inputs).
CALIBRATION = Stage(name="calibration", kind="calibration", where=lambda run_dir: run_dir.calibration,
                    unit=Unit("quantgate.calibration", "run"))
OVERLAP = JsonStage(name="overlap", kind="overlap", where=lambda run_dir: run_dir.overlap, keyed=overlap_key,
                    unit=Unit("quantgate.gates.stage", "overlap_summary"), read=_read_overlap)
BASELINE_MEASURE = JsonStage(name="measure", kind="measure", where=RunDir.measure,
                             keyed=baseline_measure_key, unit=Unit("quantgate.quantize.measure", "measure_and_bound"),
                             read=stage_measurement)
BASELINE_EVALUATE = DirectoryStage(name="evaluate", kind="evaluate", where=RunDir.results, keyed=baseline_evaluate_key,
                                   unit=_units("evaluate_baseline"), load=evalsets.load_results)
QUANTIZE = DirectoryStage(name="quantize", kind="quantize", where=RunDir.checkpoint, keyed=quantize_key,
                          unit=_units("quantize_format"), load=verified_checkpoint,
                          # the checkpoint failed its own checks (no load, NaN/Inf logits): the format is
                          # blocked for it, and the same inputs give the same failure next time
                          failures=(QuantizationFailed,))
MEASURE = JsonStage(name="measure", kind="measure", where=RunDir.measure, keyed=measure_key,
                    unit=Unit("quantgate.quantize.measure", "measure_and_bound"), read=stage_measurement)
SEQUENTIAL = JsonStage(name="sequential", kind="evaluate", where=RunDir.sequential, keyed=sequential_key,
                       unit=_units("sequential"), read=_read_sequential)
SERVE = JsonStage(name="serve", kind="serve", where=RunDir.serve, keyed=serve_key, unit=_units("serve_check"),
                  read=_read_serve)
SERVED_RESULTS = DirectoryStage(name="served-results", kind="evaluate", where=RunDir.served_results, keyed=served_results_key,
                                unit=_units("evaluate_served"), load=evalsets.load_results)
GATE = JsonStage(name="gate", kind="gate", where=RunDir.verdict, keyed=gate_key, unit=None, read=_read_verdict)
BLOCKED_GATE = JsonStage(name="gate", kind="gate", where=RunDir.verdict, keyed=blocked_gate_key, unit=None,
                         read=_read_verdict)
SENSITIVITY = DirectoryStage(name="sensitivity", kind="sensitivity", where=RunDir.sensitivity, keyed=sensitivity_key,
                             unit=Unit("quantgate.quantize.sensitivity", "run"), load=load_sensitivity)
TRIAL_QUANTIZE = DirectoryStage(name="quantize", kind="quantize", where=RunDir.checkpoint, keyed=trial_quantize_key,
                                unit=_units("quantize_trial"), load=verified_checkpoint, failures=(QuantizationFailed,))

STAGES: tuple[Stage, ...] = (CALIBRATION, OVERLAP, BASELINE_MEASURE, BASELINE_EVALUATE, QUANTIZE, MEASURE, SEQUENTIAL, SERVE,
                             SERVED_RESULTS, GATE, BLOCKED_GATE, SENSITIVITY, TRIAL_QUANTIZE)


def executor_kinds() -> set[str]:
    """The kinds of the stages whose work is a unit (the executor's `StageKind`s)."""
    return {stage.kind for stage in STAGES if stage.unit is not None}

