"""Planned ceilings (docs/gates.md, "Planned ceilings"): a plan's `planned` ceiling is the
sample-size planner's items for power 0.8 at half each gate's margin, rounded up to the set's
looks and capped by its size; every gate's power is recorded on the resolved plan; preflight
names each gate its ceiling cannot decide at that power; a discordance the plan gives carries its
source or is refused."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate import evalsets
from quantgate.core.errors import InputError
from quantgate.evalsets.sets import all_names
from quantgate.gates.policy import LoadedPolicy, load_policy
from quantgate.gates.samplesize import (
    DEFAULT_DISCORDANCE,
    DEFAULT_EFFECT_FRACTION,
    DEFAULT_POWER,
    Discordance,
    gate_powers,
    items_needed,
    power_at,
)
from quantgate.gates.sequential import schedule
from quantgate.gates.stage import load_gate_policy, valid_metrics
from quantgate.pipeline.plan import DEMO_PLAN, PLANNED, RunPlan, SetItems, from_mapping, load_plan
from quantgate.pipeline.resolve import ResolvedPlan, Splits, resolve_items, resolve_plan
from tests.fuzzing import preflight_only
from tests.helpers import plan_mapping

SMALL = "small-model@v4"
# lambada's accuracy gate and wiki-text's KL (no prior spread: its ceiling is given), no minimum
# items, looks 50 and 150: a planned lambada ceiling lies past the last look
POLICY = """name: planned
version: v1
sequential: {looks: [50, 150]}
metrics:
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.05, 4bit: 0.15}}
  lambada:
    acc: {max_drop_points: {8bit: 5.0, 4bit: 10.0}}
"""


def small_model() -> LoadedPolicy:
    return load_policy(SMALL, valid_metrics(all_names())).narrowed(["arc-easy", "lambada", "wiki-text"])


def expected_ceiling(bound_points: float, discordance: float, looks: tuple[int, ...], size: int, min_items: int) -> int:
    """The rule, written out apart from the code: the first look of the set's schedule at which
    the items needed (the confidence split over that many looks) fit; past the policy's last look
    the items needed themselves; else the set's size."""
    sd = math.sqrt(discordance) * 100
    effect = DEFAULT_EFFECT_FRACTION * bound_points
    for k, ceiling in enumerate(schedule(looks, size), start=1):
        needed = max(min_items, items_needed(effect, sd, confidence=0.95, looks=k, power=DEFAULT_POWER))
        if needed <= ceiling:
            return needed if ceiling == size and all(n < size for n in looks) else ceiling
    return size


def write_plan(tmp_path: Path, mapping: dict[str, Any]) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(mapping), encoding="utf-8")
    return path


def tiny_plan(model: Path, tmp_path: Path, evaluation: dict[str, Any]) -> dict[str, Any]:
    mapping = plan_mapping(model, tmp_path, evaluation={"sets": ["wiki-text", "lambada"], **evaluation})
    (tmp_path / "policy.yaml").write_text(POLICY, encoding="utf-8")
    return mapping


def resolved(model: Path, tmp_path: Path, evaluation: dict[str, Any]) -> ResolvedPlan:
    return resolve_plan(from_mapping(tiny_plan(model, tmp_path, evaluation)), show_progress=False)


# ---- the planner ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["arc-easy@v1", "lambada@v1"])
@pytest.mark.parametrize("classes", [["8bit"], ["4bit"], ["8bit", "4bit"]])
def test_a_planned_ceiling_is_the_planners_items_rounded_up_to_a_look(spec: str, classes: list[str]) -> None:
    policy = small_model()
    size = evalsets.load(spec).size
    looks = policy.policy.sequential.looks_for(spec.split("@")[0])
    bounds = {"8bit": 5.0, "4bit": 10.0}
    expected = max(expected_ceiling(bounds[c], DEFAULT_DISCORDANCE[c], looks, size, 110) for c in classes)
    ceiling, powers = gate_powers(policy, spec, classes, None, size=size)
    assert ceiling == expected
    assert ceiling in schedule(looks, size)  # a look of the set's schedule (its last)
    assert [p.precision for p in powers] == classes and all(p.planned and p.ceiling == ceiling for p in powers)
    for p in powers:  # the items and power at the ceiling's own looks
        k = len(schedule(looks, ceiling))
        sd = math.sqrt(DEFAULT_DISCORDANCE[p.precision]) * 100
        assert p.items == max(110, items_needed(p.effect, sd, confidence=0.95, looks=k))
        assert p.power == pytest.approx(power_at(ceiling, p.effect, sd, confidence=0.95, looks=k))
        assert p.effect == pytest.approx(bounds[p.precision] / 2) and p.discordance == DEFAULT_DISCORDANCE[p.precision]


