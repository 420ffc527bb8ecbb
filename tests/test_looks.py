"""`quantgate.pipeline.looks.Looks.run` with a scripted evaluator: no model, no lm-eval.

The evaluator records every call and answers with per-item records written for the test (a
results object `gates.stage.item_records` reads: `manifest.sets`, `items(spec)`,
`token_values(spec)`, `path`). The plan is a stand-in for `ResolvedPlan` with what `Looks` and
`set_order` use: `policy`, `looks`, `set_specs` and `goldens[spec].kind`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from quantgate.core.rundir import BASELINE, RunDir
from quantgate.evalsets import Kind
from quantgate.gates.policy import LoadedPolicy, Outcome, load_policy
from quantgate.gates.sequential import look_confidence
from quantgate.pipeline.looks import Looks, SequentialOutcome, set_order
from quantgate.pipeline.resolve import ResolvedPlan, Split

FMT = "int8-test"
TOKENS = 100  # scored positions of every text item


# ---- the scripted evaluator -----------------------------------------------------------------


@dataclass
class SetData:
    """One set's per-item records, the baseline's and the candidate's, item by item (the first N
    of them are a look at N), and the candidate's per-token values of a text set."""

    baseline: list[dict[str, Any]]
    candidate: list[dict[str, Any]]
    token_values: dict[str, list[np.ndarray]] = field(default_factory=dict)


@dataclass
class FakeResults:
    path: Path
    spec: str
    records: list[dict[str, Any]]
    values: dict[str, np.ndarray]

    @property
    def manifest(self) -> SimpleNamespace:
        return SimpleNamespace(sets={self.spec: SimpleNamespace(items=len(self.records))})

    def items(self, spec: str) -> dict[str, Any]:
        assert spec == self.spec
        return {"schema_version": 1, "items": copy.deepcopy(self.records)}

    def token_values(self, spec: str) -> dict[str, np.ndarray]:
        assert spec == self.spec
        return dict(self.values)


@dataclass(frozen=True)
class Call:
    name: str
    spec: str
    items: int
    out: Path
    baseline_dir: Path | None


class Evaluator:
    """`evaluate(name, {spec: n}, out, baseline_dir)` that answers from `data` and logs each call."""

    def __init__(self, data: dict[str, SetData]) -> None:
        self.data = data
        self.calls: list[Call] = []

    def __call__(self, name: str, items: dict[str, int], out: Path, baseline_dir: Path | None, split: Split) -> Any:
        assert name in (BASELINE, FMT) and len(items) == 1
        ((spec, n),) = items.items()
        self.calls.append(Call(name, spec, n, out, baseline_dir))
        data = self.data[f"{spec}@held-out" if split.name == "held-out" else spec]
        assert n <= len(data.baseline), f"{spec} has {len(data.baseline)} items, asked for {n}"
        if name == BASELINE:
            return FakeResults(out, spec, data.baseline[:n], {})
        values = {key: np.concatenate(arrays[:n]).astype(np.float32) for key, arrays in data.token_values.items()}
        return FakeResults(out, spec, data.candidate[:n], values)

    def looked(self) -> list[tuple[str, int]]:
        """(spec, items) of each candidate call, in order."""
        return [(call.spec, call.items) for call in self.calls if call.name == FMT]


# ---- records ---------------------------------------------------------------------------------


def choice_set(baseline: Sequence[int], candidate: Sequence[int]) -> SetData:
    """Multiple-choice or last-word records: per-item 0/1 accuracy."""
    def records(correct: Sequence[int]) -> list[dict[str, Any]]:
        return [{"id": f"q{i}", "metrics": {"acc": float(value), "acc_norm": float(value)}} for i, value in enumerate(correct)]

    assert len(baseline) == len(candidate)
    return SetData(records(baseline), records(candidate))


def same_answers(items: int) -> SetData:
    """A candidate that answers every item as the baseline does: its interval is [0, 0]."""
    correct = [1 if i % 3 else 0 for i in range(items)]
    return choice_set(correct, correct)


def noisy_answers(items: int) -> SetData:
    """A candidate that loses one item in 10 and gains another: no loss on average, 20% of items
    answered differently, so its interval is wide (about +-14 points at 40 items)."""
    baseline = [i % 2 for i in range(items)]
    candidate = list(baseline)
    for i in range(0, items, 10):
        candidate[i], candidate[i + 1] = 1 - baseline[i], 1 - baseline[i + 1]
    return choice_set(baseline, candidate)


