"""Log-likelihoods of lm-eval's (context, continuation) requests with the numbers of HFLM's own
loop and less of its work: a context that several continuations share (a multiple-choice
item's choices) runs once, its continuations run against its cached keys and values, and the
output layer is applied only at the positions that are scored (docs/evaluate.md, "Less work,
the same scores")."""

from __future__ import annotations

# torch is imported where used: it takes seconds to import, and the package imports without it.
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# (context tokens, continuation tokens), as HFLM._loglikelihood_tokens receives them
Pair = tuple[Sequence[int], Sequence[int]]
# (summed log-probability of the continuation in nats, whether it is the greedy continuation)
Answer = tuple[float, bool]

# How far the probe's log-probabilities may be from the model's own forward pass, nats per
# token: FP32 products in another order move them by ~1e-6; soft-capped or scaled logits, a
# cache that does not continue a padded context, move them by far more.
PROBE_TOLERANCE = 1e-4
# Rows of the output layer computed at once: [rows, vocab] FP32 logits, ~200 MB at a 49k vocab
HEAD_ROWS = 1024


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
        from quantgate.core.errors import InputError

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
        window = getattr(model.config, "sliding_window", None)
        # A sliding window counts cache slots, and a shorter context's padding would take slots
        # inside it: with one, contexts share a forward pass only with contexts of their length.
        self.equal_lengths_only = isinstance(window, int) and not isinstance(window, bool)
        # the work done so far, for benchmarks and tests: decoder passes, the positions they ran
        # (padding included) and the rows the output layer was applied to
        self.work = {"passes": 0, "positions": 0, "head_rows": 0}

    @property
    def device(self) -> Any:
        return self.head.weight.device

    def unusable(self) -> str:
        """Why this model cannot be scored this way ('' when it can): a seeded probe of requests,
        two shared contexts of different lengths and two requests alone, scored here and by the
        model's own full forward pass, one request at a time, must agree to PROBE_TOLERANCE. The
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
            truth = []
            for context, continuation in probe:
                inputs = torch.tensor([list(context) + list(continuation)[:-1]], device=self.device)
                logits = self.model(input_ids=inputs).logits[0, len(context) - 1 :]
                logprobs = torch.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
                truth.append(logprobs.gather(1, torch.tensor(continuation, device=self.device)[:, None])[:, 0])
            try:
                ours = self.token_logprobs(probe, batch_size=4)
            except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as error:
                return f"the decoder cannot continue a cached context ({type(error).__name__}: {error})"
        self.work = dict.fromkeys(self.work, 0)  # the probe's own work is not the requests'
        worst = max(float((mine.double() - theirs.double()).abs().max()) for (mine, _), theirs in zip(ours, truth, strict=True))
        if not worst <= PROBE_TOLERANCE:  # a NaN is a failure too
            return f"its log-probabilities differ from the model's own by {worst:.2e} nats on the probe"
        return ""

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
        greedy flag. Requests are grouped by identical context: a group of two or more runs its
        context once; a request alone runs as HFLM runs it. Either way, longest first in batches
        of `batch_size` contexts, so that a batch pads little."""
        import torch

        groups: dict[tuple[int, ...], list[int]] = {}
        for index, (context, _) in enumerate(pairs):
            groups.setdefault(tuple(context), []).append(index)
        alone = sorted((members[0] for members in groups.values() if len(members) == 1),
                       key=lambda index: -(len(pairs[index][0]) + len(pairs[index][1])))
        shared = sorted(((list(context), members) for context, members in groups.items() if len(members) > 1),
                        key=lambda group: -len(group[0]))
        results: list[tuple[Any, bool] | None] = [None] * len(pairs)
        with torch.no_grad():
            for start in range(0, len(alone), batch_size):
                batch = alone[start : start + batch_size]
                self._finish(self._alone(pairs, batch), results)
                on_rows(len(batch))
            for batch_groups in self._context_batches(shared, batch_size):
                self._finish(self._shared(pairs, batch_groups), results)
                on_rows(sum(len(members) for _, members in batch_groups))
        return [result for result in results if result is not None]

    def _context_batches(self, groups: list[tuple[list[int], list[int]]],
                         batch_size: int) -> list[list[tuple[list[int], list[int]]]]:
        batches: list[list[tuple[list[int], list[int]]]] = []
        for group in groups:
            last = batches[-1] if batches else None
            if (last is None or len(last) == batch_size
                    or (self.equal_lengths_only and len(last[0][0]) != len(group[0]))):
                batches.append([group])
            else:
                last.append(group)
        return batches

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
        """Contexts with several continuations: the contexts in one pass, keeping their keys and
        values; then every continuation longer than one token (all but its last token) in one
        pass against its context's cache, the padding after a shorter context masked out and
        positions counted from the context's real end."""
        import torch

        contexts = [context for context, _ in groups]
        out = self._decode(self._padded(contexts), use_cache=True)
        last = [out.last_hidden_state[g, len(context) - 1 : len(context)] for g, context in enumerate(contexts)]
        longer = [(g, index) for g, (_, members) in enumerate(groups) for index in members if len(pairs[index][1]) > 1]
        following: dict[int, Any] = {}
        if longer:
            cache = out.past_key_values
            width = max(len(context) for context in contexts)
            rows = [list(pairs[index][1])[:-1] for _, index in longer]
            steps = max(len(row) for row in rows)
            cache.batch_select_indices(torch.tensor([g for g, _ in longer], device=self.device))
            mask = torch.ones((len(longer), width + steps), dtype=torch.long, device=self.device)
            start = torch.tensor([len(contexts[g]) for g, _ in longer], device=self.device)
            for row, (g, _) in enumerate(longer):
                mask[row, len(contexts[g]) : width] = 0
            positions = start[:, None] + torch.arange(steps, device=self.device)[None, :]
            hidden = self._decode(self._padded(rows), attention_mask=mask, position_ids=positions,
                                  past_key_values=cache, use_cache=True).last_hidden_state
            following = {index: hidden[row, : len(rows[row])] for row, (_, index) in enumerate(longer)}
        scored = []
        for g, (_, members) in enumerate(groups):
            for index in members:
                parts = [last[g]] + ([following[index]] if index in following else [])
                scored.append(_Scored(index, torch.cat(parts) if len(parts) > 1 else parts[0], pairs[index][1]))
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
            logits = self.head(hidden[None, start : start + HEAD_ROWS])[0]
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
