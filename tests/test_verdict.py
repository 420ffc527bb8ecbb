"""Verdicts on synthetic per-item results: identical candidates pass, damaged ones are
blocked with the reason, a policy edit changes the verdict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quantgate.core.errors import InputError
from quantgate.gates.policy import Outcome, load_policy
from quantgate.gates.verdict import compare
from quantgate.quantize.measure.record import MeasurementRecord
from tests.helpers import measurement_record


def mc_items(correct: list[int]) -> list[dict]:
    return [{"id": str(i), "metrics": {"acc": float(c), "acc_norm": float(c)}} for i, c in enumerate(correct)]


def text_items(nll: list[float], kl: list[float] | None = None, top1: list[int] | None = None) -> list[dict]:
    items = [{"id": str(i), "nll": value, "tokens": 10} for i, value in enumerate(nll)]
    for i, item in enumerate(items):
        if kl is not None:
            item.update(kl_sum=kl[i], top1_matches=top1[i])
    return items


def token_items(kl: list[np.ndarray], change: list[np.ndarray] | None = None) -> list[dict]:
    """Text-set records with per-token values, as the results loader attaches them in memory."""
    change = change if change is not None else [np.zeros_like(values) for values in kl]
    return [{"id": str(i), "nll": 30.0, "tokens": values.size, "kl_sum": float(values.sum()), "top1_matches": values.size,
             "top_prob_change_sum": float(delta.sum()), "token_values": {"kl": values, "top_prob_change": delta}}
            for i, (values, delta) in enumerate(zip(kl, change, strict=True))]


def policy_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text("name: test\nversion: v1\n" + body)
    return path


def test_identical_candidate_is_approved(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    correct = rng.integers(0, 2, 300).tolist()
    nll = rng.uniform(20, 40, 300).tolist()
    policy = load_policy(policy_file(tmp_path, """
metrics:
  arc-easy: {acc: {max_drop_points: {8bit: 1.0}, undecided_margin_points: 1.0}}
  wiki-text:
    perplexity: {max_increase_percent: {8bit: 3.0}, undecided_margin_percent: 1.0}
    kl_divergence: {max_value: {8bit: 0.02}, undecided_margin: 0.01}
    top1_agreement: {min_value: {8bit: 0.95}, undecided_margin: 0.01}
"""))
    baseline = {"arc-easy@v1": mc_items(correct), "wiki-text@v1": text_items(nll)}
    candidate = {"arc-easy@v1": mc_items(correct), "wiki-text@v1": text_items(nll, [0.0] * 300, [10] * 300)}
    verdict = compare(baseline, candidate, policy, "8bit")
    assert verdict.approved, verdict.reasons
    assert {gate.outcome for gate in verdict.gates} == {Outcome.passed}


def test_damaged_candidate_is_blocked_with_the_failing_metric(tmp_path: Path) -> None:
    correct = [1] * 150 + [0] * 150
    damaged = [1] * 120 + [0] * 180  # 10 points worse
    policy = load_policy(policy_file(tmp_path, "metrics: {arc-easy: {acc: {max_drop_points: {4bit: 3.0}, undecided_margin_points: 3.0}}}\n"))
    verdict = compare({"arc-easy@v1": mc_items(correct)}, {"arc-easy@v1": mc_items(damaged)}, policy, "4bit")
    assert not verdict.approved
    (reason,) = verdict.reasons
    assert reason.startswith("arc-easy acc -10.00 points [") and reason.endswith("exceeds -3.00 points")


def test_a_policy_edit_changes_the_verdict(tmp_path: Path) -> None:
    correct = [1] * 150 + [0] * 150
    slightly_worse = [1] * 144 + [0] * 156  # -2 points
    baseline, candidate = {"arc-easy@v1": mc_items(correct)}, {"arc-easy@v1": mc_items(slightly_worse)}
    strict = load_policy(policy_file(tmp_path, "metrics: {arc-easy: {acc: {max_drop_points: {4bit: 1.0}, undecided_margin_points: 5}}}\n"))
    lenient = load_policy(policy_file(tmp_path, "metrics: {arc-easy: {acc: {max_drop_points: {4bit: 3.0}, undecided_margin_points: 5}}}\n"))
    assert not compare(baseline, candidate, strict, "4bit").approved
    assert compare(baseline, candidate, lenient, "4bit").approved


def test_too_few_items_to_tell_blocks_as_insufficient_evidence(tmp_path: Path) -> None:
    # same accuracy (15 of 30), but the two models disagree on 16 items: the point estimate
    # passes a 1-point bound while the interval reaches far past it
    baseline = [1] * 15 + [0] * 15
    candidate = [0] * 8 + [1] * 15 + [0] * 7
    policy = load_policy(policy_file(tmp_path, "metrics: {arc-easy: {acc: {max_drop_points: {8bit: 1.0}, undecided_margin_points: 0.5}}}\n"))
    verdict = compare({"arc-easy@v1": mc_items(baseline)}, {"arc-easy@v1": mc_items(candidate)}, policy, "8bit")
    (gate,) = verdict.gates
    assert gate.estimate == 0.0 and gate.low < -10
    assert gate.outcome is Outcome.insufficient and not verdict.approved
    assert "insufficient evidence" in verdict.reasons[0]


def test_high_kl_and_low_agreement_block(tmp_path: Path) -> None:
    nll = [30.0] * 100
    policy = load_policy(policy_file(tmp_path, """
