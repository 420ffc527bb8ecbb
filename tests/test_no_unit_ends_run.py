"""No unit ends the run, the search and the stage before it included (issue 35): a failing
calibration, a searched format whose quantization failed, a failing sensitivity stage, a search
trial whose quantization raises, and the baseline (the one unit every verdict needs) each become
that unit's typed record in run.json (failed_units), the report shows it, run.json is written
to the end, and the run exits 5 (UNIT_FAILED). A quantization child killed with SIGKILL is its
unit's record naming the signal and the child's peak memory, and the next format gets its verdict.

The search cases run one after another in one run directory (each later run reuses what the
earlier ones made), so that the suite pays for the tiny model's quantizations once."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from quantgate import calibration, quantize
from quantgate.core.artifacts import read_json
from quantgate.core.errors import InputError
from quantgate.core.exitcodes import Exit
from quantgate.gates.run_record import BASELINE_FAILED, FINISHED
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline import units
from quantgate.pipeline.plan import from_mapping
from quantgate.quantize import sensitivity
from tests.helpers import plan_mapping
from tests.test_pipeline_search import search_plan


@dataclass(frozen=True)
class Failed:
    """One run with a unit made to fail: its result, run.json and the report's JSON and Markdown."""

    result: pipeline.RunResult
    run: dict[str, Any]
    report: dict[str, Any]
    markdown: str


def _run(mapping: dict[str, Any], out: Path) -> Failed:
    result = pipeline.run(from_mapping(mapping), show_progress=False)
    return Failed(result, read_json(out / "run.json"), read_json(out / "report" / "report.json"),
                  (out / "report" / "report.md").read_text(encoding="utf-8"))


def _raises(message: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)
    return fail


