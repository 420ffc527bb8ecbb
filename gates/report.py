"""The size-vs-accuracy report: one row per format (and the baseline), written as
report.json (the data, schema_version 1), report.md and a self-contained report.html with an
inline SVG plot (no scripts, no network), the Pareto front drawn."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import evalsets
from quantgate.core.artifacts import MANIFEST, atomic_directory, read_json
from quantgate.core.errors import InputError
from quantgate.core.ids import GateId
from quantgate.core.metrics import metric as metric_facts
from quantgate.core.rundir import BASELINE, RUN_KIND, RunDir
from quantgate.core.stagecache import stored_value

SCHEMA_VERSION = 1


def recommendation(rows: list[dict[str, Any]], profile: str) -> str | None:
    """The approved format with the lowest batch-1 decode bound on `profile`, or None."""
    approved = [row for row in rows if row["verdict"] == "approved" and profile in row.get("bounds", {})]
    if not approved:
        return None
    return min(approved, key=lambda row: row["bounds"][profile]["batch1_ms"])["format"]


def pareto_front(points: list[tuple[float, float, str]], higher_is_better: bool = True) -> list[tuple[float, float, str]]:
    """Points (size, quality, label) not beaten by another that is no larger and no worse."""
    sign = 1.0 if higher_is_better else -1.0
    front, best = [], float("-inf")
    for size, quality, label in sorted(points, key=lambda p: (p[0], -sign * p[1])):
        if sign * quality > best:
            front.append((size, quality, label))
            best = sign * quality
    return front


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _metric_cell(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "–"
    text = _number(entry.get("value"), 4)
    if entry.get("difference") is not None:
        unit = entry.get("unit", "")
        suffix = " pts" if unit == "points" else unit
        text += f" ({entry['difference']:+.2f}{suffix} [{entry['low']:+.2f}, {entry['high']:+.2f}])"
    elif entry.get("low") is not None and entry.get("high") is not None:
        text += f" [{entry['low']:.4f}, {entry['high']:.4f}]"
    return text


def table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    profiles = [profile["name"] for profile in report["hardware"]]
    metrics = report["metric_columns"]
    header = ["format", "bytes", "bits/weight (layers)", "bits/param (model)", "x baseline"]
    header += [f"{p} b1 / b32 ms (lower bound)" for p in profiles] + metrics + ["KL", "verdict", "reasons"]
    rows = []
    for row in report["rows"]:
        cells = [row["format"], _number(row["bytes"]), _number(row.get("bits_per_weight_layers")),
                 _number(row.get("bits_per_parameter")), _number(row.get("ratio_to_baseline"))]
        for profile in profiles:
            bound = row.get("bounds", {}).get(profile)
            cells.append(f"{bound['batch1_ms']:.3f} / {bound['batch32_ms']:.3f}" if bound else "–")
        cells += [_metric_cell(row.get("metrics", {}).get(metric)) for metric in metrics]
        cells += [_number(row.get("kl_divergence"), 4), row["verdict"], "; ".join(row.get("reasons", [])) or "–"]
        rows.append(cells)
    return header, rows


def markdown(report: dict[str, Any]) -> str:
    header, rows = table(report)
    lines = [f"# quantgate report: {report['model']}", "",
             f"Policy {report['policy']['name']}@{report['policy']['version']} (sha256 {report['policy']['sha256'][:12]}). "
             "Decode times are lower bounds from peak bandwidth and FLOP/s, not measurements.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    lines += ["", "## Recommendation", "",
              "The approved format with the lowest batch-1 decode bound on each hardware profile:", ""]
    for profile, choice in report["recommendation"].items():
        lines.append(f"- {profile}: {choice or 'none (no format approved)'}")
    lines += ["", "## What was measured", ""] + [f"- {line}" for line in context_lines(report)]
    return "\n".join(lines) + "\n"


def context_lines(report: dict[str, Any]) -> list[str]:
    """The sizes behind the numbers: how many items each golden set contributed, the
    confidence level, the calibration set, the bounds' assumptions."""
    lines = []
    if report.get("evalsets"):
        sets = ", ".join(f"{entry['spec']} {entry['items']} items" + (f" (first {entry['limit']} of {entry['size']})" if entry.get("limit") else "")
                         for entry in report["evalsets"])
        lines.append(f"Golden sets: {sets}. Differences are candidate minus baseline, item by item, with "
                     f"{report.get('confidence', 0.95):.0%} paired-bootstrap intervals.")
    if report.get("calibration"):
        calibration = report["calibration"]
        lines.append(f"Calibration set: {calibration['samples']} x {calibration['seq_len']} tokens from {calibration['source']} "
                     f"(fingerprint {calibration['fingerprint'][:12]}).")
    if report.get("bounds_inputs"):
        inputs = report["bounds_inputs"]
        lines.append(f"Decode bounds: batch 1 and 32, {inputs['context_tokens']} context tokens a sequence, "
                     f"{inputs['kv_bytes_per_element']:g}-byte KV cache, peak bandwidth and FLOP/s of each profile.")
    return lines