metrics:
  wiki-text:
    kl_divergence: {max_value: {4bit: 0.1}, undecided_margin: 0.01}
    top1_agreement: {min_value: {4bit: 0.85}, undecided_margin: 0.01}
"""))
    verdict = compare({"wiki-text@v1": text_items(nll)}, {"wiki-text@v1": text_items(nll, [3.0] * 100, [7] * 100)}, policy, "4bit")
    assert not verdict.approved
    assert any("kl_divergence 0.3000" in reason and "exceeds 0.1000" in reason for reason in verdict.reasons)
    assert any("top1_agreement 0.7000" in reason and "is below 0.8500" in reason for reason in verdict.reasons)


def test_a_nan_estimate_fails_instead_of_slipping_through(tmp_path: Path) -> None:
    nll = [30.0] * 20
    policy = load_policy(policy_file(tmp_path, "metrics: {wiki-text: {kl_divergence: {max_value: {8bit: 0.1}, undecided_margin: 0.01}}}\n"))
    candidate = text_items(nll, [float("nan")] + [0.0] * 19, [10] * 20)
    verdict = compare({"wiki-text@v1": text_items(nll)}, {"wiki-text@v1": candidate}, policy, "8bit")
    (gate,) = verdict.gates
    assert gate.outcome is Outcome.failed and "NaN or Inf" in gate.reason and not verdict.approved


TAIL_POLICY = """
metrics:
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.05}, undecided_margin: 0.01}
    kl_p999: {max_value: {8bit: 0.5}, undecided_margin: 0.1}
"""


def test_a_mean_kl_that_passes_does_not_hide_a_p999_that_does_not(tmp_path: Path) -> None:
    # 200 items x 50 tokens: almost every token agrees (KL 0.01 nats), but 30 tokens, one in each
    # of 30 items, go off (KL 4 nats). The mean is 0.022 and passes; the p99.9 is 4 and blocks.
    rng = np.random.default_rng(0)
    benign = [rng.uniform(0.0, 0.02, 50).astype(np.float32) for _ in range(200)]
    spiky = [np.full(50, 0.01, dtype=np.float32) for _ in range(200)]
    for values in spiky[::200 // 30][:30]:
        values[7] = 4.0
    baseline = {"wiki-text@v1": text_items([30.0] * 200)}
    policy = load_policy(policy_file(tmp_path, TAIL_POLICY))
    blocked = compare(baseline, {"wiki-text@v1": token_items(spiky)}, policy, "8bit")
    mean, tail = blocked.gates
    assert mean.outcome is Outcome.passed and mean.estimate == pytest.approx(0.01 + 30 * 3.99 / 10_000)
    assert tail.gate == "wiki-text@v1 kl_p999" and tail.outcome is Outcome.failed and tail.estimate == 4.0
    assert not blocked.approved and blocked.reasons == ["wiki-text kl_p999 4.0000 [4.0000, 4.0000] exceeds 0.5000"]
    passed = compare(baseline, {"wiki-text@v1": token_items(benign)}, policy, "8bit")
    assert passed.approved, passed.reasons
    every = np.concatenate(benign)
    assert passed.gates[1].estimate == float(np.quantile(every, 0.999, method="inverted_cdf"))  # the metric evaluate reports


def test_top_prob_change_gates_block_a_candidate_that_drops_the_baselines_choice(tmp_path: Path) -> None:
    # Δp: higher is better (0 for an identical model); a drop of 0.6 on 1% of the tokens
    policy = load_policy(policy_file(tmp_path, """
metrics:
  wiki-text:
    top_prob_change_mean: {min_value: {4bit: -0.05}, undecided_margin: 0.01}
    top_prob_change_p01: {min_value: {4bit: -0.3}, undecided_margin: 0.05}