def test_the_small_model_numbers() -> None:
    """small-model@v4 at the default prior: lambada's ceiling is its 960-item look; arc-easy's
    570 items are too few for power 0.8 in either class, so its ceiling is the whole set."""
    policy = small_model()
    lambada, powers = gate_powers(policy, "lambada@v1", ["8bit", "4bit"], None, size=5153)
    assert lambada == 960 and [(p.items, p.decidable) for p in powers] == [(893, True), (670, True)]
    assert all(p.power is not None and p.power >= DEFAULT_POWER for p in powers)
    arc, powers = gate_powers(policy, "arc-easy@v1", ["8bit", "4bit"], None, size=570)
    assert arc == 570 and [(p.items, p.decidable) for p in powers] == [(893, False), (670, False)]
    assert all(p.power is not None and p.power < DEFAULT_POWER for p in powers)


def test_past_the_last_look_the_ceiling_is_the_items_needed(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY, encoding="utf-8")
    policy = load_policy(tmp_path / "policy.yaml")
    ceiling, powers = gate_powers(policy, "lambada@v1", ["8bit"], None, size=5153)
    needed = items_needed(2.5, math.sqrt(0.05) * 100, confidence=0.95, looks=3)
    assert 150 < ceiling == needed < 5153 and powers[0].items == needed
    assert powers[0].power == pytest.approx(DEFAULT_POWER, abs=0.002)  # the power the formula solves for


def test_the_ceiling_is_capped_at_the_sets_size_and_the_gate_named_undecidable() -> None:
    prior = Discordance({"8bit": 0.4}, "a test's assumption")
    ceiling, powers = gate_powers(small_model(), "arc-easy@v1", ["8bit"], None, size=570, prior=prior)
    (gate,) = powers
    assert ceiling == 570 and gate.ceiling == 570 and gate.items is not None and gate.items > 570
    assert gate.decidable is False and gate.power is not None and gate.power < 0.5
    assert gate.discordance == 0.4 and gate.source == "a test's assumption"
    assert gate.warning().startswith(f"arc-easy@v1 acc (8bit): 570 items decide a candidate 2.50 points inside its bound "
                                     f"-5.00 points with power {gate.power:.2f}, not 0.8: that needs {gate.items} items")
    assert "discordance 0.4: a test's assumption" in gate.warning()


def test_a_set_whose_gates_have_no_prior_spread_cannot_be_planned() -> None:
    with pytest.raises(InputError, match=r"wiki-text@v1's ceiling is planned, but none of its gates \(kl_divergence, kl_p99, "
                                         r"perplexity, top1_agreement\) has a prior spread to plan from: give its ceiling as a number"):
        gate_powers(small_model(), "wiki-text@v1", ["8bit"], None, size=2938)
    ceiling, powers = gate_powers(small_model(), "wiki-text@v1", ["8bit"], 50, size=2938)
    assert ceiling == 50 and all(p.items is None and p.power is None and p.decidable is None for p in powers)


# ---- the plan: syntax, preflight, the record --------------------------------------------------