def _higher_is_better(column: str) -> bool:
    """Which way the plot's metric column ('SET METRIC') is better, from the metrics table."""
    return metric_facts(GateId.parse(column).check).higher_is_better


def svg_plot(report: dict[str, Any], width: int = 640, height: int = 400) -> str:
    metric = report["plot"]["y"]
    higher_is_better = report["plot"]["higher_is_better"] if "higher_is_better" in report["plot"] else _higher_is_better(metric)
    points = [(row["bytes"] / 1e6, row["metrics"][metric]["value"], row["format"], row["verdict"])
              for row in report["rows"] if row.get("metrics", {}).get(metric, {}).get("value") is not None]
    margin = 60
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="20" y="40">no data for {html.escape(metric)}</text></svg>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = 0.0, max(xs) * 1.1
    y_pad = (max(ys) - min(ys)) * 0.15 or abs(max(ys)) * 0.05 or 1.0
    y0, y1 = min(ys) - y_pad, max(ys) + y_pad
    def sx(x: float) -> float:
        return margin + (x - x0) / (x1 - x0) * (width - 2 * margin)

    def sy(y: float) -> float:
        return height - margin - (y - y0) / (y1 - y0) * (height - 2 * margin)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="size-accuracy" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<line x1="{margin}" y1="{height - margin}" x2="{width - margin}" y2="{height - margin}" stroke="#333"/>',
             f'<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{height - margin}" stroke="#333"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">checkpoint size (MB)</text>',
             f'<text x="15" y="{height / 2}" text-anchor="middle" transform="rotate(-90 15 {height / 2})">{html.escape(metric)}</text>']
    for step in range(5):
        xv, yv = x0 + (x1 - x0) * step / 4, y0 + (y1 - y0) * step / 4
        parts.append(f'<text x="{sx(xv):.1f}" y="{height - margin + 16}" text-anchor="middle">{xv:.0f}</text>')
        parts.append(f'<text x="{margin - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.3f}</text>')
    front = pareto_front([(x, y, label) for x, y, label, _ in points], higher_is_better)
    if len(front) > 1:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in front)
        parts.append(f'<polyline class="pareto" points="{path}" fill="none" stroke="#888" stroke-dasharray="4 3"/>')
    colours = {"approved": "#1a7f37", "blocked": "#cf222e", "baseline": "#57606a"}
    for x, y, label, verdict in points:
        colour = colours.get(verdict, "#57606a")
        cx, cy = sx(x), sy(y)
        if verdict == "blocked":
            parts.append(f'<g class="point blocked"><line x1="{cx - 6:.1f}" y1="{cy - 6:.1f}" x2="{cx + 6:.1f}" y2="{cy + 6:.1f}" stroke="{colour}" stroke-width="2.5"/>'
                         f'<line x1="{cx - 6:.1f}" y1="{cy + 6:.1f}" x2="{cx + 6:.1f}" y2="{cy - 6:.1f}" stroke="{colour}" stroke-width="2.5"/></g>')
        else:
            parts.append(f'<circle class="point {verdict}" cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="{colour}"/>')
        parts.append(f'<text x="{cx + 9:.1f}" y="{cy - 8:.1f}">{html.escape(label)}</text>')
    legend_y = margin - 25
    for offset, (verdict, colour) in enumerate(colours.items()):
        parts.append(f'<circle cx="{margin + 10 + offset * 110}" cy="{legend_y}" r="5" fill="{colour}"/>'
                     f'<text x="{margin + 20 + offset * 110}" y="{legend_y + 4}">{verdict}</text>')
    parts.append(f'<text x="{width - margin}" y="{legend_y + 4}" text-anchor="end" fill="#888">- - Pareto front</text>')
    parts.append("</svg>")
    return "".join(parts)


