"""The report's one Jinja environment. Its templates are package data (gates/templates): the
HTML page and the SVG figures autoescape every value they print, so a format, policy or reason
holding `<`, `&` or `"` is text on the page, never markup; report.md is plain text, whose only
escaping is a table cell's pipes and line breaks (the `cell` filter)."""

from __future__ import annotations

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape


def markdown_cell(text: object) -> str:
    """A Markdown table cell: a pipe escaped, a line break a space, so the row keeps its columns."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def one_decimal(value: float) -> str:
    """A coordinate in an SVG figure: one decimal is a tenth of a pixel."""
    return f"{value:.1f}"


ENVIRONMENT = Environment(
    loader=PackageLoader("quantgate.gates", "templates"),
    # on for HTML and SVG (and anything else), off for Markdown only
    autoescape=select_autoescape(enabled_extensions=("html.j2", "svg.j2"), disabled_extensions=("md.j2",), default=True),
    undefined=StrictUndefined,  # a name the context lacks is an error, not an empty string on the page
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)
ENVIRONMENT.filters["cell"] = markdown_cell
ENVIRONMENT.filters["f1"] = one_decimal