def test_planned_ceilings_resolve_to_the_planners_numbers_and_their_power_is_recorded(quant_model: Path, tmp_path: Path) -> None:
    plan = resolved(quant_model, tmp_path, {"items": {"lambada": "planned", "wiki-text": 4}})
    ceiling, _ = gate_powers(plan.policy, "lambada@v1", ["8bit", "4bit"], None, size=5153)
    assert plan.looks["lambada@v1"] == (50, 150, ceiling) and plan.looks["wiki-text@v1"] == (4,)
    assert plan.eval_cfg.limit_for("lambada", "lambada@v1") == ceiling  # what the evaluator is given
    record = json.loads(json.dumps(plan.planned_power))  # JSON as it is
    by_gate = {(r["split"], r["set"], r["gate"], r["precision"]): r for r in record}
    assert set(by_gate) == {("plan", s, g, c) for s, g in (("wiki-text@v1", "kl_divergence"), ("lambada@v1", "acc"))
                            for c in ("8bit", "4bit")}  # the tiny plan's formats: fp8-e4m3 and gptq-int4
    lam = by_gate[("plan", "lambada@v1", "acc", "8bit")]
    assert lam["ceiling"] == ceiling and lam["planned"] is True and lam["decidable"] is True
    assert lam["power"] >= DEFAULT_POWER and lam["items"] <= ceiling and lam["target"] == DEFAULT_POWER
    assert lam["discordance"] == 0.05 and "DEFAULT_DISCORDANCE" in lam["source"]
    kl = by_gate[("plan", "wiki-text@v1", "kl_divergence", "4bit")]
    assert kl["ceiling"] == 4 and kl["planned"] is False and kl["power"] is None and "no prior spread" in kl["source"]
    assert plan.power_warnings == []  # every gate that can be said is decidable at its planned ceiling


def test_a_plans_discordance_moves_the_ceiling_and_its_source_is_recorded(quant_model: Path, tmp_path: Path) -> None:
    default = resolved(quant_model, tmp_path, {"items": {"lambada": "planned", "wiki-text": 4}})
    sourced = resolved(quant_model, tmp_path, {"items": {"lambada": "planned", "wiki-text": 4},
                                               "discordance": {"8bit": 0.1, "source": "measured: run 2026-11-30, 240 items"}})
    assert sourced.looks["lambada@v1"][-1] > default.looks["lambada@v1"][-1]
    by_class = {r["precision"]: r for r in sourced.planned_power if r["set"] == "lambada@v1"}
    assert by_class["8bit"]["discordance"] == 0.1 and by_class["8bit"]["source"] == "measured: run 2026-11-30, 240 items"
    assert by_class["4bit"]["discordance"] == DEFAULT_DISCORDANCE["4bit"]  # a class it does not give keeps the default


@pytest.mark.parametrize("discordance, fragment", [
    ({"8bit": 0.1}, "evaluation.discordance: a planning discordance needs `source:`, where its values come from"),
    ({"8bit": 0.1, "source": "  "}, "a planning discordance needs `source:`"),
    ({"source": "a paper"}, "a planning discordance gives `8bit:`, `4bit:` or both"),
    ({"8bit": 1.5, "source": "a paper"}, "evaluation.discordance.8bit: Input should be less than or equal to 1"),
])
def test_a_discordance_without_its_source_is_refused_in_one_line(cli, tmp_path: Path, discordance: dict[str, Any],
                                                                  fragment: str) -> None:
    mapping = tiny_plan(tmp_path / "no-model-needed", tmp_path, {"items": {"lambada": "planned"}, "discordance": discordance})
    result = cli("run", write_plan(tmp_path, mapping))
    assert result.code == 2, result.err
    assert result.err.startswith("quantgate: error: ") and result.err.count("\n") == 1 and fragment in result.err, result.err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("items, fragment", [
    ({"lambada": "plan"}, "evaluation.items.lambada: a ceiling is a positive number of items or `planned`, not 'plan'"),
    ({"lambada": 0}, "evaluation.items.lambada: a ceiling is a positive number of items or `planned`, not 0"),
    ({"lambada": {"search": -1}}, "evaluation.items.lambada.search: a ceiling is a positive number of items or `planned`, not -1"),
    ({"lambada": {"ceiling": 4, "holdout": 4}}, "evaluation.items.lambada.holdout: unknown field (did you mean 'held_out'?); "
                                                "valid: ceiling, search, held_out"),
    ({"lambada": {"held_out": 4}}, "evaluation.items.lambada.held_out is for a search's split, and the plan has no search"),
])
def test_a_ceiling_is_a_number_or_planned(cli, tmp_path: Path, items: dict[str, Any], fragment: str) -> None:
    result = cli("run", write_plan(tmp_path, tiny_plan(tmp_path / "none", tmp_path, {"items": items})))
    assert result.code == 2 and result.err.count("\n") == 1 and fragment in result.err, result.err


