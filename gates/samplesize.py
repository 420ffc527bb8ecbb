"""Sample-size guidance: how many items a gate needs before its interval lies wholly on one side
of its bound, at a given true distance from the bound (the effect), with the policy's confidence
split over a set's looks (gates/sequential.py), with a given power.

Normal approximation for the paired difference of one item, standard deviation sd:

    n = ((z_{1 - a/2K} + z_power) * sd / effect)^2,    a = 1 - confidence, K = looks

(the minimum-detectable-effect formula of a two-sided test, solved for n). Where no results are
at hand the per-item sd of an accuracy gate comes from the share of items the two models answer
differently (the discordance d): a 0/1 paired difference with true mean delta has variance
d - delta^2, at most d. Other metrics have no such default: their per-item spread is estimated
from a baseline's and a candidate's results, from the width of the gate's own bootstrap interval
over the n items evaluated (sd = half_width * sqrt(n) / z).

The arithmetic is pure; `plan` at the bottom loads a policy, the sets' sizes and optional results
for `quantgate evalsets plan`. docs/gates.md, "Sample-size guidance".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import TypedDict

from quantgate import evalsets
from quantgate.core.errors import InputError, did_you_mean
from quantgate.core.formats import PRECISION_CLASSES, PrecisionClass
from quantgate.core.ids import SetRef
from quantgate.core.metrics import METRICS, Metric, Statistic
from quantgate.evalsets.sets import all_names
from quantgate.gates.policy import LoadedPolicy, MetricGate, load_policy
from quantgate.gates.sequential import critical_value, look_confidence, schedule
from quantgate.gates.stage import item_records, valid_metrics
from quantgate.gates.verdict import Records, gate_records, metric_gate
from quantgate.gates.verdict_record import Number, PolicyIdentity

DEFAULT_POWER = 0.8
# The default effect: this share of a bound's distance from "no change" (0 for a change, the
# baseline's own value for an agreement or a KL), so a candidate that costs half of what the
# bound allows passes with `power`, and one that costs half as much again as the bound fails.
DEFAULT_EFFECT_FRACTION = 0.5
# Planning values of the discordance (share of items two models answer differently) of
# accuracy gates, per precision class, where neither --discordance nor results are given. Not
# measurements: quantized models flip answers both ways even where accuracy holds (Dutta et al.,
# 2024, "Accuracy is Not All You Need", arXiv 2407.09141), so d is well above the accuracy change;
# 8-bit formats flip few answers, INT4 formats more, small models most. Measure your own.
DEFAULT_DISCORDANCE: dict[str, float] = {PrecisionClass.eight_bit: 0.05, PrecisionClass.four_bit: 0.15}


# ---- the arithmetic -------------------------------------------------------------------------


def items_needed(effect: float, sd: float, *, confidence: float, looks: int = 1, power: float = DEFAULT_POWER) -> int:
    """Items for an interval at `confidence` split over `looks` looks to lie wholly on one side of
    a bound `effect` away from the truth with probability `power`, per-item sd `sd` (same unit)."""
    if not effect > 0 or not math.isfinite(effect):
        raise InputError(f"an effect must be a positive distance from the bound, got {effect}")
    if not sd >= 0 or not math.isfinite(sd):
        raise InputError(f"a per-item standard deviation must be zero or more, got {sd}")
    _check_share("confidence", confidence)
    _check_share("power", power)
    if looks < 1:
        raise InputError(f"looks must be at least 1, got {looks}")
    z = critical_value(confidence, looks) + NormalDist().inv_cdf(power)
    return max(1, math.ceil((z * sd / effect) ** 2 - 1e-9))


def accuracy_sd(discordance: float, difference: float = 0.0) -> float:
    """Per-item sd of a 0/1 paired difference (candidate - baseline correct): sqrt(d - delta^2) for
    discordance d and true difference delta, both as shares of items (0.05, not 5 points)."""
    if not 0 < discordance <= 1:
        raise InputError(f"a discordance is a share of items in (0, 1], got {discordance}")
    if abs(difference) > discordance:
        raise InputError(f"a difference of {difference} needs at least that share of items to differ, not {discordance}")
    return math.sqrt(discordance - difference**2)


def sd_from_interval(half_width: float, items: int, confidence: float) -> float:
    """The per-item sd a two-sided interval of this half-width over `items` items implies:
    half_width = z * sd / sqrt(items)."""
    if items < 1:
        raise InputError("an interval over no items says nothing of the spread")
    return half_width * math.sqrt(items) / critical_value(confidence)


def zero_loss_floor(bound: float, *, confidence: float, looks: int = 1) -> int | None:
    """Accuracy gates: the fewest items at which a candidate that loses exactly the bound's share
    of items (`bound`, 0.05 for 5 points) and gains none shows no loss at all with probability at
    most one look's one-sided error, (1 - confidence) / 2K. Below it, a look can see every item
    agree, get the interval [0, 0], and pass a regression at the bound (tests/test_sequential.py
    measures it). None for a bound of no drop at all (no such floor)."""
    if not 0 < bound < 1:
        return None
    error = (1 - look_confidence(confidence, looks)) / 2
    return math.ceil(math.log(error) / math.log(1 - bound) - 1e-9)


def no_change(metric: Metric) -> float:
    """A metric's value for a candidate identical to its baseline: 0 for a change (points,
    percent), the baseline's own value for an agreement or a divergence."""
    return 0.0 if metric.is_change else (metric.baseline_value or 0.0)


