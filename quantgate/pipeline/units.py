"""The work of a run's stages, as the tasks an executor runs: module-level functions of picklable
arguments (the resolved plan, paths, configs), so that the same function runs in this process
(the local executor) or in a Ray worker on another machine (the ray executor,
docs/scale-out.md). Each returns what the runner's stage cache stores; none writes outside the
run directory it is given, and none touches the ledger (the driver is its only writer).

A process keeps the models it evaluated (`evaluator`): sequential evaluation asks for the
baseline at every look of every candidate, and a model is loaded once per process however many
looks ask (the two most recent, so a Ray worker that runs many tasks holds at most two).
"""

from __future__ import annotations

import functools
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pydantic import JsonValue

from quantgate import evalsets, quantize
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.rundir import BASELINE, RunDir
from quantgate.evalsets import served
from quantgate.pipeline.looks import Looks, LooksRecord, gated_sets
from quantgate.pipeline.resolve import ResolvedPlan, Split
from quantgate.quantize.checkpoint import CheckpointManifest
from quantgate.serving import ServingEnv, device

_EVALUATORS: OrderedDict[tuple[str, bool], evalsets.Evaluator] = OrderedDict()
_KEEP = 2  # models a process keeps loaded


def evaluator(model: Path, allow_pickle: bool, identity: evalsets.ModelIdentity | None = None, keep: int = _KEEP) -> evalsets.Evaluator:
    """The evaluator of `model` this process keeps (made, and its model loaded, on first use);
    `identity`: the model's, where the caller has it (the run's baseline: hashed once a run);
    `keep`: how many this process keeps (the plan's `models_kept`: 1 where two do not fit)."""
    key = (str(model), allow_pickle)
    if key in _EVALUATORS:
        _EVALUATORS.move_to_end(key)
        return _EVALUATORS[key]
    while len(_EVALUATORS) >= max(1, keep):  # before the new model loads: the memory is free first
        _EVALUATORS.popitem(last=False)
    made = _EVALUATORS[key] = evalsets.Evaluator(model, allow_pickle=allow_pickle, identity=identity)
    return made


def forget(model: Path | None = None) -> None:
    """Drop the kept evaluator of `model` (every one when None): its memory is not needed now."""
    for key in [key for key in _EVALUATORS if model is None or key[0] == str(model)]:
        del _EVALUATORS[key]


def model_of(plan: ResolvedPlan, run_dir: RunDir, name: str) -> Path:
    """The model behind a name of the run: the baseline's directory, or a checkpoint's."""
    return plan.model_dir if name == BASELINE else run_dir.checkpoint(name)


def evaluate(plan: ResolvedPlan, run_dir: RunDir, name: str, items: dict[str, int], out: Path,
             baseline: Path | None = None, split: Split | None = None) -> evalsets.EvaluationResults:
    """`name` (BASELINE or a checkpoint) on the sets in `items` at their first N items (of `split`,
    default the plan's own), into `out`; results already there for exactly these settings are
    used as they are."""
    cfg = plan.look_cfg(items, split)
    made = evaluator(model_of(plan, run_dir, name), plan.plan.allow_pickle, plan.identity if name == BASELINE else None,
                     plan.models_kept)
    if baseline is None and out.is_dir():
        try:
            existing = evalsets.load_results(out)
        except (InputError, IntegrityError):  # damaged, or not results: made again
            existing = None
        # reused only when every set was made under the same cache key: the same model,
        # settings, device, evaluator version and libraries
        if existing is not None and {spec: entry.cache_key for spec, entry in existing.manifest.sets.items()} \
                == made.cache_keys(cfg):
            return existing
    return made.run(cfg, out, baseline_results=baseline, overwrite=True)


def evaluate_baseline(plan: ResolvedPlan, out: Path) -> evalsets.EvaluationResults:
    """The baseline at every set's first look, into `out`."""
    return evaluator(plan.model_dir, plan.plan.allow_pickle, plan.identity, plan.models_kept).run(plan.first_look_cfg, out, overwrite=True)


def baseline_looks(plan: ResolvedPlan, run_dir: RunDir, spec: str) -> int:
    """The baseline at every look of one set that a candidate of the plan's own split can ask
    for (a set no gate looks at: its first), made before candidates run side by side, so that
    no two of them make the same look at once. Returns the looks made or found."""
    looks = Looks(plan, run_dir, functools.partial(evaluate, plan, run_dir))
    counts = baseline_look_counts(plan, spec)
    for items in counts:
        looks.baseline_at(spec, items)
    return len(counts)


def baseline_look_counts(plan: ResolvedPlan, spec: str) -> tuple[int, ...]:
    """The looks of a set a format can ask the baseline for: every one where a gate looks at
    the set, else its first (evaluated once, for the report)."""
    looks = tuple(plan.own_split.looks[spec])
    return looks if spec in gated_sets(plan) else looks[:1]