def text_set(items: int, *, kl_tokens: int = 0, kl_value: float = 0.0,
             top1: Sequence[int] | None = None) -> SetData:
    """Text records of `TOKENS` positions an item: the candidate's per-token KL is `kl_value` at
    `kl_tokens` positions of each item and 0 elsewhere; its top-1 matches are `top1[i % len]`."""
    top1 = top1 or [TOKENS]
    baseline, candidate, kl, change = [], [], [], []
    for i in range(items):
        values = np.zeros(TOKENS)
        values[:kl_tokens] = kl_value
        kl.append(values)
        change.append(np.zeros(TOKENS))
        baseline.append({"id": f"t{i}", "nll": 300.0, "tokens": TOKENS})
        candidate.append({"id": f"t{i}", "nll": 300.0 + float(values.sum()), "tokens": TOKENS, "kl_sum": float(values.sum()),
                          "top1_matches": top1[i % len(top1)], "top_prob_change_sum": 0.0})
    return SetData(baseline, candidate, {"kl": kl, "top_prob_change": change})


def policy(tmp_path: Path, body: str) -> LoadedPolicy:
    path = tmp_path / "policy.yaml"
    path.write_text("name: test\nversion: v1\n" + body)
    return load_policy(path)


def plan(policy_: LoadedPolicy, sets: dict[str, tuple[Kind, tuple[int, ...]]]) -> ResolvedPlan:
    """A stand-in for ResolvedPlan: the sets in plan order, each with its kind and schedule."""
    looks = {spec: looks for spec, (_, looks) in sets.items()}
    return cast(ResolvedPlan, SimpleNamespace(
        policy=policy_, set_specs=list(sets), goldens={spec: SimpleNamespace(kind=kind) for spec, (kind, _) in sets.items()},
        looks=looks, own_split=Split("plan", looks, {})))


def by_gate(outcome: SequentialOutcome) -> dict[str, Any]:
    gates = {gate.gate: gate for gate in outcome.gates}
    assert len(gates) == len(outcome.gates), "every gate once"
    return gates


# ---- fail fast -------------------------------------------------------------------------------

FAIL_FAST_POLICY = """
statistics: {confidence: 0.95, resamples: 400, seed: 0}
metrics:
  arc-easy: {acc: {max_drop_points: {8bit: 5.0}}}
  lambada: {acc: {max_drop_points: {8bit: 5.0}}}
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.05}}
    kl_p99: {max_value: {8bit: 0.5}}
    top1_agreement: {min_value: {8bit: 0.85}}
"""


@pytest.fixture
def fail_fast(tmp_path: Path) -> tuple[SequentialOutcome, Evaluator, RunDir]:
    """The candidate's KL is 2 nats on 2 positions in 100 of every item: a mean of 0.04 (within
    0.05) and a 99th percentile of 2 (past 0.5), so the tail gate fails at the first look; its
    top-1 agreement alternates 70% and 100% an item, around its 85% bound: undecided there."""
    sets = {"arc-easy@v1": (Kind.multiple_choice, (20, 40, 80)), "lambada@v1": (Kind.last_word, (20, 40, 80)),
            "wiki-text@v1": (Kind.text, (20, 40, 80)), "notes@v1": (Kind.text, (15, 30))}  # notes: gated by nothing
    evaluator = Evaluator({"arc-easy@v1": same_answers(80), "lambada@v1": same_answers(80), "notes@v1": text_set(30),
                           "wiki-text@v1": text_set(80, kl_tokens=2, kl_value=2.0, top1=[70, 100])})
    run_dir = RunDir(tmp_path / "run")
    outcome = Looks(plan(policy(tmp_path, FAIL_FAST_POLICY), sets), run_dir, evaluator).run(FMT, "8bit", None)
    return outcome, evaluator, run_dir