"""))
    kl = [np.full(100, 0.05, dtype=np.float32) for _ in range(100)]
    steady = [np.full(100, -0.01, dtype=np.float32) for _ in range(100)]
    dropping = [values.copy() for values in steady]
    for values in dropping:
        values[:2] = -0.6  # 2% of each item's tokens
    baseline = {"wiki-text@v1": text_items([30.0] * 100)}
    good = compare(baseline, {"wiki-text@v1": token_items(kl, steady)}, policy, "4bit")
    assert good.approved, good.reasons
    bad = compare(baseline, {"wiki-text@v1": token_items(kl, dropping)}, policy, "4bit")
    mean, tail = bad.gates
    assert mean.outcome is Outcome.passed and mean.estimate == pytest.approx(-0.01 * 0.98 - 0.6 * 0.02)
    assert tail.outcome is Outcome.failed and tail.estimate == pytest.approx(-0.6)
    assert bad.reasons == ["wiki-text top_prob_change_p01 -0.6000 [-0.6000, -0.6000] is below -0.3000"]


def test_a_tail_gate_without_per_token_values_asks_for_a_baseline(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path, "metrics: {wiki-text: {kl_p99: {max_value: {8bit: 1.0}}}}\n"))
    nll = [30.0] * 10
    with pytest.raises(InputError, match="no per-token values for kl_p99: evaluate the candidate with --baseline-results"):
        compare({"wiki-text@v1": text_items(nll)}, {"wiki-text@v1": text_items(nll, [0.0] * 10, [10] * 10)}, policy, "8bit")
    short = token_items([np.zeros(10, dtype=np.float32)] * 10)
    short[3]["token_values"] = {"kl": np.zeros(9), "top_prob_change": np.zeros(9)}
    with pytest.raises(InputError, match="candidate item 3 has 9 per-token values for 10 tokens"):
        compare({"wiki-text@v1": text_items(nll)}, {"wiki-text@v1": short}, policy, "8bit")


def measurement(measured: float | None, exact: float | None, lines: list[dict] | None = None) -> MeasurementRecord:
    return measurement_record(measured=measured, exact=exact, lines=lines)


def test_size_gates_compare_bits_exactly_and_block_unexplained_bytes(tmp_path: Path) -> None:
    from quantgate.gates.verdict import size_gates

    policy = load_policy(policy_file(tmp_path, "metrics: {}\nsize: {max_bits_per_weight_excess: 0.01}\n"))
    within, over = size_gates(measurement(4.2195, 4.2095), policy)[0], size_gates(measurement(4.2196, 4.2095), policy)[0]
    assert within.outcome is Outcome.passed and over.outcome is Outcome.failed  # 0.0100 vs 0.0101: no rounding
    assert "exceeds the tolerance 0.01" in over.reason
    lines = [{"cause": "other_group_size", "bytes": 9000, "detail": "g64 layers"},
             {"cause": "wider_than_baseline", "bytes": 56623104, "detail": "model.embed_tokens.weight is F32, the baseline BF16"}]
    bits, unexplained = size_gates(measurement(4.2, 4.2, lines), policy)
    assert bits.outcome is Outcome.passed and unexplained.outcome is Outcome.failed
    assert unexplained.reason == ("size: 56,623,104 bytes the format does not explain: "
                                  "model.embed_tokens.weight is F32, the baseline BF16 (56,623,104 B)")
    # an unquantized candidate has no quantized layers: only the unexplained-bytes gate applies
    (only,) = size_gates(measurement(None, None), policy)
    assert only.gate == "size unexplained_bytes" and only.outcome is Outcome.passed


def test_integrity_gates_finite_logits_and_calibration_overlap(tmp_path: Path) -> None:
    from quantgate.gates.verdict import integrity_gates
    from quantgate.gates.verdict_record import OverlapSummary

    policy = load_policy(policy_file(tmp_path, "metrics: {}\nintegrity: {max_calibration_overlap: 0.01}\n"))
    clean = OverlapSummary(n=13, candidate_ngrams=1000, shared_ngrams=10, share=0.01, against=["wiki-text@v1"])
    leaky = OverlapSummary(n=13, candidate_ngrams=1000, shared_ngrams=11, share=0.011, against=["wiki-text@v1"])
    finite, overlap = integrity_gates(policy, {"logits_finite": True}, clean, {"wiki-text@v1": text_items([1.0, 2.0])})
    assert finite.outcome is Outcome.passed and overlap.outcome is Outcome.passed
    _, leaked = integrity_gates(policy, {"logits_finite": True}, leaky)
    assert leaked.outcome is Outcome.failed and leaked.reason.startswith("integrity: 11 of the calibration set's 1000 13-grams")
    (nan,) = integrity_gates(policy, {"logits_finite": True}, None, {"wiki-text@v1": text_items([1.0, float("inf")])})
    assert nan.outcome is Outcome.failed and "wiki-text item 1 has nll inf" in nan.reason
    (unknown,) = integrity_gates(policy, None, None)
    assert unknown.outcome is Outcome.failed  # nothing shows the checkpoint even loads: fail closed


def test_every_metric_a_set_scores_is_in_the_metrics_table_and_each_gateable_one_has_a_rule(tmp_path: Path) -> None:
    from quantgate.core.metrics import GATEABLE, METRICS
    from quantgate.evalsets.sets import SCORING, scored_metrics

    scored = {name for kind in SCORING for name in scored_metrics(kind)}
    assert scored == set(METRICS)  # a typo in either would silently drop a gate
    rng = np.random.default_rng(1)
    nll = rng.uniform(20, 40, 50).tolist()
    records = {"arc-easy@v1": mc_items(rng.integers(0, 2, 50).tolist()),
               "wiki-text@v1": token_items([np.zeros(10, dtype=np.float32)] * 50)}
    for item, value in zip(records["wiki-text@v1"], nll, strict=True):
        item["nll"] = value
    for item in records["arc-easy@v1"]:
        item["metrics"]["exact_match"] = item["metrics"]["acc"]
    sets = {"acc": "arc-easy", "acc_norm": "arc-easy", "exact_match": "arc-easy", "perplexity": "wiki-text",
            "kl_divergence": "wiki-text", "top1_agreement": "wiki-text",
            **dict.fromkeys(["kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "top_prob_change_mean",
                             "top_prob_change_p01"], "wiki-text")}
    assert set(sets) == set(GATEABLE)
    bounds = {"points": "max_drop_points", "%": "max_increase_percent"}
    for name in GATEABLE:
        facts = METRICS[name]
        bound = bounds.get(facts.unit, "min_value" if facts.higher_is_better else "max_value")
        policy = load_policy(policy_file(tmp_path, f"metrics: {{{sets[name]}: {{{name}: {{{bound}: {{8bit: 1.0}}}}}}}}\n"))
        (gate,) = compare(records, records, policy, "8bit").gates
        assert gate.gate == f"{sets[name]}@v1 {name}" and gate.unit == facts.unit
    policy = load_policy(policy_file(tmp_path, "metrics: {wiki-text: {bits_per_byte: {max_value: {8bit: 1.0}}}}\n"))
    with pytest.raises(InputError, match="no gate rule for metric 'bits_per_byte'"):
        compare(records, records, policy, "8bit")


def test_a_policy_with_no_metric_gate_approves_nothing(tmp_path: Path) -> None:
    """Fail closed: size and integrity alone never approve a candidate."""
    from quantgate.gates.verdict import judge

    policy = load_policy(policy_file(tmp_path, "metrics: {}\n"))
    verdict = judge({}, {"wiki-text@v1": text_items([1.0])}, policy, "8bit", smoke={"logits_finite": True})
    assert verdict.gates and all(gate.outcome is Outcome.passed for gate in verdict.gates) and not verdict.approved


def test_a_verdict_missing_a_policy_gate_is_refused(tmp_path: Path) -> None:
    from quantgate.gates.verdict import judge

    policy = load_policy(policy_file(tmp_path, "metrics: {wiki-text: {kl_divergence: {max_value: {8bit: 0.1}}}}\n"))
    with pytest.raises(InputError, match="refusing to judge"):
        judge({}, None, policy, "8bit", smoke={"logits_finite": True}, metric_gates=[])


def test_an_interval_that_is_not_finite_fails_the_gate(tmp_path: Path) -> None:
    policy = load_policy(policy_file(tmp_path, "metrics: {wiki-text: {kl_divergence: {max_value: {8bit: 0.1}}}}\n"))
    items = text_items([1.0, 2.0], [0.0, 0.0], [10, 10])
    items[1]["tokens"] = 0  # a resample of only this item divides 0 by 0
    verdict = compare({"wiki-text@v1": text_items([1.0, 2.0])}, {"wiki-text@v1": items}, policy, "8bit")
    (gate,) = verdict.gates
    assert gate.outcome is Outcome.failed and "NaN or Inf" in gate.reason and not verdict.approved


def test_a_drop_exactly_on_the_bound_touches_it_whatever_the_baseline_scores(tmp_path: Path) -> None:
    """6 answers lost of 120 is exactly 5 points: it touches a 5-point bound (pass), whether the
    baseline got 120 or 72 right; computed in points it fell either side by a rounding."""
    policy = load_policy(policy_file(tmp_path, "metrics: {arc-easy: {acc: {max_drop_points: {8bit: 5.0}, "
                                               "undecided_margin_points: 100.0}}}\n"))
    for right in (120, 72):
        baseline = [1] * right + [0] * (120 - right)
        candidate = [0] * 6 + baseline[6:]
        (gate,) = compare({"arc-easy@v1": mc_items(baseline)}, {"arc-easy@v1": mc_items(candidate)}, policy, "8bit").gates
        assert gate.outcome is Outcome.passed, (right, gate.estimate)
