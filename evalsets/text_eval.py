"""Text sets, scored directly with transformers: per-item negative log-likelihood, tokens and
UTF-8 bytes (perplexity, bits per byte), this model's top-k cache (so it can serve as a
baseline), and, given a baseline's cache, KL divergence, top-1 agreement and the change in the
probability of the baseline's top token per position (kept per position, for their tails).

Why not lm-eval here: its loglikelihood_rolling returns one number per document, while the
agreement metrics need the whole next-token distribution at every position; one forward pass
gives both, so the text sets never run the model twice.
"""

from __future__ import annotations

# torch is imported where used: it takes seconds to import, and the package imports without it.
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quantgate.core.errors import IntegrityError, ModelError
from quantgate.evalsets import agreement
from quantgate.evalsets.config import GoldenItem
from quantgate.evalsets.results import ExactCheck, ItemRecord, TextDetails

EXACT_SEED = 0


@dataclass
class BaselineSide:
    """What a candidate is compared with: a baseline's cache on the same items and tokens."""

    token_ids: Any  # int32 [positions]: the scored tokens, which a candidate's must equal
    item_tokens: list[int]
    topk_ids: Any  # int32 [positions, k]
    topk_logprobs: Any  # float32 [positions, k]
    topk_residual: Any  # float64 [positions]: the mass outside the top-k
    head_inputs: Any  # float32 [positions, hidden] or None: the output layer's inputs
    head_weight: Any  # [vocab, hidden] or None: the output layer itself
    head_bias: Any  # [vocab] or None
    exact_positions: list[int]  # top-k mode only: where the whole distribution is kept
    exact_logprobs: Any  # float32 [m, vocab] or None
    sha256: str

    @property
    def exact(self) -> bool:
        return self.head_inputs is not None


@dataclass
class TextRun:
    items: list[ItemRecord]
    metrics: dict[str, float]
    details: TextDetails
    tensors: dict[str, Any] = field(default_factory=dict)  # this model's cache, for topk.safetensors
    # with a baseline, per scored position (the order of token_ids; item spans by item_tokens):
    # "kl": KL(baseline || this), "top_prob_change": q(t) - p(t) for the baseline's top token t;
    # float32 [positions] each. Empty without a baseline.
    token_values: dict[str, Any] = field(default_factory=dict)


def encode(tokenizer: Any, texts: list[str], max_tokens: int) -> list[tuple[list[int], int, bool]]:
    """(token ids, UTF-8 bytes they cover, truncated) per text; at most `max_tokens` ids each."""
    encoded = []
    for text in texts:
        if getattr(tokenizer, "is_fast", False):
            batch = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = batch["input_ids"], batch["offset_mapping"]
            truncated = len(ids) > max_tokens
            ids = ids[:max_tokens]
            covered = text[: offsets[len(ids) - 1][1]] if truncated else text
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            truncated = len(ids) > max_tokens
            ids = ids[:max_tokens]
            covered = tokenizer.decode(ids) if truncated else text
        encoded.append((ids, len(covered.encode("utf-8")), truncated))
    return encoded


def prefix_token(tokenizer: Any) -> int:
    # The first token needs a context: bos where the tokenizer has one, else eos (lm-eval's choice too)
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ModelError("the tokenizer has neither a bos nor an eos token to condition the first token on")


def exact_check_positions(total_positions: int, count: int) -> list[int]:
    """The seeded positions where the whole baseline distribution is kept (same for every model)."""
    return sorted(random.Random(EXACT_SEED).sample(range(total_positions), min(count, total_positions)))