def test_a_gate_failing_at_the_first_look_blocks_and_nothing_after_it_is_evaluated(fail_fast) -> None:
    outcome, evaluator, _ = fail_fast
    gates = by_gate(outcome)
    tail = gates["wiki-text@v1 kl_p99"]
    assert tail.outcome is Outcome.failed and tail.look == 1 and tail.items == 20 and tail.decided_by == "interval"
    assert tail.low == tail.high == pytest.approx(2.0) and "kl_p99" in tail.reason and "exceeds" in tail.reason
    assert outcome.blocked_by == tail.reason
    # the mean KL was decided at the same look, before the block: it stays decided
    assert gates["wiki-text@v1 kl_divergence"].outcome is Outcome.passed
    assert gates["wiki-text@v1 kl_divergence"].estimate == pytest.approx(0.04)
    # only the first look at the text set was evaluated: the later sets (and the ungated one) never
    assert [(call.name, call.spec, call.items) for call in evaluator.calls] == [(BASELINE, "wiki-text@v1", 20),
                                                                                (FMT, "wiki-text@v1", 20)]
    assert outcome.depths == {"arc-easy@v1": 0, "lambada@v1": 0, "wiki-text@v1": 20, "notes@v1": 0}
    for gate_id in ("lambada@v1 acc", "arc-easy@v1 acc"):
        gate = gates[gate_id]
        assert gate.outcome is Outcome.not_evaluated and gate.items == 0 and gate.decided_by == "not evaluated"
        assert gate.estimate is None and gate.low is None and gate.high is None
        assert gate.limit == -5.0 and gate.unit == "points"
        name = gate_id.split("@")[0]
        assert gate.reason == f"{name} acc: not evaluated (blocked first by {tail.reason})"
    assert {gate.gate for gate in outcome.gates} == {"wiki-text@v1 kl_divergence", "wiki-text@v1 kl_p99",
                                                     "wiki-text@v1 top1_agreement", "lambada@v1 acc", "arc-easy@v1 acc"}


def test_a_gate_still_undecided_in_the_blocking_set_is_not_evaluated_and_says_how_far_it_got(fail_fast) -> None:
    outcome, _, _ = fail_fast
    top1 = by_gate(outcome)["wiki-text@v1 top1_agreement"]
    assert top1.outcome is Outcome.not_evaluated and top1.limit == 0.85
    assert top1.reason.startswith(f"wiki-text top1_agreement: not decided (undecided after 20 items when the candidate was "
                                  f"blocked by {outcome.blocked_by}; at its last look: wiki-text top1_agreement ")
    # it was judged at that look, undecided: its interval reached across its bound, and the
    # record keeps how far it got (its items and interval), though nothing was decided by them
    (entry,) = [entry for entry in outcome.trace if entry["metric"] == "top1_agreement"]
    assert entry["outcome"] == "undecided" and entry["low"] < 0.85 < entry["high"]
    assert (top1.items, top1.estimate, top1.low, top1.high) == (20, entry["estimate"], entry["low"], entry["high"])
    assert top1.decided_by == "not evaluated"
    assert outcome.as_dict()["blocked_by"] == outcome.blocked_by


def test_a_candidate_blocked_before_the_looks_is_not_evaluated_at_all(tmp_path: Path) -> None:
    sets = {"lambada@v1": (Kind.last_word, (20, 40)), "wiki-text@v1": (Kind.text, (20, 40))}
    evaluator = Evaluator({"lambada@v1": same_answers(40), "wiki-text@v1": text_set(40)})
    reason = "size: 1,024 bytes the format does not explain"
    outcome = Looks(plan(policy(tmp_path, FAIL_FAST_POLICY.replace("  arc-easy: {acc: {max_drop_points: {8bit: 5.0}}}\n", "")),
                         sets), RunDir(tmp_path / "run"), evaluator).run(FMT, "8bit", reason)
    assert evaluator.calls == [] and outcome.trace == [] and outcome.blocked_by == reason
    assert outcome.depths == {"lambada@v1": 0, "wiki-text@v1": 0}
    assert all(gate.outcome is Outcome.not_evaluated and gate.reason.endswith(f"(blocked first by {reason})")
               for gate in outcome.gates) and len(outcome.gates) == 4


