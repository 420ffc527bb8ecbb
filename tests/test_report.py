"""The report: the table, the recommendation rule, the Pareto front and a self-contained HTML."""

from __future__ import annotations

import json
from pathlib import Path

from gates.report import pareto_front, recommendation, write
from tests.helpers import sample_report


def test_recommendation_is_the_approved_format_with_the_lowest_batch1_bound() -> None:
    rows = sample_report()["rows"]
    assert recommendation(rows, "reference") == "smoothquant-w8a8"
    assert recommendation([r for r in rows if r["verdict"] != "approved"], "reference") is None


def test_pareto_front_keeps_only_unbeaten_points() -> None:
    front = pareto_front([(270, 0.60, "baseline"), (166, 0.598, "fp8"), (112, 0.50, "int4"), (166, 0.595, "w8a8"), (200, 0.59, "worse")])
    assert [label for _, _, label in front] == ["int4", "fp8", "baseline"]


def test_report_files_are_written_and_self_contained(tmp_path: Path) -> None:
    out = write(sample_report(), tmp_path / "report")
    data = json.loads((out / "report.json").read_text())
    assert data["schema_version"] == 1 and data["recommendation"] == {"reference": "smoothquant-w8a8", "h200": "smoothquant-w8a8"}
    markdown = (out / "report.md").read_text()
    assert "| gptq-int4 |" in markdown and "exceeds -3.00 points" in markdown and "lower bound" in markdown
    page = (out / "report.html").read_text()
    assert "<svg" in page and 'class="pareto"' in page and page.count('class="point') == 4
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page
