"""Log-likelihoods of lm-eval's (context, continuation) requests with the numbers of HFLM's own
loop and less of its work: a context that several continuations share (a multiple-choice
item's choices) runs once, in one row with its continuations under an attention mask that
keeps them apart, and the output layer is applied only at the positions that are scored
(docs/evaluate.md, "Less work, the same scores")."""

from __future__ import annotations

# torch is imported where used: it takes seconds to import, and the package imports without it.
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from quantgate.core.errors import InputError
from quantgate.evalsets.text_eval import HEAD_TOLERANCE, head_difference_beyond_rounding

# (context tokens, continuation tokens), as HFLM._loglikelihood_tokens receives them
Pair = tuple[Sequence[int], Sequence[int]]
# (summed log-probability of the continuation in nats, whether it is the greedy continuation)
Answer = tuple[float, bool]

# How far the probe's log-probabilities may be from the model's own forward pass, nats per
# token: FP32 products in another order move them by ~1e-5 (and BF16 ones, with the output layer in
# FP32, by 3.8e-6 on the demo model's probe, AVX-512 with avx512_bf16); soft-capped or scaled logits, a
# model that ignores a custom attention mask or position ids, move them by far more.
PROBE_TOLERANCE = 1e-4
# Rows of the output layer computed at once: [rows, vocab] FP32 logits, ~200 MB at a 49k vocab
HEAD_ROWS = 1024
# The longest row a shared context and its continuations make together; its attention mask is
# width^2 numbers (64 MB in FP32 at 4096), so a longer group runs its requests alone.
SHARED_ROW_LIMIT = 4096


@dataclass(frozen=True)
class _Scored:
    """One request's scored positions: the output layer's inputs there, and the tokens they predict."""

    index: int
    hidden: Any  # [len(tokens), hidden]
    tokens: Sequence[int]