class _HeadInputs:
    """Captures what the model's output layer (a Linear: logits = h W^T + b) receives each forward,
    and, where the model can be asked for a few positions' logits only (`logits_to_keep`), the
    decoder's final hidden states at every position, which are those inputs: the output layer is
    then applied here, in FP32, and the model's own [batch, tokens, vocabulary] logits, the
    largest tensor of a forward, are never made (1.2 GB at a 152k vocabulary, batch 4, 512 tokens)."""

    def __init__(self, model: Any) -> None:
        import inspect

        import torch

        self.module = model.get_output_embeddings()
        self.usable = isinstance(self.module, torch.nn.Linear)
        self.last: Any = None
        self.final: Any = None
        decoder = model.get_decoder() if self.usable and hasattr(model, "get_decoder") else None
        takes = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        self.selective = isinstance(decoder, torch.nn.Module) and decoder is not model and takes
        self._hook = self.module.register_forward_hook(self._keep) if self.usable else None
        self._decoder_hook = decoder.register_forward_hook(self._keep_final) if self.selective and decoder is not None else None

    def _keep(self, module: Any, inputs: tuple[Any, ...], output: Any) -> None:
        self.last = inputs[0].detach()

    def _keep_final(self, module: Any, inputs: tuple[Any, ...], output: Any) -> None:
        import torch

        hidden = output if torch.is_tensor(output) else getattr(output, "last_hidden_state", None)
        if hidden is None and isinstance(output, tuple) and output and torch.is_tensor(output[0]):
            hidden = output[0]
        self.final = hidden.detach() if hidden is not None else None

    def stop_selective(self) -> None:
        """The model's own logits from here on: the decoder's output is no longer kept."""
        self.selective = False
        self.final = None
        if self._decoder_hook is not None:
            self._decoder_hook.remove()
            self._decoder_hook = None

    def close(self) -> None:
        for hook in (self._hook, self._decoder_hook):
            if hook is not None:
                hook.remove()


# Where the output layer is applied here rather than by the model, it is first checked against the
# model's own logits at this many positions of the longest item (spread over it, first and last
# included): the check the whole item's logits made before, at positions rather than everywhere.
HEAD_CHECK_POSITIONS = 64


def _check_positions(count: int) -> list[int]:
    if count <= HEAD_CHECK_POSITIONS:
        return list(range(count))
    return sorted({round(i * (count - 1) / (HEAD_CHECK_POSITIONS - 1)) for i in range(HEAD_CHECK_POSITIONS)})


def head_logits(hidden: Any, weight: Any, bias: Any) -> Any:
    """Logits from the output layer's inputs: hidden [T, d] @ weight [V, d]^T (+ bias), in FP32."""
    import torch

    return torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _kl_rows(base_logprobs: Any, candidate_logprobs: Any, rows: int = 128) -> Any:
    """agreement.kl_exact in chunks of positions, so [T, vocab] float64 never has to exist at once."""
    import torch

    return torch.cat([agreement.kl_exact(base_logprobs[i : i + rows], candidate_logprobs[i : i + rows])
                      for i in range(0, base_logprobs.shape[0], rows)])


# A reconstruction of the logits from the head's inputs must agree with the model's own logits to
# this many logit units (FP32 products in another order differ by ~1e-5); beyond it (logit
# soft-capping, a quantized head with activation quantization) the exact mode is not used. A model
# computing in a 16-bit dtype rounds its own logits to it: there the FP32 reconstruction may also
# differ by one unit in the last place of each logit (eps x |logit|: 0.0078 x |logit| in BF16), and
# the reconstruction, not the rounded logits, is what is scored (the output layer in FP32).
HEAD_TOLERANCE = 1e-3


def head_difference_beyond_rounding(rebuilt: Any, actual: Any, dtype: Any) -> float:
    """The largest difference between FP32-rebuilt logits and the model's own, less one unit in the
    last place of the model's logit dtype (none for FP32)."""
    import torch

    ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    return float(((rebuilt - actual).abs() - ulp * actual.abs()).max())


