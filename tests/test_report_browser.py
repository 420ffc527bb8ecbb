"""The report's HTML in a real headless browser (Debian's chromium): the table, the plot and each
candidate's forest plot render, approved and blocked formats drawn in their colours, the page
fits a 1280-pixel window, and no network is needed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from quantgate.gates.report import write
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import plan_mapping, sample

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it)")

# The report has no scripts (test_report checks that); to read its layout, a test-only copy gets
# this one, which writes what the browser laid out into the DOM that --dump-dom prints.
LAYOUT_PROBE = """<pre id="layout"></pre><script>
window.addEventListener("load", () => {
  const candidates = [...document.querySelectorAll("section.candidate")].map((section) => {
    const forest = section.querySelector("svg.forest");
    const box = forest ? forest.getBoundingClientRect() : null;
    return {id: section.id, forest: box && {left: box.left + window.scrollX, right: box.right + window.scrollX,
                                            width: box.width, height: box.height}};
  });
  const widest = Math.max(...[...document.body.querySelectorAll("*")].map((e) => e.getBoundingClientRect().right + window.scrollX));
  document.getElementById("layout").textContent = JSON.stringify({
    scrollWidth: document.documentElement.scrollWidth, clientWidth: document.documentElement.clientWidth,
    scrollHeight: document.documentElement.scrollHeight,
    widest: widest, candidates: candidates});
});
</script>"""


def chromium(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *arguments],
                          capture_output=True, text=True, timeout=120, check=True)


def layout(tmp_path: Path, page: Path, width: int) -> dict[str, Any]:
    """What chromium laid out for `page` in a window `width` pixels wide."""
    probe = tmp_path / "layout-probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", LAYOUT_PROBE + "</body>"), encoding="utf-8")
    dom = chromium(tmp_path, "--dump-dom", f"--window-size={width},900", "--virtual-time-budget=5000", probe.as_uri()).stdout
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.DOTALL)
    assert found is not None and found[1], dom[-2000:]
    return json.loads(found[1].replace("&quot;", '"').replace("&amp;", "&"))


def test_report_renders_its_table_and_plot_in_chromium(tmp_path: Path) -> None:
    from PIL import Image

    page = write(sample(), tmp_path / "report") / "report.html"
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert dom.count("<tr class=\"approved\">") == 2 and dom.count("<tr class=\"blocked\">") == 2
    assert dom.count("<tr class=\"baseline\">") == 1
    assert "<svg" in dom and "polyline" in dom and dom.count('class="forest"') == 4
    shot = tmp_path / "report.png"  # the whole page, as docs/report.png shows it
    chromium(tmp_path, f"--window-size=1280,{layout(tmp_path, page, 1280)['scrollHeight']}", f"--screenshot={shot}", page.as_uri())
    image = Image.open(shot).convert("RGB")
    colours = {pixel for _, pixel in image.getcolors(maxcolors=1 << 20)}
    assert (0x1A, 0x7F, 0x37) in colours  # approved points and verdicts, passed gates, drawn
    assert (0xCF, 0x22, 0x2E) in colours  # the blocked formats' crosses and failed gates
    assert (0xBF, 0x87, 0x00) in colours  # the gate with insufficient evidence


def test_report_fits_a_1280_pixel_window_with_every_forest_plot(tmp_path: Path) -> None:
    page = write(sample(), tmp_path / "report") / "report.html"
    seen = layout(tmp_path, page, 1280)
    assert seen["clientWidth"] == 1280, seen  # the window size took
    assert seen["scrollWidth"] <= 1280 and seen["widest"] <= 1280, seen  # no horizontal scrolling
    assert [entry["id"] for entry in seen["candidates"]] == [
        "candidate-fp8-e4m3", "candidate-gptq-int4", "candidate-awq-int4", "candidate-smoothquant-w8a8"]
    for entry in seen["candidates"]:
        forest = entry["forest"]
        assert forest is not None, entry
        assert forest["left"] >= 0 and forest["right"] <= 1280 and forest["width"] > 600 and forest["height"] > 100, entry


def test_a_search_report_fits_a_1280_pixel_window_with_its_charts(tmp_path: Path) -> None:
    """A report with a mixed-precision search: the trials' and the held-out gate's rows, the plot
    with its diamonds and ring, the trials table and the sensitivity chart, inside 1280 pixels."""
    page = write(sample(search="approved"), tmp_path / "report") / "report.html"
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert dom.count('<tr class="trial passed">') == 2 and dom.count('<tr class="held-out approved">') == 1
    assert dom.count('class="point trial') == 3 and 'class="held-out-approved"' in dom
    assert dom.count('<g class="series"') == 2 and 'id="search-trials"' in dom
    seen = layout(tmp_path, page, 1280)
    assert seen["scrollWidth"] <= 1280 and seen["widest"] <= 1280, seen
    assert len(seen["candidates"]) == 8 and all(entry["forest"]["right"] <= 1280 for entry in seen["candidates"]), seen


def test_a_runs_report_renders_in_chromium(quant_model: Path, tmp_path: Path) -> None:
    """The report `quantgate run` wrote for the tiny model: every row, the plot, the recommendation,
    each candidate's section with its forest plot, inside a 1280-pixel window."""
    result = pipeline.run(from_mapping(plan_mapping(quant_model, tmp_path)), show_progress=False)
    page = result.report / "report.html"
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    verdicts = [entry.verdict for entry in result.verdicts.values()]
    assert dom.count('<tr class="baseline">') == 1
    assert dom.count('<tr class="approved">') == verdicts.count("approved")
    assert dom.count('<tr class="blocked">') == verdicts.count("blocked")
    assert dom.count('class="point') == 1 + len(verdicts) and 'id="size-accuracy"' in dom
    assert 'id="recommendation"' in dom and "wiki-text@v1 top1_agreement" in dom
    for fmt in result.verdicts:
        assert f'<section class="candidate" id="candidate-{fmt}">' in dom
    seen = layout(tmp_path, page, 1280)
    assert seen["scrollWidth"] <= 1280 and len(seen["candidates"]) == len(verdicts)
    assert all(entry["forest"] and entry["forest"]["right"] <= 1280 for entry in seen["candidates"]), seen
