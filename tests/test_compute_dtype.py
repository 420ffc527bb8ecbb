"""The dtype evaluation computes in: FP32 on every CPU unless BF16 is asked for (faster where the
CPU has BF16 arithmetic, but it moves gate estimates), recorded in every set's results, never mixed
between a baseline and a candidate, and scored through the output layer in FP32 either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate import evalsets
from quantgate.core.errors import InputError
from quantgate.evalsets.config import ComputeDtype
from quantgate.evalsets.evaluate import compute_dtype_name

AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AMX = frozenset({"avx512f", "amx_bf16", "amx_int8", "amx_tile"})
AVX512_ONLY = frozenset({"avx2", "avx512f"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX, AVX512_ONLY, AVX2])
def test_auto_computes_in_fp32_on_every_cpu_class(flags: frozenset[str]) -> None:
    """BF16 is faster where the CPU has BF16 arithmetic, but it moved the 1.5B model's gate
    estimates past a tenth of their bounds (docs/evaluate.md): not the default on any class."""
    choice = compute_dtype_name("cpu", "BF16", flags=flags)
    assert choice.dtype == "float32" and "BF16 moves gate estimates" in choice.basis
    assert compute_dtype_name("cpu", "BF16", flags=flags) == choice  # one basis: FP32 results key alike on every class


def test_other_storage_dtypes_asked_dtypes_and_accelerators() -> None:
    assert compute_dtype_name("cpu", "F16", flags=AVX512_BF16).dtype == "float32"
    assert compute_dtype_name("cpu", "F32", flags=AMX).dtype == "float32"
    assert compute_dtype_name("cuda", "BF16").dtype == "bfloat16"
    assert compute_dtype_name("cuda", "F16").dtype == "float16"
    asked = compute_dtype_name("cpu", "BF16", ComputeDtype.bfloat16, flags=AVX512_BF16)
    assert asked.dtype == "bfloat16" and asked.basis == "bfloat16, as the evaluation asks"
    emulated = compute_dtype_name("cpu", "BF16", ComputeDtype.bfloat16, flags=AVX2)
    assert emulated.dtype == "bfloat16" and "emulated: this CPU has no BF16 arithmetic" in emulated.basis
    assert compute_dtype_name("cpu", "BF16", ComputeDtype.float32, flags=AVX512_BF16).dtype == "float32"


def test_each_dtype_is_recorded_scored_in_fp32_and_kept_apart(tiny_model: Path, tmp_path: Path) -> None:
    results = {}
    for dtype in ("float32", "bfloat16"):
        cfg = evalsets.EvaluateConfig(evalsets=("wiki-text", "lambada"), limit=3, dtype=dtype)
        baseline = evalsets.run(cfg, tiny_model, tmp_path / f"baseline-{dtype}")
        results[dtype] = evalsets.run(cfg, tiny_model, tmp_path / f"candidate-{dtype}", baseline_results=baseline.path)
        for spec in ("wiki-text@v1", "lambada@v1"):
            settings = results[dtype].record(spec)["settings"]
            assert settings["dtype"] == dtype and "as the evaluation asks" in settings["dtype_basis"]
        text = results[dtype].record("wiki-text@v1")
        # the output layer is rebuilt from its inputs in FP32 in both dtypes (BF16 logits hold ~3 digits)
        assert text["details"]["head"]["rebuilt_from_hidden_states"], text["details"]["head"]
        assert text["metrics"]["kl_divergence"] == 0.0 and text["metrics"]["top1_agreement"] == 1.0  # the model against itself
        # the two dtypes never share a cache entry
    assert results["float32"].manifest.sets["wiki-text@v1"].cache_key != results["bfloat16"].manifest.sets["wiki-text@v1"].cache_key
    # a BF16 model in BF16 differs from FP32 by rounding only: perplexity within 1%
    perplexities = [results[dtype].record("wiki-text@v1")["metrics"]["perplexity"] for dtype in ("float32", "bfloat16")]
    assert abs(perplexities[1] / perplexities[0] - 1) < 0.01, perplexities
    # a candidate is never compared with a baseline evaluated in another dtype
    with pytest.raises(InputError, match="wiki-text@v1: the baseline was evaluated in float32, the candidate in bfloat16"):
        evalsets.run(evalsets.EvaluateConfig(evalsets=("wiki-text",), limit=3, dtype="bfloat16"), tiny_model,
                     tmp_path / "mixed", baseline_results=tmp_path / "baseline-float32")
    assert not (tmp_path / "mixed").exists()


def test_the_bf16_scorer_agrees_with_the_model_and_is_used(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from quantgate.evalsets.loglikelihood import SharedContextScorer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    scorer = SharedContextScorer(model)
    assert scorer.unusable() == ""  # its probe: within 1e-4 nats of the model's own pass, output layer in FP32 both
    [(logprob, _)] = scorer.score([([1, 2, 3, 4], [5, 6])], max_length=64, batch_size=1)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).last_hidden_state[0, 3:5].float()
        logits = hidden @ model.lm_head.weight.float().T
    expected = float(torch.log_softmax(logits, -1)[[0, 1], [5, 6]].sum())
    assert abs(logprob - expected) < 1e-4


def test_a_baseline_of_the_other_dtype_is_refused_for_every_set_kind_and_by_the_gate(tiny_model: Path, tmp_path: Path, cli) -> None:
    fp32 = evalsets.EvaluateConfig(evalsets=("lambada",), limit=3, dtype="float32")
    bf16 = evalsets.EvaluateConfig(evalsets=("lambada",), limit=3, dtype="bfloat16")
    baseline = evalsets.run(fp32, tiny_model, tmp_path / "baseline")
    with pytest.raises(InputError, match="lambada@v1: the baseline was evaluated in float32, the candidate in bfloat16"):
        evalsets.run(bf16, tiny_model, tmp_path / "candidate", baseline_results=baseline.path)
    assert not (tmp_path / "candidate").exists()
    # results made apart (no baseline given) are refused when gated together: exit 2, one line
    candidate = evalsets.run(bf16, tiny_model, tmp_path / "apart")
    result = cli("gate", "--baseline", str(baseline.path), "--candidate", str(candidate.path), "--policy", "small-model",
                 "--precision", "8bit", "--narrow-policy", "lambada")
    assert result.code == 2 and "evaluated in float32, the candidate in bfloat16" in result.err, result.err