def evaluate_text(
    model: Any,
    tokenizer: Any,
    items: list[GoldenItem],
    *,
    max_tokens: int,
    top_k: int,
    exact_positions: int,
    batch_size: int,
    baseline: BaselineSide | None,
    advance: Callable[[int], None],
) -> TextRun:
    """Score every token of every item; against a baseline, KL(baseline || this) and top-1 agreement.

    Both sides' distributions come from their output layer applied to its captured inputs
    (checked against the model's logits): the baseline's are rebuilt exactly from its cached
    final hidden states and head, and an identical model gives bit-identical numbers. Where a
    head cannot be rebuilt, the baseline's top-k cache is used instead (a lower bound on KL,
    agreement.kl_from_topk), with the whole distribution kept at a few positions to measure it.
    """
    import torch

    encoded = encode(tokenizer, [item["text"] for item in items], max_tokens)
    item_tokens = [len(ids) for ids, _, _ in encoded]
    if any(count == 0 for count in item_tokens):
        raise ModelError("a text item encodes to no tokens")
    starts = [0]
    for count in item_tokens:
        starts.append(starts[-1] + count)
    total = starts[-1]
    token_ids = torch.tensor([token for ids, _, _ in encoded for token in ids], dtype=torch.int32)
    if baseline is not None and (baseline.item_tokens != item_tokens or not torch.equal(baseline.token_ids, token_ids)):
        raise IntegrityError(
            "this model's tokenizer encodes the text set differently from the baseline's; "
            "token-level agreement needs the same tokens"
        )
    prefix = prefix_token(tokenizer)
    device = next(model.parameters()).device
    capture = _HeadInputs(model)
    head_ok: bool | None = None if capture.usable else False
    head_difference: float | None = None
    # weight and head_inputs: torch tensors (Any), None only where head_ok is False, so never used then
    weight: Any = capture.module.weight.detach() if capture.usable else None
    # the output layer in FP32 once (a no-op for a model computing in FP32), not again for every item
    weight_fp32: Any = weight.float().cpu() if weight is not None else None
    bias = getattr(capture.module, "bias", None) if capture.usable else None
    bias_cpu: Any = None if bias is None else bias.detach().cpu()  # once, not for every item

    topk_ids = torch.zeros((total, top_k), dtype=torch.int32)
    topk_logprobs = torch.zeros((total, top_k), dtype=torch.float32)
    topk_residual = torch.zeros(total, dtype=torch.float64)
    hidden_size = weight.shape[-1] if weight is not None else 0
    head_inputs: Any = torch.zeros((total, hidden_size), dtype=torch.float32) if capture.usable else None
    full_rows: dict[int, Any] = {}  # position -> whole distribution, top-k mode only
    sampled = frozenset(exact_check_positions(total, exact_positions))
    nll = [0.0] * len(items)
    kl_sum = [0.0] * len(items)
    top1 = [0] * len(items)
    change_sum = [0.0] * len(items)
    kl_tokens = torch.zeros(total, dtype=torch.float32)
    change_tokens = torch.zeros(total, dtype=torch.float32)
    checks: dict[str, list[float]] = {"exact": [], "estimate": [], "bound": []}

    # Longest first, fixed chunks: deterministic batches, so the same model gives the same bits.
    order = sorted(range(len(items)), key=lambda index: (-item_tokens[index], index))
    try:
        with torch.no_grad():
            for chunk_start in range(0, len(order), batch_size):
                chunk = order[chunk_start : chunk_start + batch_size]
                width = max(item_tokens[index] for index in chunk)
                input_ids = torch.full((len(chunk), width), prefix, dtype=torch.long)
                attention = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, index in enumerate(chunk):
                    ids = [prefix, *encoded[index][0][:-1]]  # position t predicts token t of the item
                    input_ids[row, : len(ids)] = torch.tensor(ids)
                    attention[row, : len(ids)] = 1
                inputs = {"input_ids": input_ids.to(device), "attention_mask": attention.to(device)}
                # Selective: the model's logits at a few positions only (the head check's, then one);
                # every position's distribution is the output layer applied here to the decoder's output.
                selective = capture.selective and head_ok is not False
                checked = _check_positions(item_tokens[chunk[0]]) if selective and head_ok is None else []
                if selective:  # (an index on the CPU: transformers indexes the hidden states with it on any device)
                    inputs["logits_to_keep"] = torch.tensor(checked) if checked else 1
                logits = model(**inputs).logits
                if checked:  # once per model, on the longest item: is the decoder's output the head's input, and the head a plain Linear?
                    final, last = capture.final, capture.last
                    same_inputs = (final is not None and last is not None and final.shape[:2] == (len(chunk), width)
                                   and torch.equal(final[:, checked].to(last.device), last))
                    if same_inputs:
                        rebuilt = head_logits(final[0, checked].float().cpu(), weight_fp32, bias_cpu)
                        head_difference = head_difference_beyond_rounding(rebuilt, logits[0].float().cpu(), logits.dtype)
                        del rebuilt
                    head_ok = same_inputs and head_difference is not None and head_difference <= HEAD_TOLERANCE
                    if not head_ok:  # the model's own logits, everywhere, from here on
                        capture.stop_selective()
                        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
                for row, index in enumerate(chunk):
                    count = item_tokens[index]
                    span = slice(starts[index], starts[index] + count)
                    if selective and head_ok:
                        hidden = capture.final[row, :count].float().cpu()
                        actual = head_logits(hidden, weight_fp32, bias_cpu)
                        head_inputs[span] = hidden
                    else:
                        actual = logits[row, :count].float().cpu()
                    if not selective and head_ok is not False:
                        hidden = capture.last[row, :count].float().cpu()
                        rebuilt = head_logits(hidden, weight_fp32, bias_cpu)
                        if head_ok is None:  # checked once per model, on the longest item
                            head_difference = head_difference_beyond_rounding(rebuilt, actual, logits.dtype)
                            head_ok = head_difference <= HEAD_TOLERANCE
                        if head_ok:
                            actual = rebuilt
                            head_inputs[span] = hidden
                        del rebuilt
                    logprobs = torch.log_softmax(actual, dim=-1)
                    del actual  # one [tokens, vocabulary] FP32 copy fewer while the baseline's are rebuilt (core.memory.SCORED_COPIES)
                    targets = torch.tensor(encoded[index][0])
                    nll[index] = float(-logprobs.gather(-1, targets[:, None]).double().sum())
                    ids, values, residual = agreement.topk_cache(logprobs, top_k)
                    topk_ids[span], topk_logprobs[span], topk_residual[span] = ids, values, residual
                    if not head_ok:
                        full_rows.update({position: logprobs[position - span.start].clone()
                                          for position in range(span.start, span.stop) if position in sampled})
                    if baseline is not None:
                        kl = _compare(baseline, span, logprobs, checks)
                        kl_sum[index] = float(kl.sum())
                        top1[index] = int(agreement.top1_matches(baseline.topk_ids[span], ids).sum())
                        change = agreement.top_prob_change(baseline.topk_ids[span], baseline.topk_logprobs[span], logprobs)
                        change_sum[index] = float(change.sum())
                        kl_tokens[span], change_tokens[span] = kl.float(), change.float()
                advance(len(chunk))
    finally:
        capture.close()

    records: list[ItemRecord] = []
    for index, item in enumerate(items):
        record: ItemRecord = {
            "index": index,
            "id": item["id"],
            "tokens": item_tokens[index],
            "bytes": encoded[index][1],
            "truncated": encoded[index][2],
            "nll": nll[index],
        }
        if baseline is not None:
            record.update({"kl_sum": kl_sum[index], "top1_matches": top1[index], "top_prob_change_sum": change_sum[index]})
        records.append(record)
    total_nll = sum(nll)
    total_bytes = sum(record["bytes"] for record in records)
    metrics = {
        "perplexity": agreement.perplexity(total_nll, total),
        "bits_per_byte": agreement.bits_per_byte(total_nll, total_bytes),
        "residual_mass_mean": float(topk_residual.mean()),
    }
    details: TextDetails = {
        "items": len(items),
        "tokens": total,
        "bytes": total_bytes,
        "truncated_items": sum(record["truncated"] for record in records),
        "nll_sum": total_nll,
        "top_k": top_k,
        "head": {
            "rebuilt_from_hidden_states": bool(head_ok),
            "max_abs_logit_difference": head_difference,
            "tolerance": HEAD_TOLERANCE,
        },
    }
    token_values: dict[str, Any] = {}
    if baseline is not None:
        token_values = {"kl": kl_tokens, "top_prob_change": change_tokens}
        metrics.update(
            kl_divergence=sum(kl_sum) / total,
            top1_agreement=sum(top1) / total,
            top_prob_change_mean=sum(change_sum) / total,
            # from the float32 values that are stored, so a gate's point estimate is the same number
            **agreement.token_quantiles({key: values.numpy() for key, values in token_values.items()}),
            baseline_residual_mass_mean=float(baseline.topk_residual.mean()),
        )
        details.update({
            "agreement_mode": "exact" if baseline.exact else "top-k",
            "baseline_top_k": int(baseline.topk_ids.shape[-1]),
            "baseline_cache_sha256": baseline.sha256,
        })
        if not baseline.exact:
            details["exact_check"] = _exact_summary(checks["exact"], checks["estimate"], checks["bound"])
    tensors = {
        "token_ids": token_ids,
        "item_tokens": torch.tensor(item_tokens, dtype=torch.int64),
        "topk_ids": topk_ids,
        "topk_logprobs": topk_logprobs,
        "topk_residual": topk_residual,
    }
    if head_ok:
        tensors.update(head_inputs=head_inputs, head_weight=_compact(weight.cpu()))
        if bias is not None:
            tensors["head_bias"] = bias.detach().float().cpu()
    elif full_rows:  # top-k mode: the whole distribution at the sampled positions, to measure the estimate
        positions = sorted(full_rows)
        tensors.update(exact_positions=torch.tensor(positions, dtype=torch.int64),
                       exact_logprobs=torch.stack([full_rows[position] for position in positions]))
    return TextRun(records, metrics, details, tensors, token_values)


