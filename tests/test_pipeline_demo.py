"""`quantgate run` on the real demo model, cut down to one format and a few items (the whole
demo is `make demo`, about 15 minutes): the stages join on real checkpoints, every byte of a
real checkpoint is explained, and the bounds and the report come out."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate.core.artifacts import read_json
from quantgate.core.errors import InputError
from quantgate.core.formats import PrecisionClass
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping

pytestmark = pytest.mark.integration


def test_demo_model_through_the_whole_pipeline(demo_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_HOME", str(demo_model.path.parent.parent))
    plan = from_mapping({
        "model": str(demo_model.path), "formats": ["fp8-e4m3"], "quantize": {"fp8-e4m3": {"fp8_dynamic": True}},
        "calibration": {"samples": 4, "seq_len": 128},
        "evaluation": {"sets": ["wiki-text@v1", "lambada@v1"], "items": {"wiki-text@v1": 4, "lambada@v1": 10}},
        "policy": "small-model", "out": str(tmp_path / "run"),
    })
    with pytest.raises(InputError, match="gates arc-easy, hellaswag"):
        pipeline.run(plan, show_progress=False)  # small-model gates four sets; this plan has two

    policy = tmp_path / "two-sets.yaml"
    policy.write_text("""name: two-sets
version: v1
metrics:
  lambada:
    acc: {max_drop_points: {8bit: 10.0}, undecided_margin_points: 50.0}
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.1}, undecided_margin: 0.05}
    top1_agreement: {min_value: {8bit: 0.8}, undecided_margin: 0.1}
""")
    plan = from_mapping({**plan.plan.model_dump(mode="json"), "policy": str(policy)})
    result = pipeline.run(plan, show_progress=False)
    record = result.verdicts["fp8-e4m3"].to_json()
    gates = {gate["gate"]: gate for gate in record["gates"]}
    assert gates["size unexplained_bytes"]["outcome"] == "pass", gates["size unexplained_bytes"]["reason"]
    assert gates["size bits_per_weight"]["outcome"] == "pass"
    assert gates["integrity calibration_overlap"]["estimate"] == 0.0
    assert 0.0 < gates["wiki-text@v1 kl_divergence"]["estimate"] < 0.1
    report = read_json(tmp_path / "run" / "report" / "report.json")
    baseline, fp8 = report["rows"]
    assert baseline["bytes"] == 269_060_552 and 0.60 < fp8["ratio_to_baseline"] < 0.61
    # the H200 moves 4.8 TB/s against the reference's 3 TB/s: every bound is lower there
    assert fp8["bounds"]["h200"]["batch1_ms"] < fp8["bounds"]["reference"]["batch1_ms"]
    assert fp8["bounds"]["reference"]["batch1_ms"] < baseline["bounds"]["reference"]["batch1_ms"]
    assert pipeline.run(plan, show_progress=False).redone == []


def test_awq_int4_goes_through_the_whole_pipeline_on_the_demo_model(demo_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """awq-int4 on the real model: AWQ's scale search on the demo model's layer mappings, its zero
    points stored and every byte explained, gated under the 4-bit bounds its bits give."""
    monkeypatch.setenv("QUANTGATE_HOME", str(demo_model.path.parent.parent))
    policy = tmp_path / "int4.yaml"
    policy.write_text("""name: int4
version: v1
metrics:
  wiki-text:
    kl_divergence: {max_value: {4bit: 1.0}, undecided_margin: 0.5}
""")
    plan = from_mapping({
        "model": str(demo_model.path), "formats": ["awq-int4"], "quantize": {"awq-int4": {"awq_n_grid": 3}},
        "calibration": {"samples": 4, "seq_len": 128},
        "evaluation": {"sets": ["wiki-text@v1"], "items": {"wiki-text@v1": 4}},
        "policy": str(policy), "out": str(tmp_path / "run"),
    })
    result = pipeline.run(plan, show_progress=False)
    record = result.verdicts["awq-int4"].to_json()
    assert record["precision"] == PrecisionClass.four_bit
    gates = {gate["gate"]: gate for gate in record["gates"]}
    assert gates["size unexplained_bytes"]["outcome"] == "pass", gates["size unexplained_bytes"]["reason"]
    assert 0.0 < gates["wiki-text@v1 kl_divergence"]["estimate"] < 1.0
    rows = {row["format"]: row for row in read_json(tmp_path / "run" / "report" / "report.json")["rows"]}
    # 4-bit weights, a 16-bit scale and a 4-bit zero point per group of 64 (576 wide) or 128: 4.27 bits
    assert 4.2 < rows["awq-int4"]["bits_per_weight_layers"] < 4.35 and 0.40 < rows["awq-int4"]["ratio_to_baseline"] < 0.46