def test_preflight_warns_of_each_gate_its_ceiling_cannot_decide_with_the_items_it_needs(cli, quant_model: Path,
                                                                                      tmp_path: Path) -> None:
    """A hand-given ceiling below the planner's is run (a user may accept less power), and named."""
    plan = write_plan(tmp_path, tiny_plan(quant_model, tmp_path, {"items": 4}))
    with preflight_only():
        result = cli("run", plan)
    assert result.code == 0 and "preflight passed" in result.out, result.err
    warnings = [line for line in result.err.splitlines() if line.startswith("quantgate: warning: plan: ")]
    for precision, effect, bound, discordance in (("8bit", "2.50", "-5.00", 0.05), ("4bit", "5.00", "-10.00", 0.15)):
        needed = items_needed(float(effect), math.sqrt(discordance) * 100, confidence=0.95, looks=1)
        power = power_at(4, float(effect), math.sqrt(discordance) * 100, confidence=0.95)
        assert (f"quantgate: warning: plan: lambada@v1 acc ({precision}): 4 items decide a candidate {effect} points inside its "
                f"bound {bound} points with power {power:.2f}, not 0.8: that needs {needed} items (discordance {discordance:g}, "
                f"the {precision} planning default)") in warnings, result.err
    assert len(warnings) == 2  # wiki-text's KL has no prior spread: its power is recorded as unknown, not warned of
    with preflight_only():
        quiet = cli("run", plan, "--quiet")
    assert quiet.code == 0 and "warning" not in quiet.err  # --quiet: the summary only (the record keeps the powers)


def test_a_planned_search_split_and_held_out_split(quant_model: Path, tmp_path: Path) -> None:
    """The search's splits are planned for the class its trials are gated under (lowest-bits: 4bit)."""
    mapping = tiny_plan(quant_model, tmp_path, {"items": {"lambada": "planned", "wiki-text": 4}})  # planned on every split
    (tmp_path / "policy.yaml").write_text(POLICY + "mixed_precision: {rule: lowest-bits}\n", encoding="utf-8")
    mapping |= {"formats": ["gptq-int4", "smoothquant-w8a8"], "search": {"formats": ["gptq-int4", "smoothquant-w8a8"]}}
    plan = resolve_plan(from_mapping(mapping), show_progress=False)
    own, _ = gate_powers(plan.policy, "lambada@v1", ["8bit", "4bit"], None, size=5153)
    four, _ = gate_powers(plan.policy, "lambada@v1", ["4bit"], None, size=own)
    assert plan.looks["lambada@v1"][-1] == own and plan.search_looks is not None and plan.search_looks["lambada@v1"][-1] == four
    assert plan.holdout is not None and plan.holdout.looks["lambada@v1"][-1] == four and plan.holdout.offsets["lambada@v1"] == own
    splits = {(r["split"], r["precision"]) for r in plan.planned_power if r["set"] == "lambada@v1"}
    assert splits == {("plan", "8bit"), ("plan", "4bit"), ("search", "4bit"), ("held-out", "4bit")}


def test_a_planned_held_out_split_needs_items_left_after_the_plans(quant_model: Path, tmp_path: Path) -> None:
    mapping = tiny_plan(quant_model, tmp_path, {"items": {"lambada": {"ceiling": 5153, "search": 100, "held_out": "planned"},
                                                          "wiki-text": 4}})
    (tmp_path / "policy.yaml").write_text(POLICY + "mixed_precision: {rule: lowest-bits}\n", encoding="utf-8")
    mapping |= {"formats": ["gptq-int4", "smoothquant-w8a8"], "search": {"formats": ["gptq-int4", "smoothquant-w8a8"]}}
    with pytest.raises(InputError, match="lambada@v1 has 5153 items, all of them in the plan's split: none is left to hold out"):
        resolve_plan(from_mapping(mapping), show_progress=False)


