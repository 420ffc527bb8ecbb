"""The report: the summary, the compact table, the recommendation rule, the Pareto front, each
candidate's forest plot and gate table, and a self-contained HTML."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gates.report import blocked_sentence, forest_svg, pareto_front, recommendation, table, write
from tests.helpers import sample_report

CANDIDATES = ["fp8-e4m3", "gptq-int4", "awq-int4", "smoothquant-w8a8"]


def test_recommendation_is_the_approved_format_with_the_lowest_batch1_bound() -> None:
    rows = sample_report()["rows"]
    assert recommendation(rows, "reference") == "smoothquant-w8a8"
    assert recommendation([r for r in rows if r["verdict"] != "approved"], "reference") is None


def test_pareto_front_keeps_only_unbeaten_points() -> None:
    front = pareto_front([(270, 0.60, "baseline"), (166, 0.598, "fp8"), (112, 0.50, "int4"), (166, 0.595, "w8a8"), (200, 0.59, "worse")])
    assert [label for _, _, label in front] == ["int4", "fp8", "baseline"]


def test_each_blocked_format_gets_one_sentence_naming_its_gates() -> None:
    rows = {row["format"]: row for row in sample_report()["rows"]}
    gptq = blocked_sentence(rows["gptq-int4"])
    assert gptq.startswith("gptq-int4 is blocked by ") and gptq.endswith(".") and gptq.count(". ") == 0
    assert "wiki-text kl_divergence 0.331 [0.276, 0.397] above 0.15" in gptq
    assert "top1_agreement 0.712 [0.681, 0.744] below 0.8" in gptq
    assert "decided after 25 items (look 1 of 3)" in gptq and "1 more gate was not evaluated" in gptq
    assert "kl_p99" not in gptq  # a gate that passed is not a reason
    awq = blocked_sentence(rows["awq-int4"])
    assert "arc-easy acc -8.00 points [-22.00, +6.00], insufficient evidence against the limit -10.00 points" in awq
    old = {key: value for key, value in rows["awq-int4"].items() if key not in ("gates", "not_evaluated")}
    assert blocked_sentence(old) == f"awq-int4 is blocked: {old['reasons'][0]}."  # a record from before gates were kept


def test_the_main_table_is_compact_and_has_no_reasons() -> None:
    header, rows = table({**sample_report(), "recommendation": {}})
    assert header == ["format", "MB", "x baseline", "bits/weight", "reference b1 ms", "h200 b1 ms", "KL", "verdict", "items"]
    assert rows[2] == ["gptq-int4", "112.0", "0.41", "4.20", "0.037", "0.023", "0.3310", "blocked", "25"]
    assert all(len(cell) < 20 for row in rows for cell in row)


def test_the_forest_plot_draws_every_metric_gate_in_its_outcome_colour() -> None:
    gptq = next(row for row in sample_report()["rows"] if row["format"] == "gptq-int4")
    svg = forest_svg(gptq)
    assert svg.startswith("<svg") and 'class="forest"' in svg
    metric_gates = [gate for gate in gptq["gates"] if "@" in gate["gate"]]
    assert svg.count('<g class="gate ') == len(metric_gates) == 5
    assert svg.count('<g class="gate fail">') == 3 and svg.count('<g class="gate not-evaluated">') == 1
    # every evaluated gate: an interval and a dot; the one not evaluated has neither
    assert svg.count('class="interval"') == svg.count('class="estimate"') == 4
    assert svg.count('stroke="#cf222e" stroke-width="3"') == 3 and 'stroke="#1a7f37" stroke-width="3"' in svg
    assert "size " not in svg and "integrity " not in svg  # exact checks are in the table, not the plot
    width = re.search(r'width="(\d+)"', svg)
    assert width is not None and int(width[1]) <= 1280 - 2 * 40  # inside a 1280-px window, with the page's margins


def test_report_files_are_written_and_self_contained(tmp_path: Path) -> None:
    out = write(sample_report(), tmp_path / "report")
    data = json.loads((out / "report.json").read_text())
    assert data["schema_version"] == 1 and data["recommendation"] == {"reference": "smoothquant-w8a8", "h200": "smoothquant-w8a8"}
    assert [len(row["gates"]) for row in data["rows"]] == [0, 9, 9, 9, 9]
    assert data["rows"][2]["not_evaluated"] == {"arc-easy@v1": "fail fast: wiki-text@v1 blocked the candidate at 25 items"}

    markdown = (out / "report.md").read_text()
    summary = markdown[markdown.index("## Summary"):markdown.index("## Formats")]
    assert "On reference: smoothquant-w8a8" in summary and "On h200: smoothquant-w8a8" in summary
    assert "- gptq-int4 is blocked by wiki-text perplexity" in summary and "- awq-int4 is blocked by arc-easy acc" in summary
    assert "| gptq-int4 | 112.0 |" in markdown and "lower bound" in markdown and "blocked (3 of 9 gates failed, 1 not evaluated)" in markdown
    for name in CANDIDATES:  # each candidate: a heading and a table of every gate
        section = markdown.split(f"### {name}: ")[1].split("### ")[0]
        assert "| gate | outcome | estimate | interval | limit | items | look | confidence |" in section
        assert section.count("| integrity ") == 2 and section.count("| size ") == 2 and section.count("| wiki-text@v1 ") == 4
    assert "| wiki-text@v1 kl_divergence | fail | 0.331 | [0.276, 0.397] | ≤ 0.15 | 25 | 1 of 3, by interval | 98.3% |" in markdown
    assert "| arc-easy@v1 acc | not evaluated | – | – | ≥ -10.00 pts | 0 |" in markdown
    assert "- arc-easy@v1: fail fast: wiki-text@v1 blocked the candidate at 25 items" in markdown

    page = (out / "report.html").read_text()
    assert page.index('id="summary"') < page.index('id="formats"') < page.index('id="size-accuracy"') < page.index('class="candidate"')
    assert "gptq-int4 is blocked by wiki-text perplexity +14.20% [+11.00, +17.90] above +10.00%" in page
    formats = page[page.index('<table id="formats">'):page.index("</table>", page.index('<table id="formats">'))]
    assert "reason" not in formats and "exceeds" not in formats
    for name in CANDIDATES:
        section = page.split(f'<section class="candidate" id="candidate-{name}">')[1].split("</section>")[0]
        assert section.count('class="forest"') == 1 and section.count('<table class="gates">') == 1
        assert f'href="#candidate-{name}"' in formats
    assert "<svg" in page and 'class="pareto"' in page and page.count('class="point') == 5
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page
    assert "https://" not in page and " src=" not in page  # nothing fetched
