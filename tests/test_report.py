"""The report: the summary, the compact table, the recommendation rule, the Pareto front, each
candidate's forest plot, gate table and KL tails, what was measured (each set's looks, each
format's items), a narrowed policy, a report built from a run directory, and a self-contained HTML;
a run with a mixed-precision search: its trials as rows judged on the search split, the held-out
verdict as the search's result, no trial recommended on its own verdict, the Pareto front over
formats and trials, and the per-layer sensitivity chart."""

from __future__ import annotations

import functools
import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from quantgate.core.errors import InputError
from quantgate.core.rundir import RUN_KIND
from quantgate.evalsets.config import EvaluateConfig
from quantgate.gates import figures
from quantgate.gates.decisions import pareto_front, recommendation
from quantgate.gates.report import (
    blocked_sentence,
    build,
    compose,
    forest_figure,
    html_page,
    items_evaluated,
    markdown,
    plot_figure,
    plot_front,
    recommendation_sentences,
    write,
)
from quantgate.gates.report import read as read_report
from quantgate.gates.report_model import RunRecords
from quantgate.gates.run_record import RunRecord
from quantgate.gates.verdict_record import VerdictRecord
from quantgate.quantize.measure.accounting import measure as measure_checkpoint
from tests.helpers import composed, sample, sample_records, sample_report, write_header_only

CANDIDATES = ["fp8-e4m3", "gptq-int4", "awq-int4", "smoothquant-w8a8"]


def test_recommendation_is_the_approved_format_with_the_lowest_batch1_bound() -> None:
    rows = sample_records().rows
    assert recommendation(rows, "reference") == "smoothquant-w8a8"
    assert recommendation([r for r in rows if r.verdict != "approved"], "reference") is None
    assert sample().recommendation == {"reference": "smoothquant-w8a8", "h200": "smoothquant-w8a8"}


def test_pareto_front_keeps_only_unbeaten_points() -> None:
    front = pareto_front([(270, 0.60, "baseline"), (166, 0.598, "fp8"), (112, 0.50, "int4"), (166, 0.595, "w8a8"), (200, 0.59, "worse")])
    assert [label for _, _, label in front] == ["int4", "fp8", "baseline"]


def test_each_blocked_format_gets_one_sentence_naming_its_gates() -> None:
    rows = {row.format: row for row in sample_records().rows}
    gptq = blocked_sentence(rows["gptq-int4"])
    assert gptq.startswith("gptq-int4 is blocked by ") and gptq.endswith(".") and gptq.count(". ") == 0
    assert "wiki-text kl_divergence 0.331 [0.276, 0.397] above 0.15" in gptq
    assert "top1_agreement 0.712 [0.681, 0.744] below 0.8" in gptq
    assert "decided after 25 items (look 1 of 3)" in gptq and "1 more gate was not evaluated" in gptq
    assert "kl_p99" not in gptq  # a gate that passed is not a reason
    awq = blocked_sentence(rows["awq-int4"])
    assert "arc-easy acc -8.00 points [-22.00, +6.00], insufficient evidence against the limit -10.00 points" in awq
    old = rows["awq-int4"].model_copy(update={"gates": [], "not_evaluated": {}})
    assert blocked_sentence(old) == f"awq-int4 is blocked: {old.reasons[0]}."  # a record from before gates were kept


def test_the_main_table_is_compact_and_has_no_reasons() -> None:
    formats = sample().formats
    header = formats.header
    rows = [[row.format, *row.numbers, row.verdict, ", ".join(row.items)] for row in formats.rows]
    assert header == ["format", "MB", "x baseline", "bits/weight", "reference b1 ms", "h200 b1 ms", "KL", "verdict", "items"]
    assert rows[2] == ["gptq-int4", "112.0", "0.41", "4.20", "0.037", "0.023", "0.3310", "blocked", "wiki-text 25, arc-easy 0"]
    assert all(len(cell) < 20 for row in rows for cell in row[:-1]) and all(len(row[-1]) < 30 for row in rows)


def test_the_forest_plot_draws_every_metric_gate_in_its_outcome_colour() -> None:
    gptq = next(row for row in sample_records().rows if row.format == "gptq-int4")
    svg = str(figures.forest(forest_figure(gptq)))
    assert svg.startswith("<svg") and 'class="forest"' in svg
    metric_gates = [gate for gate in gptq.gates if "@" in gate.gate]
    assert svg.count('<g class="gate ') == len(metric_gates) == 5
    assert svg.count('<g class="gate fail">') == 3 and svg.count('<g class="gate not-evaluated">') == 1
    # every evaluated gate: an interval and a dot; the one not evaluated has neither
    assert svg.count('class="interval"') == svg.count('class="estimate"') == 4
    assert svg.count('stroke="#cf222e" stroke-width="3"') == 3 and 'stroke="#1a7f37" stroke-width="3"' in svg
    assert "size " not in svg and "integrity " not in svg  # exact checks are in the table, not the plot
    width = re.search(r'width="(\d+)"', svg)
    assert width is not None and int(width[1]) <= 1280 - 2 * 40  # inside a 1280-px window, with the page's margins


def test_report_files_are_written_and_self_contained(tmp_path: Path) -> None:
    out = write(sample(), tmp_path / "report")
    data = json.loads((out / "report.json").read_text())
    assert data["schema_version"] == 2 and data["recommendation"] == {"reference": "smoothquant-w8a8", "h200": "smoothquant-w8a8"}
    assert [len(row["gates"]) for row in data["rows"]] == [0, 9, 9, 9, 9]
    assert data["rows"][2]["not_evaluated"] == {"arc-easy@v1": "fail fast: wiki-text@v1 blocked the candidate at 25 items"}

    text = (out / "report.md").read_text()
    summary = text[text.index("## Summary"):text.index("## Formats")]
    assert "On reference: smoothquant-w8a8" in summary and "On h200: smoothquant-w8a8" in summary
    assert "- gptq-int4 is blocked by wiki-text perplexity" in summary and "- awq-int4 is blocked by arc-easy acc" in summary
    assert "| gptq-int4 | 112.0 |" in text and "lower bound" in text and "blocked (3 of 9 gates failed, 1 not evaluated)" in text
    for name in CANDIDATES:  # each candidate: a heading and a table of every gate
        section = text.split(f"### {name}: ")[1].split("### ")[0].split("\n## ")[0]
        assert "| gate | outcome | estimate | interval | limit | items | look | confidence |" in section
        assert section.count("| integrity ") == 2 and section.count("| size ") == 2 and section.count("| wiki-text@v1 ") == 4
    assert "| wiki-text@v1 kl_divergence | fail | 0.331 | [0.276, 0.397] | ≤ 0.15 | 25 | 1 of 3, by interval | 98.3% |" in text
    assert "| arc-easy@v1 acc | not evaluated | – | – | ≥ -10.00 pts | 0 |" in text
    assert "- arc-easy@v1: fail fast: wiki-text@v1 blocked the candidate at 25 items" in text

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


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["format"]: row for row in report["rows"]}


