"""Sample-size guidance (gates/samplesize.py) and `quantgate evalsets plan`: the formula against
textbook numbers and a simulation, the accuracy default, the spread measured from results, the
command's output and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from quantgate.core.errors import InputError
from quantgate.core.metrics import METRICS
from quantgate.gates.policy import load_policy
from quantgate.gates.samplesize import (
    DEFAULT_DISCORDANCE,
    Effects,
    accuracy_sd,
    items_needed,
    measured_spreads,
    parse_effects,
    plan_policy,
    sd_from_interval,
    zero_loss_floor,
)
from quantgate.gates.sequential import critical_value
from tests.helpers import write_results_manifest

SEQUENTIAL_POLICY = """name: planned
version: v1
sequential: {looks: [50, 150, 450]}
metrics:
  hellaswag: {acc_norm: {max_drop_points: {8bit: 5.0, 4bit: 10.0}}}
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.05}}
    perplexity: {max_increase_percent: {8bit: 3.0}}
"""


def policy_file(tmp_path: Path, text: str = SEQUENTIAL_POLICY) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


# ---- the arithmetic -------------------------------------------------------------------------


def test_items_needed_is_the_normal_sample_size_formula() -> None:
    # the textbook case: 95% two-sided, 80% power, effect half an sd: ((1.960 + 0.842) / 0.5)^2 = 31.4
    assert items_needed(0.5, 1.0, confidence=0.95) == 32
    z = NormalDist().inv_cdf(1 - 0.05 / 8) + NormalDist().inv_cdf(0.9)
    assert items_needed(2.0, 30.0, confidence=0.95, looks=4, power=0.9) == math.ceil((z * 30.0 / 2.0) ** 2)
    assert items_needed(1.0, 0.0, confidence=0.95) == 1  # no spread: one item settles it


def test_splitting_the_confidence_over_more_looks_needs_more_items_but_not_many_more() -> None:
    one, four, ten = (items_needed(2.5, 44.7, confidence=0.95, looks=k) for k in (1, 4, 10))
    assert one < four < ten
    assert four / one < 1.45 and ten / one < 1.75  # the union bound's price grows like log K


@pytest.mark.parametrize(("args", "fragment"), [
    ((0.0, 1.0), "positive distance"), ((-1.0, 1.0), "positive distance"), ((1.0, -1.0), "zero or more"),
    ((1.0, math.nan), "zero or more"),
])
def test_items_needed_refuses_what_is_no_effect_or_no_spread(args: tuple[float, float], fragment: str) -> None:
    with pytest.raises(InputError, match=fragment):
        items_needed(*args, confidence=0.95)


def test_items_needed_refuses_a_power_or_confidence_outside_zero_one() -> None:
    with pytest.raises(InputError, match="power"):
        items_needed(1.0, 1.0, confidence=0.95, power=1.0)
    with pytest.raises(InputError, match="confidence"):
        items_needed(1.0, 1.0, confidence=1.5)


def test_accuracy_sd_is_that_of_a_paired_zero_one_difference() -> None:
    assert accuracy_sd(0.2) == pytest.approx(math.sqrt(0.2))
    assert accuracy_sd(0.2, -0.1) == pytest.approx(math.sqrt(0.2 - 0.01))
    # against the sample: per-item differences of +1 (a gain), -1 (a loss), 0
    rng = np.random.default_rng(0)
    draws = rng.random(200_000)
    change = np.where(draws < 0.05, 1.0, np.where(draws < 0.20, -1.0, 0.0))  # d = 0.2, delta = -0.1
    assert change.std() == pytest.approx(accuracy_sd(0.2, -0.1), rel=0.01)
    with pytest.raises(InputError, match="share of items"):
        accuracy_sd(0.0)
    with pytest.raises(InputError, match="at least that share"):
        accuracy_sd(0.05, -0.1)


def test_at_the_planned_items_a_gate_is_decisive_with_the_planned_power() -> None:
    """Paired 0/1 items with discordance 0.2, the truth 2.5 points inside a 5-point bound: at the
    formula's n, the share of replications whose normal interval (the split confidence of four
    looks) lies wholly above the bound is the planned 80%."""
    effect, discordance, truth = 2.5, 0.2, -2.5
    n = items_needed(effect, accuracy_sd(discordance) * 100, confidence=0.95, looks=4)
    rng = np.random.default_rng(1)
    gain, loss = (discordance + truth / 100) / 2, (discordance - truth / 100) / 2
    counts = rng.multinomial(n, [gain, loss, 1 - gain - loss], size=4000)
    mean = (counts[:, 0] - counts[:, 1]) / n
    sd = np.sqrt((counts[:, 0] + counts[:, 1]) / n - mean**2)
    decisive = (mean - critical_value(0.95, 4) * sd / math.sqrt(n)) * 100 >= -5.0
    assert decisive.mean() == pytest.approx(0.8, abs=0.03)


def test_sd_from_interval_inverts_the_interval_width() -> None:
    z = critical_value(0.95)
    assert sd_from_interval(z * 3.0 / math.sqrt(400), 400, 0.95) == pytest.approx(3.0)


def test_zero_loss_floor_is_where_no_loss_at_all_becomes_rarer_than_a_look_error() -> None:
    floor = zero_loss_floor(0.05, confidence=0.95, looks=4)
    assert floor == 99
    assert 0.95**floor <= 0.05 / 8 < 0.95 ** (floor - 1)
    assert zero_loss_floor(0.01, confidence=0.95) == 368  # a 1-point bound, one look
    assert zero_loss_floor(0.0, confidence=0.95) is None


def test_effects_parse_every_gate_and_per_metric() -> None:
    effects = parse_effects(["2", "kl_divergence=0.01"])
    assert effects.every == 2.0 and dict(effects.by_metric) == {"kl_divergence": 0.01}
    assert effects.for_gate(METRICS["kl_divergence"], 0.05)[0] == 0.01
    assert effects.for_gate(METRICS["acc"], -5.0)[0] == 2.0
    # the default: half the bound's distance from no change (the baseline's own value for an agreement)
    assert Effects().for_gate(METRICS["top1_agreement"], 0.85)[0] == pytest.approx(0.075)
    assert Effects().for_gate(METRICS["acc"], -5.0)[0] == pytest.approx(2.5)
    for bad in ("abc", "acc=-1", "0", "nosuch=1", "acc=inf"):
        with pytest.raises(InputError, match="invalid --effect"):
            parse_effects([bad])


# ---- the plan -------------------------------------------------------------------------------


def test_plan_places_the_needed_items_among_the_sets_looks(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path))
    plans = plan_policy(policy, {"hellaswag": 1000, "wiki-text": 2938}, precision="8bit", discordance=0.2,
                        effects=parse_effects(["acc_norm=5"]))
    accuracy = next(plan for plan in plans if plan.gate == "hellaswag acc_norm")
    assert accuracy.looks == [50, 150, 450, 1000] and accuracy.look_confidence == pytest.approx(0.9875)
    assert accuracy.items == items_needed(5.0, math.sqrt(0.2) * 100, confidence=0.95, looks=4) == 893
    assert accuracy.look == 4  # decided by the ceiling
    assert accuracy.zero_loss_floor == 99 and "set min_items to at least 99" in (accuracy.floor_warning or "")
    kl = next(plan for plan in plans if plan.gate == "wiki-text kl_divergence")
    assert kl.items is None and "give --baseline-results" in kl.sd_from and kl.effect == pytest.approx(0.025)


def test_plan_defaults_per_precision_class_and_respects_min_items(tmp_path: Path) -> None:
    text = SEQUENTIAL_POLICY.replace("sequential: {looks: [50, 150, 450]}", "sequential: {looks: [50, 150, 450], min_items: 120}")
    policy = load_policy(policy_file(tmp_path, text))
    plans = {(plan.gate, plan.precision): plan for plan in plan_policy(policy, {"hellaswag": 1000, "wiki-text": 2938},
                                                                         effects=Effects(every=40.0))}
    eight, four = plans[("hellaswag acc_norm", "8bit")], plans[("hellaswag acc_norm", "4bit")]
    assert "the 8bit default" in eight.sd_from and eight.sd == pytest.approx(math.sqrt(DEFAULT_DISCORDANCE["8bit"]) * 100)
    assert four.sd == pytest.approx(math.sqrt(DEFAULT_DISCORDANCE["4bit"]) * 100)
    assert eight.items == 120 and eight.look == 2  # a large effect needs 4 items: min_items decides, at the 150-item look
    assert eight.floor_warning is None  # min_items covers the zero-loss floor
    assert ("wiki-text kl_divergence", "4bit") not in plans  # the policy gives no 4-bit KL bound


def test_plan_refusals_are_input_errors(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path))
    sizes = {"hellaswag": 1000, "wiki-text": 2938}
    with pytest.raises(InputError, match="--precision must be one of"):
        plan_policy(policy, sizes, precision="2bit")
    with pytest.raises(InputError, match="share of items"):
        plan_policy(policy, sizes, discordance=1.5)
    with pytest.raises(InputError, match="does not gate"):
        plan_policy(policy, sizes, effects=parse_effects(["top1_agreement=0.1"]))
    with pytest.raises(InputError, match="power"):
        plan_policy(policy, sizes, power=0.0)


def paired_records(rng: np.random.Generator, items: int, *, gain: float, loss: float) -> tuple[list[dict], list[dict]]:
    draws = rng.random(items)
    baseline = (rng.random(items) < 0.6).astype(float)
    candidate = baseline.copy()
    baseline[draws < gain], candidate[draws < gain] = 0.0, 1.0
    lost = (draws >= gain) & (draws < gain + loss)
    baseline[lost], candidate[lost] = 1.0, 0.0
    as_records = [[{"id": str(i), "metrics": {"acc_norm": float(v), "acc": float(v)}} for i, v in enumerate(side)]
                  for side in (baseline, candidate)]
    return as_records[0], as_records[1]


def test_the_measured_spread_is_the_per_item_sd_of_the_gate_statistic(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path))
    baseline, candidate = paired_records(np.random.default_rng(2), 2000, gain=0.05, loss=0.15)
    spreads = measured_spreads({"hellaswag@v1": baseline}, {"hellaswag@v1": candidate}, policy)
    assert set(spreads) == {("hellaswag", "acc_norm")}  # wiki-text is not in the results: left out
    spread = spreads[("hellaswag", "acc_norm")]
    assert spread.items == 2000 and spread.estimate == pytest.approx(-10.0, abs=2.0)
    assert spread.sd == pytest.approx(accuracy_sd(0.2, -0.1) * 100, rel=0.08)


# ---- the command ----------------------------------------------------------------------------


def write_results(path: Path, spec: str, records: list[dict]) -> Path:
    """A minimal evaluation-results directory: a manifest and one set's items.json."""
    (path / spec).mkdir(parents=True)
    (path / spec / "items.json").write_text(json.dumps({"schema_version": 1, "items": records}))
    return write_results_manifest(path, {spec: len(records)})


