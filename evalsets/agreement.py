"""Agreement of a candidate's next-token distributions with the baseline's, and the text-set
metrics, as pure functions on tensors: KL divergence from a cached top-k, top-1 agreement,
the change in the probability of the baseline's top token, the tails of per-token values,
perplexity and bits per byte. No model, no I/O.

Notation per scored position: p is the baseline's distribution, q the candidate's, S the
baseline's top-k token ids, r = 1 - p(S) the baseline's residual mass, q_R = 1 - q(S).
"""

from __future__ import annotations

# torch is imported where used: it takes seconds to import, and the package imports without it.
import math
from typing import Any, Final

import numpy as np

from quantgate.core.metrics import METRICS, TOKEN_QUANTILES

Tensor = Any  # torch.Tensor

# The one quantile rule of per-token values, here and in the gates' bootstrap
# (gates.stats.token_quantile): the inverted empirical CDF (Hyndman & Fan, 1996, definition 1;
# numpy's method="inverted_cdf"): the smallest value v with at least a share q of the positions
# at or below v. It interpolates nothing, so a quantile is always one of the measured values.
QUANTILE_METHOD: Final = "inverted_cdf"


def topk_cache(logprobs: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per position: the k most likely token ids (most likely first), their log-probabilities,
    and the residual mass r = 1 - p(S), summed over the tail itself (no 1 - sum cancellation)."""
    import torch

    values, ids = torch.topk(logprobs.float(), k=min(k, logprobs.shape[-1]), dim=-1)
    return ids.to(torch.int32), values.to(torch.float32), tail_mass(logprobs, ids)


def tail_mass(logprobs: Tensor, ids: Tensor) -> Tensor:
    """The probability of every token not in `ids`, per position, in float64 (0 when ids cover all)."""
    import torch

    masked = logprobs.float().scatter(-1, ids.long(), float("-inf"))
    return torch.logsumexp(masked, dim=-1).double().exp()


def kl_from_topk(base_ids: Tensor, base_logprobs: Tensor, base_residual: Tensor, candidate_logprobs: Tensor) -> Tensor:
    """KL(p || q) per position, with p known only on its top-k S and as one residual bucket.

    This is the exact KL divergence between p and q coarsened to the k+1 outcomes
    {s_1, ..., s_k, "any other token"}:

        KL_k = sum_{v in S} p_v (log p_v - log q_v) + r (log r - log q_R)

    By the chain rule of relative entropy, KL(p || q) = KL_k + r * KL(p_R || q_R), where p_R, q_R
    are p and q conditioned on the tail; so 0 <= KL_k <= KL(p || q), with equality when r = 0 or
    when q's tail is proportional to p's. An identical candidate gives exactly 0: r and q_R are
    then the same computation on the same numbers.
    """
    import torch

    base = base_logprobs.double()
    candidate_at_base = candidate_logprobs.gather(-1, base_ids.long()).double()
    head = (base.exp() * (base - candidate_at_base)).sum(-1)
    r = base_residual.double()
    q_r = tail_mass(candidate_logprobs, base_ids)
    # r log(r / q_R) with 0 log 0 = 0; a candidate with no mass where the baseline has some gives inf
    tail = torch.where(r > 0, r * (torch.log(r) - torch.log(q_r)), torch.zeros_like(r))
    return (head + tail).clamp(min=0.0)  # >= 0 in exact arithmetic; clamp rounding of ~1e-16


def kl_exact(base_logprobs: Tensor, candidate_logprobs: Tensor) -> Tensor:
    """KL(p || q) per position from both full distributions (log-probabilities over the vocabulary)."""
    base = base_logprobs.double()
    return (base.exp() * (base - candidate_logprobs.double())).sum(-1).clamp(min=0.0)


def kl_shortfall_bound(base_ids: Tensor, base_logprobs: Tensor, base_residual: Tensor, candidate_logprobs: Tensor) -> Tensor:
    """Worst case of KL(p || q) - KL_k per position, knowing only p's top-k (not its tail).

    The shortfall is r * KL(p_R || q_R). What is known of p_R: it is a distribution on the tail
    with p_R(v) <= c = min(1, p_k / r) (no tail token is likelier than the k-th). KL(. || q_R) is
    convex, so its maximum over that set is at a vertex: mass c on each of the tail tokens q
    deems least likely. This bound is rigorous and usually loose (q has near-zero tokens); the
    measured shortfall at the exact-check positions is the practical figure (docs/evaluate.md).
    """
    import torch

    r = base_residual.double()
    smallest_kept = base_logprobs.double().exp()[..., -1]
    masked = candidate_logprobs.double().scatter(-1, base_ids.long(), float("inf"))
    q_r = tail_mass(candidate_logprobs, base_ids)
    tail_size = candidate_logprobs.shape[-1] - base_ids.shape[-1]
    bounds = torch.zeros_like(r)
    for position in range(r.shape[0]):
        if r[position] <= 0 or q_r[position] <= 0:
            bounds[position] = 0.0 if r[position] <= 0 else float("inf")
            continue
        c = min(1.0, float(smallest_kept[position] / r[position]))
        count = min(math.ceil(1.0 / c - 1e-12), tail_size)
        lowest = torch.topk(-masked[position], k=count).values.neg()  # log q_v of the least likely tail tokens
        conditional = lowest - torch.log(q_r[position])  # log q_R(v)
        mass = torch.full_like(conditional, c)
        mass[-1] = max(0.0, 1.0 - c * (count - 1))
        terms = torch.where(mass > 0, mass * (torch.log(mass.clamp(min=1e-300)) - conditional), torch.zeros_like(mass))
        bounds[position] = r[position] * terms.sum()
    return bounds


def top1_matches(base_ids: Tensor, candidate_ids: Tensor) -> Tensor:
    """Per position, whether the candidate's most likely token is the baseline's (both from topk_cache)."""
    return base_ids[..., 0] == candidate_ids[..., 0]


def top_prob_change(base_ids: Tensor, base_logprobs: Tensor, candidate_logprobs: Tensor) -> Tensor:
    """Δp = q(t) - p(t) per position, t the baseline's most likely token (its cached top-k's
    first column), in float64: below 0 where the candidate is less sure of the baseline's choice.
    An identical candidate gives exactly 0 (the same log-probability, exponentiated the same way)."""
    top = base_ids[..., :1].long()
    candidate_at_top = candidate_logprobs.gather(-1, top)[..., 0].double().exp()
    return candidate_at_top - base_logprobs[..., 0].double().exp()


def quantile(values: Any, q: float) -> float:
    """The q-quantile (0 <= q <= 1) of per-token values by the inverted CDF (QUANTILE_METHOD):
    q = 1 is the maximum; NaN anywhere gives NaN."""
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        return float("nan")
    return float(np.quantile(array, q, method=QUANTILE_METHOD))


def token_quantiles(token_values: dict[str, Any]) -> dict[str, float]:
    """Every token_quantile metric of quantgate.core.metrics (kl_median ... kl_max,
    top_prob_change_p01) from a text set's per-token series {"kl": ..., "top_prob_change": ...}."""
    quantiles = {}
    for name in TOKEN_QUANTILES:
        metric = METRICS[name]
        assert metric.tokens is not None and metric.quantile is not None
        quantiles[name] = quantile(token_values[metric.tokens], metric.quantile)
    return quantiles


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(total negative log-likelihood in nats / tokens scored)."""
    return math.exp(nll_sum / tokens) if tokens else float("nan")


def bits_per_byte(nll_sum: float, utf8_bytes: int) -> float:
    """Total NLL in bits over the UTF-8 bytes it covers: tokenizer-independent (Gao et al., The Pile, 2020)."""
    return nll_sum / (math.log(2) * utf8_bytes) if utf8_bytes else float("nan")
