"""The agreement math on tiny tensors with known answers: the top-k KL estimate is exact when
nothing is cut off, never exceeds the true KL, and misses exactly r * KL(tail); an identical
candidate gives 0 and full top-1 agreement; perplexity and bits per byte."""

from __future__ import annotations

import math

import pytest
import torch

from quantgate.evalsets import agreement


def logprobs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def test_identical_candidate_has_zero_kl_and_full_top1_agreement() -> None:
    torch.manual_seed(0)
    candidate = torch.log_softmax(torch.randn(50, 300), dim=-1)
    ids, values, residual = agreement.topk_cache(candidate, 8)
    assert torch.equal(agreement.kl_from_topk(ids, values, residual, candidate), torch.zeros(50, dtype=torch.float64))
    assert agreement.top1_matches(ids, agreement.topk_cache(candidate, 8)[0]).all()
    assert torch.equal(agreement.kl_exact(candidate, candidate), torch.zeros(50, dtype=torch.float64))
    assert torch.equal(agreement.top_prob_change(ids, values, candidate), torch.zeros(50, dtype=torch.float64))


def test_top_prob_change_is_the_candidates_probability_of_the_baselines_top_token_minus_the_baselines() -> None:
    p = logprobs([0.5, 0.3, 0.2], [0.1, 0.1, 0.8])
    q = logprobs([0.2, 0.7, 0.1], [0.05, 0.05, 0.9])
    ids, values, _ = agreement.topk_cache(p, 2)
    change = agreement.top_prob_change(ids, values, q)
    assert change.tolist() == pytest.approx([0.2 - 0.5, 0.9 - 0.8], abs=1e-6)


def test_token_quantiles_use_the_inverted_cdf_and_the_metrics_table() -> None:
    kl = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 5.0], dtype=torch.float32)
    change = torch.tensor([-0.9, -0.5, 0, 0, 0, 0, 0, 0, 0, 0.1], dtype=torch.float32)
    tails = agreement.token_quantiles({"kl": kl.numpy(), "top_prob_change": change.numpy()})
    as_stored = kl.double().tolist()  # every quantile is one of the values: no interpolation
    assert tails == {"kl_median": as_stored[4], "kl_p90": as_stored[8], "kl_p99": 5.0, "kl_p999": 5.0, "kl_max": 5.0,
                     "top_prob_change_p01": pytest.approx(-0.9)}
    assert agreement.quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0  # not 2.5: the lower of the middle two
    assert math.isnan(agreement.quantile([1.0, float("nan")], 0.5))


def test_topk_estimate_is_the_exact_kl_when_k_covers_the_vocabulary() -> None:
    p = logprobs([0.5, 0.25, 0.125, 0.125])
    q = logprobs([0.25, 0.25, 0.25, 0.25])
    cached = agreement.topk_cache(p, 4)
    # KL = 0.5 ln 2 + 0.25 ln 1 + 2 * 0.125 ln 0.5 = 0.25 ln 2
    expected = 0.25 * math.log(2)
    assert agreement.kl_from_topk(*cached, q)[0] == pytest.approx(expected, abs=1e-6)
    assert agreement.kl_exact(p, q)[0] == pytest.approx(expected, abs=1e-6)


def test_topk_estimate_misses_exactly_r_times_the_tail_kl() -> None:
    torch.manual_seed(1)
    p = torch.log_softmax(torch.randn(20, 64) * 2, dim=-1)
    q = torch.log_softmax(torch.randn(20, 64) * 2, dim=-1)
    ids, values, residual = agreement.topk_cache(p, 5)
    estimate = agreement.kl_from_topk(ids, values, residual, q)
    exact = agreement.kl_exact(p, q)
    assert (estimate <= exact + 1e-9).all()
    # chain rule: KL(p||q) = KL_k + r * KL(p_R || q_R), p_R and q_R conditioned on the tail
    tail = torch.ones_like(p, dtype=torch.bool).scatter(-1, ids.long(), False)
    pd, qd = p.double().exp(), q.double().exp()
    r = (pd * tail).sum(-1)
    q_r = (qd * tail).sum(-1)
    p_tail = torch.where(tail, pd / r[:, None], torch.zeros_like(pd))
    q_tail = torch.where(tail, qd / q_r[:, None], torch.ones_like(qd))
    tail_kl = torch.where(tail, p_tail * (p_tail.clamp(min=1e-300).log() - q_tail.log()), torch.zeros_like(pd)).sum(-1)
    assert torch.allclose(exact - estimate, r * tail_kl, atol=1e-5)


def test_topk_estimate_is_exact_when_the_candidate_tail_is_proportional() -> None:
    p = logprobs([0.6, 0.2, 0.1, 0.1])
    q = logprobs([0.4, 0.3, 0.15, 0.15])  # tail {2, 3} split 1:1 in both
    cached = agreement.topk_cache(p, 2)
    assert agreement.kl_from_topk(*cached, q)[0] == pytest.approx(float(agreement.kl_exact(p, q)[0]), abs=1e-6)


def test_worst_case_shortfall_bounds_the_true_shortfall() -> None:
    torch.manual_seed(2)
    p = torch.log_softmax(torch.randn(30, 40) * 3, dim=-1)
    q = torch.log_softmax(torch.randn(30, 40) * 3, dim=-1)
    cached = agreement.topk_cache(p, 4)
    shortfall = agreement.kl_exact(p, q) - agreement.kl_from_topk(*cached, q)
    bound = agreement.kl_shortfall_bound(*cached, q)
    assert (shortfall <= bound + 1e-6).all()
    assert (bound >= 0).all()


def test_candidate_with_no_mass_on_the_baseline_tail_gives_infinite_kl() -> None:
    p = logprobs([0.5, 0.3, 0.2])
    q = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])
    cached = agreement.topk_cache(p, 2)
    assert math.isinf(float(agreement.kl_from_topk(*cached, q)[0]))


def test_residual_mass_is_summed_over_the_tail_not_one_minus_the_head() -> None:
    # 1 - (p1 + p2) in float32 cancels to noise when the tail is tiny; summing the tail does not
    p = logprobs([0.5, 0.5 - 1e-9, 1e-9])
    _, _, residual = agreement.topk_cache(p, 2)
    assert float(residual[0]) == pytest.approx(1e-9, rel=1e-5)
    _, _, none_left = agreement.topk_cache(p, 3)
    assert float(none_left[0]) == 0.0


def test_perplexity_and_bits_per_byte_known_values() -> None:
    # 4 tokens, each with probability 1/2: perplexity 2; 4 ln 2 nats over 2 bytes = 2 bits per byte
    assert agreement.perplexity(4 * math.log(2), 4) == pytest.approx(2.0)
    assert agreement.bits_per_byte(4 * math.log(2), 2) == pytest.approx(2.0)
    assert math.isnan(agreement.perplexity(1.0, 0))
