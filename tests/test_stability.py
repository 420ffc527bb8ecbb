"""Verdict stability (gates.stats.verdict_stability): the share of resamples of a decided gate's
items on which its own rule decides the same. Known answers on tiny inputs, the nested
bootstrap against a slow reference at the full inner count, the record (GateResult, the looks)
and the report's column, figure and flag."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from quantgate.core.metrics import METRICS
from quantgate.core.rundir import RunDir
from quantgate.gates import report as report_module
from quantgate.gates import stats
from quantgate.gates.policy import Outcome, decide, load_policy
from quantgate.gates.report_model import RunRecords
from quantgate.gates.sequential import decide_at_look
from quantgate.gates.verdict import GateResult, Look, compare, metric_gate
from quantgate.pipeline.looks import Looks
from tests.helpers import composed, sample_report
from tests.test_looks import FAIL_FAST_POLICY, FMT, Evaluator, plan, same_answers, text_set
from tests.test_looks import policy as looks_policy
from tests.test_verdict import mc_items, policy_file


def accuracy_pair(n: int, losses: int, gains: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """0/1 correctness of a baseline and a candidate on n items: `losses` items the candidate
    gets wrong and the baseline right, `gains` the other way, the rest the same, in a seeded order."""
    rng = np.random.default_rng(seed)
    baseline = rng.integers(0, 2, n).astype(float)
    candidate = baseline.copy()
    right, wrong = np.flatnonzero(baseline == 1), np.flatnonzero(baseline == 0)
    candidate[rng.choice(right, losses, replace=False)] = 0.0
    candidate[rng.choice(wrong, gains, replace=False)] = 1.0
    return baseline, candidate


def final_rule(limit: float, margin: float = 0.0):
    """A higher-is-better gate's fixed-size rule at its one look."""
    return lambda estimate, low, high: decide(estimate, low, high, limit=limit, margin=margin, higher_is_better=True)


# ---- the pure function: known answers -------------------------------------------------------


def test_a_gate_whose_every_item_is_identical_is_perfectly_stable() -> None:
    # every paired difference is -1 item in 1: every resample has the same estimate and interval
    baseline, candidate = np.ones(50), np.zeros(50)
    statistic = stats.mean_difference(baseline, candidate)
    result = stats.verdict_stability(statistic, 50, final_rule(-0.5), Outcome.failed, confidence=0.95, seed=3)
    assert result == stats.Stability(share=1.0, resamples=stats.STABILITY_RESAMPLES,
                                     inner_resamples=stats.STABILITY_INNER_RESAMPLES, seed=3)


def test_an_estimate_exactly_on_the_limit_is_a_coin_throw() -> None:
    # a continuous paired difference whose mean is exactly the limit; a margin wide enough that the
    # estimate's side alone decides: about half the resamples land on each side
    rng = np.random.default_rng(1)
    differences = rng.normal(size=300)
    differences -= differences.mean()
    statistic = stats.mean_difference(np.zeros(300), differences)
    limit = float(statistic(np.arange(300)[None, :])[0])
    outcome = final_rule(limit, margin=10.0)(limit, limit - 1, limit + 1)
    assert outcome is Outcome.passed  # touching the limit passes
    share = stats.verdict_stability(statistic, 300, final_rule(limit, margin=10.0), outcome, confidence=0.95).share
    assert 0.4 <= share <= 0.6


def test_two_items_a_known_share() -> None:
    # differences 0 and 1: a resample's mean is 0, 1/2 or 1 with probability 1/4, 1/2, 1/4, so
    # "mean >= 1/2" holds in 3/4 of resamples
    statistic = stats.mean_difference(np.zeros(2), np.array([0.0, 1.0]))
    result = stats.verdict_stability(statistic, 2, lambda e, lo, hi: e >= 0.5, True, confidence=0.95, resamples=8000,
                                     inner_resamples=20, seed=5)
    assert result.share == pytest.approx(0.75, abs=0.02)


def test_the_rule_sees_each_resamples_own_interval() -> None:
    # 240 items, 20 losses and 2 gains: -7.5 points, the interval about [-11, -4] (a resample's
    # estimate moves by about 2 points): "the interval's low end is above -20 points" holds in
    # every resample, "its high end is above -4 points" in some only
    baseline, candidate = accuracy_pair(240, 20, 2)
    statistic = stats.mean_difference(baseline, candidate)
    assert stats.verdict_stability(statistic, 240, lambda e, lo, hi: lo >= -0.20, True, confidence=0.95).share == 1.0
    share = stats.verdict_stability(statistic, 240, lambda e, lo, hi: hi >= -0.04, True, confidence=0.95).share
    assert 0.05 < share < 0.95
    # a wider interval (higher confidence) reaches further: the rule on the high end holds more often
    wider = stats.verdict_stability(statistic, 240, lambda e, lo, hi: hi >= -0.04, True, confidence=0.995).share
    assert wider > share