def _check_share(name: str, value: float) -> None:
    if not 0 < value < 1:
        raise InputError(f"{name} must be in (0, 1), got {value}")


# ---- effects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Effects:
    """The true distance from each bound to plan for, in each gate's own unit: `by_metric` for
    one metric's gates, else `every` for all, else `fraction` of the bound's distance from no change."""

    every: float | None = None
    by_metric: Mapping[str, float] = field(default_factory=dict)
    fraction: float = DEFAULT_EFFECT_FRACTION

    def for_gate(self, metric: Metric, limit: float) -> tuple[float, str]:
        """The effect for one gate, and where it came from."""
        if metric.name in self.by_metric:
            return self.by_metric[metric.name], f"--effect {metric.name}"
        if self.every is not None:
            return self.every, "--effect"
        distance = abs(limit - no_change(metric))
        if distance == 0:
            raise InputError(f"the {metric.name} bound is at no change ({limit}), so a share of its distance is no effect: "
                             f"give --effect {metric.name}=X")
        return self.fraction * distance, f"{self.fraction:g} of the bound's distance from no change"


def parse_effects(values: Sequence[str]) -> Effects:
    """`X` (every gate) and `METRIC=X` (that metric's gates), X a positive number in the gate's unit."""
    every: float | None = None
    by_metric: dict[str, float] = {}
    for value in values:
        name, _, number = value.rpartition("=")
        try:
            effect = float(number)
        except ValueError as error:
            raise InputError(f"invalid --effect {value!r}: expected X or METRIC=X, X a number") from error
        if not effect > 0 or not math.isfinite(effect):
            raise InputError(f"invalid --effect {value!r}: an effect is a positive distance from the bound")
        if not name:
            every = effect
        elif name not in METRICS:
            raise InputError(f"invalid --effect {value!r}: unknown metric {name!r}{did_you_mean(name, list(METRICS))}")
        else:
            by_metric[name] = effect
    return Effects(every=every, by_metric=by_metric)


# ---- spreads measured from results ----------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """The per-item sd of one gate's statistic, from the gate's bootstrap interval on results."""

    sd: float
    items: int
    half_width: float
    confidence: float
    estimate: float  # the gate's value on those results (unit of the gate)


