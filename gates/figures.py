"""The report's figures as inline SVG: the size-vs-metric plot, a candidate's forest plot and
verdict-stability bars, the per-layer sensitivity chart. Each is drawn from its figure datum in
the `Report` (gates.report_model), which holds every decision (which gates, which side is worse,
which points are on the Pareto front); this module only lays it out in pixels and hands the
layout to an SVG template of gates/templates/figures, through the report's autoescaping Jinja
environment, so every label is escaped there."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from markupsafe import Markup

from quantgate.gates.report_model import (
    ForestFigure,
    ForestRow,
    PlotFigure,
    PlotPoint,
    SensitivityFigure,
    SensitivityPoint,
    StabilityFigure,
)
from quantgate.gates.templating import ENVIRONMENT

# The outcomes' colours (a verdict record's outcome strings), on the page as in the figures.
COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "insufficient evidence": "#bf8700", "not evaluated": "#8c959f"}
PASS_COLOUR, FAIL_COLOUR, GREY = COLOURS["pass"], COLOURS["fail"], COLOURS["not evaluated"]
TRIAL_COLOUR = "#8250df"  # the search's trials in the plot and the trials table
PLOT_COLOURS = {"approved": PASS_COLOUR, "blocked": FAIL_COLOUR, "baseline": "#57606a"}
SERIES_COLOURS = ("#0969da", "#bc4c00", TRIAL_COLOUR, "#1a7f37", "#cf222e", "#57606a")
UNQUANTIZED_COLOUR = "#d0d7de"  # a group the allocation left at 16 bits


def colour(outcome: str) -> str:
    """A gate's outcome colour (grey for one this version does not know)."""
    return COLOURS.get(outcome, GREY)


def _svg(template: str, **layout: object) -> Markup:
    """A figure's template rendered with its layout. The templates are written one element a line
    for reading; the page gets each figure on one line, as its text has no line of its own."""
    drawn = ENVIRONMENT.get_template(f"figures/{template}").render(**layout)
    return Markup(re.sub(r">\s*\n\s*<", "><", drawn.strip()))


# ---- a candidate's forest plot --------------------------------------------------------------------

@dataclass(frozen=True)
class ForestLine:
    """One gate's row of the forest plot, in pixels."""

    gate: ForestRow
    y: float
    label: str  # shortened to fit its column
    colour: str
    interval: tuple[float, float] | None  # the interval's ends, left to right
    estimate: float | None


FOREST = {"label_w": 210, "plot_w": 300, "row_h": 26, "top": 34}


def _forest_line(index: int, gate: ForestRow, centre: float, half: float) -> ForestLine:
    """The row's own scale: its farthest number from the limit reaches the plot's edge (the gates
    are in different units, so only the limit's x is shared)."""
    row_h, top = FOREST["row_h"], FOREST["top"]
    ends = [value for value in (gate.low, gate.estimate, gate.high) if value is not None]
    farthest = max((abs(value) for value in ends), default=0.0)
    scale = half / farthest if farthest else 0.0
    interval = None
    if gate.low is not None and gate.high is not None:
        left, right = sorted((centre + gate.low * scale, centre + gate.high * scale))
        interval = (left, right)
    estimate = None if gate.estimate is None else centre + gate.estimate * scale
    label = gate.label if len(gate.label) <= 32 else gate.label[:31] + "…"
    return ForestLine(gate=gate, y=top + index * row_h + row_h / 2, label=label, colour=colour(gate.outcome),
                      interval=interval, estimate=estimate)


def forest(figure: ForestFigure) -> Markup:
    """Every metric gate of a candidate as one row: the interval as a line, the estimate as a
    dot, the limit as a mark, coloured by outcome. The limit sits at the same x in every row,
    each row is stretched to its own farthest number and turned so that the worse side is to the
    right (the figure's rows hold the distances so turned); the numbers are printed beside it."""
    label_w, plot_w, row_h, top = FOREST["label_w"], FOREST["plot_w"], FOREST["row_h"], FOREST["top"]
    centre, half = label_w + plot_w / 2, plot_w / 2 - 12
    text_x = label_w + plot_w + 18
    columns = (text_x, text_x + 190, text_x + 285)  # estimate [interval], limit, outcome
    width = columns[2] + 150  # room for "insufficient evidence" in bold: 968 px, inside a 1280-px window
    height = top + max(1, len(figure.rows)) * row_h + 8
    lines = [_forest_line(index, gate, centre, half) for index, gate in enumerate(figure.rows)]
    return _svg("forest.svg.j2", name=figure.format, lines=lines, width=width, height=height, top=top, row_h=row_h,
                centre=centre, plot_w=plot_w, columns=columns, titles=("estimate [interval]", "limit", "outcome"))