def test_insufficient_evidence_at_the_ceiling_blocks_like_a_failure(tmp_path: Path) -> None:
    """No loss on average, but too few items to show it: still across the bound at the ceiling,
    the fixed-size rule (no margin) makes it insufficient evidence, which blocks what follows."""
    sets = {"arc-easy@v1": (Kind.multiple_choice, (20, 40)), "lambada@v1": (Kind.last_word, (20, 40))}
    evaluator = Evaluator({"arc-easy@v1": same_answers(40), "lambada@v1": noisy_answers(40)})
    body = "statistics: {resamples: 400}\nmetrics:\n  arc-easy: {acc: {max_drop_points: {8bit: 5.0}}}\n" \
           "  lambada: {acc: {max_drop_points: {8bit: 5.0}}}\n"
    outcome = Looks(plan(policy(tmp_path, body), sets), RunDir(tmp_path / "run"), evaluator).run(FMT, "8bit", None)
    gates = by_gate(outcome)
    accuracy = gates["lambada@v1 acc"]
    assert accuracy.outcome is Outcome.insufficient and accuracy.look == 2 and accuracy.decided_by == "ceiling"
    assert accuracy.estimate == pytest.approx(0.0) and accuracy.low < -5.0
    assert outcome.blocked_by == accuracy.reason and "insufficient evidence" in accuracy.reason
    assert gates["arc-easy@v1 acc"].outcome is Outcome.not_evaluated
    assert evaluator.looked() == [("lambada@v1", 20), ("lambada@v1", 40)]
    assert outcome.depths == {"arc-easy@v1": 0, "lambada@v1": 40}


# ---- an approved candidate: the order, the pairing, the confidence, min_items, the trace ---------

APPROVE_POLICY = """
statistics: {confidence: 0.90, resamples: 400, seed: 0}
sequential: {min_items: 20}
metrics:
  hellaswag: {acc_norm: {max_drop_points: {8bit: 5.0}}}
  arc-easy: {acc: {max_drop_points: {8bit: 5.0}, min_items: 60}}
  lambada: {acc: {max_drop_points: {8bit: 5.0}}}
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.05}}
    top1_agreement: {min_value: {8bit: 0.85}}
"""
# plan order; each set's schedule (its last look the ceiling) and the items its gates are decided at
APPROVE_SETS = {
    "hellaswag@v1": (Kind.multiple_choice, (50,)),  # one look: a fixed-size test
    "wiki-text@v1": (Kind.text, (20, 40, 80)),  # decided at its first look: stops there
    "arc-easy@v1": (Kind.multiple_choice, (20, 40, 80, 160)),  # its gate's min_items 60: decided at 80
    "lambada@v1": (Kind.last_word, (10, 40)),  # the policy's min_items 20: decided at 40
    "notes@v1": (Kind.text, (15, 30)),  # gated by nothing: evaluated once, at its first look, last
}
DECIDED_AT = {"hellaswag@v1": 50, "wiki-text@v1": 20, "arc-easy@v1": 80, "lambada@v1": 40}
# the candidate's looks, in order: the text sets first, then last-word, then multiple-choice (plan order within a kind)
VISITS = [("wiki-text@v1", 20), ("lambada@v1", 10), ("lambada@v1", 40), ("hellaswag@v1", 50),
          ("arc-easy@v1", 20), ("arc-easy@v1", 40), ("arc-easy@v1", 80), ("notes@v1", 15)]


@pytest.fixture
def approved(tmp_path: Path) -> tuple[SequentialOutcome, Evaluator, RunDir]:
    evaluator = Evaluator({"hellaswag@v1": same_answers(50), "arc-easy@v1": same_answers(160), "lambada@v1": same_answers(40),
                           "wiki-text@v1": text_set(80, kl_tokens=1, kl_value=1.0, top1=[95]), "notes@v1": text_set(30)})
    run_dir = RunDir(tmp_path / "run")
    outcome = Looks(plan(policy(tmp_path, APPROVE_POLICY), APPROVE_SETS), run_dir, evaluator).run(FMT, "8bit", None)
    return outcome, evaluator, run_dir


def test_every_gate_passes_each_set_stopping_when_its_gates_are_decided(approved) -> None:
    outcome, evaluator, _ = approved
    assert outcome.blocked_by is None
    assert {gate.gate: gate.outcome for gate in outcome.gates} == {
        "wiki-text@v1 kl_divergence": Outcome.passed, "wiki-text@v1 top1_agreement": Outcome.passed,
        "lambada@v1 acc": Outcome.passed, "hellaswag@v1 acc_norm": Outcome.passed, "arc-easy@v1 acc": Outcome.passed}
    for gate in outcome.gates:
        assert gate.items == DECIDED_AT[gate.gate.split()[0]]
    # wiki-text was decided at its first look and not looked at again, while arc-easy went on to 80 of its 160
    assert outcome.depths == {**DECIDED_AT, "notes@v1": 15}
    assert [items for spec, items in evaluator.looked() if spec == "wiki-text@v1"] == [20]
    assert [items for spec, items in evaluator.looked() if spec == "arc-easy@v1"] == [20, 40, 80]