def measured_spreads(baseline_items: Mapping[str, Records], candidate_items: Mapping[str, Records],
                     policy: LoadedPolicy) -> dict[tuple[str, str], Spread]:
    """(policy set key, metric) -> the spread of each gate whose set both results hold, from the
    gate's own interval (`gates.verdict.metric_gate`, one look at the policy's confidence) over
    the items evaluated: sd = half_width * sqrt(n) / z. Sets the results lack are left out."""
    spreads: dict[tuple[str, str], Spread] = {}
    settings = policy.policy.statistics
    for key, gates in policy.policy.metrics.items():
        wanted = SetRef.parse(key)
        spec = next((s for s in candidate_items if wanted.matches(SetRef.parse(s))), None)
        if spec is None or spec not in baseline_items:
            continue
        pair = gate_records(spec, list(baseline_items[spec]), list(candidate_items[spec]))
        for name, gate in gates.items():
            result = metric_gate(spec, _gated(name), gate, pair, settings=settings, precision=_any_precision(gate))
            if result.half_width is None or result.items is None or result.estimate is None:
                continue
            sd = sd_from_interval(result.half_width, result.items, settings.confidence)
            spreads[(key, name)] = Spread(sd=sd, items=result.items, half_width=result.half_width,
                                          confidence=settings.confidence, estimate=result.estimate)
    return spreads


def _gated(name: str) -> Metric:
    metric = METRICS.get(name)
    if metric is None or not metric.gateable:
        raise InputError(f"no gate rule for metric {name!r}")
    return metric


def _any_precision(gate: MetricGate) -> str:
    """A precision class the gate has a bound for (an interval's width does not depend on it)."""
    bounds: dict[str, float] = getattr(gate, gate.kind)
    return next(iter(bounds))


# ---- the plan -------------------------------------------------------------------------------


class GatePlanJSON(TypedDict):
    """A gate's plan as `quantgate plan --json` prints it (GatePlan.as_dict)."""

    gate: str
    precision: str
    unit: str
    limit: Number
    effect: Number
    effect_from: str
    sd: Number | None
    sd_from: str
    items: int | None
    looks: list[int]
    look_confidence: Number
    look: int | None
    set_size: int
    min_items: int
    zero_loss_floor: int | None
    floor_warning: str | None


class PlanJSON(TypedDict):
    """A policy's plan as `quantgate plan --json` prints it (Plan.as_dict)."""

    policy: dict[str, object]  # the policy's identity (PolicyIdentity.to_json)
    power: Number
    gates: list[GatePlanJSON]


class GatePowerJSON(TypedDict):
    """One gate's planned power as run.json and the report record it (GatePower.as_dict)."""

    split: str
    set: str
    gate: str
    precision: str
    ceiling: int
    planned: bool
    items: int | None
    power: Number | None
    target: Number
    effect: Number
    limit: Number
    unit: str
    discordance: Number | None
    source: str
    decidable: bool | None