@dataclass(frozen=True)
class SequentialUnit:
    """The candidate of a sequential stage: its checkpoint's name (`fmt`), its verdict's name
    (`name`), its precision class and the size or integrity gate that blocks it before any
    evaluation (None: none does)."""

    fmt: str
    name: str
    precision: str
    blocked_before: str | None


class SequentialValue(LooksRecord):
    """The sequential stage's value (cached in sequential/): the candidate's looks, and the plan's
    part: each set's planned looks, the split's offsets, the error control and the confidence."""

    looks: dict[str, list[int]]
    offsets: dict[str, int]
    error_control: str
    confidence: float


def sequential(plan: ResolvedPlan, run_dir: RunDir, candidate: SequentialUnit, split: Split | None = None) -> SequentialValue:
    """A candidate's looks (quantgate.pipeline.looks) and, when any set was evaluated, its results
    and the paired baseline's on the same items, published in the run directory: the sequential
    stage's value."""
    fmt, name = candidate.fmt, candidate.name
    run = functools.partial(evaluate, plan, run_dir)
    try:
        outcome = Looks(plan, run_dir, run, split).run(fmt, candidate.precision, candidate.blocked_before)
        evaluated = {spec: items for spec, items in outcome.depths.items() if items}
        if evaluated:
            paired = run(BASELINE, evaluated, run_dir.paired_baseline(name), None, split)
            run(fmt, evaluated, run_dir.results(name), paired.path, split)
        else:  # blocked before a single item: no results of its own
            shutil.rmtree(run_dir.results(name), ignore_errors=True)
    finally:
        forget(run_dir.checkpoint(fmt))  # its model is not needed again for now
    looked = outcome.as_dict()
    return SequentialValue(gates=looked["gates"], depths=looked["depths"], trace=looked["trace"], blocked_by=looked["blocked_by"],
                           looks=(split or plan.own_split).looks_json, offsets=dict(split.offsets) if split else {},
                           error_control=plan.policy.policy.sequential.error_control,
                           confidence=plan.policy.policy.statistics.confidence)


def evaluate_served(plan: ResolvedPlan, checkpoint: Path, gated: Path, settings: dict[str, str], device_class: str,
                    out: Path) -> evalsets.EvaluationResults:
    """The items of the gated results `gated` (those of its multiple-choice, last-word and
    generation sets that the policy gates) evaluated again through the serving engine under
    `settings` on a machine of `device_class`: what that class serves, gated as its quality
    evidence (gates.verdict.served_quality_gates), into `out`. A machine of another class would
    compute other numerics under the same settings: refused (a unit failure)."""
    here = device.local_class("cuda" if plan.serving_env is not None and plan.serving_env.engine == "vllm" else "cpu")
    if here != device_class:
        raise RuntimeError(f"the numerics of {device_class} cannot be evaluated on this machine ({here})")
    cfg = evalsets.as_served(evalsets.load_results(gated), settings, plan.policy.policy.metrics)
    if cfg is None:
        raise InputError(f"{gated} holds no set the serving engine evaluates (text sets are scored in the reference numerics only)")
    return evaluator(checkpoint, plan.plan.allow_pickle, keep=plan.models_kept).run(cfg, out, overwrite=True)


def _room_to_quantize(plan: ResolvedPlan) -> None:
    """Where memory holds one model at a time (the plan's `models_kept`), no evaluator is kept
    while a model is quantized."""
    if plan.models_kept < 2:
        forget()


def quantize_format(plan: ResolvedPlan, fmt: str, calibration: Path, checkpoint: Path) -> CheckpointManifest:
    """A format's checkpoint, into `checkpoint`: its manifest."""
    _room_to_quantize(plan)
    made = quantize.run(plan.quantize_cfgs[fmt], plan.model_dir, calibration, checkpoint, overwrite=True,
                        allow_pickle=plan.plan.allow_pickle, placement=plan.quantize_placement)
    return made.manifest


def quantize_trial(plan: ResolvedPlan, cfg: quantize.MixedConfig, calibration: Path, checkpoint: Path) -> CheckpointManifest:
    """A search trial's mixed checkpoint, into `checkpoint`: its manifest."""
    _room_to_quantize(plan)
    made = quantize.run_mixed(cfg, plan.model_dir, calibration, checkpoint, overwrite=True, allow_pickle=plan.plan.allow_pickle,
                              placement=plan.quantize_placement)
    return made.manifest


def serve_check(checkpoint: Path, results: evalsets.EvaluationResults | None, cfg: served.ServeCheckConfig,
                env: ServingEnv, *, work: Path, reference_probe: float | None, reference_load: float | None = None) -> dict[str, JsonValue]:
    """The serve stage's value: the serve record (evalsets.served.check) as the JSON it is
    cached as; the runner reads it back through ServeRecord."""
    return served.check(checkpoint, results, cfg, env, work, reference_probe=reference_probe, reference_load=reference_load).to_json()
