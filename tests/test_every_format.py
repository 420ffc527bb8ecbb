"""Every format of the registry through the whole pipeline on the tiny model: quantized, measured,
evaluated, gated, signed into the ledger and drawn in the report. The formats test_pipeline.py's
tiny run does not take (TINY_FORMATS) run here, in one run; a format added to the registry is run
here with no other change (awq-int4 is one of them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate.core.artifacts import read_json
from quantgate.core.formats import FORMATS as REGISTRY
from quantgate.core.headers import read_header
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import TINY_FORMATS, plan_mapping

FORMATS = [name for name in REGISTRY if name not in TINY_FORMATS]


@pytest.fixture(scope="module")
def every_format(quant_model: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("every-format")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("every-format-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        result = pipeline.run(from_mapping(plan_mapping(quant_model, root, formats=FORMATS)), show_progress=False)
    return root / "run", result


def test_every_format_gets_a_verdict_a_signed_ledger_record_and_a_report_row(every_format) -> None:
    out, result = every_format
    assert set(result.verdicts) == set(FORMATS)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert {record["format"] for record in ledger} == set(FORMATS)
    assert all(record.get("signature") for record in ledger)
    report = read_json(out / "report" / "report.json")
    rows = {row["format"]: row for row in report["rows"]}
    assert set(rows) == {"baseline", *FORMATS}
    for fmt in FORMATS:
        record = read_json(out / "verdicts" / f"{fmt}.json")["value"]
        assert record["verdict"] in ("approved", "blocked"), (fmt, record["verdict"], record.get("reasons"))
        gates = {gate["gate"]: gate for gate in record["gates"]}
        # the evidence every format is gated on, each with its estimate and reason
        for name in ("wiki-text@v1 kl_divergence", "wiki-text@v1 top1_agreement", "lambada@v1 acc", "size unexplained_bytes"):
            assert gates[name]["estimate"] is not None and gates[name]["reason"], (fmt, name)
        assert gates["size unexplained_bytes"]["outcome"] == "pass", (fmt, gates["size unexplained_bytes"]["reason"])
        # the bits a weight takes on disk follow from the format's weight bits (scales and zero points on top)
        assert record["precision"] == REGISTRY[fmt].precision  # the class its weight bits give, from the registry
        bits = REGISTRY[fmt].weights["num_bits"]
        assert bits <= rows[fmt]["bits_per_weight_layers"] < bits + 1, (fmt, rows[fmt]["bits_per_weight_layers"])
        assert rows[fmt]["bytes"] < rows["baseline"]["bytes"]


def test_awq_int4_goes_through_with_its_zero_points_counted(every_format) -> None:
    out, result = every_format
    header = read_header(out / "checkpoints" / "awq-int4" / "model.safetensors")
    assert any(name.endswith("weight_zero_point") for name in header)
    rows = {row["format"]: row for row in read_json(out / "report" / "report.json")["rows"]}
    # gptq-int4's 4-bit weights and group sizes (4.25 bits on the tiny model's 192-wide layers:
    # groups of 64), and a 4-bit zero point per group besides its scale
    assert 4.25 < rows["awq-int4"]["bits_per_weight_layers"] < 4.4
    record = read_json(out / "verdicts" / "awq-int4.json")["value"]
    assert record["checkpoint"]["format"] == "awq-int4" and record["checkpoint"]["files"]
