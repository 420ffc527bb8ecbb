"""Helpers that more than one test module uses: how a refusal looks, small input writers, the
tiny run plan and policy, a sample report, a header-only safetensors writer. Test modules import
from here (and tests.factories for models), never from each other."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any, Protocol

import pytest

from quantgate.core.artifacts import MANIFEST, Stopwatch, file_hashes, provenance
from quantgate.core.headers import DTYPE_BITS
from quantgate.core.records import Provenance
from quantgate.evalsets.config import EvaluateConfig, Kind
from quantgate.evalsets.results import ModelIdentity, ResultsManifest, SetResults
from quantgate.gates.report import compose
from quantgate.gates.report_model import Report, RunRecords
from quantgate.quantize.measure.record import MeasurementRecord


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
    acc: {max_drop_points: {8bit: 5.0, 4bit: 10.0}, undecided_margin: 50.0}
"""
TINY_FORMATS = ["fp8-e4m3", "gptq-int4"]
# A policy's serving section (the margins of small-model@v4's serving gate), for tests that serve.
SERVING_RULES = """
serving:
  require_loads: true
  max_baseline_mean_logprob_difference: 0.1
  mean_logprob_difference_margin: {weight_only: 0.05, quantized_activations: 0.25}
  p99_logprob_difference_margin: {weight_only: 0.3, quantized_activations: 1.5}
  nll_increase_margin: 0.02
"""
# quality bounds no tiny random model misses: serving alone decides approved or pending
LENIENT_POLICY = """\
name: lenient
version: v1
metrics:
  wiki-text:
    kl_divergence: {max_value: {8bit: 50.0, 4bit: 50.0}, undecided_margin: 0.01}
  lambada:
    acc: {max_drop_points: {8bit: 100.0, 4bit: 100.0}, undecided_margin: 1.0}
"""


def write_policy(path: Path, text: str = TINY_POLICY) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def plan_mapping(model: Path, root: Path, **changes: Any) -> dict[str, Any]:
    """A run plan for the tiny model (TINY_FORMATS, TINY_POLICY written into `root`), as a mapping."""
    mapping: dict[str, Any] = {
        "model": str(model), "formats": TINY_FORMATS,
        "calibration": {"samples": 8, "seq_len": 64},
        "evaluation": {"sets": ["wiki-text", "lambada"], "items": 4},
        "policy": str(write_policy(root / "policy.yaml")), "hardware": ["reference", "h200"],
        "out": str(root / "run"),
    }
    mapping.update(changes)
    return mapping


def vllm_cpu_serves_int4() -> bool:
    """Whether vLLM's CPU build serves INT4 weight-only checkpoints here: on x86 it loads its
    AVX-512 kernels only where torch finds AVX-512 (vLLM 0.32.0 `platforms/cpu.py`,
    `import_kernels`), and its AVX2 library has no `cpu_gemm_wna16` (nor a static FP8 quant op):
    on an AVX2-only CPU gptq-int4 and fp8-e4m3 are not served, smoothquant-w8a8 is (measured)."""
    import torch

    return platform.machine() not in ("x86_64", "AMD64") or bool(torch.cpu._is_avx512_supported())


# The format the vLLM tests serve: the weight-only INT4 one where this CPU's vLLM serves it.
SERVED_FORMAT = "gptq-int4" if vllm_cpu_serves_int4() else "smoothquant-w8a8"


# --- evaluation results ---------------------------------------------------------------------------


def write_results_manifest(path: Path, items: dict[str, int], kind: Kind = Kind.multiple_choice) -> Path:
    """The manifest of a results directory whose sets (spec -> items evaluated, each in its own
    directory, of `kind`) a test wrote itself: every file under `path` hashed, made-up identities."""
    zeros = "0" * 64
    sets = {spec: SetResults(dir=spec, kind=kind, sha256=zeros, primary="acc", metrics={}, items=count, limit=None, offset=0,
                             cache_key=zeros, from_cache=False, seconds=0.0) for spec, count in items.items()}
    ResultsManifest(
        model=ModelIdentity(path=str(path), weights_sha256=zeros, config_sha256=zeros, tokenizer_sha256=zeros, storage_dtype="BF16"),
        baseline=None, config=EvaluateConfig(evalsets=tuple(items)), sets=sets, model_load_seconds=None, files=file_hashes(path),
        provenance=Provenance.model_validate(provenance(Stopwatch())),
    ).write(path / MANIFEST)
    return path


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


