"""The gated mixed-precision search of a run (`search:` in the plan; docs/search.md).

sensitivity of every layer group (quantize.sensitivity) -> the search space: each group's exact
bytes in each format, measured on the format's uniform checkpoint of this run, and its predicted
cost -> trials: a byte budget (gates.search.next_budget), its allocation (quantize.allocation),
one mixed checkpoint quantized, measured, evaluated on the search split and gated like any
format -> the smallest approved trial gated once more on the held-out split, whose verdict alone
can approve it.

The run's stages do the work (`Trials`, the runner's callbacks); this module decides what they
are asked to do and writes the search's record (`search.json`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypedDict

from quantgate.core.errors import InputError
from quantgate.gates.search import Tried, chosen, conclusion, next_budget
from quantgate.gates.verdict import passes_here
from quantgate.pipeline.budget import ignored as _ignored
from quantgate.pipeline.plan import SearchPlan
from quantgate.pipeline.resolve import ResolvedPlan
from quantgate.quantize.allocation import Allocation, AllocationJSON, Option, Unit, allocate
from quantgate.quantize.config import UNQUANTIZED, MixedConfig
from quantgate.quantize.fusion import LayerGroup, layer_groups
from quantgate.quantize.measure.record import MeasurementRecord
from quantgate.quantize.presets import get_preset

TRIAL_PREFIX = "search-"


class SpaceSummary(TypedDict):
    """The search space as search.json records it (`Space.as_dict`)."""

    groups: int  # layer groups searched
    fixed_bytes: int
    baseline_bytes: int
    uniform_bytes: dict[str, int]


class TrialEntry(TypedDict):
    """One trial in search.json: its budget, the bytes and predicted cost its allocation gives,
    and its verdict with the reasons."""

    name: str
    budget_bytes: int
    budget_ratio: float
    bytes: int
    ratio: float
    predicted_cost: float
    groups_by_format: dict[str, int]
    allocation: AllocationJSON
    verdict: str
    reasons: list[str]


class Repeat(TypedDict):
    """A budget whose allocation an earlier trial had: its verdict stands."""

    budget_bytes: int
    same_as: str


class HeldOutVerdict(TypedDict):
    verdict: str
    reasons: list[str]


class _SearchBounds(TypedDict, total=False):
    """What a search knows once its space is built: absent from the record of a search that
    stopped before (`stopped_search`)."""

    ceiling_bytes: int
    lo_bytes: int
    space: SpaceSummary


class SearchRecord(_SearchBounds):
    """The search's record: search.json, and under `verdicts` (not written there) every trial's
    verdict record by name."""

    formats: list[str]
    objective: str
    max_trials: int
    trials: list[TrialEntry]
    repeats: list[Repeat]
    verdicts: dict[str, dict[str, Any]]  # name -> its verdict record (the runner's)
    chosen: str | None
    held_out: HeldOutVerdict | None
    conclusion: str


@dataclass(frozen=True)
class Space:
    """What the allocation chooses from: each layer group's options, and the bytes no choice touches."""

    groups: list[LayerGroup]
    units: list[Unit]
    fixed: int  # tensor bytes outside the searched groups (embeddings, norms, layers no format quantizes)
    baseline: int  # the baseline's tensor bytes
    uniform: dict[str, int]  # format -> its uniform checkpoint's tensor bytes
    layer_bytes: dict[str, dict[str, int]]  # format (or 16-bit) -> linear layer -> bytes

    def trial_layers(self, allocation: Allocation) -> dict[str, int]:
        """The bytes the allocation gives each linear layer, what the size gate checks: a searched
        layer its format's, every other one (an untied lm_head, a layer no format quantizes) its
        16-bit bytes."""
        chosen = {layer: self.layer_bytes[allocation.choice[group.name]][layer] for group in self.groups for layer in group.layers}
        return {**{layer: size for layer, size in self.layer_bytes[UNQUANTIZED].items() if layer not in chosen}, **chosen}

    def as_dict(self) -> SpaceSummary:
        return {"groups": len(self.groups), "fixed_bytes": self.fixed, "baseline_bytes": self.baseline, "uniform_bytes": self.uniform}