@dataclass(frozen=True)
class GatePlan:
    gate: str  # "arc-easy acc"
    precision: str
    unit: str
    limit: float  # in the gate's unit, as verdicts compare it (an accuracy drop is negative)
    effect: float
    effect_from: str
    sd: float | None  # per item, in the gate's unit; None: no default and no results
    sd_from: str
    items: int | None  # for a decisive verdict at this effect and power; None without an sd
    looks: list[int]  # the set's schedule: planned looks below its size, then its size
    look_confidence: float
    look: int | None  # 1-based: the first look with at least `items` items; None: past the set
    set_size: int
    min_items: int
    zero_loss_floor: int | None  # accuracy gates (docs/gates.md): keep min_items at least this

    @property
    def floor_warning(self) -> str | None:
        """Why this gate may decide on too few items (docs/gates.md), where it may."""
        floor = self.zero_loss_floor
        if floor is None or self.looks[0] >= floor or self.min_items >= floor:
            return None
        if len(self.looks) == 1:
            return (f"the set's {self.set_size} items are below the zero-loss floor of {floor}: a regression at the bound "
                    "passes more often than the policy's error allows")
        return (f"the first look ({self.looks[0]} items) is below the zero-loss floor of {floor} items and min_items is "
                f"{self.min_items}: set min_items to at least {floor}")

    def as_dict(self) -> GatePlanJSON:
        return GatePlanJSON(gate=self.gate, precision=self.precision, unit=self.unit, limit=self.limit, effect=self.effect,
                            effect_from=self.effect_from, sd=self.sd, sd_from=self.sd_from, items=self.items, looks=list(self.looks),
                            look_confidence=self.look_confidence, look=self.look, set_size=self.set_size, min_items=self.min_items,
                            zero_loss_floor=self.zero_loss_floor, floor_warning=self.floor_warning)

    def describe(self) -> str:
        """One line: what the gate needs, and where that falls."""
        signed = self.unit in ("points", "%")
        effect = f"{_number(self.effect, self.unit, signed=False)} from the bound {_number(self.limit, self.unit, signed=signed)}"
        if self.sd is None or self.items is None:
            return f"{self.gate} ({self.precision}): at {effect}: {self.sd_from}"
        where = f"look {self.look} ({self.looks[self.look - 1]} items)" if self.look is not None else \
            f"more than the set's {self.set_size} items"
        line = (f"{self.gate} ({self.precision}): needs {self.items} items to decide at {effect} (sd "
                f"{_number(self.sd, self.unit, signed=False)} an item: {self.sd_from}); looks {', '.join(map(str, self.looks))} "
                f"at {self.look_confidence * 100:.4g}% each: {where}")
        return line if self.floor_warning is None else f"{line}; warning: {self.floor_warning}"


def _number(value: float, unit: str, *, signed: bool = True) -> str:
    sign = "+" if signed else ""
    if unit == "points":
        return f"{value:{sign}.2f} points"
    if unit == "%":
        return f"{value:{sign}.2f}%"
    return f"{value:{sign}.4g}"


def _limit(gate: MetricGate, precision: str) -> float:
    threshold = gate.threshold(precision)
    return -threshold if gate.kind == "max_drop_points" else threshold


@dataclass(frozen=True)
class GateInputs:
    """What one gate's plan is computed from, besides the gate."""

    precision: str
    set_size: int
    looks: Sequence[int]
    effects: Effects = Effects()
    discordance: float | None = None
    spread: Spread | None = None
    power: float = DEFAULT_POWER


def plan_gate(name: str, metric: Metric, gate: MetricGate, policy: LoadedPolicy, inputs: GateInputs) -> GatePlan:
    """One gate at one precision class: items for a decisive verdict, and the look it falls in."""
    settings, sequential = policy.policy.statistics, policy.policy.sequential
    limit = _limit(gate, inputs.precision)
    effect, effect_from = inputs.effects.for_gate(metric, limit)
    looks = schedule(inputs.looks, inputs.set_size)
    floor = None
    if metric.statistic is Statistic.mean_difference:
        floor = zero_loss_floor(-limit / metric.scale, confidence=settings.confidence, looks=len(looks))
    sd, sd_from = _spread(metric, inputs)
    min_items = gate.min_items or sequential.min_items
    needed = None
    if sd is not None:
        needed = max(min_items, items_needed(effect, sd, confidence=settings.confidence, looks=len(looks), power=inputs.power))
    look = next((index + 1 for index, n in enumerate(looks) if needed is not None and n >= needed), None)
    return GatePlan(gate=name, precision=inputs.precision, unit=metric.unit, limit=limit, effect=effect, effect_from=effect_from,
                    sd=sd, sd_from=sd_from, items=needed, looks=looks,
                    look_confidence=look_confidence(settings.confidence, len(looks)), look=look, set_size=inputs.set_size,
                    min_items=min_items, zero_loss_floor=floor)


def _spread(metric: Metric, inputs: GateInputs) -> tuple[float | None, str]:
    spread = inputs.spread
    if spread is not None:
        return spread.sd, (f"measured: half-width {_number(spread.half_width, metric.unit, signed=False)} at "
                           f"{spread.confidence:.0%} over {spread.items} items")
    if metric.statistic is Statistic.mean_difference:
        if inputs.discordance is not None:
            return accuracy_sd(inputs.discordance) * metric.scale, f"discordance {inputs.discordance:g}"
        default = DEFAULT_DISCORDANCE[inputs.precision]
        return accuracy_sd(default) * metric.scale, f"planning discordance {default:g}, the {inputs.precision} default"
    return None, f"no default spread for {metric.name}: give --baseline-results and --candidate-results"