def effective_pair(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[list[int], list[int]]:
    """The context HFLM actually conditions on: it feeds `(context + continuation)[-(max_length +
    1):][:-1]`, so a request longer than the model's positions loses context tokens from the left
    (never continuation tokens: lm-eval requires the continuation to fit)."""
    if not context or not continuation or len(continuation) > max_length:
        raise InputError(f"a loglikelihood request with {len(context)} context and {len(continuation)} continuation tokens "
                         f"cannot be scored in {max_length} positions")
    keep = max_length + 1 - len(continuation)
    return list(context[-keep:]), list(continuation)


class SharedContextScorer:
    """Scores requests on a Hugging Face causal LM through its decoder (`get_decoder()`, final norm
    included) and its output layer (`get_output_embeddings()`), checked once against the model's
    own forward pass (`unusable`)."""

    def __init__(self, model: Any, *, softmax_dtype: Any = None) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.softmax_dtype = softmax_dtype  # HFLM's: None keeps the logits' dtype
        # A model computing in a 16-bit dtype is scored through its output layer in FP32 (BF16
        # logits hold ~3 significant digits: a logit of 20 to the nearest 0.125); in FP32 the layer as it is
        self._head_fp32: Any = None
        import torch

        if isinstance(self.head, torch.nn.Linear) and self.head.weight.dtype in (torch.bfloat16, torch.float16):
            self._head_fp32 = (self.head.weight.detach().float(), None if self.head.bias is None else self.head.bias.detach().float())
        window = getattr(model.config, "sliding_window", None)
        # A custom attention mask replaces the model's own, sliding window included: a request
        # that reaches past a sliding window runs alone, under the model's own masks.
        self.window = window if isinstance(window, int) and not isinstance(window, bool) else None
        # the work done so far, for benchmarks and tests: decoder passes, the positions they ran
        # (padding included) and the rows the output layer was applied to
        self.work = {"passes": 0, "positions": 0, "head_rows": 0}

    @property
    def device(self) -> Any:
        # the embedding's, not the output layer's: a quantized output layer may keep no `weight`
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> Any:
        """The hidden states' dtype, which an additive attention mask must have."""
        return self.model.get_input_embeddings().weight.dtype

    def unusable(self) -> str:
        """Why this model cannot be scored this way ('' when it can): a seeded probe of requests,
        two shared contexts of different lengths and two requests alone, scored here and by the
        model's own full forward pass on HFLM's rows, must agree to PROBE_TOLERANCE. The
        first call into the model is that full forward pass: compressed-tensors checkpoints
        decompress their weights on it, before the decoder is called on its own."""
        import torch

        if self.head is None or self.decoder is None or self.decoder is self.model:
            return "the model has no separate decoder and output layer"
        vocab = int(self.model.get_input_embeddings().num_embeddings)
        ids = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(0)).tolist()
        probe: list[Pair] = [
            (ids[:7], ids[11:12]), (ids[:7], ids[12:15]), (ids[:7], ids[15:17]),
            (ids[7:11], ids[17:20]), (ids[7:11], ids[11:12]),
            (ids[:5], ids[5:8]), (ids[3:12], ids[12:14]),
        ]
        with torch.no_grad():
            # HFLM's rows, right-padded into one pass of the whole model (its output layer's inputs
            # kept: a 16-bit model's logits are rebuilt from them in FP32, as the scorer's are)
            inputs: list[Any] = []
            hook = self.head.register_forward_hook(lambda module, args, output: inputs.append(args[0]))
            try:
                every = self.model(input_ids=self._padded([list(c) + list(x)[:-1] for c, x in probe])).logits
            finally:
                hook.remove()
            if self._head_fp32 is not None:
                # the model's own logits must be its output layer's, to one unit in the last place of
                # its dtype: what the model does after that layer (a soft cap, a scale) would be lost
                # by rebuilding them in FP32 (text_eval checks its reconstruction the same way)
                if not inputs:
                    return "its forward pass does not apply the output layer get_output_embeddings() names"
                rebuilt = self._logits(inputs[-1])
                beyond = head_difference_beyond_rounding(rebuilt, every.float(), every.dtype)
                if not beyond <= HEAD_TOLERANCE:
                    return f"its logits differ from its output layer's by {beyond:.2e} beyond {every.dtype} rounding (capped or scaled logits)"
                every = rebuilt
            truth = []
            for row, (context, continuation) in enumerate(probe):
                logits = every[row, len(context) - 1 : len(context) - 1 + len(continuation)]
                logprobs = torch.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
                truth.append(logprobs.gather(1, torch.tensor(continuation, device=self.device)[:, None])[:, 0])
            try:
                ours = self.token_logprobs(probe, batch_size=4)
            except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, KeyError) as error:
                return f"the decoder refuses a custom attention mask or position ids ({type(error).__name__}: {error})"
        self.work = dict.fromkeys(self.work, 0)  # the probe's own work is not the requests'
        worst = max(float((mine.double() - theirs.double()).abs().max()) for (mine, _), theirs in zip(ours, truth, strict=True))
        if not worst <= PROBE_TOLERANCE:  # a NaN is a failure too
            return f"its log-probabilities differ from the model's own by {worst:.2e} nats on the probe"
        return ""

    def _logits(self, hidden: Any) -> Any:
        """The output layer on `hidden`: in FP32 for a model computing in a 16-bit dtype."""
        import torch

        if self._head_fp32 is None:
            return self.head(hidden)
        weight, bias = self._head_fp32
        return torch.nn.functional.linear(hidden.float(), weight, bias)

    def score(self, pairs: Sequence[Pair], *, max_length: int, batch_size: int,
              on_rows: Callable[[int], None] = lambda rows: None) -> list[Answer]:
        """One answer per request, in the requests' order, as HFLM._loglikelihood_tokens answers:
        the continuation's log-probability summed in FP32 token order, and whether every one of
        its tokens is the model's most likely one."""
        effective = [effective_pair(context, continuation, max_length) for context, continuation in pairs]
        return [(float(logprobs.sum()), greedy) for logprobs, greedy in self.token_logprobs(effective, batch_size, on_rows)]

    def token_logprobs(self, pairs: Sequence[Pair], batch_size: int,
                       on_rows: Callable[[int], None] = lambda rows: None) -> list[tuple[Any, bool]]:
        """Per request, the log-probability of each continuation token ([len(continuation)]) and the
        greedy flag. Requests are grouped by identical context: a group of two or more shares one
        row; a request alone (or one whose group reaches past a sliding window or makes a row
        longer than SHARED_ROW_LIMIT) runs as HFLM runs it.
        Either way `batch_size` rows a forward pass, longest first, so that a batch pads little."""
        import torch

        groups: dict[tuple[int, ...], list[int]] = {}
        for index, (context, _) in enumerate(pairs):
            groups.setdefault(tuple(context), []).append(index)
        alone, shared = [], []
        for context, members in groups.items():
            longest = len(context) + max(len(pairs[index][1]) for index in members) - 1
            packed = len(context) + sum(len(pairs[index][1]) - 1 for index in members)
            if len(members) == 1 or packed > SHARED_ROW_LIMIT or (self.window is not None and longest > self.window):
                alone += members
            else:
                shared.append((list(context), members))
        alone.sort(key=lambda index: -(len(pairs[index][0]) + len(pairs[index][1])))
        shared.sort(key=lambda group: -(len(group[0]) + sum(len(pairs[index][1]) - 1 for index in group[1])))
        results: list[tuple[Any, bool] | None] = [None] * len(pairs)
        with torch.no_grad():
            for start in range(0, len(alone), batch_size):
                batch = alone[start : start + batch_size]
                self._finish(self._alone(pairs, batch), results)
                on_rows(len(batch))
            for start in range(0, len(shared), batch_size):
                batch_groups = shared[start : start + batch_size]
                self._finish(self._shared(pairs, batch_groups), results)
                on_rows(sum(len(members) for _, members in batch_groups))
        return [result for result in results if result is not None]

    def _padded(self, rows: list[list[int]]) -> Any:
        """Token rows right-padded (with token 0) into one tensor. A causal model's position never
        sees the positions after it, so right padding changes nothing before it (HFLM pads so too)."""
        import torch

        width = max(len(row) for row in rows)
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=self.device)

    def _alone(self, pairs: Sequence[Pair], batch: list[int]) -> list[_Scored]:
        """Requests with a context of their own: context and continuation in one pass, as HFLM."""
        rows = [list(pairs[index][0]) + list(pairs[index][1])[:-1] for index in batch]
        hidden = self._decode(self._padded(rows), use_cache=False).last_hidden_state
        scored = []
        for row, index in enumerate(batch):
            context, continuation = pairs[index]
            first = len(context) - 1  # the last context token's output predicts the first continuation token
            scored.append(_Scored(index, hidden[row, first : first + len(continuation)], continuation))
        return scored

    def _shared(self, pairs: Sequence[Pair], groups: list[tuple[list[int], list[int]]]) -> list[_Scored]:
        """Contexts with several continuations, one row per context: the context, then each
        continuation but its last token, side by side. Each continuation's positions count on from
        the context's end, and it attends to the context and to itself only (a 4D attention mask,
        0 where allowed and the dtype's lowest number elsewhere), so every position sees exactly
        what it sees in HFLM's row of that request alone."""
        import torch

        rows, segments, positions = [], [], []
        for context, members in groups:
            tokens, segment, position = list(context), [0] * len(context), list(range(len(context)))
            for number, index in enumerate(members, start=1):
                tail = list(pairs[index][1])[:-1]
                tokens += tail
                segment += [number] * len(tail)
                position += range(len(context), len(context) + len(tail))
            rows.append(tokens)
            segments.append(segment)
            positions.append(position)
        ids = self._padded(rows)
        width = ids.shape[1]
        # padding: a segment of its own (-1), so that no real position attends to it
        segment_ids = torch.tensor([seg + [-1] * (width - len(seg)) for seg in segments], device=self.device)
        position_ids = torch.tensor([pos + [0] * (width - len(pos)) for pos in positions], device=self.device)
        key, query = segment_ids[:, None, :], segment_ids[:, :, None]
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        allowed = ((key == 0) | (key == query)) & causal
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill(~allowed, torch.finfo(self.dtype).min)
        hidden = self._decode(ids, attention_mask=mask[:, None], position_ids=position_ids, use_cache=False).last_hidden_state
        scored = []
        for row, (context, members) in enumerate(groups):
            offset = len(context)
            for index in members:
                continuation = pairs[index][1]
                # the context's last position predicts the first token, the continuation's own the rest
                picks = [len(context) - 1, *range(offset, offset + len(continuation) - 1)]
                scored.append(_Scored(index, hidden[row, picks], continuation))
                offset += len(continuation) - 1
        return scored

    def _decode(self, input_ids: Any, **kwargs: Any) -> Any:
        self.work["passes"] += 1
        self.work["positions"] += int(input_ids.numel())
        return self.decoder(input_ids=input_ids, **kwargs)

    def _finish(self, scored: list[_Scored], results: list[tuple[Any, bool] | None]) -> None:
        """The output layer at the scored positions only, then log-softmax and the greedy check
        (as HFLM: the argmax of every scored position equals the continuation)."""
        import torch

        hidden = torch.cat([item.hidden for item in scored])
        self.work["head_rows"] += int(hidden.shape[0])
        tokens = torch.tensor([token for item in scored for token in item.tokens], device=self.device)
        logprobs, greedy = [], []
        for start in range(0, hidden.shape[0], HEAD_ROWS):
            logits = self._logits(hidden[None, start : start + HEAD_ROWS])[0]
            chunk = torch.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
            targets = tokens[start : start + HEAD_ROWS, None]
            logprobs.append(chunk.gather(1, targets)[:, 0])
            greedy.append(chunk.argmax(dim=-1) == targets[:, 0])
        token_logprobs, token_greedy = torch.cat(logprobs), torch.cat(greedy)
        offset = 0
        for item in scored:
            span = slice(offset, offset + len(item.tokens))
            results[item.index] = (token_logprobs[span], bool(token_greedy[span].all()))
            offset += len(item.tokens)