@pytest.fixture(scope="module")
def search_failures(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Failed]:
    """The tiny search plan run four times in one directory, each time with another unit failing:
    the calibration set, gptq-int4's quantization, the sensitivity, the first trial's quantization."""
    root = tmp_path_factory.mktemp("search-failures")
    out, mapping = root / "run", search_plan(quant_model, root)
    runs: dict[str, Failed] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("search-failures-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        with patch.context() as failing:
            failing.setattr(calibration, "run", _raises("no text could be sampled"))
            runs["calibration"] = _run(mapping, out)
        real_quantize = quantize.run
        with patch.context() as failing:
            def quantize_or_raise(cfg: Any, *args: Any, **kwargs: Any) -> Any:
                if cfg.format == "gptq-int4":
                    raise RuntimeError("gptq ran out of luck")
                return real_quantize(cfg, *args, **kwargs)
            failing.setattr(quantize, "run", quantize_or_raise)
            runs["searched format"] = _run(mapping, out)
        with patch.context() as failing:
            failing.setattr(sensitivity, "run", _raises("fisher went negative"))
            runs["sensitivity"] = _run(mapping, out)
        with patch.context() as failing:
            # bad input only the unit finds (a mixed config llmcompressor refuses), found after the formats' verdicts:
            # it stops the search, not the run (before, it ended the run with exit 2 and no report)
            def refused(*args: Any, **kwargs: Any) -> Any:
                raise InputError("the mixed recipe would not trace")
            failing.setattr(quantize, "run_mixed", refused)
            runs["trial"] = _run(mapping, out)
    return runs


def _finished_with_report(failed: Failed, unit: str, fragment: str) -> None:
    """What every failed-unit run shares: exit 5, run.json finished with the unit typed in
    failed_units, the report (JSON and Markdown) naming it."""
    assert failed.result.exit_code == Exit.UNIT_FAILED
    assert failed.run["status"] == FINISHED and failed.run["seconds"] is not None
    (recorded,) = [entry for entry in failed.run["failed_units"] if entry["unit"] == unit]
    assert fragment in recorded["reason"] and Path(recorded["log"]).is_file() and "Traceback" in Path(recorded["log"]).read_text()
    assert any(entry["unit"] == unit and fragment in entry["reason"] for entry in failed.report["failed_units"])
    assert "## Failed units" in failed.markdown and fragment in failed.markdown


def test_a_failing_calibration_blocks_every_format_with_its_reason_and_the_run_writes_its_report(search_failures) -> None:
    failed = search_failures["calibration"]
    _finished_with_report(failed, "calibration", "no text could be sampled")
    for fmt in ("gptq-int4", "smoothquant-w8a8"):
        verdict = failed.result.verdicts[fmt]
        assert verdict.verdict == "blocked" and "the calibration set failed" in verdict.reasons[0]
    assert set(failed.result.verdicts) == {"gptq-int4", "smoothquant-w8a8"}  # no trial: the search did not start
    assert failed.report["search"]["conclusion"].startswith("no verdict of the search: the calibration set failed")


def test_a_searched_format_whose_quantization_failed_stops_the_search_with_its_reason(search_failures) -> None:
    failed = search_failures["searched format"]
    _finished_with_report(failed, "quantize gptq-int4", "gptq ran out of luck")
    assert failed.result.verdicts["smoothquant-w8a8"].checkpoint is not None  # the other format was judged
    conclusion = failed.report["search"]["conclusion"]
    assert conclusion.startswith("no verdict of the search: it mixes gptq-int4, which this run did not measure")
    assert "gptq ran out of luck" in conclusion and not any(name.startswith("search-") for name in failed.result.verdicts)


def test_a_failing_sensitivity_stage_ends_the_search_with_a_conclusion_not_a_crash(search_failures) -> None:
    failed = search_failures["sensitivity"]
    _finished_with_report(failed, "sensitivity", "fisher went negative")
    assert {fmt: verdict.checkpoint is not None for fmt, verdict in failed.result.verdicts.items()} == \
        {"gptq-int4": True, "smoothquant-w8a8": True}
    assert failed.report["search"]["conclusion"].startswith("no verdict of the search: the sensitivity stage failed")
    assert failed.report["search"]["chosen"] is None


def test_a_search_trial_whose_quantization_raises_ends_the_search_saying_why(search_failures) -> None:
    failed = search_failures["trial"]
    _finished_with_report(failed, "quantize search-1", "the mixed recipe would not trace")
    assert [entry["kind"] for entry in failed.run["failed_units"]] == ["quantize"]
    assert failed.report["search"]["conclusion"].startswith("no verdict of the search: search-1's quantization failed")
    # the uniform formats keep their verdicts; the failed trial has none (no verdict to bisect on)
    assert set(failed.result.verdicts) == {"gptq-int4", "smoothquant-w8a8"}
    assert "search-1's quantization failed" in failed.markdown


def test_a_failed_baseline_leaves_no_verdict_and_says_so_in_run_json_and_the_report(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(units, "evaluate_baseline", _raises("the baseline's logits are all NaN"))
    out = tmp_path / "run"
    failed = _run(plan_mapping(quant_model, tmp_path, formats=["fp8-e4m3"]), out)
    assert failed.result.exit_code == Exit.UNIT_FAILED and failed.result.verdicts == {}
    assert failed.run["status"] == BASELINE_FAILED and failed.run["verdicts"] == {}
    assert [entry["unit"] for entry in failed.run["failed_units"]] == ["evaluate baseline"]
    assert failed.report["no_verdict"].startswith("no format was judged") and "all NaN" in failed.report["no_verdict"]
    assert "**No verdict.**" in failed.markdown
    assert not (out / "checkpoints" / "fp8-e4m3").exists()  # nothing quantized for a verdict that cannot be reached


def test_a_quantize_child_killed_by_sigkill_names_the_signal_and_its_peak_memory_and_the_next_format_is_judged(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_quantize = quantize.run

    def killed(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if cfg.format == "gptq-int4":
            ballast = bytearray(256 * 2**20)  # touched: 256 MiB resident in the child before it dies
            ballast[:: 4096] = b"\x01" * len(ballast[:: 4096])
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer sends
        return real_quantize(cfg, *args, **kwargs)

    monkeypatch.setattr(quantize, "run", killed)
    out = tmp_path / "run"
    failed = _run(plan_mapping(quant_model, tmp_path, formats=["gptq-int4", "fp8-e4m3"]), out)  # the killed one first
    assert failed.result.exit_code == Exit.UNIT_FAILED
    (unit,) = failed.run["failed_units"]
    assert unit["unit"] == "quantize gptq-int4" and unit["signal"] == "SIGKILL"
    assert unit["peak_memory_bytes"] >= 256 * 2**20 and "killed by SIGKILL" in unit["reason"]
    assert failed.result.verdicts["gptq-int4"].verdict == "blocked"
    assert failed.result.verdicts["fp8-e4m3"].checkpoint is not None  # the next format ran, and was judged
    assert "SIGKILL" in failed.markdown and failed.run["status"] == FINISHED
