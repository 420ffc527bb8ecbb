"""The size-vs-accuracy report: one row per format (and the baseline), written as
report.json (the data, schema_version 1), report.md and a self-contained report.html with an
inline SVG plot (no scripts, no network), the Pareto front drawn."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from gates.artifacts import atomic_directory

SCHEMA_VERSION = 1


def recommendation(rows: list[dict[str, Any]], profile: str) -> str | None:
    """The approved format with the lowest batch-1 decode bound on `profile`, or None."""
    approved = [row for row in rows if row["verdict"] == "approved" and profile in row.get("bounds", {})]
    if not approved:
        return None
    return min(approved, key=lambda row: row["bounds"][profile]["batch1_ms"])["format"]


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points (size, quality, label) not beaten by another that is no larger and no worse."""
    front, best = [], float("-inf")
    for size, quality, label in sorted(points, key=lambda p: (p[0], -p[1])):
        if quality > best:
            front.append((size, quality, label))
            best = quality
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
    lines += ["", "## Recommendation", ""]
    for profile, choice in report["recommendation"].items():
        lines.append(f"- {profile}: {choice or 'none (no format approved)'}")
    return "\n".join(lines) + "\n"


def svg_plot(report: dict[str, Any], width: int = 640, height: int = 400) -> str:
    metric = report["plot"]["y"]
    points = [(row["bytes"] / 1e6, row["metrics"][metric]["value"], row["format"], row["verdict"])
              for row in report["rows"] if row.get("metrics", {}).get(metric, {}).get("value") is not None]
    margin = 60
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="20" y="40">no data for {html.escape(metric)}</text></svg>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = 0.0, max(xs) * 1.1
    y_pad = (max(ys) - min(ys)) * 0.15 or abs(max(ys)) * 0.05 or 1.0
    y0, y1 = min(ys) - y_pad, max(ys) + y_pad
    sx = lambda x: margin + (x - x0) / (x1 - x0) * (width - 2 * margin)  # noqa: E731
    sy = lambda y: height - margin - (y - y0) / (y1 - y0) * (height - 2 * margin)  # noqa: E731
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
    front = pareto_front([(x, y, label) for x, y, label, _ in points])
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