def test_fewer_inner_resamples_stay_close_to_the_full_count_and_to_a_slow_reference() -> None:
    # a gate near its bound: 240 items, -5 points [about -8, -2] against a -7.5 point bound
    baseline, candidate = accuracy_pair(240, 16, 4, seed=2)
    statistic = stats.mean_difference(baseline, candidate)
    rule = final_rule(-0.075)
    outcome = rule(*(lambda i: (i.estimate, i.low, i.high))(stats.paired_bootstrap(statistic, 240, confidence=0.95)))
    fast = stats.verdict_stability(statistic, 240, rule, outcome, confidence=0.95, seed=7).share
    full = stats.verdict_stability(statistic, 240, rule, outcome, confidence=0.95, seed=7, inner_resamples=2000).share
    assert 0.3 < full < 0.95  # a gate worth measuring
    assert abs(fast - full) <= 0.05  # the same outer resamples: only the inner intervals' noise differs
    # the slow way: the same outer resamples (the generator's first draw), each judged with
    # paired_bootstrap at the policy's 2000 resamples
    outer = np.random.default_rng(7).integers(0, 240, size=(stats.STABILITY_RESAMPLES, 240))
    same = 0
    for row in outer[:100]:
        interval = stats.paired_bootstrap(lambda index, row=row: statistic(row[index]), 240, confidence=0.95, seed=11)
        same += rule(interval.estimate, interval.low, interval.high) == outcome
    reference = same / 100
    first_half = stats.verdict_stability(statistic, 240, rule, outcome, confidence=0.95, seed=7, resamples=100).share
    assert abs(first_half - reference) <= 0.1


def test_nested_intervals_are_each_resamples_percentile_interval() -> None:
    # one outer resample, a large inner count: its interval is paired_bootstrap's on the resampled items
    baseline, candidate = accuracy_pair(120, 12, 5, seed=4)
    statistic = stats.mean_difference(baseline, candidate)
    estimates, lows, highs = stats.nested_intervals(statistic, 120, resamples=1, inner_resamples=20000, confidence=0.9, seed=9)
    row = np.random.default_rng(9).integers(0, 120, size=(1, 120))[0]
    expected = stats.paired_bootstrap(lambda index: statistic(row[index]), 120, resamples=20000, confidence=0.9, seed=1)
    assert estimates[0] == expected.estimate
    assert lows[0] == pytest.approx(expected.low, abs=0.01) and highs[0] == pytest.approx(expected.high, abs=0.01)
    with pytest.raises(Exception, match="at least"):
        stats.nested_intervals(statistic, 0)


def test_a_240_item_gate_costs_well_under_a_second() -> None:
    baseline, candidate = accuracy_pair(240, 30, 10)
    statistic = stats.mean_difference(baseline, candidate)
    stats.verdict_stability(statistic, 240, final_rule(-0.05), Outcome.failed, confidence=0.975)  # warm
    start = time.perf_counter()
    stats.verdict_stability(statistic, 240, final_rule(-0.05), Outcome.failed, confidence=0.975)
    assert time.perf_counter() - start < 1.5  # about 0.2 s on one core; generous for a loaded 2-core machine


def test_the_token_quantiles_binary_search_is_the_cumulative_sums_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(8)
    items = [rng.exponential(0.05, size=rng.integers(0, 40)).round(3) for _ in range(30)]  # ties, and an empty item
    items[0] = np.array([0.5, 0.5, 0.01])
    index = rng.integers(0, 30, size=(400, 30))
    for q in (0.0, 0.01, 0.5, 0.9, 0.99, 1.0):
        searched = stats.token_quantile(items, q)(index)
        monkeypatch.setattr(stats, "_TABLE_AT_MOST", 0)  # the cumulative sum over every token
        summed = stats.token_quantile(items, q)(index)
        monkeypatch.undo()
        assert searched.tolist() == summed.tolist(), q


# ---- the record: metric_gate, compare, the looks, stored gates -------------------------------


