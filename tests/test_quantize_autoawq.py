"""The AutoAWQ reference backend: a one-line hint without the extra, and with it a real
AutoAWQ GEMM checkpoint from the same model and calibration set."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from quantgate import quantize
from quantgate.core.headers import read_header
from quantgate.quantize.autoawq_backend import common_group_size
from quantgate.quantize.checkpoint import CheckpointManifest
from tests.helpers import assert_refused


def test_without_the_extra_the_backend_fails_with_a_hint(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path, monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "awq" else real_find_spec(name, *a))
    out = tmp_path / "out"
    result = cli("quantize", "--model", quant_model, "--format", "awq-int4", "--calibration", quant_calibration,
                 "--out", out, "--backend", "autoawq")
    assert_refused(result, "pip install 'quantgate[autoawq]'", out)


def test_autoawq_backend_makes_only_awq(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli("quantize", "--model", quant_model, "--format", "gptq-int4", "--calibration", quant_calibration,
                 "--out", out, "--backend", "autoawq")
    assert_refused(result, "makes awq-int4 checkpoints only", out)


def test_one_group_size_must_divide_every_layer() -> None:
    assert common_group_size([576, 1536], 128) == 64
    assert common_group_size([4096, 11008], 128) == 128


@pytest.mark.skipif(importlib.util.find_spec("awq") is None, reason="the autoawq extra is not installed")
def test_autoawq_writes_an_awq_gemm_checkpoint(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    result = cli("quantize", "--model", quant_model, "--format", "awq-int4", "--calibration", quant_calibration, "--out", tmp_path / "awq",
                 "--backend", "autoawq")
    assert result.code == 0, result.out + result.err
    # AutoAWQ takes one group size: the note says so (it has no layer width to name)
    assert "note: every layer got group size 64, not 128: AutoAWQ takes one group size" in result.out
    checkpoint = quantize.QuantizedCheckpoint(tmp_path / "awq", CheckpointManifest.read(tmp_path / "awq" / "manifest.json"))
    config = json.loads((checkpoint.path / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"], config["group_size"], config["zero_point"], config["version"]) == ("awq", 4, 64, True, "gemm")
    header = read_header(next(checkpoint.path.glob("*.safetensors")))
    assert any(name.endswith(".qweight") for name in header) and any(name.endswith(".qzeros") for name in header)
    assert checkpoint.manifest.backend == "autoawq" and checkpoint.manifest.smoke.logits_finite
    assert checkpoint.manifest.group_size.fallbacks[0].group_size == 64