def build_space(formats: tuple[str, ...], measurements: Mapping[str, MeasurementRecord],
                scores: Mapping[str, Mapping[str, float]]) -> Space:
    """`measurements`: the measurement (`quantgate measure --json`) of the baseline (key
    `16-bit`) and of each format's uniform checkpoint; `scores`: format -> group -> predicted
    cost. A group is searched when every format quantizes all of its layers; its 16-bit option
    costs nothing."""
    baseline = measurements[UNQUANTIZED].layers_by_name()
    per_format = {fmt: measurements[fmt].layers_by_name() for fmt in formats}
    layer_bytes = {UNQUANTIZED: {name: layer.bytes for name, layer in baseline.items()},
                   **{fmt: {name: layer.bytes for name, layer in layers.items()} for fmt, layers in per_format.items()}}
    searched = [group for group in layer_groups(list(baseline))
                if all(layer in per_format[fmt] and per_format[fmt][layer].quantized for fmt in formats for layer in group.layers)]
    units = []
    for group in searched:
        options = [Option(UNQUANTIZED, sum(layer_bytes[UNQUANTIZED][layer] for layer in group.layers), 0.0)]
        for fmt in formats:
            if group.name not in scores[fmt]:
                raise InputError(f"the sensitivity holds no score for {group.name} in {fmt}: made for another model or ignore list")
            options.append(Option(fmt, sum(layer_bytes[fmt][layer] for layer in group.layers), float(scores[fmt][group.name])))
        units.append(Unit(group.name, tuple(options)))
    total = measurements[UNQUANTIZED].totals.tensor_bytes
    searched_bytes = sum(layer_bytes[UNQUANTIZED][layer] for group in searched for layer in group.layers)
    return Space(groups=searched, units=units, fixed=total - searched_bytes, baseline=total,
                 uniform={fmt: measurements[fmt].totals.tensor_bytes for fmt in formats}, layer_bytes=layer_bytes)


def mixed_config(plan: ResolvedPlan, space: Space, allocation: Allocation) -> MixedConfig:
    """The mixed checkpoint of an allocation: each layer's format, each format's knobs from the plan."""
    search = plan.plan.search
    assert search is not None
    layers = {layer: allocation.choice[group.name] for group in space.groups for layer in group.layers}
    unsearched = {name: UNQUANTIZED for name in space.layer_bytes[UNQUANTIZED] if name not in layers}
    grouped = [plan.quantize_cfgs[fmt] for fmt in search.formats if get_preset(fmt).grouped]
    knobs = {fmt: plan.quantize_cfgs[fmt] for fmt in search.formats}
    first = grouped[0] if grouped else plan.quantize_cfgs[search.formats[0]]
    # layers a format's ignore list leaves alone (lm_head) are not the checkpoint's to assign
    assigned = {name: fmt for name, fmt in {**unsearched, **layers}.items() if not _ignored(name, first.ignore)}
    return MixedConfig(layers=assigned, knobs=knobs, group_size=first.group_size, ignore=first.ignore)


class SearchStopped(Exception):
    """A unit the search cannot go on without failed (a trial's quantization, its evaluation):
    the search ends with no verdict of its own, its conclusion says why, and the run goes on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


NO_VERDICT = "no verdict of the search"


def stopped_search(plan: ResolvedPlan, reason: str) -> SearchRecord:
    """The record of a search that stopped before its first trial (its sensitivity failed, or a
    format it mixes was not measured): what it would have searched, and why it did not."""
    search = plan.plan.search
    assert search is not None  # the runner calls it for a plan with a search only
    return {"formats": list(search.formats), "objective": search.objective, "max_trials": search.max_trials, "trials": [],
            "repeats": [], "verdicts": {}, "chosen": None, "held_out": None, "conclusion": f"{NO_VERDICT}: {reason}"}


@dataclass(frozen=True)
class Trials:
    """The runner's side of a search: `trial(name, allocation)` quantizes, measures, evaluates
    (search split) and gates one trial, returning its verdict record; `held_out(name)` gates a
    trial again on the held-out split; `uniform` holds the run's verdicts on the uniform formats."""

    trial: Callable[[str, Allocation], dict[str, Any]]  # raises SearchStopped when the trial could not be judged
    held_out: Callable[[str], dict[str, Any]]  # the same
    uniform: Mapping[str, Mapping[str, Any]]


