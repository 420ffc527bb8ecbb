"""Sequential evaluation of one candidate: its golden sets in growing looks, judged after each,
until every gate is decided or one blocks it (fail fast).

Set by set, the cheapest decisive first (text sets: KL, top-1 and perplexity from one forward
pass), each set is evaluated at its next look (the first N items of its seeded order) while one
of its gates is undecided, for the candidate and, where it has not been that far yet, the
baseline (its looks are kept in the run directory and shared by every candidate); after each
look every open gate of the set is judged at that look's confidence (`gates.sequential`; the
split is per gate, so the order of the sets does not touch the error rate). A gate that fails,
or is insufficient evidence at the ceiling, blocks the candidate at once: the sets it had still
to run are not run, and their gates are recorded as not evaluated, with why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from pydantic import JsonValue

from quantgate import evalsets
from quantgate.core.console import stderr
from quantgate.core.ids import GateId, SetRef
from quantgate.core.metrics import METRICS
from quantgate.core.rundir import BASELINE, RunDir
from quantgate.evalsets import Kind
from quantgate.gates.policy import LoadedPolicy, MetricGate, Outcome
from quantgate.gates.sequential import look_confidence
from quantgate.gates.stage import item_records
from quantgate.gates.verdict import GateResult, Look, gate_records, metric_gate, not_evaluated
from quantgate.pipeline.resolve import ResolvedPlan, Split

# Which kinds of set run first: the cheapest per decisive number (one forward pass a text item
# gives every agreement metric over hundreds of tokens), then one request an item, then several.
_KIND_ORDER = {Kind.text: 0, Kind.last_word: 1, Kind.multiple_choice: 2, Kind.generation: 3}


class TraceEntry(TypedDict):
    """One gate judged at one look: where, at which confidence, and what it gave."""

    set: str
    metric: str
    look: int
    looks: int
    items: int
    confidence: float
    outcome: str  # an Outcome's value
    estimate: float | None
    low: float | None
    high: float | None
    limit: float
    stability: float | None


class LooksRecord(TypedDict):
    """A candidate's looks as JSON (`SequentialOutcome.as_dict`): the sequential stage's value
    without the plan's part (quantgate.pipeline.units.SequentialValue)."""

    gates: list[dict[str, JsonValue]]  # each a GateRecord's JSON (GateResult.as_dict; read back by read_gates)
    depths: dict[str, int]
    trace: list[TraceEntry]
    blocked_by: str | None


@dataclass
class SequentialOutcome:
    """What the looks decided for one candidate."""

    gates: list[GateResult]  # every metric gate of the policy, decided or not evaluated, set by set in the order visited
    depths: dict[str, int]  # set spec -> items the candidate was evaluated on (0: not run)
    trace: list[TraceEntry] = field(default_factory=list)  # one entry a gate a look
    blocked_by: str | None = None  # the reason that stopped the looks, if any

    def as_dict(self) -> LooksRecord:
        return {"gates": [gate.as_dict() for gate in self.gates], "depths": self.depths, "trace": self.trace,
                "blocked_by": self.blocked_by}


def set_order(plan: ResolvedPlan) -> list[str]:
    """The plan's sets, cheapest decisive kind first, plan order within a kind."""
    return sorted(plan.set_specs, key=lambda spec: (_KIND_ORDER.get(plan.goldens[spec].kind, 9), plan.set_specs.index(spec)))


def gated_sets(plan: ResolvedPlan) -> list[str]:
    """The plan's sets some gate of its policy looks at, in the order they are visited."""
    return [spec for spec in set_order(plan) if _policy_gates(plan.policy, spec)]


def _policy_gates(policy: LoadedPolicy, spec: str) -> dict[str, MetricGate]:
    ref = SetRef.parse(spec)
    return {metric: gate for key, gates in policy.policy.metrics.items() if SetRef.parse(key).matches(ref)
            for metric, gate in gates.items()}


