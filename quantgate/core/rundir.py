"""The layout of a `quantgate run` directory: every path in it, in one place, for the pipeline
that writes it and the report that reads it.

    run.json                 the resolved plan, each stage's status, the verdicts
    calibration/             the calibration set (calibration.run, reused by its own key)
    overlap.json             n-gram overlap of the calibration texts with the golden sets
    checkpoints/<format>/    the quantized checkpoints (servable as is)
    measure/<name>.json      byte accounting and decode-time bounds (baseline and formats)
    results/<name>/          evaluation results (baseline at each set's first look; formats as deep as they went)
    baselines/<format>/      the baseline's results on the items each format was judged on
    sequential/<format>.json the looks: what each look decided, the items that decided each gate
    looks/                   the results of each look (set at N items), baseline and formats
    sensitivity/             per-layer sensitivity scores (a plan with a search)
    search.json              the mixed-precision search: trials, allocations, the held-out verdict
    serve/<name>.json        the serve check: vLLM loads it, agrees with what was gated, decode tokens/s
    serve/<name>/            the serve check's request, response and vLLM's log
    verdicts/<format>.json   every gate, its numbers, the verdict and its reasons
    stages/<stage>.json      keys of the directory artifacts
    report/                  report.md, report.json, report.html
    ledger.jsonl             the approval ledger (unless the plan names another)
    ledger.jsonl.lock        held while a run appends to the ledger (beside whichever ledger the plan names)
    .lock                    held (flock) by the run using the directory; names its pid

A run killed at any point leaves every artifact whole or absent: what it was writing is a
staging sibling (`.NAME.partial-PID-*`, or a replaced `.NAME.old-PID-*`), which the next run
removes (quantgate.core.artifacts.remove_temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

RUN_KIND: Final = "quantgate-run"  # run.json's "kind"
BASELINE = "baseline"  # the name of the baseline's measure/ and results/ entries


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory; nothing here touches the disk."""

    root: Path

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    @property
    def calibration(self) -> Path:
        return self.root / "calibration"

    @property
    def overlap(self) -> Path:
        return self.root / "overlap.json"

    def checkpoint(self, fmt: str) -> Path:
        return self.root / "checkpoints" / fmt

    def measure(self, name: str) -> Path:
        """The measurement of the baseline (`BASELINE`) or of a format's checkpoint."""
        return self.root / "measure" / f"{name}.json"

    def results(self, name: str) -> Path:
        """The evaluation results of the baseline (`BASELINE`) or of a format's checkpoint."""
        return self.root / "results" / name

    def paired_baseline(self, fmt: str) -> Path:
        """The baseline's results on the sets and items the format was judged on."""
        return self.root / "baselines" / fmt

    def sequential(self, fmt: str) -> Path:
        return self.root / "sequential" / f"{fmt}.json"

    def look(self, name: str, spec: str, items: int, offset: int = 0) -> Path:
        """The results of one look: `name` (a format or BASELINE) on set `spec` at its first `items`
        items (after its first `offset`: `<spec>+<offset>@<items>`, a held-out split's look)."""
        return self.root / "looks" / name / (f"{spec}+{offset}@{items}" if offset else f"{spec}@{items}")

    def sensitivity(self) -> Path:
        """The per-layer sensitivity of the baseline, for the mixed-precision search."""
        return self.root / "sensitivity"

    @property
    def search_file(self) -> Path:
        """The search's record: its space, each trial's budget, allocation and verdict, the choice."""
        return self.root / "search.json"

    def serve(self, name: str) -> Path:
        """The serve check of the baseline (`BASELINE`) or of a checkpoint (a verdict's name)."""
        return self.root / "serve" / f"{name}.json"

    def serve_work(self, name: str) -> Path:
        """The serve check's request, vLLM's response and its log."""
        return self.root / "serve" / name

    def served_results(self, name: str, which: str) -> Path:
        """A checkpoint's golden sets evaluated as a device class serves it (`which`: its serve
        stage's settings, `served`, or the engine's default, `engine_default`)."""
        return self.root / "served-results" / f"{name}-{which}"

    def verdict(self, fmt: str) -> Path:
        return self.root / "verdicts" / f"{fmt}.json"

    @property
    def library_log(self) -> Path:
        """What other libraries printed while the run worked (llmcompressor, transformers, torch,
        vLLM's launcher): kept out of the terminal (`quantgate run --verbose` shows it there too)."""
        return self.root / "logs" / "libraries.log"

    def unit_log(self, kind: str, name: str) -> Path:
        """One unit of work's log: what the libraries printed while it worked (run on this machine),
        and, when it failed (a quantization that raised, an evaluation out of memory), its
        traceback at the end: the run went on without it."""
        return self.root / "logs" / f"{kind}-{name}.log"

    def stage_record(self, stage: str) -> Path:
        return self.root / "stages" / f"{stage}.json"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def report_json(self) -> Path:
        return self.report / "report.json"

    @property
    def report_html(self) -> Path:
        return self.report / "report.html"

    @property
    def ledger(self) -> Path:
        """The run's own ledger, used unless the plan names another."""
        return self.root / "ledger.jsonl"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    def relative(self, path: Path) -> str:
        """`path` inside the run directory, as a stage record names it."""
        return str(path.relative_to(self.root))