def measurement_record(layers: dict[str, tuple[int, bool]] | None = None, *, tensor_bytes: int = 0, measured: float | None = None,
                       exact: float | None = None, lines: list[dict[str, Any]] | None = None) -> MeasurementRecord:
    """A measurement record with only what a test sets: linear layers (name -> (bytes, quantized)),
    the tensor bytes, the quantized layers' measured and exact bits per weight, the explanation's
    lines ({cause, bytes, detail}); everything else empty or zero."""
    empty_block = {"index": None, "bytes": {}, "total_bytes": 0, "parameters": 0}
    layer_fields = {"block": None, "layout": "unquantized", "bits": None, "group_size": None, "symmetric": None, "strategy": None,
                    "in_features": 0, "out_features": 0, "parameters": 0, "bytes_by_role": {}, "bits_per_weight": 0.0,
                    "exact_bits_per_weight": None, "nominal_bits_per_weight": None, "gaps": [], "notes": []}
    value = {
        "kind": "measurement", "schema_version": 1, "checkpoint": "ckpt", "index": None, "files": [],
        "format": {"family": "dense", "layout": "bf16", "name": "unquantized BF16", "detected_from": "a test", "quant_method": None,
                   "weights": None, "activations": None, "tie_word_embeddings": None, "config_dtype": None},
        "totals": {"file_bytes": tensor_bytes, "header_bytes": 0, "tensor_bytes": tensor_bytes, "parameters": 0, "bits_per_parameter": None},
        "categories": {}, "blocks": [], "outside_blocks": empty_block,
        "linear_layers": [{"name": name, "bytes": size, "quantized": quantized, **layer_fields}
                          for name, (size, quantized) in (layers or {}).items()],
        "quantized_linear": {"layers": 0, "parameters": 0, "bytes": 0, "by_scheme": {},
                             "bits_per_weight": {"measured": measured, "exact": exact, "format_at_g128": None, "rule": None,
                                                 "unweighted_mean": None}},
        "whole_model": {"bits_per_parameter": {"measured": None, "exact": None, "rule": 16}},
        "rule": {"bits_per_weight": 16, "group_size": 128, "source": "a test"},
        "baseline_dtype": {"dtype": "BF16", "source": "a test"},
        "explanation": {"expected_bytes": 0, "measured_bytes": tensor_bytes, "gap_bytes": 0, "unexplained_bytes": 0,
                        "lines": [{"bits_per_parameter": None, **line} for line in lines or []]},
        "baseline": None, "notes": [], "wall_seconds": 0.0,
    }
    return MeasurementRecord.from_json(value, "a test's measurement")


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


def sample(search: str | None = None) -> Report:
    """The report (gates.report.compose) of `sample_report`'s records."""
    return composed(sample_report(search))


def composed(records: dict[str, Any]) -> Report:
    """The report of records in `sample_report`'s shape, validated as strictly as report.json is
    read (an unknown field is an error), so that a sample cannot drift from the model."""
    return compose(RunRecords.model_validate(records))


def sample_records(search: str | None = None) -> RunRecords:
    return RunRecords.model_validate(sample_report(search))


