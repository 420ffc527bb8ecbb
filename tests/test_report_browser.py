"""The report's HTML in a real headless browser (Debian's chromium): the table and the plot
render, with approved and blocked formats drawn in their colours, and no network needed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gates.report import write
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import plan_mapping, sample_report

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")


def chromium(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *arguments],
                          capture_output=True, text=True, timeout=120, check=True)


def test_report_renders_its_table_and_plot_in_chromium(tmp_path: Path) -> None:
    from PIL import Image

    page = write(sample_report(), tmp_path / "report") / "report.html"
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert dom.count("<tr class=\"approved\">") == 2 and dom.count("<tr class=\"blocked\">") == 1
    assert "<svg" in dom and "polyline" in dom
    shot = tmp_path / "report.png"
    chromium(tmp_path, "--window-size=1400,900", f"--screenshot={shot}", page.as_uri())
    image = Image.open(shot).convert("RGB")
    colours = {pixel for _, pixel in image.getcolors(maxcolors=1 << 20)}
    assert (0x1A, 0x7F, 0x37) in colours  # approved points and verdicts, drawn
    assert (0xCF, 0x22, 0x2E) in colours  # the blocked format's cross


def test_a_runs_report_renders_in_chromium(quant_model: Path, tmp_path: Path) -> None:
    """The report `quantgate run` wrote for the tiny model: every row, the plot, the recommendation."""
    result = pipeline.run(from_mapping(plan_mapping(quant_model, tmp_path)), show_progress=False)
    page = result.report / "report.html"
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    verdicts = [entry["verdict"] for entry in result.verdicts.values()]
    assert dom.count('<tr class="baseline">') == 1
    assert dom.count('<tr class="approved">') == verdicts.count("approved")
    assert dom.count('<tr class="blocked">') == verdicts.count("blocked")
    assert dom.count('class="point') == 1 + len(verdicts) and 'id="size-accuracy"' in dom
    assert 'id="recommendation"' in dom and "wiki-text@v1 top1_agreement" in dom