@dataclass(frozen=True)
class Plan:
    policy: PolicyIdentity  # the policy's identity
    label: str
    power: float
    gates: list[GatePlan]

    def as_dict(self) -> PlanJSON:
        return PlanJSON(policy=self.policy.to_json(), power=self.power, gates=[gate.as_dict() for gate in self.gates])

    def lines(self) -> list[str]:
        return [f"plan under {self.label}: items for a decisive verdict with power {self.power:g}, the confidence split "
                "over each set's looks (Bonferroni)",
                *(f"  {gate.describe()}" for gate in self.gates)]


def plan_policy(policy: LoadedPolicy, set_sizes: Mapping[str, int], *, precision: str | None = None,
                effects: Effects = Effects(), discordance: float | None = None,
                spreads: Mapping[tuple[str, str], Spread] | None = None, power: float = DEFAULT_POWER) -> list[GatePlan]:
    """Every gate of the policy at `precision` (default: every class it gives a bound for).
    `set_sizes`: policy set key -> the set's items (the ceiling)."""
    if precision is not None and precision not in PRECISION_CLASSES:
        raise InputError(f"--precision must be one of {', '.join(PRECISION_CLASSES)}, got {precision!r}")
    if discordance is not None and not 0 < discordance <= 1:
        raise InputError(f"--discordance is a share of items in (0, 1], got {discordance}")
    _check_share("--power", power)
    gated = sorted({name for gates in policy.policy.metrics.values() for name in gates})
    stray = [name for name in effects.by_metric if name not in gated]
    if stray:
        raise InputError(f"--effect names {', '.join(stray)}, which the policy does not gate; it gates {', '.join(gated)}")
    plans = []
    for key, gates in policy.policy.metrics.items():
        set_name = SetRef.parse(key).name
        for name, gate in gates.items():
            metric = _gated(name)
            bounds: dict[str, float] = getattr(gate, gate.kind)
            for precision_class in [precision] if precision is not None else PRECISION_CLASSES:
                if precision_class not in bounds:
                    continue
                inputs = GateInputs(precision=precision_class, set_size=set_sizes[key], looks=policy.policy.sequential.looks_for(set_name),
                                    effects=effects, discordance=discordance, spread=(spreads or {}).get((key, name)),
                                    power=power)
                plans.append(plan_gate(f"{set_name} {name}", metric, gate, policy, inputs))
    if not plans:
        raise InputError(f"policy {policy.label} gives no bound for {precision} formats")
    return plans


def plan(policy_spec: str | Path, *, precision: str | None = None, effects: Sequence[str] = (), discordance: float | None = None,
         baseline_results: Path | None = None, candidate_results: Path | None = None, power: float = DEFAULT_POWER) -> Plan:
    """`quantgate evalsets plan`: the policy (validated against every known set), each gated set's
    size, and the spreads measured on the results when both are given."""
    if (baseline_results is None) != (candidate_results is None):
        raise InputError("give both --baseline-results and --candidate-results (a candidate evaluated against that "
                         "baseline), or neither")
    parsed = parse_effects(effects)
    policy = load_policy(policy_spec, valid_metrics(all_names()))
    sizes = {key: evalsets.load(key).size for key in policy.policy.metrics}
    spreads = None
    if baseline_results is not None and candidate_results is not None:
        baseline_items = item_records(evalsets.load_results(baseline_results))
        candidate_items = item_records(evalsets.load_results(candidate_results))
        spreads = measured_spreads(baseline_items, candidate_items, policy)
        if not spreads:
            raise InputError(f"the results hold none of the sets policy {policy.label} gates "
                             f"({', '.join(policy.policy.metrics)}) for both models")
    gates = plan_policy(policy, sizes, precision=precision, effects=parsed, discordance=discordance, spreads=spreads,
                        power=power)
    return Plan(policy=PolicyIdentity(**policy.identity), label=policy.label, power=power, gates=gates)