def sample_report(search: str | None = None) -> dict[str, Any]:
    """A run's records of four formats and a baseline, in the shape of gates.report_model.RunRecords
    (gates.report_records.records reads it from a run directory), under a policy narrowed to wiki-text and
    arc-easy (hellaswag dropped). wiki-text is looked at on 25, 75 and 200 items, arc-easy on 25
    and 50. Its verdicts' gates hold every outcome: fp8-e4m3 and smoothquant-w8a8 pass all (the
    latter's wiki-text gates decided at the second look, 75 items); gptq-int4 fails wiki-text's
    KL, top-1 and perplexity at the first of three looks (25 items), and fail fast leaves
    arc-easy not evaluated; awq-int4 has too little evidence on arc-easy at its ceiling. Each
    format's row carries its looks (`sequential`) and wiki-text's per-token KL tails.

    `search` ("approved" or "blocked", the held-out verdict) adds a mixed-precision search of
    gptq-int4 and smoothquant-w8a8 (`_add_search`): three trials judged on the search split
    (search-1 and search-2 pass it, search-3 is blocked), search-2 chosen and gated on held-out
    items (row `search-2@held-out`), one repeated budget, and a sensitivity of 12 layer groups.
    Size against top-1: the Pareto front is gptq-int4, awq-int4, search-2, search-1, fp8-e4m3 and
    the baseline (search-3 is beaten by awq-int4, smoothquant-w8a8 by fp8-e4m3)."""
    looks = {"wiki-text@v1": [25, 75, 200], "arc-easy@v1": [25, 50]}

    def metric(name: str, outcome: str, estimate: float | None, low: float | None, high: float | None, limit: float,
               unit: str, items: int, look: tuple[int, int] = (1, 1), reason: str = "") -> dict[str, Any]:
        confidence = 1 - 0.05 / look[1]
        if estimate is None:
            return {"gate": name, "outcome": outcome, "estimate": None, "low": None, "high": None, "limit": limit, "unit": unit,
                    "reason": reason, "items": 0, "look": None, "looks": None, "confidence": None, "decided_by": "not evaluated",
                    "half_width": None, "detectable": None}
        assert low is not None and high is not None
        half = (high - low) / 2
        return {"gate": name, "outcome": outcome, "estimate": estimate, "low": low, "high": high, "limit": limit, "unit": unit,
                "reason": reason or f"{name.split('@')[0]} {name.split()[1]} {estimate:.4f} [{low:.4f}, {high:.4f}] within {limit}",
                "items": items, "look": look[0], "looks": look[1], "confidence": confidence,
                "decided_by": "interval" if look[0] < look[1] else "ceiling", "half_width": half, "detectable": half * 1.42}

    def exact(name: str, value: float, limit: float, unit: str, reason: str, outcome: str = "pass") -> dict[str, Any]:
        return {"gate": name, "outcome": outcome, "estimate": value, "low": value, "high": value, "limit": limit, "unit": unit,
                "reason": reason, "items": None, "look": None, "looks": None, "confidence": None, "decided_by": "exact",
                "half_width": None, "detectable": None}

    def checks(bits_excess: float) -> list[dict[str, Any]]:
        return [exact("integrity finite_logits", 1.0, 1.0, "", "integrity: the checkpoint loads and its logits are finite on every evaluated item"),
                exact("integrity calibration_overlap", 0.0021, 0.01, "", "integrity: 9 of the calibration set's 4210 13-grams occur in the golden sets (0.21%, within 1.00%)"),
                exact("size bits_per_weight", bits_excess, 0.01, "bits", f"size: quantized layers store {bits_excess:+.4f} bits per weight over the format's exact figure (within the tolerance 0.01)"),
                exact("size unexplained_bytes", 0.0, 0.0, "bytes", "size: every byte is explained by the format")]

    def passing(kl: float, top1: float, ppl: float, acc: float, limits: tuple[float, float, float, float],
                wiki_look: int = 1) -> list[dict[str, Any]]:
        items, look = looks["wiki-text@v1"][wiki_look - 1], (wiki_look, 3)
        return [metric("wiki-text@v1 perplexity", "pass", ppl, ppl - 0.9, ppl + 1.1, limits[0], "%", items, look),
                metric("wiki-text@v1 kl_divergence", "pass", kl, kl * 0.85, kl * 1.2, limits[1], "", items, look),
                metric("wiki-text@v1 top1_agreement", "pass", top1, top1 - 0.02, top1 + 0.02, limits[2], "", items, look),
                metric("wiki-text@v1 kl_p99", "pass", kl * 5, kl * 4, kl * 6.5, 1.0, "", items, look),
                metric("arc-easy@v1 acc", "pass", acc, acc - 4.5, acc + 4.0, limits[3], "points", 50, (2, 2))]

    def sequential(gates: list[dict[str, Any]], depths: dict[str, int], not_evaluated: dict[str, str]) -> dict[str, Any]:
        """The verdict's record of its looks (quantgate.pipeline.runner.sequential_summary)."""
        decided = [gate for gate in gates if "@" in gate["gate"] and gate["look"] is not None]
        blocked_by = next((gate["reason"] for gate in decided if gate["outcome"] != "pass"), None)
        trace = [{"set": gate["gate"].split()[0], "metric": gate["gate"].split()[1], "look": gate["look"], "looks": gate["looks"],
                  "items": gate["items"], "confidence": gate["confidence"], "outcome": gate["outcome"], "estimate": gate["estimate"],
                  "low": gate["low"], "high": gate["high"], "limit": gate["limit"]} for gate in decided]
        return {"looks": looks, "items": depths, "error_control": "bonferroni", "confidence": 0.95, "blocked_by": blocked_by,
                "not_evaluated": not_evaluated, "trace": trace}

    def tails(gates: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
        """wiki-text's per-token KL tails (gates.verdict.tails), consistent with its KL gates."""
        by_id = {gate["gate"]: gate for gate in gates}
        kl, p99 = by_id["wiki-text@v1 kl_divergence"], by_id["wiki-text@v1 kl_p99"]
        mean = kl["estimate"]

        def tail(estimate: float, low: float, high: float) -> dict[str, Any]:
            return {"estimate": estimate, "low": low, "high": high, "confidence": 0.95, "items": kl["items"]}

        return {"wiki-text@v1": {
            "kl_divergence": tail(mean, kl["low"], kl["high"]),
            "kl_median": tail(mean * 0.42, mean * 0.36, mean * 0.49),
            "kl_p90": tail(mean * 2.1, mean * 1.8, mean * 2.5),
            "kl_p99": tail(p99["estimate"], p99["low"], p99["high"]),
            "kl_p999": tail(p99["estimate"] * 2.3, p99["estimate"] * 1.7, p99["estimate"] * 3.1),
            "kl_max": tail(p99["estimate"] * 4.4, p99["estimate"] * 2.9, p99["estimate"] * 4.4),
            "top_prob_change_mean": tail(-mean * 0.12, -mean * 0.16, -mean * 0.08),
            "top_prob_change_p01": tail(max(-1.0, -mean * 1.9), max(-1.0, -mean * 2.4), -mean * 1.4)}}

    def row(name: str, size: int, top1: float, verdict: str, b1: float, gates: list[dict[str, Any]],
            not_evaluated: dict[str, str] | None = None, depths: dict[str, int] | None = None) -> dict[str, Any]:
        by_id = {gate["gate"]: gate for gate in gates}
        acc, kl = by_id.get("arc-easy@v1 acc"), by_id.get("wiki-text@v1 kl_divergence")
        acc_value = 0.60 if name == "baseline" or acc is None or acc["estimate"] is None else 0.60 + acc["estimate"] / 100
        metrics = {"arc-easy@v1 acc": {"value": acc_value, "difference": None if acc is None else acc["estimate"],
                                       "low": None if acc is None else acc["low"], "high": None if acc is None else acc["high"], "unit": "points"},
                   "wiki-text@v1 top1_agreement": {"value": top1}}
        return {"format": name, "bytes": size, "bits_per_weight_layers": None if name == "baseline" else 4.2 if "int4" in name else 8.03,
                "bits_per_parameter": 16.0 * size / 270e6, "ratio_to_baseline": size / 270e6,
                "bounds": {"reference": {"batch1_ms": b1, "batch32_ms": b1 * 1.5}, "h200": {"batch1_ms": b1 / 1.6, "batch32_ms": b1}},
                "metrics": metrics, "kl_divergence": None if kl is None else kl["estimate"], "verdict": verdict,
                "reasons": [gate["reason"] for gate in gates if gate["outcome"] != "pass"],
                "gates": gates, "not_evaluated": not_evaluated or {},
                "sequential": None if depths is None else sequential(gates, depths, not_evaluated or {}),
                "tails": tails(gates) if depths is not None else {}}

    gptq = checks(0.0) + [
        metric("wiki-text@v1 perplexity", "fail", 14.2, 11.0, 17.9, 10.0, "%", 25, (1, 3),
               "wiki-text perplexity +14.20% [+11.00, +17.90] exceeds +10.00%"),
        metric("wiki-text@v1 kl_divergence", "fail", 0.331, 0.276, 0.397, 0.15, "", 25, (1, 3),
               "wiki-text kl_divergence 0.3310 [0.2760, 0.3970] exceeds 0.1500"),
        metric("wiki-text@v1 top1_agreement", "fail", 0.712, 0.681, 0.744, 0.80, "", 25, (1, 3),
               "wiki-text top1_agreement 0.7120 [0.6810, 0.7440] is below 0.8000"),
        metric("wiki-text@v1 kl_p99", "pass", 0.82, 0.55, 0.97, 1.0, "", 25, (1, 3)),
        metric("arc-easy@v1 acc", "not evaluated", None, None, None, -10.0, "points", 0,
               reason="arc-easy acc: not evaluated (wiki-text@v1 blocked the candidate first)")]
    awq = checks(0.0) + passing(0.118, 0.83, 7.4, 0.0, (10.0, 0.15, 0.80, -10.0))[:4] + [
        metric("arc-easy@v1 acc", "insufficient evidence", -8.0, -22.0, 6.0, -10.0, "points", 50, (2, 2),
               "arc-easy acc -8.00 points [-22.00, +6.00]: insufficient evidence, the interval reaches past -10.00 points "
               "by more than the policy allows")]
    policy = {"name": "small-model", "version": "v2", "sha256": "ab" * 32, "narrowed_to": ["arc-easy", "wiki-text"],
              "dropped": ["hellaswag"]}
    report = {"model": "tiny", "policy": policy,
            "hardware": [{"name": "reference"}, {"name": "h200"}],
            "metric_columns": ["arc-easy@v1 acc", "wiki-text@v1 top1_agreement"],
            "plot": {"x": "bytes", "y": "wiki-text@v1 top1_agreement", "higher_is_better": True},
            # the baseline's results: each set at its first look
            "evalsets": [{"spec": "wiki-text@v1", "items": 25, "limit": 25, "sha256": "cd" * 32, "size": 200, "looks": looks["wiki-text@v1"]},
                         {"spec": "arc-easy@v1", "items": 25, "limit": 25, "sha256": "ef" * 32, "size": 2376, "looks": looks["arc-easy@v1"]}],
            "confidence": 0.95,
            "rows": [row("baseline", 270_000_000, 1.0, "baseline", 0.09, []),
                     row("fp8-e4m3", 166_000_000, 0.902, "approved", 0.055, checks(0.0) + passing(0.031, 0.902, 1.2, -0.4, (3.0, 0.05, 0.85, -5.0)),
                         depths={"wiki-text@v1": 25, "arc-easy@v1": 50}),
                     row("gptq-int4", 112_000_000, 0.712, "blocked", 0.037, gptq,
                         {"arc-easy@v1": "fail fast: wiki-text@v1 blocked the candidate at 25 items"},
                         depths={"wiki-text@v1": 25, "arc-easy@v1": 0}),
                     row("awq-int4", 118_000_000, 0.83, "blocked", 0.039, awq, depths={"wiki-text@v1": 25, "arc-easy@v1": 50}),
                     row("smoothquant-w8a8", 166_000_000, 0.889, "approved", 0.054,
                         checks(0.0) + passing(0.042, 0.889, 1.9, -1.2, (3.0, 0.05, 0.85, -5.0), wiki_look=2),
                         depths={"wiki-text@v1": 75, "arc-easy@v1": 50})]}
    if search is None:
        return report
    limits = (10.0, 0.15, 0.80, -10.0)  # the policy's rule for a mixed checkpoint with 4-bit groups: its 4-bit limits
    trials = {"search-1": row("search-1", 150_000_000, 0.895, "approved", 0.050, checks(0.0) + passing(0.05, 0.895, 2.0, -1.0, limits, 2),
                              depths={"wiki-text@v1": 75, "arc-easy@v1": 50}),
              "search-2": row("search-2", 140_000_000, 0.89, "approved", 0.048, checks(0.0) + passing(0.07, 0.89, 3.0, -2.0, limits, 2),
                              depths={"wiki-text@v1": 75, "arc-easy@v1": 50}),
              "search-3": row("search-3", 128_000_000, 0.80, "blocked", 0.045, checks(0.0) + [
                  metric("wiki-text@v1 kl_divergence", "fail", 0.21, 0.18, 0.25, 0.15, "", 25, (1, 3),
                         "wiki-text kl_divergence 0.2100 [0.1800, 0.2500] exceeds 0.1500"),
                  metric("wiki-text@v1 top1_agreement", "pass", 0.80, 0.78, 0.82, 0.70, "", 25, (1, 3)),
                  metric("wiki-text@v1 kl_p99", "pass", 0.9, 0.7, 0.99, 1.0, "", 25, (1, 3)),
                  metric("arc-easy@v1 acc", "not evaluated", None, None, None, -10.0, "points", 0,
                         reason="arc-easy acc: not evaluated (wiki-text@v1 blocked the candidate first)")],
                              {"arc-easy@v1": "fail fast: wiki-text@v1 blocked the candidate at 25 items"},
                              depths={"wiki-text@v1": 25, "arc-easy@v1": 0})}
    held_gates = checks(0.0) + passing(0.08, 0.88, 3.5, -2.5, limits, 2)
    if search == "blocked":
        held_gates[5] = metric("wiki-text@v1 kl_divergence", "fail", 0.19, 0.16, 0.23, 0.15, "", 75, (2, 3),
                               "wiki-text kl_divergence 0.1900 [0.1600, 0.2300] exceeds 0.1500")
    held = row("search-2@held-out", 140_000_000, 0.88, search, 0.048, held_gates, depths={"wiki-text@v1": 75, "arc-easy@v1": 50})
    _add_search(report, trials, held)
    return report


def _add_search(report: dict[str, Any], trials: dict[str, dict[str, Any]], held: dict[str, Any]) -> None:
    """sample_report's search: the trial rows and the held-out row with their `search` records
    (as gates.report_records.records makes them), the search record (search.json) and the sensitivity."""
    mixes = {"search-1": {"gptq-int4": 5, "smoothquant-w8a8": 7}, "search-2": {"gptq-int4": 7, "smoothquant-w8a8": 5},
             "search-3": {"gptq-int4": 10, "smoothquant-w8a8": 2}}
    budgets = {"search-1": 0.56, "search-2": 0.52, "search-3": 0.475}
    costs = {"search-1": 0.0021, "search-2": 0.0034, "search-3": 0.0081}
    roles = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    groups = [{"name": f"model.layers.{block}.{role}", "block": block, "role": role, "parameters": 1_000_000 * (index + 1),
               "scores": {"gptq-int4": 1e-3 / (1 + index) / (1 + block), "smoothquant-w8a8": 0.0 if index == 3 and block == 2 else 2e-6 / (1 + block)}}
              for block in range(3) for index, role in enumerate(roles)]
    choice = {group["name"]: "smoothquant-w8a8" if group["role"].startswith("self_attn") and group["block"] < 2 else "gptq-int4"
              for group in groups}
    items = {"search": {"wiki-text@v1": {"offset": 0, "ceiling": 75}, "arc-easy@v1": {"offset": 0, "ceiling": 50}},
             "held-out": {"wiki-text@v1": {"offset": 75, "ceiling": 75}, "arc-easy@v1": {"offset": 50, "ceiling": 50}}}
    for name, trial in trials.items():
        trial["bits_per_weight_layers"] = 6.1
        trial["search"] = {"role": "trial", "checkpoint": name, "split": "search", "split_items": items["search"],
                           "groups_by_format": mixes[name], "groups": 12, "budget_ratio": budgets[name],
                           "predicted_cost": costs[name], "chosen": name == "search-2"}
    held["bits_per_weight_layers"] = 6.1
    held["search"] = {**trials["search-2"]["search"], "role": "held-out", "split": "held-out", "split_items": items["held-out"]}
    report["rows"] += [*trials.values(), held]
    verdict = held["verdict"]
    conclusion = ("search-2 (0.519x the baseline's bytes) is approved on held-out items the search never saw" if verdict == "approved"
                  else "search-2 (0.519x the baseline's bytes) passed on the search split but is blocked on the held-out items: "
                  + held["reasons"][0])
    report["search"] = {
        "formats": ["gptq-int4", "smoothquant-w8a8"], "objective": "smallest-approved", "max_trials": 4,
        "ceiling_bytes": 166_000_000, "lo_bytes": 112_000_000,
        "space": {"groups": 12, "fixed_bytes": 40_000_000, "baseline_bytes": 270_000_000,
                  "uniform_bytes": {"gptq-int4": 112_000_000, "smoothquant-w8a8": 166_000_000}},
        "trials": [{"name": name, "budget_bytes": int(budgets[name] * 270e6), "budget_ratio": budgets[name], "bytes": trial["bytes"],
                    "ratio": trial["bytes"] / 270e6, "predicted_cost": costs[name], "groups_by_format": mixes[name],
                    "allocation": {"choice": choice if name == "search-2" else {}}, "verdict": trial["verdict"],
                    "reasons": trial["reasons"]} for name, trial in trials.items()],
        "repeats": [{"budget_bytes": 137_000_000, "same_as": "search-2"}], "chosen": "search-2",
        "held_out": {"verdict": verdict, "reasons": held["reasons"]}, "conclusion": conclusion}
    report["sensitivity"] = {
        "method": "diagonal-fisher", "formula": "score(group, format) = 1/2 * sum_i F_ii * (RTN_format(W)_i - W_i)^2",
        "unit": "nats per token (predicted KL increase)", "fisher": "sampled", "tokens": 4_032,
        "formats": ["gptq-int4", "smoothquant-w8a8"],
        "totals": {fmt: sum(group["scores"][fmt] for group in groups) for fmt in ("gptq-int4", "smoothquant-w8a8")},
        "groups": groups, "spearman": {"gptq-int4": 0.9, "smoothquant-w8a8": None}}