class Looks:
    """The sequential evaluation of the candidates of one run. `evaluate_baseline` and
    `evaluate_candidate` evaluate a model on one set at N items into a directory and return its
    results (the pipeline passes its cached evaluators)."""

    def __init__(self, plan: ResolvedPlan, run_dir: RunDir,
                 evaluate: Callable[[str, dict[str, int], Path, Path | None, Split], evalsets.EvaluationResults],
                 split: Split | None = None) -> None:
        self.plan = plan
        self.dir = run_dir
        self.evaluate = evaluate  # (name, {spec: items}, out, baseline results dir or None, split) -> results
        self.split = split or plan.own_split  # which items: the plan's, or a search's split

    def look_dir(self, name: str, spec: str, items: int) -> Path:
        return self.dir.look(name, spec, items, self.split.offsets.get(spec, 0))

    def baseline_at(self, spec: str, items: int) -> evalsets.EvaluationResults:
        return self.evaluate(BASELINE, {spec: items}, self.look_dir(BASELINE, spec, items), None, self.split)

    def run(self, fmt: str, precision: str, blocked_before: str | None) -> SequentialOutcome:
        """Look at the candidate `fmt` set by set, round by round; `blocked_before`: a size or
        integrity gate that already blocks it (then nothing is evaluated)."""
        plan, policy = self.plan, self.plan.policy
        order = gated_sets(plan)
        ungated = [spec for spec in set_order(plan) if spec not in order]
        open_gates = {spec: dict(_policy_gates(policy, spec)) for spec in order}
        decided: dict[str, GateResult] = {}
        last: dict[str, GateResult] = {}  # an open gate's last look
        depths = {spec: 0 for spec in plan.set_specs}
        trace: list[TraceEntry] = []
        blocked_by = blocked_before
        for spec in order if blocked_by is None else []:
            looks = self.split.looks[spec]
            for index, items in enumerate(looks):
                if blocked_by is not None or not open_gates[spec]:
                    break
                baseline = self.baseline_at(spec, items)
                candidate = self.evaluate(fmt, {spec: items}, self.look_dir(fmt, spec, items), baseline.path, self.split)
                depths[spec] = items
                pair = gate_records(spec, item_records(baseline)[spec], item_records(candidate)[spec])
                look = Look(index=index + 1, looks=len(looks), confidence=look_confidence(policy.policy.statistics.confidence, len(looks)),
                            min_items=policy.policy.sequential.min_items)
                for metric_name, gate in list(open_gates[spec].items()):
                    result = metric_gate(spec, METRICS[metric_name], gate, pair, settings=policy.policy.statistics,
                                         precision=precision, look=look)
                    trace.append(_trace_entry(spec, metric_name, look, items, result))
                    unstable = not look.final and result.stability is not None and \
                        result.stability < policy.policy.sequential.min_stability
                    if result.outcome is Outcome.undecided or unstable:  # looked at again, on more items
                        last[str(GateId(spec, metric_name))] = result
                        continue
                    decided[str(GateId(spec, metric_name))] = result
                    del open_gates[spec][metric_name]
                    if result.outcome is not Outcome.passed and blocked_by is None:
                        blocked_by = result.reason
                _show(spec, items, look, trace)
        # the sets no gate looks at are still evaluated once, at their first look, for the report
        for spec in ungated if blocked_by is None else []:
            first = self.split.looks[spec][0]
            self.evaluate(fmt, {spec: first}, self.look_dir(fmt, spec, first), self.baseline_at(spec, first).path, self.split)
            depths[spec] = first
        gates = []
        for spec in order:
            for metric_name, gate in _policy_gates(policy, spec).items():
                gate_id = str(GateId(spec, metric_name))
                if gate_id in decided:
                    gates.append(decided[gate_id])
                    continue
                why = (f"blocked first by {blocked_by}" if depths[spec] == 0
                       else f"undecided after {depths[spec]} items when the candidate was blocked by {blocked_by}")
                limit = gate.threshold(precision)
                gates.append(not_evaluated(spec, metric_name, METRICS[metric_name].unit,
                                           -limit if gate.kind == "max_drop_points" else limit, why, last=last.get(gate_id)))
        return SequentialOutcome(gates, depths, trace, blocked_by)


def _trace_entry(spec: str, metric: str, look: Look, items: int, result: GateResult) -> TraceEntry:
    return {"set": spec, "metric": metric, "look": look.index, "looks": look.looks, "items": items, "confidence": look.confidence,
            "outcome": result.outcome.value, "estimate": result.estimate, "low": result.low, "high": result.high,
            "limit": result.limit, "stability": result.stability}


def _show(spec: str, items: int, look: Look, trace: list[TraceEntry]) -> None:
    here = [entry for entry in trace if entry["set"] == spec and entry["look"] == look.index]
    outcomes = ", ".join(f"{entry['metric']} {entry['outcome']}" for entry in here)
    stderr.print(f"look {look.index} of {look.looks} at {spec} ({items} items, {look.confidence:.2%} intervals): {outcomes}",
                 highlight=False, soft_wrap=True)