# ---- a candidate's verdict stability --------------------------------------------------------------

def stability(figure: StabilityFigure) -> Markup:
    """The decided metric gates' stability as bars (0 to 1), the bar marked; a bar below it is
    red and says so."""
    label_w, plot_w, row_h, top = 210, 300, 18, 24
    width, height = label_w + plot_w + 160, top + len(figure.rows) * row_h + 6
    bars = [(top + index * row_h, bar, FAIL_COLOUR if bar.unstable else PASS_COLOUR) for index, bar in enumerate(figure.rows)]
    return _svg("stability.svg.j2", name=figure.format, bars=bars, width=width, height=height, top=top, row_h=row_h,
                label_w=label_w, plot_w=plot_w, bar=figure.bar, bar_x=label_w + plot_w * figure.bar)


# ---- size against the plot's metric ---------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    """A point of the plot, in pixels, with its label's spot."""

    point: PlotPoint
    cx: float
    cy: float
    css: str
    shape: str  # 'diamond' (a trial), 'cross' (blocked), 'dot'
    colour: str
    fill: str
    label_x: float
    label_y: float
    label_anchor: str
    ring: str | None  # 'approved' or 'blocked': the held-out verdict on this trial's checkpoint


# Where a point's label may go, tried in order until it overlaps no label placed before it:
# (dx, dy, text-anchor) from the point's centre.
_LABEL_SPOTS = ((9, -8, "start"), (9, 16, "start"), (-9, -8, "end"), (-9, 16, "end"), (9, -20, "start"), (-9, 28, "end"))