def test_sets_are_visited_cheapest_kind_first_each_to_completion(approved) -> None:
    _, evaluator, _ = approved
    stand_in = SimpleNamespace(set_specs=list(APPROVE_SETS), goldens={spec: SimpleNamespace(kind=kind)
                                                                      for spec, (kind, _) in APPROVE_SETS.items()})
    assert set_order(cast(ResolvedPlan, stand_in)) == ["wiki-text@v1", "notes@v1", "lambada@v1", "hellaswag@v1", "arc-easy@v1"]
    # text, then last-word, then multiple-choice (hellaswag before arc-easy: plan order), each set's
    # looks one after another until its gates are decided; the ungated set once, after the gated ones
    assert evaluator.looked() == VISITS


def test_every_candidate_look_is_paired_with_a_baseline_look_at_the_same_items(approved) -> None:
    _, evaluator, run_dir = approved
    calls = evaluator.calls
    assert len(calls) == 2 * len(VISITS)
    for baseline, candidate in zip(calls[::2], calls[1::2], strict=True):
        assert baseline.name == BASELINE and candidate.name == FMT
        assert (baseline.spec, baseline.items) == (candidate.spec, candidate.items)
        assert baseline.baseline_dir is None  # the baseline is evaluated on its own
        assert baseline.out == run_dir.look(BASELINE, baseline.spec, baseline.items)
        assert candidate.out == run_dir.look(FMT, candidate.spec, candidate.items)
        assert candidate.baseline_dir == baseline.out  # against the baseline's results of that look


def test_each_look_is_at_the_bonferroni_confidence_of_its_sets_schedule(approved) -> None:
    outcome, _, _ = approved
    for gate in outcome.gates:
        spec = gate.gate.split()[0]
        looks = len(APPROVE_SETS[spec][1])
        assert gate.looks == looks and gate.look == APPROVE_SETS[spec][1].index(gate.items) + 1
        assert gate.confidence == pytest.approx(look_confidence(0.90, looks)) == pytest.approx(1 - 0.10 / looks)
    for entry in outcome.trace:
        looks = len(APPROVE_SETS[entry["set"]][1])
        assert entry["looks"] == looks and entry["confidence"] == pytest.approx(1 - 0.10 / looks)
    # a one-look set is a fixed-size test at the policy's own confidence
    assert by_gate(outcome)["hellaswag@v1 acc_norm"].confidence == pytest.approx(0.90)


def test_min_items_defers_a_gate_whose_interval_already_clears_the_bound(approved) -> None:
    outcome, _, _ = approved
    gates = by_gate(outcome)
    # identical answers: the interval is [0, 0] at every look, on the passing side of -5 from the first
    for spec, deferred, decided_at in (("arc-easy@v1", [20, 40], 80), ("lambada@v1", [10], 40)):
        entries = [entry for entry in outcome.trace if entry["set"] == spec]
        assert [entry["items"] for entry in entries] == [*deferred, decided_at]
        for entry in entries[:-1]:  # below min_items (the gate's 60; the policy's 20): undecided
            assert entry["outcome"] == "undecided" and entry["low"] >= entry["limit"] == -5.0
        assert entries[-1]["outcome"] == "pass"
        gate = gates[f"{spec} acc"]
        assert gate.items == decided_at and gate.decided_by == "interval" and gate.low == gate.high == 0.0


def test_the_trace_holds_one_entry_for_each_open_gate_at_each_look(approved) -> None:
    outcome, _, _ = approved
    expected = [("wiki-text@v1", "kl_divergence", 1, 20), ("wiki-text@v1", "top1_agreement", 1, 20),
                ("lambada@v1", "acc", 1, 10), ("lambada@v1", "acc", 2, 40), ("hellaswag@v1", "acc_norm", 1, 50),
                ("arc-easy@v1", "acc", 1, 20), ("arc-easy@v1", "acc", 2, 40), ("arc-easy@v1", "acc", 3, 80)]
    assert [(entry["set"], entry["metric"], entry["look"], entry["items"]) for entry in outcome.trace] == expected
    gates = by_gate(outcome)
    for entry in outcome.trace:
        assert entry["low"] <= entry["estimate"] <= entry["high"]
        assert set(entry) == {"set", "metric", "look", "looks", "items", "confidence", "outcome", "estimate", "low", "high",
                              "limit", "stability"}
        if entry["outcome"] != "undecided":  # the look that decided a gate: the gate's own numbers
            gate = gates[f"{entry['set']} {entry['metric']}"]
            assert (entry["estimate"], entry["low"], entry["high"], entry["look"], entry["items"]) == (
                gate.estimate, gate.low, gate.high, gate.look, gate.items)
    kl = gates["wiki-text@v1 kl_divergence"]
    assert kl.estimate == pytest.approx(0.01) and kl.low == pytest.approx(0.01) and kl.limit == 0.05
    assert gates["wiki-text@v1 top1_agreement"].estimate == pytest.approx(0.95)
    assert outcome.as_dict()["trace"] == outcome.trace