def _compact(weight: Any) -> Any:
    """The head's weight in BF16 when that is lossless (a BF16-stored model run in FP32), else FP32."""
    import torch

    as_bf16 = weight.to(torch.bfloat16)
    return as_bf16 if torch.equal(as_bf16.float(), weight.float()) else weight.float()


def _compare(baseline: BaselineSide, span: slice, logprobs: Any, checks: dict[str, list[float]]) -> Any:
    """KL(baseline || candidate) per position of one item: exact from the baseline's head, else top-k."""
    import torch

    if baseline.exact:
        # the rebuilt logits are dropped as soon as their log-softmax exists
        return _kl_rows(torch.log_softmax(head_logits(baseline.head_inputs[span], baseline.head_weight, baseline.head_bias), dim=-1), logprobs)
    cached = (baseline.topk_ids[span], baseline.topk_logprobs[span], baseline.topk_residual[span])
    for row, position in enumerate(baseline.exact_positions):
        if span.start <= position < span.stop:
            one = slice(position - span.start, position - span.start + 1)
            here = (cached[0][one], cached[1][one], cached[2][one])
            candidate = logprobs[one]
            checks["exact"].append(float(agreement.kl_exact(baseline.exact_logprobs[row : row + 1], candidate)[0]))
            checks["estimate"].append(float(agreement.kl_from_topk(*here, candidate)[0]))
            checks["bound"].append(float(agreement.kl_shortfall_bound(*here, candidate)[0]))
    return agreement.kl_from_topk(*cached, logprobs)


def _exact_summary(exact_kl: list[float], estimate_kl: list[float], bounds: list[float]) -> ExactCheck:
    if not exact_kl:
        return {"positions": 0}
    shortfall = [exact - estimate for exact, estimate in zip(exact_kl, estimate_kl, strict=True)]
    return {
        "positions": len(exact_kl),
        "kl_exact_mean": sum(exact_kl) / len(exact_kl),
        "kl_topk_mean": sum(estimate_kl) / len(estimate_kl),
        "shortfall_mean": sum(shortfall) / len(shortfall),
        "shortfall_max": max(shortfall),
        "worst_case_shortfall_mean": sum(bounds) / len(bounds),
    }