def _section(page: str, name: str) -> str:
    return page.split(f'<section class="candidate" id="candidate-{name}">')[1].split("</section>")[0]


def test_a_narrowed_policy_is_named_in_the_header_and_the_summary(tmp_path: Path) -> None:
    out = write(sample(), tmp_path / "report")
    label = "small-model@v2 narrowed to arc-easy, wiki-text (dropped: hellaswag)"
    policy = json.loads((out / "report.json").read_text())["policy"]
    assert policy["narrowed_to"] == ["arc-easy", "wiki-text"] and policy["dropped"] == ["hellaswag"]
    text = (out / "report.md").read_text()
    header, summary = text[:text.index("## Summary")], text[text.index("## Summary"):text.index("## Formats")]
    assert f"Policy {label}; sha256 abababababab." in header
    assert f"- Gated under policy {label}: no gate on hellaswag was applied, so no verdict here speaks for it." in summary
    page = (out / "report.html").read_text()
    assert f'<p class="muted" id="policy">Policy {label}; sha256' in page
    summary_html = page[page.index('id="summary"'):page.index('id="formats"')]
    assert '<p id="narrowed">Gated under policy ' + label in summary_html
    whole = {**sample_report(), "policy": {"name": "small-model", "version": "v2", "sha256": "ab" * 32}}
    plain = write(composed(whole), tmp_path / "whole")
    assert "Policy small-model@v2; sha256" in (plain / "report.md").read_text()
    assert "narrowed" not in (plain / "report.md").read_text() and 'id="narrowed"' not in (plain / "report.html").read_text()


def test_what_was_measured_gives_each_sets_looks_and_each_formats_items(tmp_path: Path) -> None:
    out = write(sample(), tmp_path / "report")
    text = (out / "report.md").read_text()
    measured = text[text.index("## What was measured"):]
    assert "| golden set | looks at (items) | ceiling | fp8-e4m3 | gptq-int4 | awq-int4 | smoothquant-w8a8 |" in measured
    assert "| wiki-text@v1 | 25, 75, 200 | 200 (whole set) | 25 (look 1 of 3) | 25 (look 1 of 3) | 25 (look 1 of 3) | 75 (look 2 of 3) |" in measured
    assert "| arc-easy@v1 | 25, 50 | 50 of 2,376 | 50 (look 2 of 2) | not run | 50 (look 2 of 2) | 50 (look 2 of 2) |" in measured
    # the baseline's own values are at each set's first look, and say so
    assert "Its values, at each set's first look (wiki-text 25, arc-easy 25 items): arc-easy@v1 acc 0.6000" in measured
    assert "first 25 of" not in measured  # not the old claim that each set was evaluated on its first look's items
    page = (out / "report.html").read_text()
    table_html = page[page.index('<table id="measured">'):]
    assert page.index("What was measured") < page.index('<table id="measured">')
    assert "<td>wiki-text@v1</td><td>25, 75, 200</td><td>200 (whole set)</td>" in table_html and "not run" in table_html
    # a verdict without its looks (an older run, a format that failed to quantize): the items of its decided gates
    old = sample_report()
    for row in old["rows"]:
        row["sequential"] = None
    old_text = markdown(composed(old))
    assert "| wiki-text@v1 | 25, 75, 200 | 200 (whole set) | 25 | 25 | 25 | 75 |" in old_text
    assert "| arc-easy@v1 | 25, 50 | 50 of 2,376 | 50 | 0 | 50 | 50 |" in old_text


def test_each_candidate_has_a_table_of_its_kl_tails(tmp_path: Path) -> None:
    out = write(sample(), tmp_path / "report")
    rows = _rows(json.loads((out / "report.json").read_text()))
    assert rows["baseline"]["tails"] == {}
    assert set(rows["gptq-int4"]["tails"]["wiki-text@v1"]) == {
        "kl_divergence", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "top_prob_change_mean", "top_prob_change_p01"}
    text = (out / "report.md").read_text()
    gptq = text.split("### gptq-int4: ")[1].split("### ")[0]
    assert "Tails of the per-token KL:" in gptq and "are in the forest plot as well" in gptq
    assert "the gated ones (wiki-text kl_divergence, wiki-text kl_p99)" in gptq
    assert "| set | mean KL | median | p90 | p99 | p99.9 | max KL | mean Δp | p01 Δp |" in gptq
    assert ("| wiki-text (25 items) | 0.331 [0.276, 0.397] | 0.139 [0.119, 0.162] | 0.695 [0.596, 0.828] | 0.820 [0.550, 0.970] "
            "| 1.89 [1.39, 2.54] | 3.61 [2.38, 3.61] | -0.0397 [-0.0530, -0.0265] | -0.629 [-0.794, -0.463] |") in gptq
    page = (out / "report.html").read_text()
    for name in CANDIDATES:
        section = _section(page, name)
        assert section.count('<table class="tails">') == 1 and section.index('class="forest"') < section.index('class="tails"')
        assert "<h4>Tails of the per-token KL</h4>" in section and "forest plot as well" in section
        assert section.count('<span class="ci">') == 8  # each of the eight tails with its interval
    assert '<td class="n">0.331<br><span class="ci">[0.276, 0.397]</span></td>' in _section(page, "gptq-int4")
    # a verdict with no tails recorded (an older run, no text set): no table, nothing else changes
    bare = sample_report()
    for row in bare["rows"]:
        row.pop("tails")
    bare_page = (write(composed(bare), tmp_path / "bare") / "report.html").read_text()
    assert 'class="tails"' not in bare_page and bare_page.count('class="forest"') == 4


def test_the_items_column_counts_every_set_as_deep_as_the_looks_went(tmp_path: Path) -> None:
    formats = sample().formats
    items = {row.format: ", ".join(row.items) for row in formats.rows}
    assert formats.header[-1] == "items"
    assert items == {"baseline": "wiki-text 75, arc-easy 50",  # as deep as any format went, paired item by item
                     "fp8-e4m3": "wiki-text 25, arc-easy 50", "gptq-int4": "wiki-text 25, arc-easy 0",
                     "awq-int4": "wiki-text 25, arc-easy 50", "smoothquant-w8a8": "wiki-text 75, arc-easy 50"}
    assert items_evaluated(next(row for row in sample_records().rows if row.format == "smoothquant-w8a8")) == 125
    # a record from before looks were recorded: the items of its decided gates, summed, as before
    report = sample_report()
    old = {**report, "rows": [{**row, "sequential": None} for row in report["rows"]]}
    assert {row.format: ", ".join(row.items) for row in composed(old).formats.rows} == {
        "baseline": "50", "fp8-e4m3": "75", "gptq-int4": "25", "awq-int4": "75", "smoothquant-w8a8": "125"}
    page = (write(sample(), tmp_path / "report") / "report.html").read_text()
    formats = page[page.index('<table id="formats">'):page.index("</table>", page.index('<table id="formats">'))]
    assert ('<td class="items"><span class="nowrap">wiki-text 75</span>, <span class="nowrap">arc-easy 50</span></td>'
            in formats)