def test_metric_gate_records_the_stability_of_what_it_decided(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path, "statistics: {resamples: 400, seed: 4}\n"
                                               "metrics:\n  arc-easy: {acc: {max_drop_points: {8bit: 5.0}}}\n"))
    gate = policy.policy.metrics["arc-easy"]["acc"]
    settings = policy.policy.statistics
    same = (mc_items([1, 0] * 60), mc_items([1, 0] * 60))
    passed = metric_gate("arc-easy@v1", METRICS["acc"], gate, same, settings=settings, precision="8bit")
    assert passed.outcome is Outcome.passed and passed.stability == 1.0
    assert (passed.stability_resamples, passed.stability_inner_resamples, passed.stability_seed) == (
        stats.STABILITY_RESAMPLES, stats.STABILITY_INNER_RESAMPLES, 4)
    # a candidate -5 points against a -5 point bound at a look before the last: its interval
    # reaches across, so it is undecided, and nothing is recorded
    baseline, candidate = accuracy_pair(200, 14, 4)
    pair = (mc_items(baseline.astype(int).tolist()), mc_items(candidate.astype(int).tolist()))
    early = metric_gate("arc-easy@v1", METRICS["acc"], gate, pair, settings=settings, precision="8bit",
                        look=Look(index=1, looks=3, confidence=0.9833))
    assert early.outcome is Outcome.undecided and early.stability is None and early.stability_resamples is None
    # at the ceiling the same items are decided (insufficient evidence), and how stably: the
    # estimate sits on the bound, so resamples go either way
    last = metric_gate("arc-easy@v1", METRICS["acc"], gate, pair, settings=settings, precision="8bit",
                       look=Look(index=3, looks=3, confidence=0.9833))
    assert last.outcome is Outcome.insufficient and last.decided_by == "ceiling"
    assert last.stability is not None and 0.2 < last.stability < 0.9


def test_the_look_the_gate_was_decided_at_is_the_rule_its_resamples_get(tmp_path: Path) -> None:
    # -0.83 points [-7.5, +5.8] against a 10-point bound with a wide margin: at the ceiling the
    # estimate's side decides (a resample's estimate is about 3 points from -0.83, nearly never
    # past -10); before the last look a resample passes only when its own interval clears -10
    # wholly, which about one in five does not
    policy = load_policy(policy_file(tmp_path, "metrics:\n  arc-easy: {acc: {max_drop_points: {8bit: 10.0}, "
                                               "undecided_margin_points: 50.0}}\n"))
    gate, settings = policy.policy.metrics["arc-easy"]["acc"], policy.policy.statistics
    baseline, candidate = accuracy_pair(120, 7, 6, seed=3)
    pair = (mc_items(baseline.astype(int).tolist()), mc_items(candidate.astype(int).tolist()))
    early = metric_gate("arc-easy@v1", METRICS["acc"], gate, pair, settings=settings, precision="8bit",
                        look=Look(index=1, looks=2, confidence=0.975))
    last = metric_gate("arc-easy@v1", METRICS["acc"], gate, pair, settings=settings, precision="8bit",
                       look=Look(index=2, looks=2, confidence=0.975))
    assert early.outcome is last.outcome is Outcome.passed
    assert early.decided_by == "interval" and last.decided_by == "interval"
    assert last.stability is not None and last.stability >= 0.99
    assert early.stability is not None and early.stability < 0.95
    # the share is the rule at the look, recomputed here by hand on the same nested bootstrap
    statistic = stats.mean_difference(baseline, candidate)
    estimates, lows, highs = stats.nested_intervals(statistic, 120, confidence=0.975, seed=settings.seed)
    by_hand = np.mean([decide_at_look(e, lo, hi, limit=-0.10, margin=0.5, higher_is_better=True, final=False, items=120,
                                      min_items=1) is Outcome.passed for e, lo, hi in zip(estimates, lows, highs, strict=True)])
    assert early.stability == by_hand


def test_size_and_integrity_gates_carry_no_stability_and_compare_records_it(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path, "metrics:\n  arc-easy: {acc: {max_drop_points: {8bit: 5.0}}}\n"))
    correct = [1, 0, 1, 1] * 30
    verdict = compare({"arc-easy@v1": mc_items(correct)}, {"arc-easy@v1": mc_items(correct)}, policy, "8bit")
    (gate,) = verdict.gates
    assert gate.stability == 1.0 and gate.as_dict()["stability"] == 1.0
    from quantgate.gates.verdict import blocked_verdict
    assert blocked_verdict("no load").gates[0].stability is None


def test_stored_gates_without_stability_still_read_and_new_ones_round_trip() -> None:
    old = {"gate": "arc-easy@v1 acc", "outcome": "pass", "estimate": 0.0, "low": -1.0, "high": 1.0, "limit": -5.0,
           "unit": "points", "reason": "r", "items": 120, "look": 1, "looks": 1, "confidence": 0.95, "decided_by": "ceiling",
           "half_width": 1.0, "detectable": 1.4}
    gate = GateResult.from_dict(old)
    assert gate.stability is None and gate.stability_resamples is None and gate.stability_seed is None
    new = {**old, "stability": 0.87, "stability_resamples": 200, "stability_inner_resamples": 400, "stability_seed": 0}
    assert GateResult.from_dict(new).as_dict() == new