def test_plan_command_prints_each_gate_with_its_looks(cli, tmp_path: Path) -> None:
    result = cli("evalsets", "plan", "--policy", policy_file(tmp_path), "--precision", "8bit", "--discordance", "0.2",
                 "--effect", "acc_norm=5")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("plan under planned@v1")
    (accuracy,) = [line for line in lines if "hellaswag acc_norm (8bit)" in line]
    assert "needs 893 items" in accuracy and "looks 50, 150, 450, 1000 at 98.75% each: look 4 (1000 items)" in accuracy
    assert "zero-loss floor of 99" in accuracy
    assert any("wiki-text kl_divergence (8bit)" in line and "--baseline-results" in line for line in lines)


def test_plan_command_on_a_builtin_policy_as_json(cli) -> None:
    result = cli("evalsets", "plan", "--policy", "default@v1", "--precision", "4bit", "--json")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    assert plan["policy"]["name"] == "default" and plan["power"] == 0.8
    gates = {gate["gate"]: gate for gate in plan["gates"]}
    arc = gates["arc-easy acc"]
    assert arc["set_size"] == 570 and arc["looks"] == [570] and arc["effect"] == 1.5
    assert arc["items"] == items_needed(1.5, math.sqrt(0.15) * 100, confidence=0.95) and arc["look"] is None


