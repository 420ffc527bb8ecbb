"""On the real demo model and two of its quantized checkpoints (integration): every set evaluates
offline, per-item results and agreement metrics are stored, the quantized models' numbers are
their own (KL > 0 against the baseline), and the baseline is evaluated once."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from quantgate import evalsets
from quantgate.evalsets import evaluate as evaluate_module

pytestmark = pytest.mark.integration

# Small on purpose: the demo limits (evalsets/demo_limits.yaml) are for the demo, not the suite.
LIMITS = {"arc-easy": 8, "hellaswag": 4, "lambada": 8, "wiki-text": 8}


def config(sets: tuple[str, ...] = tuple(LIMITS)) -> evalsets.EvaluateConfig:
    return evalsets.EvaluateConfig(evalsets=sets, limits={name: LIMITS[name] for name in sets})


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("evaluate-demo-home")


@pytest.fixture(scope="module")
def baseline_results(demo_model, demo_home: Path, tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(demo_home))
        return evalsets.run(config(), demo_model.path, tmp_path_factory.mktemp("baseline") / "results")


def test_baseline_evaluates_on_all_four_sets(baseline_results) -> None:
    sets = baseline_results.manifest.sets
    assert {spec: entry.items for spec, entry in sets.items()} == {
        "arc-easy@v1": 8, "hellaswag@v1": 4, "lambada@v1": 8, "wiki-text@v1": 8}
    for spec in ("arc-easy@v1", "hellaswag@v1", "lambada@v1"):
        assert 0.0 <= sets[spec].metrics["acc"] <= 1.0
        assert baseline_results.record(spec)["lm_eval"]["task_hashes"]
    wiki = sets["wiki-text@v1"].metrics
    assert 1.0 < wiki["perplexity"] < 200 and 0.3 < wiki["bits_per_byte"] < 2.0  # a trained model, not noise


# One weight-only format and one that quantizes activations: past loading (which
# test_quantize_demo checks for all four, and test_pipeline_demo evaluates fp8-e4m3 end to end),
# the evaluator's path does not depend on the format.
@pytest.mark.parametrize("fmt", ["gptq-int4", "smoothquant-w8a8"])
def test_quantized_checkpoint_evaluates_against_the_baseline(
    fmt: str, demo_checkpoints, baseline_results, demo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUANTGATE_HOME", str(demo_home))
    # a text set and a multiple-choice one: each evaluator path on the candidate's own numerics (the
    # baseline covers every set; the other two kinds add time here, not paths)
    results = evalsets.run(config(("arc-easy", "wiki-text")), demo_checkpoints[fmt], tmp_path / fmt, baseline_results=baseline_results.path)
    assert results.manifest.baseline is not None
    assert results.manifest.baseline.model.weights_sha256 == baseline_results.manifest.model.weights_sha256
    wiki = results.manifest.sets["wiki-text@v1"].metrics
    # the candidate's own numerics, activation quantization included: never identical to the baseline
    assert 0.0 < wiki["kl_divergence"] < 1.0 and math.isfinite(wiki["kl_divergence"])
    assert 0.5 < wiki["top1_agreement"] <= 1.0
    items = results.items("wiki-text@v1")["items"]
    assert sum(item["kl_sum"] for item in items) > 0 and all(item["top1_matches"] <= item["tokens"] for item in items)
    arc = results.items("arc-easy@v1")["items"]
    assert len(arc) == 8 and all(len(item["loglikelihoods"]) == len(item["choice_chars"]) for item in arc)
    baseline_arc = baseline_results.items("arc-easy@v1")["items"]
    assert [item["id"] for item in arc] == [item["id"] for item in baseline_arc]  # paired item by item
    assert any(ours["loglikelihoods"] != theirs["loglikelihoods"] for ours, theirs in zip(arc, baseline_arc, strict=True))


def test_the_baseline_is_evaluated_once(demo_model, baseline_results, demo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_HOME", str(demo_home))
    monkeypatch.setattr(evaluate_module._LoadedModel, "transformers", lambda self: pytest.fail("the baseline ran again"))
    again = evalsets.run(config(), demo_model.path, tmp_path / "again")
    assert set(again.from_cache.values()) == {True}