def label_spots(anchors: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Each label's (x, y, text-anchor) beside its point (cx, cy, text), the first spot that
    overlaps no label placed so far (else the first), so that close points keep readable names."""
    placed: list[tuple[float, float, float, float]] = []
    spots = []
    for cx, cy, text in anchors:
        width = 6.8 * len(text)  # about the width of a 12-px sans-serif character
        choice = None
        for dx, dy, anchor in _LABEL_SPOTS:
            left = cx + dx if anchor == "start" else cx + dx - width
            box = (left, cy + dy - 11, left + width, cy + dy + 3)
            if not any(box[0] < other[2] and other[0] < box[2] and box[1] < other[3] and other[1] < box[3] for other in placed):
                choice = (box, (cx + dx, cy + dy, anchor))
                break
        if choice is None:
            dx, dy, anchor = _LABEL_SPOTS[0]
            choice = ((cx + dx, cy + dy - 11, cx + dx + width, cy + dy + 3), (cx + dx, cy + dy, anchor))
        placed.append(choice[0])
        spots.append(choice[1])
    return spots


@dataclass(frozen=True)
class Axes:
    """Data to pixels: size across from 0, the metric up with a margin around its values."""

    width: int
    height: int
    margin: int
    x1: float
    y0: float
    y1: float

    def x(self, mb: float) -> float:
        return self.margin + mb / self.x1 * (self.width - 2 * self.margin)

    def y(self, value: float) -> float:
        return self.height - self.margin - (value - self.y0) / (self.y1 - self.y0) * (self.height - 2 * self.margin)


def _axes(points: list[PlotPoint], width: int, height: int, margin: int) -> Axes:
    values = [point.value for point in points]
    pad = (max(values) - min(values)) * 0.15 or abs(max(values)) * 0.05 or 1.0
    return Axes(width, height, margin, x1=max(point.mb for point in points) * 1.1, y0=min(values) - pad, y1=max(values) + pad)


def _front_path(figure: PlotFigure, axes: Axes) -> str | None:
    """The Pareto front as a step line: each point's value holds until the next, larger one betters it."""
    front = figure.front
    if len(front) < 2:
        return None
    corners = [(front[0].mb, front[0].value)]
    for previous, point in zip(front, front[1:], strict=False):
        corners += [(point.mb, previous.value), (point.mb, point.value)]
    return " ".join(f"{axes.x(x):.1f},{axes.y(y):.1f}" for x, y in corners)


def _marker(point: PlotPoint) -> tuple[str, str, str]:
    """(shape, stroke colour, fill): a purple diamond for a trial (filled: passed the search split;
    hollow: blocked on it), a red cross for a blocked format, a dot (green approved, the baseline grey)."""
    if point.trial:
        return "diamond", TRIAL_COLOUR, TRIAL_COLOUR if point.verdict == "approved" else "#ffffff"
    colour = PLOT_COLOURS.get(point.verdict, "#57606a")
    return ("cross" if point.verdict == "blocked" else "dot"), colour, colour


def _markers(figure: PlotFigure, axes: Axes) -> list[Marker]:
    spots = label_spots([(axes.x(point.mb), axes.y(point.value), point.label) for point in figure.points])
    markers = []
    for point, (label_x, label_y, anchor) in zip(figure.points, spots, strict=True):
        ring = None
        if figure.held_out is not None and point.label == figure.held_out.checkpoint:
            ring = "approved" if figure.held_out.approved else "blocked"
        cx, cy = axes.x(point.mb), axes.y(point.value)
        shape, colour, fill = _marker(point)
        css = f"point {'trial ' if point.trial else ''}{point.verdict}{' front' if point.front else ''}"
        markers.append(Marker(point=point, cx=cx, cy=cy, css=css, shape=shape, colour=colour, fill=fill, label_x=label_x,
                              label_y=label_y, label_anchor=anchor, ring=ring))
    return markers


def plot(figure: PlotFigure, width: int = 640, height: int = 400) -> Markup:
    """Size against the plot's metric: each format, the baseline and each search trial (a green
    dot approved, the baseline grey, a red cross blocked, a purple diamond a trial: filled, passed
    the search split; hollow, blocked on it), the Pareto front as a step line, the checkpoint the
    search's held-out gate approved ringed in green (blocked: a dashed red ring)."""
    margin = 60
    if not figure.points:
        return _svg("plot.svg.j2", figure=figure, width=width, height=height, axes=None)
    axes = _axes(figure.points, width, height, margin)
    digits = 0 if axes.x1 >= 10 else 1 if axes.x1 >= 1 else 2
    steps = [(axes.x1 * step / 4, axes.y0 + (axes.y1 - axes.y0) * step / 4) for step in range(5)]
    ticks = [(axes.x(x), f"{x:.{digits}f}", axes.y(y), f"{y:.3f}") for x, y in steps]
    held_out = None if figure.held_out is None else "approved" if figure.held_out.approved else "blocked"
    return _svg("plot.svg.j2", figure=figure, width=width, height=height, axes=axes, margin=margin, ticks=ticks,
                front=_front_path(figure, axes), markers=_markers(figure, axes), legend=PLOT_COLOURS, trial_colour=TRIAL_COLOUR, pass_colour=PASS_COLOUR, fail_colour=FAIL_COLOUR, held_out=held_out)


# ---- the per-layer sensitivity chart ---------------------------------------------------------------

def decades(scores: list[float]) -> tuple[int, int]:
    """The log10 range of the positive scores, whole decades (at least one)."""
    positive = [score for score in scores if math.isfinite(score) and score > 0]
    if not positive:
        return -1, 0
    low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    return low, max(high, low + 1)


def block_runs(groups: list[SensitivityPoint]) -> list[tuple[int, int, int | None]]:
    """(first group index, last group index, block) for each run of groups of one block."""
    runs: list[tuple[int, int, int | None]] = []
    for index, group in enumerate(groups):
        if runs and runs[-1][2] == group.block:
            runs[-1] = (runs[-1][0], index, runs[-1][2])
        else:
            runs.append((index, index, group.block))
    return runs


@dataclass(frozen=True)
class SensitivityGrid:
    """Layer groups across in model order, scores up on a log scale of whole decades."""

    left: int
    top: int
    plot_w: int
    plot_h: int
    count: int
    low: int
    high: int

    def x(self, index: int) -> float:
        return self.left + (index + 0.5) * self.plot_w / self.count

    def y(self, score: float) -> float:
        level = math.log10(score) if math.isfinite(score) and score > 0 else self.low  # zero: on the floor
        return self.top + self.plot_h - (min(max(level, self.low), self.high) - self.low) / (self.high - self.low) * self.plot_h

    def decade_y(self, decade: int) -> float:
        return self.top + self.plot_h - (decade - self.low) / (self.high - self.low) * self.plot_h


@dataclass(frozen=True)
class BlockTick:
    """A decoder block under the axis: the rule before its first group, its label at its middle."""

    x: float
    centre: float
    label: str
    rule: bool  # not before the first block
    labelled: bool  # at most about 24 labels


@dataclass(frozen=True)
class Score:
    x: float
    y: float
    fill: str  # hollow for a zero score, on the floor
    title: str

    @property
    def xy(self) -> str:
        return f"{self.x:.1f},{self.y:.1f}"


@dataclass(frozen=True)
class Series:
    format: str
    colour: str
    legend: str
    points: list[Score]


@dataclass(frozen=True)
class StripCell:
    x: float
    fill: str
    title: str


def _series(figure: SensitivityFigure, grid: SensitivityGrid) -> list[Series]:
    series = []
    for index, entry in enumerate(figure.series):
        colour = SERIES_COLOURS[index % len(SERIES_COLOURS)]
        points = []
        for position, group in enumerate(figure.groups):
            score = group.scores[entry.format]
            points.append(Score(grid.x(position), grid.y(score), colour if score > 0 else "#ffffff",
                                f"{group.name}, {entry.format}: {score:.3g}"))
        series.append(Series(entry.format, colour, entry.label, points))
    return series


def _blocks(figure: SensitivityFigure, grid: SensitivityGrid) -> list[BlockTick]:
    runs = block_runs(figure.groups)
    every = max(1, math.ceil(len(runs) / 24))  # at most about 24 block labels
    return [BlockTick(grid.left + first * grid.plot_w / grid.count, (grid.x(first) + grid.x(last)) / 2,
                      "–" if block is None else str(block), first > 0, position % every == 0)
            for position, (first, last, block) in enumerate(runs)]


def _strip(figure: SensitivityFigure, grid: SensitivityGrid, series: list[Series]) -> list[StripCell]:
    """The format the chosen trial gave each group, in that format's colour (grey: left at 16 bits)."""
    if figure.allocation is None:
        return []
    colours = {line.format: line.colour for line in series}
    cells = []
    for index, group in enumerate(figure.groups):
        fmt = figure.allocation.choice.get(group.name)
        cells.append(StripCell(grid.left + index * grid.plot_w / grid.count, colours.get(fmt or "", UNQUANTIZED_COLOUR),
                               f"{group.name}: {fmt or 'not searched'}"))
    return cells


def sensitivity(figure: SensitivityFigure, width: int = 960, height: int = 360) -> Markup:
    """Each layer group's score per format (`<g class="series">` per format, one point per group),
    groups across in model order under their decoder block's index, scores up on a log scale; a
    strip under the axis shows which format the chosen trial gave each group."""
    left, right, top = 78, 16, 44
    bottom = 52 + (26 if figure.allocation else 0)
    low, high = decades([score for group in figure.groups for score in group.scores.values()])
    grid = SensitivityGrid(left=left, top=top, plot_w=width - left - right, plot_h=height - top - bottom,
                           count=max(1, len(figure.groups)), low=low, high=high)
    series = _series(figure, grid)
    return _svg("sensitivity.svg.j2", figure=figure, width=width, height=height, grid=grid,
                decades=range(low, high + 1, 1 if high - low <= 8 else 2), blocks=_blocks(figure, grid), series=series,
                strip=_strip(figure, grid, series), strip_y=top + grid.plot_h + 24,
                cell_width=max(grid.plot_w / grid.count - 1, 0.5))