def test_plan_command_measures_spreads_from_results(cli, tmp_path: Path) -> None:
    baseline, candidate = paired_records(np.random.default_rng(3), 400, gain=0.05, loss=0.15)
    base = write_results(tmp_path / "baseline", "hellaswag@v1", baseline)
    cand = write_results(tmp_path / "candidate", "hellaswag@v1", candidate)
    result = cli("evalsets", "plan", "--policy", policy_file(tmp_path), "--precision", "8bit", "--baseline-results", base,
                 "--candidate-results", cand, "--json")
    assert result.code == 0, result.err
    gates = {gate["gate"]: gate for gate in json.loads(result.out)["gates"]}
    assert gates["hellaswag acc_norm"]["sd_from"].startswith("measured: half-width")
    assert gates["hellaswag acc_norm"]["sd"] == pytest.approx(44.7, rel=0.15)
    assert gates["wiki-text kl_divergence"]["items"] is None  # not in the results: still needs data


@pytest.mark.parametrize(("args", "fragment"), [
    (("--precision", "2bit"), "--precision must be one of"),
    (("--effect", "abc"), "invalid --effect"),
    (("--discordance", "0"), "--discordance is a share"),
    (("--power", "1"), "--power must be in (0, 1)"),
    (("--baseline-results", "x"), "give both --baseline-results and --candidate-results"),
    (("--policy", "nosuch"), "unknown policy"),
])
def test_plan_command_refuses_bad_input_in_one_line(cli, args: tuple[str, ...], fragment: str) -> None:
    result = cli("evalsets", "plan", *args)
    assert result.code == 2, result.out
    assert result.err.strip().count("\n") == 0 and fragment in result.err
