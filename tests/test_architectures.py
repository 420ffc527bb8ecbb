"""The architecture matrix: six transformers families (tests/architectures.py: tiny, random, built
from their configs) each calibrated; quantized to every format, or refused in one line before any
work, or failing where an upstream library does (xfail, strict: it turns into a failure the day
upstream is fixed); every checkpoint measured with every byte explained; evaluated with a finite
KL against its own baseline; its layer groups (the matmuls vLLM fuses) scored by the sensitivity
and allocated; and one family beyond Llama served by vLLM's CPU build.

EXPECTED is the one source of truth: docs/architectures.md's table is rendered from it, and the
last test checks that the document still says what the tests measure.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from quantgate import calibration, evalsets, quantize, serving
from quantgate.core.errors import InputError
from quantgate.evalsets.served import ServeCheckConfig, check
from quantgate.pipeline.search import build_space
from quantgate.quantize import sensitivity, stage
from quantgate.quantize.allocation import allocate
from quantgate.quantize.checkpoint import QuantizationFailed
from quantgate.quantize.fusion import layer_groups
from quantgate.quantize.measure import measure
from quantgate.quantize.measure.causes import UNEXPLAINED_CAUSES
from tests.architectures import FAMILIES, build_family, build_shared_tokenizer
from tests.helpers import SERVED_FORMAT

FORMATS = tuple(quantize.PRESETS)  # gptq-int4, awq-int4, smoothquant-w8a8, fp8-e4m3, gptq-int8
DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
TEXT_SET = "wiki-text@v1"
ITEMS = 2  # evaluated items of the text set: enough for a KL over a few hundred tokens
# AWQ's scale search runs each block once per grid point: 5 points instead of 20, as the demo
# checkpoints of the rest of the suite (tests/conftest.py): a coarser search, still AWQ
KNOBS = {"awq-int4": {"awq_n_grid": 5}}


@dataclass(frozen=True)
class Outcome:
    status: str  # "works", "refused" (one line, exit 2, before any work) or "fails" (upstream; xfail)
    why: str = ""  # for the docs table
    match: str = ""  # refused: a regex the refusal matches


WORKS = Outcome("works")
_NEOX_HEAD = ("transformers 5.17 reloads the head of a compressed-tensors GPT-NeoX checkpoint (stored as embed_out, "
              "renamed lm_head) in BF16 inside the FP32 model, so the smoke check cannot run it")
EXPECTED: dict[tuple[str, str], Outcome] = {(family, fmt): WORKS for family in FAMILIES for fmt in FORMATS}
EXPECTED.update({
    ("gpt-neox", "gptq-int4"): Outcome("fails", _NEOX_HEAD),
    ("gpt-neox", "awq-int4"): Outcome("refused", "llmcompressor has no AWQ mappings for GPTNeoXForCausalLM",
                                      r"^awq-int4 cannot be made for GPTNeoXForCausalLM: llmcompressor \S+ has no AWQ mappings"),
    ("gpt-neox", "smoothquant-w8a8"): Outcome("refused", "llmcompressor has no SmoothQuant mappings for GPTNeoXForCausalLM",
                                              r"^smoothquant-w8a8 cannot be made for GPTNeoXForCausalLM: llmcompressor \S+ has no SmoothQuant"),
    ("gpt-neox", "fp8-e4m3"): Outcome("fails", _NEOX_HEAD),
    ("gpt-neox", "gptq-int8"): Outcome("fails", _NEOX_HEAD),
    ("qwen2-moe", "awq-int4"): Outcome("fails", "transformers 5.17 reloads the experts without their zero points "
                                                "(DecompressExperts: 'Asymmetric quant requires zero-point values')"),
    ("qwen2-moe", "smoothquant-w8a8"): Outcome("fails", "transformers 5.17 finds none of the experts' INT8 weights to fuse "
                                                        "into gate_up_proj on reload (Concatenate: torch.cat of an empty list)"),
})

# The linear layers each family keeps at 16 bits: its untied head, the routers vLLM loads
# unquantized (quantize.llmcompressor_backend.ROUTERS).
KEPT_16BIT = re.compile(r"(^|\.)(lm_head|embed_out|mlp\.gate|mlp\.shared_expert_gate)$")
HEAD = {"llama": None, "qwen2": "lm_head", "gemma3": None, "phi3": "lm_head", "gpt-neox": "embed_out", "qwen2-moe": "lm_head"}
BIASES = {"qwen2", "gpt-neox", "qwen2-moe"}

# Each family's layer groups in a block, as vLLM fuses its matmuls: role -> the layers (within the block)
_LLAMA = {"self_attn.qkv_proj": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, "self_attn.o_proj": {"self_attn.o_proj"},
          "mlp.gate_up_proj": {"mlp.gate_proj", "mlp.up_proj"}, "mlp.down_proj": {"mlp.down_proj"}}
GROUPS: dict[str, dict[str, set[str]]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "gemma3": _LLAMA,
    # fused in the checkpoint already: each is one layer, named as vLLM names the fused matmul
    "phi3": {role: {role} for role in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")},
    "gpt-neox": {role: {role} for role in ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")},
    "qwen2-moe": {
        "self_attn.qkv_proj": _LLAMA["self_attn.qkv_proj"], "self_attn.o_proj": {"self_attn.o_proj"},
        # one FusedMoE layer in vLLM: every expert's three projections share its scheme
        "mlp.experts": {f"mlp.experts.{expert}.{name}" for expert in range(4) for name in ("gate_proj", "up_proj", "down_proj")},
        "mlp.shared_expert.gate_up_proj": {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"},
        "mlp.shared_expert.down_proj": {"mlp.shared_expert.down_proj"},
    },
}
# The family served by vLLM (one start: each costs about 20 s): Qwen2's biases, untied head and
# grouped-query attention in the format this CPU's vLLM serves. The others are not served here.
SERVED_FAMILY = "qwen2"
SERVED = {"llama": "served (tests/test_serving.py)", SERVED_FAMILY: "served, agrees with the evaluation"}


def works(family: str) -> list[str]:
    return [fmt for fmt in FORMATS if EXPECTED[(family, fmt)].status == "works"]


# --- what the tests make, once for the module ----------------------------------------------------------


class Matrix:
    """Each family's model, calibration set, checkpoints, measurements and evaluations, made on
    first use (inside a test, so in its isolated, offline QUANTGATE_HOME) and kept for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[Any, Any] = {}

    def _once(self, key: Any, make: Any) -> Any:
        if key not in self.made:
            try:
                self.made[key] = make()
            except Exception as error:  # a failure is the result, for every test that asks again
                self.made[key] = error
        if isinstance(self.made[key], Exception):
            raise self.made[key]
        return self.made[key]

    def model(self, family: str) -> Path:
        tokenizer = self._once("tokenizer", lambda: build_shared_tokenizer(self.root / "tokenizer"))
        return self._once(("model", family), lambda: build_family(family, self.root / family, tokenizer))

    def calibration(self, family: str) -> calibration.CalibrationSet:
        # 8 x 64 tokens: longer than Gemma 3's sliding window (32), enough for GPTQ's 64-wide Hessians
        cfg = calibration.CalibrationConfig(model=str(self.model(family)), source="demo", samples=8, seq_len=64)
        return self._once(("calibration", family), lambda: calibration.run(cfg, self.root / f"{family}-calibration"))

    def checkpoint(self, family: str, fmt: str) -> Path:
        def make() -> Path:
            out = self.root / f"{family}-{fmt}"
            return quantize.run(quantize.QuantizeConfig(format=fmt, **KNOBS.get(fmt, {})), self.model(family),
                                self.calibration(family).path, out).path
        return self._once(("checkpoint", family, fmt), make)

    def measurement(self, family: str, fmt: str | None = None) -> Any:
        """The measurement of the baseline (fmt None) or of a checkpoint against it."""
        if fmt is None:
            return self._once(("measure", family), lambda: measure(self.model(family)))
        return self._once(("measure", family, fmt), lambda: measure(self.checkpoint(family, fmt), self.model(family)))

    def results(self, family: str, fmt: str | None = None) -> evalsets.EvaluationResults:
        """The text set's first items evaluated on the baseline (fmt None) or on a checkpoint against it."""
        cfg = evalsets.EvaluateConfig(evalsets=(TEXT_SET,), limit=ITEMS, bootstrap_iters=0)
        if fmt is None:
            return self._once(("results", family), lambda: evalsets.run(cfg, self.model(family), self.root / f"{family}-results"))
        return self._once(("results", family, fmt), lambda: evalsets.run(
            cfg, self.checkpoint(family, fmt), self.root / f"{family}-{fmt}-results", baseline_results=self.results(family).path))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    """The matrix, on one torch thread: its matrices are 64 wide, where a second thread costs more
    in synchronisation than it gives (AWQ on the tiny Llama: 9.5 s with two threads on this
    2-core machine under load, 2.1 s with one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield Matrix(tmp_path_factory.mktemp("matrix"))
    finally:
        torch.set_num_threads(threads)


def _no_work(*_args: Any, **_kwargs: Any) -> Any:
    raise AssertionError("the model was loaded: a refusal must come before any work")


def _matrix_cases() -> list[Any]:
    """(family, format) for every cell of EXPECTED; the upstream failures expected to fail."""
    return [pytest.param(family, fmt, id=f"{family}-{fmt}",
                         marks=[pytest.mark.xfail(strict=True, raises=QuantizationFailed, reason=outcome.why)] if outcome.status == "fails" else [])
            for (family, fmt), outcome in EXPECTED.items()]


# --- calibrate, quantize, measure ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_built_from_its_config_and_calibrates(matrix: Matrix, family: str) -> None:
    config = json.loads((matrix.model(family) / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family].architecture] and config["dtype"] == "bfloat16"
    calibrated = matrix.calibration(family)
    assert calibrated.samples == 8 and tuple(calibrated.input_ids.shape) == (8, 64)


@pytest.mark.parametrize(("family", "fmt"), _matrix_cases())
def test_each_format_is_made_and_every_byte_explained_or_refused(matrix: Matrix, family: str, fmt: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = EXPECTED[(family, fmt)]
    if outcome.status == "refused":
        model, calibrated = matrix.model(family), matrix.calibration(family).path
        monkeypatch.setattr(stage, "_load_model", _no_work)
        with pytest.raises(InputError) as refusal:
            quantize.run(quantize.QuantizeConfig(format=fmt), model, calibrated, tmp_path / "out")
        assert refusal.value.exit_code == 2 and "\n" not in str(refusal.value) and re.search(outcome.match, str(refusal.value))
        assert not (tmp_path / "out").exists()
        return
    measured, baseline = matrix.measurement(family, fmt), matrix.measurement(family)
    assert outcome.status == "works"
    # every byte: no line the format does not explain, nothing left over, no parameter lost
    causes = {line["cause"] for line in measured.to_json()["explanation"]["lines"]}
    assert measured.unexplained_bits == 0 and not causes & UNEXPLAINED_CAUSES, causes
    assert measured.parameters == baseline.parameters
    # kept at the baseline's width and counted as what they are: biases, embeddings, an untied head, norms
    for category in ("biases", "embeddings", "lm_head", "norms"):
        assert measured.categories[category].bytes == baseline.categories[category].bytes, category
    assert (measured.categories["biases"].bytes > 0) is (family in BIASES)
    assert (measured.categories["lm_head"].bytes > 0) is (HEAD[family] is not None)
    # every linear layer quantized (fused ones, experts) but the head and the routers
    left = {layer.name for layer in measured.linear_layers if not layer.quantized}
    assert left == {layer.name for layer in baseline.linear_layers if KEPT_16BIT.search(layer.name)}
    assert (HEAD[family] in left) if HEAD[family] else not left & {"lm_head", "embed_out"}
    assert len(measured.linear_layers) - len(left) == sum(len(members) for members in GROUPS[family].values()) * 2  # two blocks


# --- evaluate ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_checkpoint_has_a_finite_kl_against_its_own_baseline(matrix: Matrix, family: str) -> None:
    baseline = matrix.results(family).manifest.sets[TEXT_SET].metrics
    assert math.isfinite(baseline["perplexity"]) and baseline["perplexity"] > 1
    kl = {fmt: matrix.results(family, fmt).manifest.sets[TEXT_SET].metrics["kl_divergence"] for fmt in works(family)}
    assert all(math.isfinite(value) and value >= 0 for value in kl.values()), kl
    # per-channel INT8 is closer to the baseline than INT4 in groups of 64: a SmoothQuant that
    # smooths the wrong norm (llmcompressor's Gemma 3 mapping) is not (0.016 against 0.001)
    if "smoothquant-w8a8" in kl:
        assert kl["smoothquant-w8a8"] < min(kl[fmt] for fmt in ("gptq-int4", "awq-int4") if fmt in kl) / 3, kl


# --- layer groups, sensitivity, allocation -------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_groups_vllm_fuses_are_scored_and_allocated(matrix: Matrix, family: str, tmp_path: Path) -> None:
    # the groups, from the checkpoint's names, as the search builds them
    names = [layer.name for layer in matrix.measurement(family).linear_layers if not KEPT_16BIT.search(layer.name)]
    groups = layer_groups(names)
    prefix = {group.name: group.name[: -len(group.role)] for group in groups}
    assert {group.role: {layer[len(prefix[group.name]):] for layer in group.layers} for group in groups if group.block == 0} == GROUPS[family]
    assert len(groups) == 2 * len(GROUPS[family])

    # the sensitivity scores the same groups (from the loaded model's names: experts unfused from
    # transformers' 3-D tensors, GPT-NeoX's head renamed) in every format this family is made in
    formats = tuple(works(family)) or ("gptq-int4", "fp8-e4m3")  # a family with no checkpoint: the proxy needs none
    scored = sensitivity.run(sensitivity.SensitivityConfig(formats=formats, rows=4), matrix.model(family),
                             matrix.calibration(family).path, tmp_path / "sensitivity")
    assert {group["name"]: set(group["layers"]) for group in scored.report["groups"]} == {group.name: set(group.layers) for group in groups}
    for fmt in formats:
        assert all(math.isfinite(score) and score >= 0 for score in scored.scores(fmt).values())
        # the experts are scored through their unfused Linear layers (the Fisher reaches them)
        assert all(scored.scores(fmt)[group.name] > 0 for group in groups if group.role == "mlp.experts")
    assert scored.total(formats[0]) > 0

    # the allocation: one format per group, within a budget between the smallest format's bytes and the baseline's
    if len(works(family)) < 2:  # nothing to choose between (GPT-NeoX: no checkpoint is made)
        return
    measurements = {quantize.UNQUANTIZED: matrix.measurement(family).record(),
                    **{fmt: matrix.measurement(family, fmt).record() for fmt in formats}}
    space = build_space(formats, measurements, {fmt: scored.scores(fmt) for fmt in formats})
    assert {unit.name for unit in space.units} == {group.name for group in groups}
    budget = (min(space.uniform.values()) + space.baseline) // 2
    allocation = allocate(space.units, budget - space.fixed)
    assert allocation.bytes + space.fixed <= budget and set(allocation.choice) == {group.name for group in groups}
    assert set(allocation.choice.values()) <= {quantize.UNQUANTIZED, *formats}


# --- serve ---------------------------------------------------------------------------------------------


def test_one_family_beyond_llama_is_served_by_vllm_and_agrees(matrix: Matrix, served: serving.ServingEnv, tmp_path: Path) -> None:
    cfg = ServeCheckConfig(items=ITEMS, greedy_prompts=1, prompt_tokens=8, greedy_tokens=4, batch_sizes=(1,), decode_tokens=4, runs=1,
                           kv_cache_mib=64, bandwidth_mib=16)
    record = check(matrix.checkpoint(SERVED_FAMILY, SERVED_FORMAT), matrix.results(SERVED_FAMILY, SERVED_FORMAT), cfg, served,
                   tmp_path / "serve")
    assert record.served, record.reason
    agreement, gated = record.agreement, record.gated
    assert agreement is not None and gated is not None
    assert agreement.items == ITEMS and gated.weights_match
    assert agreement.top1_agreement > 0.9 and 0 <= agreement.kl_served_gated_mean < 0.05


# --- the docs table ------------------------------------------------------------------------------------

BEGIN, END = "<!-- matrix: generated from tests/test_architectures.py EXPECTED -->", "<!-- matrix: end -->"


def render_table() -> str:
    """docs/architectures.md's tables: the families and what each keeps; then one row a family, one
    column a format, the reasons as notes."""
    notes: list[str] = []

    def cell(outcome: Outcome) -> str:
        if outcome.status == "works":
            return "works"
        note = f"{outcome.status}: {outcome.why}"
        if note not in notes:
            notes.append(note)
        return f"{outcome.status} ({notes.index(note) + 1})"

    lines = [BEGIN, "", "| family | architecture | what its tiny model keeps |", "|---|---|---|",
             *(f"| {family} | {spec.architecture} | {spec.notes} |" for family, spec in FAMILIES.items()),
             "", "| family | " + " | ".join(FORMATS) + " | layer groups (vLLM) | serve |", "|---" * (len(FORMATS) + 3) + "|"]
    for family in FAMILIES:
        groups = ", ".join(GROUPS[family])
        serve = SERVED.get(family, "not tested here")
        lines.append(f"| {family} | " + " | ".join(cell(EXPECTED[(family, fmt)]) for fmt in FORMATS) + f" | {groups} | {serve} |")
    lines += ["", *(f"{index}. {note}" for index, note in enumerate(notes, 1)), "", END]
    return "\n".join(lines)


def test_the_docs_table_is_what_the_tests_measure() -> None:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render_table(), f"docs/architectures.md's table is out of date; it should read:\n{render_table()}"