# ---- planned ceilings and the power of a ceiling ---------------------------------------------
# A plan's ceiling of a set (`planned`, docs/gates.md "Planned ceilings") comes from the policy's
# bounds and a discordance chosen before any candidate is evaluated, never from the candidates'
# numbers; every ceiling, planned or given, records the power it gives each gate.

# Where DEFAULT_DISCORDANCE comes from, as a gate's planned power records it.
DEFAULT_DISCORDANCE_SOURCE = ("quantgate's planning default for {precision} formats (gates/samplesize.py DEFAULT_DISCORDANCE): "
                              "an assumption, not a measurement (Dutta et al., 2024, arXiv 2407.09141)")


@dataclass(frozen=True)
class Discordance:
    """The discordance accuracy gates are planned with: the plan's value for a precision class,
    with the source it names, else DEFAULT_DISCORDANCE."""

    values: Mapping[str, float] = field(default_factory=dict)
    source: str = ""

    def for_class(self, precision: str) -> tuple[float, str]:
        if precision in self.values:
            return self.values[precision], self.source
        return DEFAULT_DISCORDANCE[precision], DEFAULT_DISCORDANCE_SOURCE.format(precision=precision)


def power_at(items: int, effect: float, sd: float, *, confidence: float, looks: int = 1, min_items: int = 1) -> float:
    """The probability that the interval over `items` items (the confidence split over `looks`)
    lies wholly on one side of a bound `effect` away from the truth: Phi(effect sqrt(n) / sd -
    z_{1 - a/2K}), the inverse of `items_needed`; 0 below `min_items` (no verdict there)."""
    if items < min_items:
        return 0.0
    if sd == 0:
        return 1.0
    return NormalDist().cdf(effect * math.sqrt(items) / sd - critical_value(confidence, looks))


@dataclass(frozen=True)
class GatePower:
    """One gate of one split at one precision class: its ceiling, the items it needs to be decided
    with `target` power at `effect` from its bound, and the power its ceiling gives there."""

    split: str  # "plan", "search" or "held-out"
    set: str  # the set's spec
    gate: str  # the metric
    precision: str
    ceiling: int
    planned: bool  # the ceiling is the planner's (`planned`), not a number the plan gives
    items: int | None  # for `target` power; None: no prior spread for this metric
    power: float | None  # at the ceiling, at `effect`
    target: float
    effect: float
    limit: float  # in the gate's unit, as verdicts compare it
    unit: str
    discordance: float | None
    source: str  # where the discordance comes from, or why there is no prior spread

    @property
    def decidable(self) -> bool | None:
        """Whether the ceiling gives the target power; None where it cannot be said."""
        return None if self.items is None else self.items <= self.ceiling

    def as_dict(self) -> GatePowerJSON:
        return GatePowerJSON(split=self.split, set=self.set, gate=self.gate, precision=self.precision, ceiling=self.ceiling,
                             planned=self.planned, items=self.items, power=self.power, target=self.target, effect=self.effect,
                             limit=self.limit, unit=self.unit, discordance=self.discordance, source=self.source,
                             decidable=self.decidable)

    def warning(self) -> str:
        """The line preflight prints for a gate its ceiling cannot decide at the target power."""
        split = "" if self.split == "plan" else f"{self.split} split: "
        effect = f"{_number(self.effect, self.unit, signed=False)} inside its bound {_number(self.limit, self.unit)}"
        prior = (f"discordance {self.discordance:g}, the {self.precision} planning default" if self.source.startswith("quantgate's")
                 else f"discordance {self.discordance:g}: {self.source}")
        return (f"{split}{self.set} {self.gate} ({self.precision}): {self.ceiling} items decide a candidate "
                f"{effect} with power {self.power or 0.0:.2f}, not {self.target:g}: that needs {self.items} items ({prior})")