def splits(plan: RunPlan) -> Splits:
    """A plan's item counts resolved, without its model: the sets, the policy and the planner only."""
    goldens = {golden.spec: golden for golden in map(evalsets.load, plan.evaluation.sets)}
    policy = load_gate_policy(plan.policy, list(goldens), list(plan.narrow_policy) if plan.narrow_policy else None)
    return resolve_items(plan, goldens, policy)


def test_the_demo_plan_gets_the_items_it_had_before_the_item_block_and_the_same_stage_keys() -> None:
    """`evaluation.items: {lambada@v1: planned, wiki-text@v1: 50}` in place of evaluation.limits,
    search.limits and search.holdout_limits (each the same two values): every split's looks, the
    held-out offsets and each gate's planned power are what the four fields gave (recorded from the
    plan before the change), and so are the evaluation settings the baseline's evaluation key and
    every format's sequential key hash: a demo run before the change is reused by one after it."""
    resolved = splits(load_plan("demo").plan)
    lambada, wiki = (120, 240, 480, 960), (25, 50)
    assert resolved.looks == resolved.search_looks == {"lambada@v1": lambada, "wiki-text@v1": wiki}
    assert resolved.holdout is not None and resolved.holdout.looks == {"lambada@v1": lambada, "wiki-text@v1": wiki}
    assert resolved.holdout.offsets == {"lambada@v1": 960, "wiki-text@v1": 50}
    recorded = {(p.split, p.set, p.precision, p.ceiling, p.planned) for p in resolved.powers}
    assert len(resolved.powers) == 20 and recorded == {
        ("plan", "lambada@v1", "8bit", 960, True), ("plan", "lambada@v1", "4bit", 960, True),
        ("plan", "wiki-text@v1", "8bit", 50, False), ("plan", "wiki-text@v1", "4bit", 50, False),
        ("search", "lambada@v1", "4bit", 960, True), ("search", "wiki-text@v1", "4bit", 50, False),
        ("held-out", "lambada@v1", "4bit", 960, True), ("held-out", "wiki-text@v1", "4bit", 50, False)}
    settings = resolved.eval_cfg.model_dump(mode="json")  # ResolvedPlan.eval_settings: the sequential key's `config`
    assert settings["limit"] is None and settings["limits"] == {"lambada@v1": 960, "wiki-text@v1": 50}


def test_the_evaluation_settings_hold_the_numbers_not_how_the_plan_wrote_them() -> None:
    """Every way of writing the same ceilings (for every set, by NAME or NAME@vN, a lone number or
    {ceiling: N}) gives the same settings, hence the same stage keys."""
    base = {"model": "x", "formats": ["fp8-e4m3"], "policy": "small-model@v5", "narrow_policy": ["wiki-text", "lambada"]}
    sets = ["wiki-text", "lambada"]
    written = [{"sets": sets, "items": 120}, {"sets": sets, "items": {"wiki-text": 120, "lambada@v1": {"ceiling": 120}}},
               {"sets": ["wiki-text@v1", "lambada@v1"], "items": {"wiki-text@v1": {"ceiling": 120}, "lambada": 120}}]
    settings = [splits(from_mapping({**base, "evaluation": evaluation}).plan).eval_cfg.model_dump(mode="json") for evaluation in written]
    assert settings[0]["limits"] == {"wiki-text@v1": 120, "lambada@v1": 120}
    assert settings[1:] == settings[:1] * 2


