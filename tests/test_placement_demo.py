"""A streamed evaluation of the demo model (quantgate/core/memory.py Placement; docs/models.md,
"Streamed stages"): the scores of the in-memory path, within 1e-4 nats (issue 37), for the baseline
and a compressed checkpoint decompressed into the scratch directory."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from quantgate import evalsets
from quantgate.core import memory
from quantgate.core.memory import Placement
from tests.test_placement import _close


def _per_item(results: evalsets.EvaluationResults) -> dict[str, list[dict[str, Any]]]:
    return {spec: list(results.items(spec)["items"]) for spec in results.manifest.sets}


def test_a_streamed_evaluation_scores_as_the_in_memory_one(demo_model: Any, demo_checkpoints: dict[str, Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model and its gptq-int4 checkpoint (decompressed into the scratch directory when
    streamed) on a text set and a last-word set: every metric and every item's scores within 1e-4
    nats (issue 37's bound; they are equal here)."""
    home = tmp_path / "home"
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    results: dict[tuple[str, Placement], evalsets.EvaluationResults] = {}
    for placement in (Placement.memory, Placement.streamed):
        cfg = evalsets.EvaluateConfig(evalsets=("wiki-text@v1", "lambada@v1"), limit=4, placement=placement, use_cache=False)
        results[("baseline", placement)] = baseline = evalsets.run(cfg, demo_model.path, tmp_path / f"baseline-{placement}")
        results[("gptq-int4", placement)] = evalsets.run(cfg, demo_checkpoints["gptq-int4"], tmp_path / f"gptq-{placement}",
                                                         baseline_results=baseline.path)
    for name in ("baseline", "gptq-int4"):
        in_memory, streamed = results[(name, Placement.memory)], results[(name, Placement.streamed)]
        assert in_memory.manifest.placement == "memory" and streamed.manifest.placement == "streamed"
        for spec in in_memory.manifest.sets:
            assert _close(streamed.record(spec)["metrics"], in_memory.record(spec)["metrics"], 1e-4), (name, spec)
        assert _close(_per_item(streamed), _per_item(in_memory), 1e-4), name
    assert "kl_divergence" in results[("gptq-int4", Placement.streamed)].record("wiki-text@v1")["metrics"]
    del results, baseline
    gc.collect()  # the evaluators are gone: their models with them, once collected (a model's modules refer to each other)
    assert not any((home / "scratch").iterdir())  # each streamed model's scratch directory removed with it


def test_a_packed_int4_checkpoint_counts_its_unpacked_weights(demo_model: Any, demo_checkpoints: dict[str, Path]) -> None:
    """A pack-quantized weight holds eight 4-bit values an int32: its shape alone would count an eighth."""
    baseline, packed = memory.shape(demo_model.path), memory.shape(demo_checkpoints["gptq-int4"])
    assert packed.largest_layer > 0.99 * baseline.largest_layer
    assert packed.vocabulary == baseline.vocabulary > 0 and packed.hidden == baseline.hidden > 0
