"""The mixed-precision search's decisions (gates.search) and its loop (quantgate.pipeline.search)
on hand-made spaces and verdicts: the budgets it bisects, when it stops, which trial it chooses,
and that the chosen trial is approved only by its held-out gate: a trial that passes on the
search split and fails on held-out items is blocked, and the ledger does not let it deploy."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from quantgate.core.models import checkpoint_files, weight_hashes
from quantgate.gates import keys, signing
from quantgate.gates.ledger import Status, append, verify_checkpoint
from quantgate.gates.ledger_record import LedgerRecord
from quantgate.gates.search import Tried, chosen, next_budget
from quantgate.pipeline.resolve import ResolvedPlan
from quantgate.pipeline.search import Space, Trials, run_search
from quantgate.quantize.allocation import Allocation, Option, Unit
from quantgate.quantize.config import UNQUANTIZED
from tests.helpers import measurement_record

# ---- bisection ---------------------------------------------------------------------------------

LO, CEILING = 400, 600


def test_first_budget_is_the_ceiling_and_a_failure_there_ends_the_search() -> None:
    assert next_budget(LO, CEILING, [], resolution=10) == CEILING
    failed = [Tried("search-1", CEILING, 598, approved=False, blocked_by="kl")]
    assert next_budget(LO, CEILING, failed, resolution=10) is None


def test_a_uniform_format_that_passed_below_the_ceiling_is_bisected_from_directly() -> None:
    known = [Tried("gptq-int4", LO, LO, approved=False, trial=False), Tried("w8a8", 560, 560, approved=True, trial=False)]
    assert next_budget(LO, CEILING, known, resolution=10) == (LO + 560) // 2


def test_bisection_between_the_largest_failure_and_the_smallest_pass_until_the_resolution() -> None:
    tried = [Tried("search-1", 600, 599, approved=True)]
    assert next_budget(LO, CEILING, tried, resolution=10) == 500
    tried.append(Tried("search-2", 500, 499, approved=False, blocked_by="kl"))
    assert next_budget(LO, CEILING, tried, resolution=10) == 550
    tried.append(Tried("search-3", 550, 548, approved=True))
    assert next_budget(LO, CEILING, tried, resolution=10) == 525
    assert next_budget(LO, CEILING, tried, resolution=50) is None  # 550 - 500 is within 50 bytes


def test_the_chosen_trial_is_the_smallest_approved_trial_never_a_uniform_format() -> None:
    tried = [Tried("w8a8", 560, 560, approved=True, trial=False), Tried("search-1", 600, 590, approved=True),
             Tried("search-2", 500, 505, approved=True), Tried("search-3", 450, 449, approved=False)]
    assert chosen(tried) == tried[2]
    assert chosen(tried[:1]) is None


# ---- the loop, on a hand-made space -------------------------------------------------------------

BASELINE_BYTES = 1000


def space() -> Space:
    """Three groups of 100 bytes at 16-bit, 50 at 8-bit, 25 at 4-bit; 4-bit costs grow from the
    first group to the last. Fixed bytes 700: uniform 4-bit 775 (0.775x), 8-bit 850 (0.85x)."""
    groups = [SimpleNamespace(name=f"g{i}", layers=(f"g{i}.w",)) for i in range(3)]
    units = [Unit(f"g{i}", (Option(UNQUANTIZED, 100, 0.0), Option("w8", 50, 0.001 * (i + 1)), Option("w4", 25, 0.1 * (i + 1))))
             for i in range(3)]
    layer_bytes = {UNQUANTIZED: {f"g{i}.w": 100 for i in range(3)}, "w8": {f"g{i}.w": 50 for i in range(3)},
                   "w4": {f"g{i}.w": 25 for i in range(3)}}
    return Space(cast(Any, groups), units, 700, BASELINE_BYTES, {"w4": 775, "w8": 850}, layer_bytes)


def plan(max_trials: int = 4, ratio: float | None = None, resolution: float = 0.01) -> ResolvedPlan:
    search = SimpleNamespace(formats=("w4", "w8"), objective="smallest-approved", max_trials=max_trials,
                             max_bytes_ratio=ratio, resolution=resolution)
    return cast(ResolvedPlan, SimpleNamespace(plan=SimpleNamespace(search=search)))


def verdict(approved: bool, reason: str = "wiki-text kl_divergence 0.2 [0.15, 0.25] exceeds 0.15") -> dict[str, Any]:
    return {"verdict": "approved" if approved else "blocked", "reasons": [] if approved else [reason]}


class Judge:
    """Trials approved when their allocation's predicted cost is at most `max_cost`; the held-out
    gate answers `held_out`."""

    def __init__(self, max_cost: float, held_out: bool = True) -> None:
        self.max_cost, self.held = max_cost, held_out
        self.allocations: list[Allocation] = []
        self.held_out_calls: list[str] = []

    def trial(self, name: str, allocation: Allocation) -> dict[str, Any]:
        self.allocations.append(allocation)
        return verdict(allocation.cost <= self.max_cost)

    def held_out(self, name: str) -> dict[str, Any]:
        self.held_out_calls.append(name)
        return verdict(self.held, "wiki-text kl_divergence 0.3 [0.2, 0.4] exceeds 0.15 (held-out)")

    def trials(self, uniform: dict[str, str]) -> Trials:
        return Trials(self.trial, self.held_out, {fmt: {"verdict": v} for fmt, v in uniform.items()})


BLOCKED_4BIT = {"w4": "blocked", "w8": "approved"}


def test_the_search_finds_the_smallest_approved_trial_and_gates_it_on_held_out_items() -> None:
    judge = Judge(max_cost=0.15)
    record = run_search(plan(resolution=0.001), space(), judge.trials(BLOCKED_4BIT))
    # bisected between 4-bit (775, failed) and 8-bit (850, passed): at 812 two groups must be 4-bit
    # (cost 0.303, blocked); at 831 only the least sensitive (8, 8, 4: 825 bytes, cost 0.105,
    # approved). Every budget after that gives one of those two allocations again: no third
    # checkpoint is made, the earlier verdict stands for the budget, until the resolution ends it
    assert [(entry["budget_bytes"], entry["verdict"]) for entry in record["trials"]] == [(812, "blocked"), (831, "approved")]
    assert record["repeats"] == [{"budget_bytes": 821, "same_as": "search-1"}, {"budget_bytes": 826, "same_as": "search-2"},
                                 {"budget_bytes": 823, "same_as": "search-1"}, {"budget_bytes": 824, "same_as": "search-1"},
                                 {"budget_bytes": 825, "same_as": "search-2"}]
    assert record["chosen"] == "search-2" and judge.held_out_calls == ["search-2"]
    assert record["trials"][1]["bytes"] == 825 and record["trials"][1]["groups_by_format"] == {"w4": 1, "w8": 2}
    assert record["held_out"] == {"verdict": "approved", "reasons": []}
    assert "approved on held-out items the search never saw" in record["conclusion"]
    for entry in record["trials"]:
        assert entry["bytes"] <= entry["budget_bytes"] and entry["bytes"] == entry["allocation"]["bytes"] + 700


def test_a_trial_picked_on_the_search_split_is_blocked_when_it_fails_on_the_held_out_split() -> None:
    judge = Judge(max_cost=0.15, held_out=False)
    record = run_search(plan(), space(), judge.trials(BLOCKED_4BIT))
    pick = record["chosen"]
    assert pick is not None and record["verdicts"][pick]["verdict"] == "approved"  # on the search split
    assert record["verdicts"][f"{pick}@held-out"]["verdict"] == "blocked"
    assert record["held_out"]["verdict"] == "blocked"
    assert "passed on the search split but is blocked on the held-out items" in record["conclusion"]
    assert "(held-out)" in record["conclusion"]


def test_no_trial_passing_says_which_gate_stopped_the_last_one() -> None:
    judge = Judge(max_cost=-1.0)
    record = run_search(plan(ratio=0.8), space(), judge.trials(BLOCKED_4BIT))
    assert len(record["trials"]) == 1 and record["trials"][0]["budget_bytes"] == 800  # the ceiling, once
    assert record["chosen"] is None and judge.held_out_calls == []
    assert record["conclusion"].startswith("no trial passed on the search split; the last, search-1 at 0.800x")
    assert "kl_divergence" in record["conclusion"]


def test_max_trials_bounds_the_search_and_an_approved_smallest_format_needs_none() -> None:
    judge = Judge(max_cost=0.15)
    assert len(run_search(plan(max_trials=1), space(), judge.trials(BLOCKED_4BIT))["trials"]) == 1
    record = run_search(plan(), space(), Judge(1.0).trials({"w4": "approved", "w8": "approved"}))
    assert record["trials"] == [] and "w4, is approved as it is" in record["conclusion"]


def test_the_allocation_spends_the_budget_on_the_most_sensitive_groups_first() -> None:
    judge = Judge(max_cost=1.0)
    run_search(plan(max_trials=1, ratio=0.8), space(), judge.trials(BLOCKED_4BIT))
    # 800 - 700 = 100 bytes for three groups: 8-bit (50) for the most sensitive, 4-bit for the rest
    assert judge.allocations[0].choice == {"g0": "w4", "g1": "w4", "g2": "w8"}


# ---- the ledger: a search trial's approval deploys nothing -------------------------------------


def test_a_trial_approved_on_the_search_split_only_is_not_deployable(tmp_path: Path) -> None:
    checkpoint = tmp_path / "search-1"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    record = {"kind": "verdict", "format": "search-1", "verdict": "approved", "reasons": [], "split": "search",
              "checkpoint": {"path": str(checkpoint), "weights": weight_hashes(checkpoint), "files": checkpoint_files(checkpoint)},
              "policy": {"name": "p", "version": "v1"}}
    ledger = tmp_path / "ledger.jsonl"
    key = signing.load_signing_key(keys.ensure_default_key())  # the user's own key, trusted by their verify
    append(ledger, LedgerRecord.model_validate(record), key)
    found = verify_checkpoint(checkpoint, ledger)
    assert found.status is Status.blocked and not found.deployable and "search split only" in found.reason
    append(ledger, LedgerRecord.model_validate({**record, "format": "search-1@held-out", "split": "held-out"}), key)
    assert verify_checkpoint(checkpoint, ledger).deployable


def test_a_blocked_largest_format_still_lets_the_first_trial_take_the_ceiling() -> None:
    """No byte ceiling: the largest uniform format is the ceiling; blocked as it is, a mix that
    keeps its most sensitive groups 16-bit at those bytes is still worth a trial."""
    known = [Tried("w4", LO, LO, approved=False, trial=False), Tried("w8", CEILING, CEILING, approved=False, trial=False)]
    assert next_budget(LO, CEILING, known, resolution=10) == CEILING
    assert next_budget(LO, CEILING, [*known, Tried("search-1", CEILING, 598, approved=False)], resolution=10) is None


def test_layers_outside_the_search_are_held_to_their_16_bit_bytes() -> None:
    """An untied lm_head (or a layer no format quantizes) is not searched; the size gate must still
    find its 16-bit bytes in the allocation, or every trial of such a model would be blocked."""
    from quantgate.pipeline.search import build_space

    names = ["model.layers.0.mlp.down_proj", "lm_head"]
    space_ = build_space(("w4", "w8"), {
        UNQUANTIZED: measurement_record({names[0]: (100, False), names[1]: (400, False)}, tensor_bytes=1000),
        "w4": measurement_record({names[0]: (25, True), names[1]: (400, False)}, tensor_bytes=925),
        "w8": measurement_record({names[0]: (50, True), names[1]: (400, False)}, tensor_bytes=950)},
        {"w4": {names[0]: 0.1}, "w8": {names[0]: 0.01}})
    assert [group.name for group in space_.groups] == [names[0]] and space_.fixed == 900
    allocation = Allocation(choice={names[0]: "w4"}, bytes=25, cost=0.1, budget=25)
    assert space_.trial_layers(allocation) == {names[0]: 25, "lm_head": 400}


def test_a_newer_block_on_the_search_split_overrides_an_older_held_out_approval(tmp_path: Path) -> None:
    checkpoint = tmp_path / "search-1"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    base = {"kind": "verdict", "format": "search-1", "reasons": [], "policy": {"name": "p", "version": "v1"},
            "checkpoint": {"path": str(checkpoint), "weights": weight_hashes(checkpoint), "files": checkpoint_files(checkpoint)}}
    ledger = tmp_path / "ledger.jsonl"
    append(ledger, LedgerRecord.model_validate({**base, "verdict": "approved", "split": "held-out"}))
    append(ledger, LedgerRecord.model_validate({**base, "verdict": "blocked", "split": "search", "reasons": ["a stricter policy"]}))
    found = verify_checkpoint(checkpoint, ledger)
    assert found.status is Status.blocked and "a stricter policy" in found.reason