# ---- the held-out split, through the looks ----------------------------------------------------

HELD_OUT_POLICY = """
name: split
version: v1
statistics: {confidence: 0.95, resamples: 400, seed: 0}
sequential: {min_items: 20}
metrics:
  arc-easy: {acc: {max_drop_points: {8bit: 5.0, 4bit: 10.0}}}
mixed_precision: {rule: lowest-bits}
"""


def test_the_held_out_looks_read_other_items_and_block_what_the_search_split_passed(tmp_path: Path) -> None:
    """A search's chosen trial is looked at again on items after the search split's (the
    evaluator's `@held-out` data here): what passed there can fail here."""
    (tmp_path / "policy.yaml").write_text(HELD_OUT_POLICY, encoding="utf-8")
    policy = load_policy(tmp_path / "policy.yaml")
    looks = {"arc-easy@v1": (60,)}
    stand_in = cast(ResolvedPlan, SimpleNamespace(policy=policy, set_specs=["arc-easy@v1"], looks=looks,
                                                  goldens={"arc-easy@v1": SimpleNamespace(kind=Kind.multiple_choice)},
                                                  own_split=Split("plan", looks, {})))
    lost = [1] * 60
    evaluator = Evaluator({"arc-easy@v1": same_answers(60),  # the search split: every answer kept
                           "arc-easy@v1@held-out": choice_set(lost, [0] * 20 + [1] * 40)})  # held out: a third lost
    run_dir = RunDir(tmp_path / "run")
    search = Looks(stand_in, run_dir, evaluator, Split("search", looks, {})).run(FMT, "4bit", None)
    held = Looks(stand_in, run_dir, evaluator, Split("held-out", looks, {"arc-easy@v1": 60})).run(FMT, "4bit", None)
    assert [gate.outcome for gate in search.gates] == [Outcome.passed]
    assert [gate.outcome for gate in held.gates] == [Outcome.failed] and held.blocked_by
    # the held-out looks live apart from the search split's: `<set>+<offset>@<items>`
    assert {call.out.name for call in evaluator.calls} == {"arc-easy@v1@60", "arc-easy@v1+60@60"}


@pytest.mark.parametrize("min_stability, decided_at", [(0.9, 40), (0.0, 10)])
def test_a_decision_a_resample_of_its_items_would_overturn_waits_for_the_next_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, min_stability: float, decided_at: int) -> None:
    """small-model@v5's stable decisions: a gate decided before the last look stays open while
    fewer than `min_stability` of the resamples of its items decide it the same way; at the
    ceiling it is decided as it stands."""
    from dataclasses import replace

    from quantgate.pipeline import looks as looks_module

    real = looks_module.metric_gate

    def shaky_first_look(*args: Any, **kwargs: Any) -> Any:  # the first look's decision: a coin flip away
        result = real(*args, **kwargs)
        return replace(result, stability=0.5) if kwargs["look"].index == 1 else result

    monkeypatch.setattr(looks_module, "metric_gate", shaky_first_look)
    body = (f"statistics: {{resamples: 400}}\nsequential: {{min_stability: {min_stability}}}\n"
            "metrics:\n  lambada: {acc: {max_drop_points: {8bit: 5.0}}}\n")
    evaluator = Evaluator({"lambada@v1": same_answers(80)})
    sets = {"lambada@v1": (Kind.last_word, (10, 40, 80))}
    outcome = Looks(plan(policy(tmp_path, body), sets), RunDir(tmp_path / "run"), evaluator).run(FMT, "8bit", None)
    gate = by_gate(outcome)["lambada@v1 acc"]
    assert gate.outcome is Outcome.passed and gate.items == decided_at
    assert [(entry["items"], entry["stability"]) for entry in outcome.trace][0] == (10, 0.5)