def _artifact(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": "k", "value": value}))


def _write_run(run_dir: Path, *, formats: list[str], policy: dict[str, Any], **fields: Any) -> None:
    """run.json of a finished run of `formats` under `policy`, built through its class (RunRecord);
    `fields` replace the record's own (the plan, the hardware, the plot, the looks)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    RunRecord.from_json({
        "kind": RUN_KIND, "schema_version": 1, "status": "finished", "plan": {"model": "tiny"}, "plan_file": None, "plan_sha256": "0" * 64,
        "model": "/m", "formats": formats, "sets": ["wiki-text@v1"], "hardware": [], "policy": {**policy, "path": "/p.yaml"},
        "confidence": 0.95, "looks": {}, "planned_power": [], "plot": {"x": "bytes", "y": None, "higher_is_better": False},
        "ledger": "/l", "stages": [], "verdicts": {}, "failed_units": [], "seconds": 1.0, "quantgate_version": "0.0.0", **fields,
    }, "run.json").write(run_dir / "run.json")


def _write_verdict(run_dir: Path, name: str, *, gates: list[dict[str, Any]], verdict: str, policy: dict[str, Any],
                   **fields: Any) -> None:
    """verdicts/<name>.json: a verdict with these gates (each in `metrics` too, as gates.stage
    writes them), built through its class (VerdictRecord); `fields` add the pipeline's parts."""
    summary = ("outcome", "estimate", "low", "high", "limit", "unit")
    record = VerdictRecord.from_json({
        "kind": "verdict", "format": name.split("@")[0], "precision": "8bit", "checkpoint": None,
        "baseline": {"model": "/m", "weights_sha256": "0" * 64}, "policy": policy, "evalsets": [],
        "metrics": {gate["gate"]: {key: gate[key] for key in summary} for gate in gates}, "gates": gates, "verdict": verdict,
        "reasons": [gate["reason"] for gate in gates if gate["outcome"] != "pass"], **fields}, name)
    _artifact(run_dir / "verdicts" / f"{name}.json", record.to_json())


@functools.cache
def _measurement_template() -> str:
    """A whole measurement record (a header-only checkpoint's), as JSON text: the report reads
    measurements through their class, which refuses one missing a field."""
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        write_header_only(root / "model.safetensors", {"model.embed_tokens.weight": ("BF16", [64, 32]),
                                                       "model.layers.0.mlp.up_proj.weight": ("BF16", [32, 32])}, {"format": "pt"})
        (root / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
        return json.dumps(measure_checkpoint(root).to_json())


def _measurement(size: int, bits_per_weight: float, bits_per_parameter: float, ratio: float) -> dict[str, Any]:
    """A measurement of `size` bytes with these figures (what the report shows of one)."""
    value: dict[str, Any] = json.loads(_measurement_template())
    value["totals"]["file_bytes"] = size
    value["quantized_linear"]["bits_per_weight"]["measured"] = bits_per_weight
    value["whole_model"]["bits_per_parameter"]["measured"] = bits_per_parameter
    value["baseline"] = {"checkpoint": "/m", "dtype": "BF16", "file_bytes": 1_800_000, "tensor_bytes": 1_790_000, "parameters": 900_000,
                         "linear_bytes": 1_000_000, "checkpoint_linear_bytes": size // 2, "ratio_total": ratio, "ratio_linear": ratio,
                         "parameters_match": True}
    return value


def _results_manifest(sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A results manifest holding `sets` (each's items, limit, sha256 and metrics), the rest filled in."""
    model = {"path": "/m", "weights_sha256": "0" * 64, "config_sha256": "1" * 64, "tokenizer_sha256": "2" * 64, "storage_dtype": "BF16"}
    return {"artifact": "evaluation-results", "schema_version": 1, "model": model, "baseline": None,
            "config": EvaluateConfig(evalsets=tuple(spec.split("@")[0] for spec in sets)).model_dump(mode="json"),
            "sets": {spec: {"dir": spec.replace("@", "-"), "kind": "text", "primary": "kl_divergence", "offset": 0, "cache_key": "k",
                            "from_cache": False, "seconds": 1.0, **entry} for spec, entry in sets.items()},
            "model_load_seconds": 1.0, "files": {},
            "provenance": {"created_at": "2026-01-01T00:00:00+00:00", "libraries": {}, "wall_seconds": 1.0, "peak_memory_bytes": 0,
                           "machine": {"python": "3.11", "platform": "linux", "cpu_count": 2}}}


def test_build_reads_the_narrowed_policy_looks_and_tails_of_a_run_directory(tmp_path: Path) -> None:
    """A run directory as `quantgate run` leaves it (quantgate.core.rundir): verdicts with their
    looks (one with its tails, one without), and one that failed to quantize (no looks)."""
    run_dir = tmp_path / "run"
    narrowed = {"narrowed_to": ["wiki-text"], "dropped": ["hellaswag"]}
    policy = {"name": "small-model", "version": "v2", "sha256": "ab" * 32, **narrowed}
    looks = {"wiki-text@v1": [25, 50]}
    _write_run(run_dir, formats=["fp8-e4m3", "awq-int4", "gptq-int4"], policy=policy, looks=looks,
               plot={"x": "bytes", "y": "wiki-text@v1 kl_divergence", "higher_is_better": False})
    (run_dir / "results" / "baseline").mkdir(parents=True)
    (run_dir / "results" / "baseline" / "manifest.json").write_text(json.dumps(_results_manifest(
        {"wiki-text@v1": {"items": 25, "limit": 25, "sha256": "cd" * 32, "metrics": {"kl_divergence": 0.0}}})))
    gate = {"gate": "wiki-text@v1 kl_divergence", "outcome": "pass", "estimate": 0.03, "low": 0.02, "high": 0.04, "limit": 0.05,
            "unit": "", "reason": "within", "items": 50, "look": 2, "looks": 2, "confidence": 0.975, "decided_by": "interval"}
    tail = {"estimate": 0.03, "low": 0.02, "high": 0.04, "confidence": 0.95, "items": 50}
    sequential = {"looks": looks, "items": {"wiki-text@v1": 50}, "error_control": "bonferroni", "confidence": 0.95,
                  "blocked_by": None, "not_evaluated": {}, "trace": []}
    for name, tails in (("fp8-e4m3", {"wiki-text@v1": {"kl_max": tail}}), ("awq-int4", {})):
        _write_verdict(run_dir, name, gates=[gate], verdict="approved", policy=policy, results="/r", not_evaluated={},
                       sequential=sequential, tails=tails)
    failed = {"gate": "integrity loads", "outcome": "fail", "estimate": 0.0, "low": 0.0, "high": 0.0, "limit": 1.0, "unit": "",
              "reason": "integrity: NaN logits"}
    _write_verdict(run_dir, "gptq-int4", gates=[failed], verdict="blocked", policy=policy, results=None)
    built = build(run_dir)
    report = built.model_dump(mode="json")
    assert report["policy"] == policy
    assert report["evalsets"][0]["looks"] == [25, 50] and report["evalsets"][0]["items"] == 25
    rows = _rows(report)
    assert rows["fp8-e4m3"]["sequential"] == sequential and rows["fp8-e4m3"]["tails"] == {"wiki-text@v1": {"kl_max": tail}}
    assert rows["awq-int4"]["sequential"]["items"] == {"wiki-text@v1": 50} and rows["awq-int4"]["tails"] == {}
    assert rows["gptq-int4"]["sequential"] is None and rows["baseline"]["sequential"] is None
    text = markdown(built)
    assert "Policy small-model@v2 narrowed to wiki-text (dropped: hellaswag); sha256" in text
    assert "| wiki-text@v1 | 25, 50 | 50 of 2,938 | 50 (look 2 of 2) | 50 (look 2 of 2) | – |" in text
    assert "| fp8-e4m3 | – | – | – | 0.0300 | approved (all 1 gates passed) | wiki-text 50 |" in text
    assert "| wiki-text (50 items) | – | – | – | – | – | 0.0300 [0.0200, 0.0400] | – | – |" in text


# ---- a run with a mixed-precision search --------------------------------------------------------


def test_search_trials_are_rows_beside_the_formats_marked_and_judged_on_the_search_split(tmp_path: Path) -> None:
    out = write(sample(search="approved"), tmp_path / "report")
    data = json.loads((out / "report.json").read_text())
    roles = {row["format"]: row["search"]["role"] for row in data["rows"] if row["search"]}
    assert roles == {"search-1": "trial", "search-2": "trial", "search-3": "trial", "search-2@held-out": "held-out"}
    text = (out / "report.md").read_text()
    formats = text[text.index("## Formats"):text.index("## Recommendation")]
    assert "| search-2 (mixed: 7 groups gptq-int4, 5 smoothquant-w8a8) | 140.0 | 0.52 | 6.10 |" in formats
    assert "| passed the search split (all 9 gates passed) |" in formats
    assert "| blocked on the search split (1 of 8 gates failed, 1 not evaluated) |" in formats
    assert "| search-2 on held-out items (mixed: 7 groups gptq-int4, 5 smoothquant-w8a8) |" in formats
    assert "| approved on held-out items (all 9 gates passed) |" in formats
    assert "### search-1: passed the search split" in text and "### search-2@held-out: approved on held-out items" in text
    assert "### search-1: approved" not in text  # a trial's own verdict never reads as an approval
    summary = text[text.index("## Summary"):text.index("## Formats")]
    assert "- Mixed-precision search: search-2 (0.519x the baseline's bytes) is approved on held-out items the search never saw." in summary
    assert "- search-1 passed the search split only, so it is not approved for release" in summary
    assert "Approved, every gate passed: fp8-e4m3, smoothquant-w8a8 and search-2 on held-out items (3 of 5 formats)." in summary
    assert "search-3 is blocked" not in summary  # a trial blocked on the search split is the bisection at work
    search = text[text.index("## Mixed-precision search"):text.index("## Candidates")]
    assert ("Held-out gate: search-2: approved on held-out items (wiki-text items 76–150, arc-easy items 51–100), items no trial "
            "was judged on; this verdict alone approves the mixed checkpoint checkpoints/search-2.") in search
    assert "Each trial was judged on the search split (wiki-text items 1–75, arc-easy items 1–50)" in search
    assert "1 budget gave the allocation of an earlier trial (search-2)" in search
    assert ("| search-3 | 0.475 | 0.474 | 0.0081 | gptq-int4 10, smoothquant-w8a8 2 | blocked on the search split "
            "| wiki-text kl_divergence 0.2100 [0.1800, 0.2500] exceeds 0.1500 |") in search
    assert "| search-2 (chosen) | 0.520 | 0.519 | 0.0034 | gptq-int4 7, smoothquant-w8a8 5 | passed the search split | – |" in search
    measured = text[text.index("## What was measured"):]
    assert "| wiki-text@v1 | 25, 75, 200 | 200 (whole set) |" in measured and "| 75 held out (items 76–150) |" in measured

    page = (out / "report.html").read_text()
    assert page.count('<tr class="trial passed">') == 2 and page.count('<tr class="trial blocked">') == 1
    assert page.count('<tr class="held-out approved">') == 1 and page.count('<tr class="approved">') == 2
    assert 'mix">mixed: 7 groups gptq-int4, 5 smoothquant-w8a8</span>' in page
    assert '<span class="badge trial passed">passed the search split</span>' in _section(page, "search-1")
    assert "The search chose it: its held-out gate is the search&#39;s result." in _section(page, "search-2")
    assert page.index('id="size-accuracy"') < page.index('id="search"') < page.index('class="candidate"')
    held = page[page.index('<p id="held-out"'):page.index("</p>", page.index('<p id="held-out"'))]
    assert 'class="approved"' in held and "approved on held-out items (wiki-text items 76–150, arc-easy items 51–100)" in held
    trials = page[page.index('<table id="search-trials">'):page.index("</table>", page.index('<table id="search-trials">'))]
    assert trials.count("<tr>") == 4  # the header and three trials
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page


def test_a_trial_approved_only_on_the_search_split_is_never_recommended(tmp_path: Path) -> None:
    approved = sample_records(search="approved")
    assert recommendation(approved.rows, "reference") == "search-2@held-out"  # its held-out gate approved it
    sentences = recommendation_sentences(approved)
    assert sentences[0].startswith("On reference: search-2 (mixed: 7 groups gptq-int4, 5 smoothquant-w8a8), the mixed checkpoint "
                                   "checkpoints/search-2 approved on held-out items, the approved format with the lowest")
    # search-3 (0.045 ms) and search-1 (0.050) beat smoothquant-w8a8 (0.054) on the bound, but only on the search split
    trials_only = [row for row in approved.rows if row.format in ("baseline", "search-1", "search-2", "search-3")]
    assert recommendation(trials_only, "reference") is None
    blocked = sample(search="blocked")
    out = write(blocked, tmp_path / "report")
    data = json.loads((out / "report.json").read_text())
    assert data["recommendation"] == {"reference": "smoothquant-w8a8", "h200": "smoothquant-w8a8"}
    text = (out / "report.md").read_text()
    summary = text[text.index("## Summary"):text.index("## Formats")]
    assert "- search-1 and search-2 each passed the search split only, so none is approved for release" in summary
    assert "- search-2 on held-out items is blocked by wiki-text kl_divergence 0.190 [0.160, 0.230] above 0.15" in summary
    assert ("Held-out gate: search-2: blocked on held-out items (wiki-text items 76–150, arc-easy items 51–100): "
            "wiki-text kl_divergence 0.1900 [0.1600, 0.2300] exceeds 0.1500.") in text
    assert "- reference: smoothquant-w8a8" in text and "search-2 (chosen)" in text
    page = (out / "report.html").read_text()
    assert '<p id="held-out" class="blocked">' in page and page.count('<tr class="held-out blocked">') == 1
    assert 'class="held-out-blocked"' in page and 'class="held-out-approved"' not in page


def _plot_report(values: dict[str, tuple[float, float]], higher_is_better: bool) -> RunRecords:
    """A report of hand-made points: format -> (MB, value); 'search-N' a trial, 'search-2@held-out'
    the held-out gate of search-2."""
    rows = []
    for name, (mb, value) in values.items():
        role = "held-out" if name.endswith("@held-out") else "trial" if name.startswith("search-") else None
        verdict = "baseline" if name == "baseline" else "blocked" if name == "search-3" else "approved"
        rows.append({"format": name, "bytes": int(mb * 1e6), "metrics": {"m": {"value": value}}, "verdict": verdict,
                     "search": None if role is None else {"role": role, "checkpoint": name.split("@")[0]}})
    return RunRecords.model_validate({
        "model": "tiny", "policy": {"name": "p", "version": "v1"}, "rows": rows,
        "plot": {"x": "bytes", "y": "m", "higher_is_better": higher_is_better},
        "search": {"chosen": "search-2", "held_out": {"verdict": "approved", "reasons": []}}})


def test_the_pareto_front_is_exactly_the_non_dominated_formats_and_trials() -> None:
    sizes = {"baseline": 270.0, "fp8": 166.0, "w8a8": 166.0, "int4": 112.0, "search-1": 140.0, "search-2": 125.0, "search-3": 150.0,
             "search-2@held-out": 125.0}
    # higher is better: search-3 (150, 0.92) is beaten by search-1 (140, 0.93), w8a8 by fp8 at the same size; the held-out
    # gate (0.99, on other items) is no point of its own, or it would beat every trial
    top1 = {"baseline": 1.0, "fp8": 0.95, "w8a8": 0.94, "int4": 0.80, "search-1": 0.93, "search-2": 0.90, "search-3": 0.92,
            "search-2@held-out": 0.99}
    # lower is better: search-3 (150, 0.10) is beaten by search-1 (140, 0.08), w8a8 (0.05) by fp8 (0.03)
    kl = {"baseline": 0.0, "fp8": 0.03, "w8a8": 0.05, "int4": 0.30, "search-1": 0.08, "search-2": 0.12, "search-3": 0.10,
          "search-2@held-out": 0.01}
    expected = ["int4", "search-2", "search-1", "fp8", "baseline"]
    for values, higher in ((top1, True), (kl, False)):
        report = _plot_report({name: (sizes[name], values[name]) for name in sizes}, higher)
        front = plot_front(report)
        assert [label for _, _, label in front] == expected
        assert front == [(sizes[name], values[name], name) for name in expected]
        svg = str(figures.plot(plot_figure(report)))
        marked = re.findall(r'class="point([^"]*)"[^>]*>(?:<title>([^:<]+):)', svg)
        assert sorted(label for classes, label in marked if classes.endswith(" front")) == sorted(expected)
        assert len(marked) == 7 and svg.count('class="point trial') == 3  # the held-out gate: a ring, not a point
        assert svg.count('<path class="point trial approved') == 2 and 'class="held-out-approved"' in svg
        corners = re.search(r'<polyline class="pareto" points="([^"]+)"', svg)
        assert corners is not None
        vertices = [tuple(map(float, pair.split(","))) for pair in corners[1].split()]
        assert len(vertices) == 2 * len(expected) - 1  # a step line: across, then up or down, at each point
        assert all(a[0] == b[0] or a[1] == b[1] for a, b in zip(vertices, vertices[1:], strict=False))


def test_the_sensitivity_chart_has_one_series_per_format_and_one_point_per_group(tmp_path: Path) -> None:
    sensitivity = sample_report(search="approved")["sensitivity"]
    report = sample(search="approved")
    assert report.search_section is not None and report.search_section.sensitivity is not None
    figure = report.search_section.sensitivity.figure
    assert figure.allocation is not None and figure.allocation.trial == "search-2"
    svg = str(figures.sensitivity(figure))
    series = re.findall(r'<g class="series" data-format="([^"]+)">(.*?)</g>', svg, re.DOTALL)
    assert [fmt for fmt, _ in series] == sensitivity["formats"] == ["gptq-int4", "smoothquant-w8a8"]
    assert all(body.count('<circle class="score"') == len(sensitivity["groups"]) == 12 for _, body in series)
    assert "log scale" in svg and "1e-3" in svg and "1e-7" in svg  # decades from the scores, the zero one on the floor
    strip = svg[svg.index('<g class="allocation">'):]
    assert strip[:strip.index("</g>")].count("<rect ") == 12  # the format search-2 gave each group
    assert svg.count('fill="#ffffff" stroke="#bc4c00"') == 1  # the one zero score: hollow, on the floor
    width = re.search(r'width="(\d+)"', svg)
    assert width is not None and int(width[1]) <= 1280 - 2 * 40
    page = (write(report, tmp_path / "report") / "report.html").read_text()
    section = page[page.index('id="search"'):page.index("<h2>Candidates</h2>")]
    assert section.count('<svg xmlns="http://www.w3.org/2000/svg" class="sensitivity"') == 1
    caption = section[section.index('id="sensitivity-caption"'):]
    assert "diagonal-fisher" in caption and "log scale" in caption and "gptq-int4 0.90" in caption
    text = (tmp_path / "report" / "report.md").read_text()
    assert "### Per-layer sensitivity" in text and "| 11 | model.layers.2.mlp.down_proj | 2 | 8.33e-05 | 0 | gptq-int4 |" in text
    plain = (write(sample(), tmp_path / "plain") / "report.html").read_text()
    assert 'id="search"' not in plain and 'class="sensitivity"' not in plain


def _search_run(tmp_path: Path, plan_search: bool = True) -> Path:
    """A run directory with a search (quantgate.core.rundir): two formats, three trials judged on
    the search split, search-2's held-out gate, a stale held-out verdict of search-3 that the
    search did not choose, and the sensitivity."""
    run_dir = tmp_path / "run"
    policy = {"name": "tiny", "version": "v3", "sha256": "ab" * 32}
    _write_run(run_dir, formats=["gptq-int4", "smoothquant-w8a8"], policy=policy, plan={"model": "tiny", "search": {} if plan_search else None},
               hardware=["reference"], plot={"x": "bytes", "y": "wiki-text@v1 top1_agreement", "higher_is_better": True},
               looks={"wiki-text@v1": [4]})

    def measure(name: str, size: int, b1: float) -> None:
        _artifact(run_dir / "measure" / f"{name}.json", {
            "measurement": _measurement(size, 5.0, 16.0 * size / 1_800_000, size / 1_800_000),
            "bounds": {"reference": {"batch1_ms": b1, "batch32_ms": b1 * 2, "context_tokens": 2048, "kv_bytes_per_element": 2}}})

    def verdict(name: str, verdict: str, top1: float, **changes: Any) -> None:
        gate = {"gate": "wiki-text@v1 top1_agreement", "outcome": "pass" if verdict == "approved" else "fail", "estimate": top1,
                "low": top1 - 0.01, "high": top1 + 0.01, "limit": 0.9, "unit": "", "reason": f"top1 {top1}", "items": 4, "look": 1,
                "looks": 1, "confidence": 0.95, "decided_by": "interval"}
        _write_verdict(run_dir, name, gates=[gate], verdict=verdict, policy=policy, not_evaluated={}, results="/r", **changes)

    measure("baseline", 1_800_000, 0.010)
    for name, size, b1, top1, outcome in (("gptq-int4", 620_000, 0.004, 0.85, "blocked"), ("smoothquant-w8a8", 1_000_000, 0.006, 0.99, "approved"),
                                          ("search-1", 810_000, 0.005, 0.97, "approved"), ("search-2", 710_000, 0.0045, 0.95, "approved"),
                                          ("search-3", 660_000, 0.0042, 0.88, "blocked")):
        measure(name, size, b1)
        trial = {"split": "search", "checkpoint_name": name, "split_items": {"wiki-text@v1": {"offset": 0, "ceiling": 4}}}
        verdict(name, outcome, top1, **(trial if name.startswith("search-") else {}))
    held = {"checkpoint_name": "search-2", "split": "held-out", "split_items": {"wiki-text@v1": {"offset": 4, "ceiling": 4}},
            "sequential": {"looks": {"wiki-text@v1": [4]}, "items": {"wiki-text@v1": 4}, "error_control": "bonferroni", "confidence": 0.95,
                           "blocked_by": None, "not_evaluated": {}, "trace": []}}
    verdict("search-2@held-out", "approved", 0.93, **held)
    verdict("search-3@held-out", "approved", 0.99, **{**held, "checkpoint_name": "search-3"})  # another run's: not chosen here
    trials = [{"name": name, "budget_ratio": ratio, "ratio": ratio, "predicted_cost": cost, "groups_by_format": mix, "verdict": outcome,
               "reasons": [], "allocation": {"choice": {}}}
              for name, ratio, cost, mix, outcome in (("search-1", 0.45, 0.0002, {"gptq-int4": 3, "smoothquant-w8a8": 5}, "approved"),
                                                      ("search-2", 0.40, 0.0004, {"gptq-int4": 4, "smoothquant-w8a8": 4}, "approved"),
                                                      ("search-3", 0.37, 0.0010, {"gptq-int4": 6, "smoothquant-w8a8": 2}, "blocked"))]
    (run_dir / "search.json").write_text(json.dumps({
        "formats": ["gptq-int4", "smoothquant-w8a8"], "objective": "smallest-approved", "max_trials": 3, "ceiling_bytes": 990_000,
        "lo_bytes": 610_000, "space": {"groups": 8, "fixed_bytes": 200_000, "baseline_bytes": 1_770_000, "uniform_bytes": {}},
        "trials": trials, "repeats": [], "chosen": "search-2", "held_out": {"verdict": "approved", "reasons": []},
        "conclusion": "search-2 (0.400x the baseline's bytes) is approved on held-out items the search never saw"}))
    (run_dir / "sensitivity").mkdir()
    groups = [{"name": f"model.layers.{index // 4}.g{index % 4}", "block": index // 4, "role": f"g{index % 4}", "layers": [],
               "parameters": 10, "scores": {"gptq-int4": 1e-4 * (index + 1), "smoothquant-w8a8": 1e-6 * (index + 1)}} for index in range(8)]
    (run_dir / "sensitivity" / "sensitivity.json").write_text(json.dumps({
        "method": "diagonal-fisher", "unit": "nats per token (predicted KL increase)", "formats": ["gptq-int4", "smoothquant-w8a8"],
        "groups": groups, "totals": {}, "validation": None}))
    return run_dir


def test_build_reads_a_search_run_directory(tmp_path: Path) -> None:
    built = build(_search_run(tmp_path))
    report = built.model_dump(mode="json")
    rows = _rows(report)
    assert list(rows) == ["baseline", "gptq-int4", "smoothquant-w8a8", "search-1", "search-2", "search-3", "search-2@held-out"]
    assert [rows[name]["search"]["role"] for name in ("search-1", "search-2", "search-3", "search-2@held-out")] == [
        "trial", "trial", "trial", "held-out"]
    assert rows["smoothquant-w8a8"]["search"] is None and rows["baseline"]["search"] is None
    held = rows["search-2@held-out"]  # measured as its trial's checkpoint, judged on its own items
    assert held["bytes"] == rows["search-2"]["bytes"] == 710_000 and held["metrics"]["wiki-text@v1 top1_agreement"]["value"] == 0.93
    assert held["search"]["split_items"] == {"wiki-text@v1": {"offset": 4, "ceiling": 4}}
    assert held["search"]["groups_by_format"] == {"gptq-int4": 4, "smoothquant-w8a8": 4} and held["search"]["chosen"] is True
    assert report["search"]["chosen"] == "search-2" and len(report["sensitivity"]["groups"]) == 8
    out = write(built, tmp_path / "report")
    # search-3 (0.0042 ms) and search-1 are faster than smoothquant-w8a8, search-2's checkpoint faster still: by its held-out verdict
    assert json.loads((out / "report.json").read_text())["recommendation"] == {"reference": "search-2@held-out"}
    page = (out / "report.html").read_text()
    assert page.count('<circle class="score"') == 2 * 8 and "search-3@held-out" not in page
    # a plan without a search: a search.json left in the directory is not this run's
    other = build(_search_run(tmp_path / "other", plan_search=False))
    assert [row.format for row in other.rows] == ["baseline", "gptq-int4", "smoothquant-w8a8"]
    assert other.search is None and other.sensitivity is None


def test_build_refuses_a_damaged_record_of_a_run_in_one_line(tmp_path: Path) -> None:
    """The report reads a run's measurements, results manifests and serve records through their classes."""
    from quantgate.core.errors import IntegrityError

    run_dir = _search_run(tmp_path)
    path = run_dir / "measure" / "gptq-int4.json"
    stored = json.loads(path.read_text())
    stored["value"]["measurement"]["totals"]["file_bytes"] = "620000"
    path.write_text(json.dumps(stored))
    with pytest.raises(IntegrityError) as refused:
        build(run_dir)
    assert str(refused.value) == f"{path}: measurement: measurement field totals.file_bytes: Input should be a valid integer"
    path.write_text(json.dumps({"key": "k", "value": {**stored["value"], "measurement": _measurement(620_000, 5.0, 5.5, 0.34)}}))
    _artifact(run_dir / "serve" / "baseline.json", {"served": True, "engine": {}, "status": "served"})  # schema_version 2's shape
    with pytest.raises(InputError, match=r"serve/baseline.json: value: no kind, not a serve record \(kind 'serve'\)$"):
        build(run_dir)
    (run_dir / "serve" / "baseline.json").unlink()
    # the measure stage's bounds and search.json, through the report's own model of them
    bounds = {**stored["value"]["bounds"]["reference"], "batch1_ms": "fast"}
    path.write_text(json.dumps({"key": "k", "value": {**stored["value"], "measurement": _measurement(620_000, 5.0, 5.5, 0.34),
                                                      "bounds": {"reference": bounds}}}))
    with pytest.raises(IntegrityError) as refused:
        build(run_dir)
    assert str(refused.value) == f"{path}: value: bounds.reference.batch1_ms: Input should be a valid number, unable to parse string as a number"
    path.write_text(json.dumps({"key": "k", "value": {**stored["value"], "measurement": _measurement(620_000, 5.0, 5.5, 0.34)}}))
    search = json.loads((run_dir / "search.json").read_text())
    search["trials"][0]["name"] = 1
    (run_dir / "search.json").write_text(json.dumps(search))
    with pytest.raises(IntegrityError) as refused:
        build(run_dir)
    assert str(refused.value) == f"{run_dir / 'search.json'}: trials[0].name: Input should be a valid string"


def test_build_refuses_a_run_directory_of_an_earlier_version_in_one_line(tmp_path: Path) -> None:
    """run.json and the verdicts are read through their classes (RunRecord, VerdictRecord): a run
    directory an earlier 0.x quantgate wrote (run.json without its schema_version, a verdict without
    its kind or its looks' record whole) is refused in one line, never read half (run it again)."""
    from quantgate.core.errors import IntegrityError

    run_dir = _search_run(tmp_path)
    run_file, verdict_file = run_dir / "run.json", run_dir / "verdicts" / "search-2@held-out.json"
    run, stored = json.loads(run_file.read_text()), json.loads(verdict_file.read_text())
    run_file.write_text(json.dumps({key: value for key, value in run.items() if key != "schema_version"}))
    with pytest.raises(InputError) as refused:
        build(run_dir)
    assert str(refused.value) == f"{run_file}: no schema_version; this quantgate reads 1"
    run_file.write_text(json.dumps(run))
    _artifact(verdict_file, {key: value for key, value in stored["value"].items() if key != "kind"})
    with pytest.raises(InputError) as refused:
        build(run_dir)
    assert str(refused.value) == f"{verdict_file}: value: no kind, not a verdict record (kind 'verdict')"
    looks = {key: value for key, value in stored["value"]["sequential"].items() if key != "trace"}
    _artifact(verdict_file, {**stored["value"], "sequential": looks})
    with pytest.raises(IntegrityError) as damaged:
        build(run_dir)
    assert str(damaged.value) == f"{verdict_file}: value: verdict record field sequential.trace: Field required"


# ---- the document: escaping, report.json read back, its version ----------------------------------

MARKUP_NAME = 'w8a8<script>alert("x&y")</script>|z'


def test_markup_in_a_format_or_policy_name_is_text_on_the_page_and_keeps_the_markdown_table(tmp_path: Path) -> None:
    """The templates escape every value (HTML and SVG alike): a name holding `<script>`, `&`, `"`
    is text, never markup; in report.md its pipe is escaped, so the row keeps its columns."""
    records = sample_report()
    records["rows"][4]["format"] = MARKUP_NAME  # smoothquant-w8a8, the recommended format
    records["policy"]["name"] = 'small"<b>&model'
    out = write(composed(records), tmp_path / "report")
    page = (out / "report.html").read_text()
    assert "<script" not in page and "<b>&" not in page and 'small"' not in page
    escaped = "w8a8&lt;script&gt;alert(&#34;x&amp;y&#34;)&lt;/script&gt;|z"
    assert f'<section class="candidate" id="candidate-{escaped}">' in page and f'<a href="#candidate-{escaped}">{escaped}</a>' in page
    assert f"<li>On reference: {escaped}, the approved format" in page  # a sentence
    assert f'aria-label="forest plot of the metric gates of {escaped}"' in page and f">{escaped}</text>" in page  # the figures
    assert "Policy small&#34;&lt;b&gt;&amp;model@v2 narrowed to" in page
    text = (out / "report.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| format | MB |"))
    row = next(line for line in text.splitlines() if line.startswith("| w8a8<script>"))
    assert '</script>\\|z | 166.0 |' in row  # the name's pipe escaped
    cells = re.split(r"(?<!\\)\|", row)
    assert len(cells) == len(header.split("|")) and cells[-2].strip() == "wiki-text 75, arc-easy 50"
    assert 'Policy small"<b>&model@v2' in text  # Markdown is text: nothing else escaped


def test_report_json_reads_back_as_the_same_report_and_renders_the_same_page(cli, tmp_path: Path) -> None:
    """report.json is the Report's JSON: read back (an infinite estimate included) it is the same
    model and renders the same report.md and report.html; `quantgate report` renders them from it
    alone, given the file or a folder holding it and no run."""
    records = sample_report(search="approved")
    records["rows"][2]["gates"][7]["estimate"] = math.inf  # gptq-int4's wiki-text kl_p99
    report = composed(records)
    out = write(report, tmp_path / "report")
    document = (out / "report.json").read_text()
    assert document.startswith('{\n  "schema_version": 2,') and '"estimate": Infinity' in document
    again = read_report(out / "report.json")
    assert again == report
    assert html_page(again) == (out / "report.html").read_text() and markdown(again) == (out / "report.md").read_text()
    rendered = cli("report", out / "report.json", "--out", tmp_path / "again")
    assert rendered.code == 0, rendered.err
    assert "recommended on reference: search-2@held-out" in rendered.out
    for name in ("report.json", "report.md", "report.html"):
        assert (tmp_path / "again" / name).read_text() == (out / name).read_text(), name
    (out / "report.html").unlink()
    assert cli("report", out).code == 0 and (out / "report.html").read_text() == (tmp_path / "again" / "report.html").read_text()


def test_a_report_json_of_another_schema_version_is_refused_in_one_line(cli, tmp_path: Path) -> None:
    path = write(sample(), tmp_path / "report") / "report.json"
    data = json.loads(path.read_text())
    for version in (1, 3, None):
        path.write_text(json.dumps({**data, "schema_version": version}))
        with pytest.raises(InputError) as refused:
            read_report(path)
        assert str(refused.value).startswith(f"{path}: report schema_version {version} is not one this version of quantgate reads (2)")
        assert "\n" not in str(refused.value)
    result = cli("report", path)
    errors = [line for line in result.err.splitlines() if line.startswith("quantgate: error:")]
    assert result.code == 2 and len(errors) == 1 and f"{path}: report schema_version None" in errors[0]
    path.write_text(json.dumps({**data, "colour": "blue"}))
    with pytest.raises(InputError, match="report.json: not a quantgate report: colour: Extra inputs are not permitted"):
        read_report(path)


# ---- served in vLLM -----------------------------------------------------------------------------


def _with_serving(records: dict[str, Any]) -> dict[str, Any]:
    """sample_report's records with serve checks as verdicts keep them (ServeRecord.summary,
    more fields than the report reads): the baseline and fp8-e4m3 served (fp8-e4m3 slower than the
    baseline, and the engine's default would serve it otherwise), awq-int4 not loaded, and
    smoothquant-w8a8 pending on a class without its kernel."""
    rows = {row["format"]: row for row in records["rows"]}
    agreement = {"mean_abs_logprob_difference": 0.0123, "p99_abs_logprob_difference": 0.0871, "kl_served_gated_mean": 0.00042,
                 "top1_agreement": 0.991, "nll_change": 0.0004, "positions": 512, "evalset": "wiki-text@v1"}
    served = {"served": True, "status": "served", "engine": {"engine": "vllm", "version": "0.32.0", "torch": "2.9"}, "dtype": "bfloat16",
              "device": "cpu", "device_class": "cpu-avx512", "engine_settings": {}, "schemes": [], "kernels": ["CPU attention"],
              "agreement": agreement, "greedy": {"identical": 8, "prompts": 8, "tokens": 16}, "bandwidth_bytes_per_s": 12.3e9, "log": "/l",
              "throughput": {"1": {"tokens_per_s": 48.7, "bound_tokens_per_s": 1210.4}, "8": {"tokens_per_s": 301.2, "bound_tokens_per_s": 9650.0}}}
    rows["baseline"]["serving"] = served
    rows["fp8-e4m3"]["serving"] = {
        **served, "agreement": {**agreement, "mean_abs_logprob_difference": 0.041}, "engine_settings": {"VLLM_CPU_INT4_W4A8": "0"},
        "throughput": {"1": {"tokens_per_s": 40.1, "bound_tokens_per_s": 1800.0}},
        "schemes": [{"scheme": "W4A16", "served_as": "W4A16", "engine_default": "W4A8"}],
        "engine_default": {"settings": {"VLLM_CPU_INT4_W4A8": "1"}, "served_as": {"W4A16": "W4A8"}, "because": ["vLLM source"],
                           "served": True, "agreement": {**agreement, "nll_change": 0.0123}}}
    rows["fp8-e4m3"]["gates"].append({"gate": "serving mean_logprob_difference", "outcome": "pass", "estimate": 0.041, "limit": 0.0623,
                                      "unit": "", "reason": "served & gated <agree>", "decided_by": "exact"})
    rows["fp8-e4m3"]["classes"] = {"cpu-avx512": {"status": "approved", "reason": "served as gated"}}
    rows["awq-int4"]["serving"] = {"served": False, "status": "not_served", "reason": "vLLM cannot load it", "log": "/l", "kernels": []}
    rows["smoothquant-w8a8"].update(verdict="pending", serving={"served": False, "status": "pending", "reason": "no kernel here"},
                                    classes={"cpu-avx2": {"status": "pending", "reason": "no kernel",
                                                          "next": "quantgate serving check /c --run /r"}})
    return records


def test_the_served_section_the_measured_recommendation_and_a_pending_format(tmp_path: Path) -> None:
    report = compose(RunRecords.from_records(_with_serving(sample_report())))
    measured = report.measured_recommendation
    assert measured is not None and measured.format == "fp8-e4m3" and measured.slower_than_baseline == ["fp8-e4m3"]
    assert report.summary.measured is not None and report.summary.measured.startswith(
        "On this machine (cpu, vLLM, measured): fp8-e4m3, the approved format vLLM decodes fastest at batch 1 (40.1 tokens/s); "
        "the 16-bit baseline decodes at 48.7 tokens/s there.")
    assert report.summary.engine_defaults == [
        "fp8-e4m3: vLLM's defaults on cpu-avx512 would serve W4A16 as W4A8; the serve stage served it as gated "
        "(VLLM_CPU_INT4_W4A8=0). Under the default, served log-probs differ from gated by 0.012 nats a token (mean; p99 0.087), "
        "NLL +0.0123 nats a token."]
    assert report.summary.pending == ["smoothquant-w8a8 passes every quality gate and is pending serving: cpu-avx2: pending: "
                                      "no kernel; to attest it where it will serve: quantgate serving check /c --run /r"]
    out = write(report, tmp_path / "report")
    text = (out / "report.md").read_text()
    served = text[text.index("## Served in vLLM"):text.index("## Candidates")]
    assert "vLLM 0.32.0 (vllm)" in served and "(12.3 GB/s)" in served
    assert "| fp8-e4m3 | yes (bfloat16) | 0.041 / 0.087 (0.062 / –) | 0.0004 | 0.991 | 8 of 8 | 40.1 (1,800) | – |" in served
    assert "| awq-int4 | no: vLLM cannot load it | – |" in served and "| smoothquant-w8a8 | pending: no kernel here | – |" in served
    page = (out / "report.html").read_text()
    assert '<td style="color: #cf222e">no: vLLM cannot load it</td>' in page and "<td>pending: no kernel here</td>" in page
    assert "<li>fp8-e4m3: vLLM&#39;s defaults on cpu-avx512 would serve W4A16 as W4A8;" in page
    assert '<li class="pending">smoothquant-w8a8 passes every quality gate' in page
    assert "served &amp; gated &lt;agree&gt;" in page and "<agree>" not in page
    baseline = json.loads((out / "report.json").read_text())["rows"][0]["serving"]
    assert baseline["served"] and "log" not in baseline and "torch" not in baseline["engine"]  # what the report reads, no more