def html_page(report: dict[str, Any]) -> str:
    header, rows = table(report)
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join("<tr class=\"{}\">{}</tr>".format(html.escape(row[-2]), "".join(f"<td>{html.escape(cell)}</td>" for cell in row)) for row in rows)
    recommendations = "".join(f"<li>{html.escape(profile)}: <b>{html.escape(choice or 'none (no format approved)')}</b></li>"
                              for profile, choice in report["recommendation"].items())
    context = "".join(f"<li>{html.escape(line)}</li>" for line in context_lines(report))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>quantgate report: {html.escape(report['model'])}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #1f2328; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }}
tr.approved td:nth-last-child(2) {{ color: #1a7f37; font-weight: bold; }}
tr.blocked td:nth-last-child(2) {{ color: #cf222e; font-weight: bold; }}
</style></head><body>
<h1>quantgate report: {html.escape(report['model'])}</h1>
<p>Policy {html.escape(report['policy']['name'])}@{html.escape(report['policy']['version'])}
(sha256 {html.escape(report['policy']['sha256'][:12])}). Decode times are lower bounds from peak bandwidth and FLOP/s, not measurements.</p>
<table id="formats"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<h2>Size against {html.escape(report['plot']['y'])}</h2>
{svg_plot(report)}
<h2>Recommendation</h2><ul id="recommendation">{recommendations}</ul>
<h2>What was measured</h2><ul>{context}</ul>
</body></html>
"""


def write(report: dict[str, Any], out: Path, overwrite: bool = True) -> Path:
    """Write report.json, report.md and report.html into `out` atomically."""
    report = {**report, "schema_version": SCHEMA_VERSION,
              "recommendation": {p["name"]: recommendation(report["rows"], p["name"]) for p in report["hardware"]}}
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        (staging / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (staging / "report.md").write_text(markdown(report), encoding="utf-8")
        (staging / "report.html").write_text(html_page(report), encoding="utf-8")
    return Path(out)


# ---- a report from a run directory (`quantgate run`, `quantgate report RUN_DIR`) ------------

def _row(name: str, measured: dict[str, Any] | None, results: dict[str, Any] | None, verdict: dict[str, Any] | None,
         columns: list[str]) -> dict[str, Any]:
    measurement = (measured or {}).get("measurement")
    metrics: dict[str, Any] = {}
    for column in columns:
        gate_id = GateId.parse(column)
        facts = metric_facts(gate_id.check)
        value = (results or {}).get("sets", {}).get(gate_id.scope, {}).get("metrics", {}).get(facts.name)
        gate = (verdict or {}).get("metrics", {}).get(column)
        if verdict is None and results is not None and value is None:
            value = facts.baseline_value  # the baseline against itself (agreement metrics)
        entry: dict[str, Any] = {"value": value}
        if gate is not None:
            if facts.is_change:
                entry.update(difference=gate["estimate"], low=gate["low"], high=gate["high"], unit=gate["unit"])
            else:
                entry.update(value=gate["estimate"], low=gate["low"], high=gate["high"], unit=gate["unit"])
            entry["outcome"] = gate["outcome"]
        metrics[column] = entry
    kl = next((entry["value"] for column, entry in metrics.items() if GateId.parse(column).check == "kl_divergence"), None)
    if kl is None and results is not None:
        kl = next((entry["metrics"].get("kl_divergence") for entry in results.get("sets", {}).values()
                   if "kl_divergence" in entry.get("metrics", {})), None)
    return {
        "format": name,
        "bytes": measurement["totals"]["file_bytes"] if measurement else None,
        "bits_per_weight_layers": measurement["quantized_linear"]["bits_per_weight"]["measured"] if measurement else None,
        "bits_per_parameter": measurement["whole_model"]["bits_per_parameter"]["measured"] if measurement else None,
        # the baseline is measured on its own; each format against it
        "ratio_to_baseline": None if not measurement else 1.0 if verdict is None else measurement["baseline"]["ratio_total"],
        "bounds": {profile: {"batch1_ms": entry["batch1_ms"], "batch32_ms": entry["batch32_ms"]}
                   for profile, entry in ((measured or {}).get("bounds") or {}).items()},
        "metrics": metrics,
        "kl_divergence": kl,
        "verdict": "baseline" if verdict is None else verdict["verdict"],
        "reasons": [] if verdict is None else verdict["reasons"],
    }


def build(run_dir: Path) -> dict[str, Any]:
    """The report's data from a run directory's artifacts (run.json, measure/, results/, verdicts/)."""
    layout = RunDir(Path(run_dir))
    run_dir = layout.root
    run_file = layout.run_file
    if not run_file.is_file():
        raise InputError(f"{run_dir} is not a quantgate run directory (no run.json)")
    run = read_json(run_file)
    if run.get("kind") != RUN_KIND:
        raise InputError(f"{run_file} is not the record of a quantgate run")

    def manifest(directory: Path) -> dict[str, Any] | None:
        path = directory / MANIFEST
        return read_json(path) if path.is_file() else None

    verdicts = {fmt: stored_value(layout.verdict(fmt)) for fmt in run["formats"]}
    missing = [fmt for fmt, verdict in verdicts.items() if verdict is None]
    if missing:
        raise InputError(f"the run in {run_dir} has no verdict yet for {', '.join(missing)}: run it to the end first")
    columns: list[str] = []  # every metric gate, in policy order (a format that failed to quantize has none)
    for verdict in verdicts.values():
        columns += [gate for gate in verdict["metrics"] if GateId.parse(gate).on_golden_set and gate not in columns]
    baseline_results = manifest(layout.results(BASELINE))
    baseline_measured = stored_value(layout.measure(BASELINE)) or {}
    rows = [_row("baseline", baseline_measured, baseline_results, None, columns)]
    rows += [_row(fmt, stored_value(layout.measure(fmt)), manifest(layout.results(fmt)), verdicts[fmt], columns) for fmt in run["formats"]]
    calibration = manifest(layout.calibration)
    any_bounds = next(iter((baseline_measured.get("bounds") or {}).values()), None)
    plot = dict(run["plot"])
    if plot.get("y") not in columns and columns:
        plot.update(y=columns[0], higher_is_better=_higher_is_better(columns[0]))
    return {
        "model": run["plan"]["model"],
        "model_path": run["model"],
        "policy": {key: run["policy"][key] for key in ("name", "version", "sha256")},
        "hardware": [{"name": name} for name in run["hardware"]],
        "metric_columns": columns,
        "plot": plot,
        "rows": rows,
        "evalsets": [{"spec": spec, "items": entry["items"], "limit": entry["limit"], "sha256": entry["sha256"],
                      "size": _set_size(spec)} for spec, entry in (baseline_results or {}).get("sets", {}).items()],
        "calibration": None if calibration is None else {
            "samples": calibration["samples"], "seq_len": calibration["seq_len"], "fingerprint": calibration["fingerprint"],
            "source": calibration["config"]["source"]},
        "bounds_inputs": None if any_bounds is None else {"context_tokens": any_bounds["context_tokens"],
                                                          "kv_bytes_per_element": any_bounds["kv_bytes_per_element"]},
        "confidence": run.get("confidence", 0.95),
        "ledger": run.get("ledger"),
    }


def _set_size(spec: str) -> int | None:
    try:
        return evalsets.load(spec).size
    except InputError:
        return None
