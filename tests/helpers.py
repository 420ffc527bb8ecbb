"""Helpers that more than one test module uses: how a refusal looks, small input writers, the
tiny run plan and policy, a sample report, a header-only safetensors writer. Test modules import
from here (and tests.factories for models), never from each other."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

import pytest

from evalsets.config import Kind
from quantgate.core.headers import DTYPE_BITS


class CliOutcome(Protocol):
    code: int
    out: str
    err: str


def assert_refused(result: CliOutcome, fragment: str, out: Path) -> None:
    """A refused command: exit code 2, one error line naming the problem, nothing left at `out`
    (not even a temporary sibling)."""
    assert result.code == 2, (result.code, result.err)
    lines = [line for line in result.err.splitlines() if line.startswith("quantgate: error:")]
    assert len(lines) == 1, result.err
    assert fragment in lines[0], lines[0]
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    assert leftovers == []


# --- golden-set input ---------------------------------------------------------------------------

# Two records of each kind a user may add, in the JSONL shape `evalsets add` reads.
USER_ITEMS: dict[Kind, list[dict[str, Any]]] = {
    Kind.multiple_choice: [
        {"query": "Question: 2 + 2 =\nAnswer:", "choices": ["4", "5", "22"], "gold": 0},
        {"id": "sky", "query": "The sky is", "choices": ["blue", "green"], "gold": 0, "meta": {"topic": "colour"}},
    ],
    Kind.text: [{"text": "A paragraph the model should find likely."}, {"text": "Another one, quite short."}],
    Kind.last_word: [{"context": "The cat sat on the", "target": " mat"}, {"context": "One, two,", "target": " three"}],
    Kind.generation: [{"prompt": "Q: capital of France?\nA:", "reference": "Paris"}, {"prompt": "Q: 1+1?\nA:", "reference": "2"}],
}


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


# --- the tiny run ---------------------------------------------------------------------------------

# KL and top-1 discriminate on a random tiny model; accuracy is near zero for every candidate,
# so the lambada gate checks the paired difference machinery (identical answers: +0.00).
TINY_POLICY = """\
name: tiny
version: v1
metrics:
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.01, 4bit: 0.05}, undecided_margin: 0.01}
    top1_agreement: {min_value: {8bit: 0.90, 4bit: 0.80}, undecided_margin: 0.05}
  lambada:
    acc: {max_drop_points: {8bit: 5.0, 4bit: 10.0}, undecided_margin_points: 50.0}
"""
TINY_FORMATS = ["fp8-e4m3", "gptq-int4"]


def write_policy(path: Path, text: str = TINY_POLICY) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def plan_mapping(model: Path, root: Path, **changes: Any) -> dict[str, Any]:
    """A run plan for the tiny model (TINY_FORMATS, TINY_POLICY written into `root`), as a mapping."""
    mapping: dict[str, Any] = {
        "model": str(model), "formats": TINY_FORMATS,
        "calibration": {"samples": 8, "seq_len": 64},
        "evaluation": {"sets": ["wiki-text", "lambada"], "limit": 4},
        "policy": str(write_policy(root / "policy.yaml")), "hardware": ["reference", "h200"],
        "out": str(root / "run"),
    }
    mapping.update(changes)
    return mapping


# --- measure --------------------------------------------------------------------------------------


def assert_every_byte_accounted(data: dict[str, Any]) -> None:
    """Categories plus header bytes are the files' sizes; the explanation lines are the gap."""
    files = sum(file["bytes"] for file in data["files"])
    assert sum(value["bytes"] for value in data["categories"].values()) + data["totals"]["header_bytes"] == files
    assert data["totals"]["file_bytes"] == files
    blocks = sum(block["total_bytes"] for block in data["blocks"]) + data["outside_blocks"]["total_bytes"]
    assert blocks + data["totals"]["header_bytes"] == files
    explanation = data["explanation"]
    assert explanation["unexplained_bytes"] == 0
    assert all(line["cause"] != "unexplained" for line in explanation["lines"])
    assert sum(line["bytes"] for line in explanation["lines"]) == pytest.approx(explanation["gap_bytes"], abs=1e-6)
    assert explanation["expected_bytes"] + explanation["gap_bytes"] == pytest.approx(files, abs=1e-6)


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None) -> int:
    """Write a valid safetensors file whose data section is a hole: the header, then the file
    extended to its full size without writing data (sparse where the filesystem allows).
    For tests and benchmarks of header-only tools; returns the file's size in bytes."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * DTYPE_BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment with spaces
    with open(path, "wb") as stream:
        stream.write(len(raw).to_bytes(8, "little"))
        stream.write(raw)
        stream.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


# --- the report -----------------------------------------------------------------------------------


def sample_report() -> dict[str, Any]:
    """A report document of four formats and a baseline, in the shape gates.report.write takes."""
    def row(name: str, size: int, acc: float, verdict: str, b1: float, reasons: tuple[str, ...] = ()) -> dict[str, Any]:
        return {"format": name, "bytes": size, "bits_per_weight_layers": None if name == "baseline" else 4.2,
                "bits_per_parameter": 16.0 * size / 270e6, "ratio_to_baseline": size / 270e6,
                "bounds": {"reference": {"batch1_ms": b1, "batch32_ms": b1 * 1.5}, "h200": {"batch1_ms": b1 / 1.6, "batch32_ms": b1}},
                "metrics": {"arc-easy@v1 acc": {"value": acc, "difference": None if name == "baseline" else (acc - 0.60) * 100,
                                                 "low": -1.0, "high": 1.0, "unit": "points"}},
                "kl_divergence": None if name == "baseline" else 0.01, "verdict": verdict, "reasons": list(reasons)}
    return {"model": "tiny", "policy": {"name": "default", "version": "v1", "sha256": "ab" * 32},
            "hardware": [{"name": "reference"}, {"name": "h200"}], "metric_columns": ["arc-easy@v1 acc"],
            "plot": {"x": "bytes", "y": "arc-easy@v1 acc"},
            "rows": [row("baseline", 270_000_000, 0.60, "baseline", 0.09),
                     row("fp8-e4m3", 166_000_000, 0.598, "approved", 0.055),
                     row("gptq-int4", 112_000_000, 0.50, "blocked", 0.037, ("arc-easy acc -10.00 points [-14, -6] exceeds -3.00 points",)),
                     row("smoothquant-w8a8", 166_000_000, 0.595, "approved", 0.054)]}
