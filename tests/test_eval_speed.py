"""The shared-context log-likelihood scorer (evalsets.loglikelihood) against HFLM's own loop on the
tiny model: the same accuracies and log-likelihoods within 1e-4 nats, less work, HFLM's
truncation, and HFLM's loop wherever the scorer's probe finds a model it cannot score."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from quantgate import evalsets
from quantgate.evalsets import lm_eval_tasks

TOLERANCE = 1e-4  # nats, per log-likelihood


def close(before: float, after: float) -> bool:
    """Within 1e-4 nats, or where FP32 cannot resolve 1e-4 in a sum this large, four FP32 steps:
    the random tiny model's hellaswag continuations sum to ~700 nats, where one step is 6e-5
    (HFLM's own batching moves such sums by a step too)."""
    return abs(before - after) <= max(TOLERANCE, 4 * math.ulp(abs(before)))


def load(model_dir: Path, dtype: str = "float32") -> tuple[Any, Any]:
    """The tiny model as the evaluator loads it on a CPU (FP32, or BF16 where the CPU computes
    BF16 natively), without its warm-up pass."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def items(lm: Any, spec: str, limit: int, work: Path) -> list[dict[str, Any]]:
    golden = evalsets.load(spec)
    results = lm_eval_tasks.run_task(lm, golden, work, limit, bootstrap_iters=0)
    return lm_eval_tasks.per_item(golden, results["samples"][lm_eval_tasks.task_name(golden)])


def assert_same_scores(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    assert [item["index"] for item in before] == [item["index"] for item in after]
    for old, new in zip(before, after, strict=True):
        for field in ("metrics", "predicted", "predicted_norm", "greedy"):
            assert old.get(field) == new.get(field), (field, old, new)
        values_old = old.get("loglikelihoods", [old.get("loglikelihood")])
        values_new = new.get("loglikelihoods", [new.get("loglikelihood")])
        assert all(close(a, b) for a, b in zip(values_old, values_new, strict=True)), (values_old, values_new)


def count_tokens(lm: Any) -> dict[str, int]:
    """A counter of the tokens HFLM's loop would feed the model for `lm`'s requests (context +
    continuation - 1 each), kept up to date from now on."""
    counted = {"tokens": 0}
    inner = lm._loglikelihood_tokens

    def counting(requests: Any, *args: Any, **kwargs: Any) -> Any:
        counted["tokens"] += sum(len(context) + len(continuation) - 1 for _, context, continuation in requests)
        return inner(requests, *args, **kwargs)

    lm._loglikelihood_tokens = counting  # an instance attribute: lm-eval calls self._loglikelihood_tokens
    return counted


def test_shared_context_scores_equal_hflms_own_loop_with_less_work(tiny_model_template: Path, tmp_path: Path) -> None:
    model, tokenizer = load(tiny_model_template)
    before = lm_eval_tasks.hf_model(model, tokenizer, 4, shared_context=False)
    after = lm_eval_tasks.hf_model(model, tokenizer, 4)
    counted = count_tokens(after)
    for spec, limit in (("arc-easy", 12), ("hellaswag", 6), ("lambada", 12)):
        old = items(before, spec, limit, tmp_path / f"{spec}-before")
        counted["tokens"] = 0
        new = items(after, spec, limit, tmp_path / f"{spec}-after")
        assert after.scorer_unusable == "" and before.scorer_unusable == "turned off"
        assert_same_scores(old, new)
        work, tokens = after.scorer.work, counted["tokens"]
        if spec != "lambada":  # a choice's question runs once, not once per choice
            assert work["positions"] < 0.8 * tokens, (spec, work, tokens)
        assert work["head_rows"] < 0.5 * tokens, (spec, work, tokens)  # the output layer where scored only
        after.scorer.work = dict.fromkeys(work, 0)
    assert after.get_model_info()["loglikelihood_scorer"] == "shared-context"


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_truncated_and_single_token_requests_score_as_hflm_scores_them(
        sliding_window: int | None, tiny_model_template: Path) -> None:
    """Contexts longer than the model's positions lose tokens from the left exactly as under
    HFLM; one-token continuations of a shared context, a repeated request, and (with a sliding
    window) a group longer than the window that must run alone, all score as HFLM scores them."""
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load(tiny_model_template)
    model.config.sliding_window = sliding_window
    lm = lm_eval_tasks.hf_model(model, tokenizer, 3)
    lm._max_length = 16
    ids = list(range(5, 45))
    requests = [
        (None, ids[:30], ids[30:33]), (None, ids[:30], ids[33:34]), (None, ids[:30], ids[35:40]),  # truncated
        (None, ids[:9], ids[9:10]), (None, ids[:9], ids[10:11]), (None, ids[:9], ids[9:10]),  # one token, repeated
        (None, ids[2:8], ids[8:12]), (None, ids[2:8], ids[12:14]),
        (None, ids[1:4], ids[4:20]),  # a continuation of 16 tokens: one context token fits
        (None, ids[7:10], ids[10:11]),
    ]
    reference = HFLM._loglikelihood_tokens(lm, requests)
    answers = lm._loglikelihood_tokens(requests)
    assert lm.scorer_unusable == ""
    assert [greedy for _, greedy in answers] == [greedy for _, greedy in reference]
    assert all(close(old, new) for (old, _), (new, _) in zip(reference, answers, strict=True)), (reference, answers)


def test_a_model_whose_logits_are_not_its_output_layers_is_scored_by_hflms_loop(
        tiny_model_template: Path, tmp_path: Path) -> None:
    """Soft-capped or scaled logits: the probe sees that the output layer alone does not give the
    model's logits, and every request goes through HFLM's own loop, with its scores."""
    import copy

    import torch

    model, tokenizer = load(tiny_model_template)
    scaled = copy.deepcopy(model.get_output_embeddings())
    with torch.no_grad():
        scaled.weight.mul_(2.0)
    model.get_output_embeddings = lambda: scaled  # what the scorer would apply; the model's forward keeps its own
    lm = lm_eval_tasks.hf_model(model, tokenizer, 4)
    new = items(lm, "arc-easy", 4, tmp_path / "after")
    assert "differ from the model's own" in lm.scorer_unusable
    assert "hflm" in lm.get_model_info()["loglikelihood_scorer"]
    old = items(lm_eval_tasks.hf_model(model, tokenizer, 4, shared_context=False), "arc-easy", 4, tmp_path / "before")
    assert_same_scores(old, new)


@pytest.mark.parametrize("how", ["an output layer the forward does not apply", "logits scaled after the output layer"])
def test_in_bf16_the_probe_still_sees_logits_that_are_not_the_output_layers(tiny_model_template: Path, how: str) -> None:
    """A BF16 model is scored through its output layer in FP32, rebuilt from that layer's inputs:
    the probe first checks that the model's own logits are that layer's (to BF16 rounding), so a
    scale or cap after it, or a layer the forward never applies, still sends it to HFLM's loop."""
    import copy

    import torch

    model, tokenizer = load(tiny_model_template, "bfloat16")
    if how.startswith("an output layer"):
        other = copy.deepcopy(model.get_output_embeddings())
        model.get_output_embeddings = lambda: other
        expected = "does not apply the output layer"
    else:
        model.register_forward_hook(lambda module, args, output: output.__setitem__("logits", output.logits * 0.5))
        expected = "beyond torch.bfloat16 rounding"
    lm = lm_eval_tasks.hf_model(model, tokenizer, 4)
    lm._loglikelihood_tokens([(None, [5, 6, 7], [8, 9]), (None, [5, 6, 7], [10])])
    assert expected in lm.scorer_unusable and "hflm" in lm.get_model_info()["loglikelihood_scorer"]
    assert lm.softmax_dtype == torch.float32  # HFLM's loop takes its log-softmax in FP32 for a BF16 model


def test_the_first_call_into_the_model_is_its_full_forward_pass(tiny_model_template: Path) -> None:
    """compressed-tensors checkpoints decompress their weights on the model's first full forward
    pass: the scorer must not call the decoder on its own before that."""
    model, tokenizer = load(tiny_model_template)
    calls: list[str] = []
    model.register_forward_pre_hook(lambda module, args: calls.append("model"))
    model.get_decoder().register_forward_pre_hook(lambda module, args: calls.append("decoder"))
    lm = lm_eval_tasks.hf_model(model, tokenizer, 4)
    lm._loglikelihood_tokens([(None, [5, 6, 7], [8, 9]), (None, [5, 6, 7], [10])])
    assert calls[0] == "model" and "decoder" in calls
