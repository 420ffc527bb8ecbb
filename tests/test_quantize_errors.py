"""Bad quantize input: one line, exit code 2, nothing written, checked before the long work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.factories import build_tiny_llama
from tests.helpers import assert_refused


def quantize_cli(cli, model: Path, calibration: Path, out: Path, *extra: str, format: str = "fp8-e4m3"):
    return cli("quantize", "--model", model, "--format", format, "--calibration", calibration, "--out", out, *extra)


def test_unknown_format_lists_the_valid_ones(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = quantize_cli(cli, quant_model, quant_calibration, out, format="awq-int8")
    assert_refused(result, "unknown format 'awq-int8' (did you mean 'awq-int4'?)", out)
    assert "gptq-int4, awq-int4, smoothquant-w8a8, fp8-e4m3" in result.err


def test_calibration_set_from_another_tokenizer_is_refused(cli, quant_calibration: Path, tmp_path: Path) -> None:
    other = build_tiny_llama(tmp_path / "other", vocab_size=600, hidden_size=192, intermediate_size=512, heads=3, kv_heads=1)
    out = tmp_path / "out"
    assert_refused(quantize_cli(cli, other, quant_calibration, out), "was made with another tokenizer", out)


def test_existing_output_is_refused(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = quantize_cli(cli, quant_model, quant_calibration, out)
    assert result.code == 2 and "already exists (pass --overwrite" in result.err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("size", ["48", "0", "-128"])
def test_group_size_not_a_positive_multiple_of_32(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path, size: str) -> None:
    out = tmp_path / "out"
    result = quantize_cli(cli, quant_model, quant_calibration, out, "--group-size", size, format="gptq-int4")
    assert_refused(result, "positive multiple of 32", out)


def test_an_unknown_observer_is_refused_naming_the_option(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = quantize_cli(cli, quant_model, quant_calibration, out, "--observer", "imatrix", format="gptq-int4")
    assert_refused(result, "invalid observer", out)
    assert "imatrix_mse" in result.err


def test_untraceable_architecture_is_named(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path, monkeypatch) -> None:
    from torch.fx.proxy import TraceError

    def refuse_to_trace(*args, **kwargs):
        raise TraceError("symbolically traced variables cannot be used as inputs to control flow")

    monkeypatch.setattr("quantgate.quantize.llmcompressor_backend.quantize_in_place", refuse_to_trace)
    out = tmp_path / "out"
    assert_refused(quantize_cli(cli, quant_model, quant_calibration, out, format="gptq-int4"),
                   "llmcompressor cannot trace LlamaForCausalLM", out)


def test_missing_calibration_set(cli, quant_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_refused(quantize_cli(cli, quant_model, tmp_path / "nowhere", out), "is not a calibration set", out)


def test_tampered_calibration_set(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(quant_calibration, tmp_path / "calib"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["tokens.safetensors"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    assert_refused(quantize_cli(cli, quant_model, copy, out), "tokens.safetensors does not match", out)


def test_quantize_command_reports_time_and_memory(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    result = quantize_cli(cli, quant_model, quant_calibration, tmp_path / "ckpt", format="gptq-int4")
    assert result.code == 0, result.err
    assert "got group size 64" in result.out
    last = result.out.strip().splitlines()[-1]
    assert last.startswith("gptq-int4 checkpoint written to") and " s, peak memory " in last and "GiB" in last