@pytest.mark.parametrize("old, new", [
    ({"evaluation": {"limit": 4}}, "evaluation.limit: moved: write it as `evaluation.items: N`"),
    ({"evaluation": {"limits": {"lambada": 4}}}, "evaluation.limits: moved: write it as `evaluation.items: {SET: N}`"),
    ({"search": {"limits": {"lambada": 4}}}, "search.limits: moved: write it as `evaluation.items: {SET: {search: N}}`"),
    ({"search": {"holdout_limits": {"lambada": 4}}},
     "search.holdout_limits: moved: write it as `evaluation.items: {SET: {held_out: N}}`"),
])
def test_an_item_count_where_it_was_written_before_is_refused_naming_its_new_place(cli, tmp_path: Path, old: dict[str, Any],
                                                                                  new: str) -> None:
    mapping = tiny_plan(tmp_path / "no-model-needed", tmp_path, {})
    mapping["search"] = {"formats": ["gptq-int4", "smoothquant-w8a8"]}
    mapping["formats"] = ["gptq-int4", "smoothquant-w8a8"]
    for section, fields in old.items():
        mapping[section] |= fields
    result = cli("run", write_plan(tmp_path, mapping))
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert result.err.startswith("quantgate: error: plan ") and new in result.err and "docs/gates.md" in result.err, result.err
    assert not (tmp_path / "run").exists()


def test_the_demo_plans_ceilings_are_planned_and_its_comments_give_the_planners_numbers() -> None:
    """No ceiling of the demo was chosen after seeing a result: lambada's are planned on every
    split (power at least 0.8 for each class it gates), wiki-text's are its policy looks (a text set
    has no prior spread), and arc-easy is left out because the planner says its 570 items cannot
    give 0.8: the numbers in the comments are the planner's."""
    plan = load_plan("demo").plan
    assert plan.evaluation.items == {"lambada@v1": SetItems(ceiling=PLANNED), "wiki-text@v1": SetItems(ceiling=50)}  # every split
    assert plan.search is not None
    comments = re.sub(r"\s*\n\s*#\s*", " ", DEMO_PLAN.read_text(encoding="utf-8"))
    policy, both = small_model(), ["8bit", "4bit"]
    lambada, gates = gate_powers(policy, "lambada@v1", both, None, size=5153)
    assert lambada == 960 and all(gate.power is not None and gate.power >= 0.8 for gate in gates)
    assert f"{lambada} items (a look of the policy's schedule) on every split" in comments
    arc, arc_gates = gate_powers(policy, "arc-easy@v1", both, None, size=570)
    eight = next(gate for gate in arc_gates if gate.precision == "8bit")
    assert arc == 570 and f"has 570 items, where its 8-bit gate reaches power {eight.power:.2f} ({eight.items} needed)" in comments


def test_the_docs_example_plan_validates_and_its_worked_example_is_the_planners() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "gates.md").read_text(encoding="utf-8")
    body = text[text.index("### Planned ceilings"):text.index("### Size and integrity gates")]
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", body, re.DOTALL).group(1))  # type: ignore[union-attr]  # the section holds one yaml block: a None here fails the test anyway
    formats = ["gptq-int4", "smoothquant-w8a8"]
    example["search"] = {"formats": formats}  # a search, whose splits the example's items plan too
    plan = from_mapping({"model": "x", "formats": formats, **example}).plan
    assert plan.evaluation.items["lambada@v1"] == SetItems(ceiling=PLANNED) and plan.evaluation.discordance is not None
    rows = re.findall(r"^\| (\d+) \((\d)\) \| ([\d.]+) \| (\d+), ([\d.]+) \| (\d+), ([\d.]+) \|$", body, re.MULTILINE)
    assert len(rows) == 4
    for ceiling, k, _, *numbers in rows:
        for (items, power), (effect, d) in zip(zip(numbers[::2], numbers[1::2], strict=True), ((2.5, 0.05), (5.0, 0.15)), strict=True):
            sd = math.sqrt(d) * 100
            assert int(items) == max(110, items_needed(effect, sd, confidence=0.95, looks=int(k)))
            assert power == f"{power_at(int(ceiling), effect, sd, confidence=0.95, looks=int(k)):.2f}"
    lambada, _ = gate_powers(small_model(), "lambada@v1", ["8bit", "4bit"], None, size=5153)
    assert f"lambada (5,153 items) is planned at {lambada}" in " ".join(body.split())