def test_the_looks_record_stability_on_decided_gates_only(tmp_path: Path) -> None:
    from quantgate.evalsets import Kind
    sets = {"arc-easy@v1": (Kind.multiple_choice, (20, 40, 80)), "lambada@v1": (Kind.last_word, (20, 40, 80)),
            "wiki-text@v1": (Kind.text, (20, 40, 80))}
    evaluator = Evaluator({"arc-easy@v1": same_answers(80), "lambada@v1": same_answers(80),
                           "wiki-text@v1": text_set(80, kl_tokens=2, kl_value=2.0, top1=[70, 100])})
    outcome = Looks(plan(looks_policy(tmp_path, FAIL_FAST_POLICY), sets), RunDir(tmp_path / "run"), evaluator).run(FMT, "8bit", None)
    gates = {gate.gate: gate for gate in outcome.gates}
    # every item alike: the tail fails and the mean passes in every resample
    assert gates["wiki-text@v1 kl_p99"].outcome is Outcome.failed and gates["wiki-text@v1 kl_p99"].stability == 1.0
    assert gates["wiki-text@v1 kl_divergence"].stability == 1.0
    # undecided when blocked, and never run: not evaluated, no stability
    for name in ("wiki-text@v1 top1_agreement", "lambada@v1 acc", "arc-easy@v1 acc"):
        assert gates[name].outcome is Outcome.not_evaluated and gates[name].stability is None
    assert outcome.as_dict()["gates"][0]["stability_resamples"] in (None, stats.STABILITY_RESAMPLES)


# ---- the report -------------------------------------------------------------------------------


def stability_report() -> dict:
    """The sample report, its decided metric gates given stabilities: awq-int4's arc-easy gate
    (insufficient evidence) unstable at 0.62, the rest stable; gptq-int4 left without (a verdict
    from before stability was recorded)."""
    report = sample_report()
    for row in report["rows"]:
        if row["format"] == "gptq-int4":
            continue
        for gate in row["gates"]:
            if "@" in gate["gate"] and gate["outcome"] != "not evaluated":
                unstable = row["format"] == "awq-int4" and gate["gate"] == "arc-easy@v1 acc"
                gate.update(stability=0.62 if unstable else 0.985, stability_resamples=200, stability_inner_resamples=400,
                            stability_seed=0)
    return report


def test_the_gate_table_has_a_stability_column() -> None:
    records = RunRecords.model_validate(stability_report())
    awq = next(row for row in records.rows if row.format == "awq-int4")
    column = report_module.GATE_HEADER.index("stability")
    cells = {gate.gate: report_module.gate_cells(gate)[column] for gate in awq.gates}
    assert cells["arc-easy@v1 acc"] == "0.62" and cells["wiki-text@v1 kl_divergence"] == "0.98"
    assert cells["size bits_per_weight"] == cells["integrity finite_logits"] == "exact"
    assert report_module.GATE_HEADER[-1] == "reason" and len(report_module.gate_cells(awq.gates[0])) == len(report_module.GATE_HEADER)


def test_an_unstable_decided_gate_is_flagged_in_every_form(tmp_path: Path) -> None:
    report = stability_report()
    rows = {row.format: row for row in RunRecords.model_validate(report).rows}
    (flag,) = report_module.stability_lines(rows["awq-int4"])
    assert flag == ("arc-easy acc (insufficient evidence) is unstable: a resample of its items decides otherwise in 38% "
                    "of cases (stability 0.62 over 200 resamples)")
    assert report_module.stability_lines(rows["fp8-e4m3"])[0].startswith("Every decided metric gate is stable")
    assert report_module.stability_lines(rows["gptq-int4"]) == []  # nothing recorded: nothing claimed
    out = report_module.write(composed(report), tmp_path / "report")
    page = (out / "report.html").read_text()
    section = page[page.index('id="candidate-awq-int4"'):]
    section = section[:section.index("</section>")]
    assert '<svg xmlns="http://www.w3.org/2000/svg" class="stability"' in section and "stability-row unstable" in section
    assert "decides otherwise in 38% of cases" in section
    gptq = page[page.index('id="candidate-gptq-int4"'):]
    assert 'class="stability"' not in gptq[:gptq.index("</section>")]
    markdown = (out / "report.md").read_text()
    assert "| stability |" in markdown and "decides otherwise in 38% of cases" in markdown
    data = (out / "report.json").read_text()
    import json
    gates = {gate["gate"]: gate for gate in next(row for row in json.loads(data)["rows"] if row["format"] == "awq-int4")["gates"]}
    assert gates["arc-easy@v1 acc"]["stability"] == 0.62 and gates["arc-easy@v1 acc"]["stability_resamples"] == 200