def _prior_plan(set_name: str, name: str, gate: MetricGate, policy: LoadedPolicy, precision: str, *, ceiling: int,
                prior: Discordance, power: float) -> tuple[GatePlan, float | None, str]:
    """`plan_gate` at a ceiling (the looks of its schedule split the confidence), with the prior."""
    metric = _gated(name)
    discordance, source = prior.for_class(precision) if metric.statistic is Statistic.mean_difference else (None, "")
    inputs = GateInputs(precision=precision, set_size=ceiling, looks=policy.policy.sequential.looks_for(set_name),
                        discordance=discordance, power=power)
    planned = plan_gate(f"{set_name} {name}", metric, gate, policy, inputs)
    if planned.sd is None:
        source = f"no prior spread for {name}"
    return planned, discordance, source


def _own_ceiling(set_name: str, name: str, gate: MetricGate, policy: LoadedPolicy, precision: str, *, size: int,
                 prior: Discordance, power: float) -> int | None:
    """The smallest ceiling of a set of `size` items at which one gate needs no more items than
    it holds, the confidence split over that ceiling's looks: the first look of the set's
    schedule that does, or, past the policy's last look, the items needed themselves; `size`
    where none does (capped); None without a prior spread."""
    looks = policy.policy.sequential.looks_for(set_name)
    for ceiling in schedule(looks, size):
        planned, _, _ = _prior_plan(set_name, name, gate, policy, precision, ceiling=ceiling, prior=prior, power=power)
        if planned.items is None:
            return None
        if planned.items <= ceiling:
            past_the_looks = ceiling == size and all(n < size for n in looks)
            return planned.items if past_the_looks else ceiling
    return size


def gate_powers(policy: LoadedPolicy, spec: str, precisions: Sequence[str], ceiling: int | None, *, size: int,
                split: str = "plan", prior: Discordance = Discordance(), power: float = DEFAULT_POWER) -> tuple[int, list[GatePower]]:
    """A set's ceiling and the power it gives each of the policy's gates of the set at each of
    `precisions` (those the gate bounds). `ceiling` None: planned, the largest of its gates' own
    ceilings (`_own_ceiling`), at most `size`; a gate that needs more is not decidable at `power`
    (`GatePower.decidable`). A set none of whose gates has a prior spread cannot be planned
    (InputError)."""
    ref = SetRef.parse(spec)
    pairs = [(name, gate, precision) for key, by_metric in policy.policy.metrics.items() if SetRef.parse(key).matches(ref)
             for name, gate in by_metric.items() for precision in precisions if precision in getattr(gate, gate.kind)]
    if ceiling is None:
        owns = [_own_ceiling(ref.name, name, gate, policy, precision, size=size, prior=prior, power=power) for name, gate, precision in pairs]
        known = [own for own in owns if own is not None]
        if not known:
            gated = ", ".join(sorted({name for name, *_ in pairs}))
            why = f"none of its gates ({gated}) has a prior spread to plan from" if gated else f"policy {policy.label} gates nothing on it"
            raise InputError(f"plan: {spec}'s ceiling is planned, but {why}: give its ceiling as a number")
        chosen, planned = max(known), True
    else:
        chosen, planned = ceiling, False
    powers = []
    for name, gate, precision in pairs:
        gate_plan, discordance, source = _prior_plan(ref.name, name, gate, policy, precision, ceiling=chosen, prior=prior, power=power)
        at = None if gate_plan.sd is None else power_at(
            chosen, gate_plan.effect, gate_plan.sd, confidence=policy.policy.statistics.confidence, looks=len(gate_plan.looks),
            min_items=gate_plan.min_items)
        powers.append(GatePower(split=split, set=spec, gate=name, precision=precision, ceiling=chosen, planned=planned,
                                items=gate_plan.items, power=at, target=power, effect=gate_plan.effect, limit=gate_plan.limit,
                                unit=gate_plan.unit, discordance=discordance, source=source))
    return chosen, powers