def run_search(plan: ResolvedPlan, space: Space, trials: Trials) -> SearchRecord:
    """Bisect on the verdicts, then gate the smallest approved trial on held-out items; the
    search's record (search.json) with every trial's verdict record by name under `verdicts`."""
    search = plan.plan.search
    assert search is not None
    smallest = min(search.formats, key=lambda fmt: space.uniform[fmt])
    largest = max(space.uniform[fmt] for fmt in search.formats)
    ceiling = min(int(search.max_bytes_ratio * space.baseline), largest) if search.max_bytes_ratio else largest
    lo = space.uniform[smallest]
    record: SearchRecord = {"formats": list(search.formats), "objective": search.objective, "max_trials": search.max_trials,
                            "ceiling_bytes": ceiling, "lo_bytes": lo, "space": space.as_dict(),
                            "trials": [], "repeats": [], "verdicts": {}, "chosen": None, "held_out": None,
                            "conclusion": ""}  # said once the search ends
    if passes_here(trials.uniform.get(smallest, {})):
        pending = "" if trials.uniform[smallest].get("verdict") == "approved" else " (its quality passed; serving is pending)"
        record["conclusion"] = (f"the smallest format it mixes, {smallest}, is approved as it is{pending}: "
                                "no mixed checkpoint can be smaller")
        return record
    # the uniform formats, judged on the same items: known points of the bisection
    tried = [Tried(fmt, space.uniform[fmt], space.uniform[fmt], passes_here(trials.uniform.get(fmt, {})),
                   trial=False) for fmt in search.formats]
    ran: dict[str, Allocation] = {}
    try:
        return _bisect(search, space, trials, record, tried=tried, ran=ran, lo=lo, ceiling=ceiling)
    except SearchStopped as stopped:  # no trial after it, no held-out gate: the trials so far keep their verdicts
        record["conclusion"] = f"{NO_VERDICT}: {stopped.reason}"
        return record


def _bisect(search: SearchPlan, space: Space, trials: Trials, record: SearchRecord, *, tried: list[Tried], ran: dict[str, Allocation],
            lo: int, ceiling: int) -> SearchRecord:
    """The trials, then the held-out gate of the smallest approved one: `record` completed."""
    while len(ran) < search.max_trials:
        budget = next_budget(lo, ceiling, tried, resolution=int(search.resolution * space.baseline))
        if budget is None:
            break
        with _stdout_to_stderr():
            allocation = allocate(space.units, budget - space.fixed)
        total = allocation.bytes + space.fixed
        same = next((name for name, earlier in ran.items() if earlier.choice == allocation.choice), None)
        if same is not None:  # the allocation of an earlier trial: its verdict stands for this budget too
            earlier = next(trial for trial in tried if trial.name == same)
            tried.append(Tried(same, budget, total, earlier.approved, earlier.blocked_by))
            record["repeats"].append({"budget_bytes": budget, "same_as": same})
            continue
        name = f"{TRIAL_PREFIX}{len(ran) + 1}"
        ran[name] = allocation
        verdict = trials.trial(name, allocation)
        tried.append(Tried(name, budget, total, passes_here(verdict), (verdict.get("reasons") or [None])[0]))
        record["verdicts"][name] = verdict
        record["trials"].append(_trial_entry(name, budget, total, allocation, verdict=verdict, space=space))
    pick = chosen(tried)
    held = trials.held_out(pick.name) if pick else None
    if pick and held:
        record["verdicts"][f"{pick.name}@held-out"] = held
    record["chosen"] = pick.name if pick else None
    record["held_out"] = None if held is None else {"verdict": held["verdict"], "reasons": held["reasons"]}
    record["conclusion"] = conclusion(tried, held, space.baseline)
    return record


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """The HiGHS that scipy bundles sometimes prints a debug line to C-level stdout
    (ERGO-Code/HiGHS#2783); stdout is the run's verdicts, so file descriptor 1 points at stderr
    while it solves."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _trial_entry(name: str, budget: int, total: int, allocation: Allocation, *, verdict: Mapping[str, Any],
                 space: Space) -> TrialEntry:
    counts = {fmt: len(groups) for fmt, groups in allocation.by_format().items()}
    return {"name": name, "budget_bytes": budget, "budget_ratio": budget / space.baseline, "bytes": total,
            "ratio": total / space.baseline, "predicted_cost": allocation.cost, "groups_by_format": counts,
            "allocation": allocation.to_json(), "verdict": verdict["verdict"], "reasons": verdict.get("reasons") or []}
