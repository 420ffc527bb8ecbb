"""Per-layer-group sensitivity on the tiny model: every group gets a finite, non-negative score
per format, 4-bit costs more than 8-bit, the proxy is in the unit it claims (nats per token, close
to the KL measured by quantizing a block), the artifact round-trips, is reused when its inputs
match and refused when they differ, and bad input is one typed error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from quantgate import calibration
from quantgate.core.errors import InputError, OutputExistsError
from quantgate.core.validation import validated
from quantgate.quantize import sensitivity
from quantgate.quantize.sensitivity import FisherVariant, SensitivityConfig
from tests.helpers import assert_refused

FORMATS = ("gptq-int4", "awq-int4", "smoothquant-w8a8", "fp8-e4m3")
FOUR_BIT, EIGHT_BIT = ("gptq-int4", "awq-int4"), ("smoothquant-w8a8", "fp8-e4m3")


@pytest.fixture(scope="module")
def artifact(quant_model: Path, quant_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> sensitivity.Sensitivity:
    out = tmp_path_factory.mktemp("sensitivity") / "result"
    return sensitivity.run(SensitivityConfig(formats=FORMATS, rows=8, validation=True), quant_model, quant_calibration, out)


def test_every_group_has_a_finite_non_negative_score_per_format(artifact: sensitivity.Sensitivity) -> None:
    groups = artifact.report["groups"]
    # 2 blocks x (qkv, o, gate_up, down): q/k/v and gate/up are scored as vLLM fuses them
    assert [group["role"] for group in groups] == ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"] * 2
    assert groups[0]["layers"] == [f"model.layers.0.self_attn.{name}_proj" for name in "qkv"]
    assert groups[0]["group_sizes"] == [64, 64, 64] and groups[3]["group_sizes"] == [128]  # width 192 falls back to 64
    assert all(not name.startswith("lm_head") for group in groups for name in group["layers"])
    for group in groups:
        assert set(group["scores"]) == set(FORMATS)
        assert all(math.isfinite(value) and value >= 0 for value in group["scores"].values()), group
    assert artifact.report["rows"] == 8 and artifact.report["tokens"] == 8 * 63  # each position with a next token in its row


def test_four_bit_costs_more_than_eight_bit_in_every_group(artifact: sensitivity.Sensitivity) -> None:
    for group in artifact.report["groups"]:
        scores = group["scores"]
        assert min(scores[fmt] for fmt in FOUR_BIT) > max(scores[fmt] for fmt in EIGHT_BIT), group["name"]


def test_the_proxy_predicts_the_measured_kl_in_nats_per_token(artifact: sensitivity.Sensitivity) -> None:
    """On a small random model a block's RTN error is small enough for the second-order term to
    be the whole story: the proxy summed over a block is within 2x of the measured KL."""
    validation = artifact.report["validation"]
    assert validation["rows"] == 8
    for fmt in FORMATS:
        figures = validation["formats"][fmt]
        assert -1.0 <= figures["spearman"] <= 1.0
        for block in figures["blocks"]:
            assert 0.5 < block["proxy"] / block["measured_kl"] < 2.0, (fmt, block)


def test_the_artifact_round_trips_and_is_reused(artifact: sensitivity.Sensitivity, quant_model: Path, quant_calibration: Path) -> None:
    loaded = sensitivity.load(artifact.path)
    assert loaded.report == artifact.report and loaded.manifest == artifact.manifest
    manifest = loaded.manifest
    assert (manifest["kind"], manifest["schema_version"]) == ("sensitivity", 1)
    assert manifest["calibration"]["fingerprint"] == calibration.load(quant_calibration).fingerprint
    assert set(manifest["files"]) == {"sensitivity.json"} and manifest["baseline"]["weights_sha256"]
    assert loaded.ranked("gptq-int4")[0][1] == max(loaded.scores("gptq-int4").values())
    again = sensitivity.run(SensitivityConfig(formats=FORMATS, rows=8, validation=True), quant_model, quant_calibration, artifact.path)
    assert again.reused and again.manifest == manifest


def test_a_changed_calibration_or_format_list_is_refused_at_the_same_out(
        artifact: sensitivity.Sensitivity, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    other = calibration.run(calibration.CalibrationConfig(model=str(quant_model), source="demo", samples=8, seq_len=64, seed=1),
                            tmp_path / "other-calibration")
    cfg = SensitivityConfig(formats=FORMATS, rows=8, validation=True)
    sha = artifact.manifest["baseline"]["weights_sha256"]
    keys = {sensitivity.input_key(cfg, sha, calibration.load(quant_calibration).fingerprint),
            sensitivity.input_key(cfg, sha, other.fingerprint),
            sensitivity.input_key(SensitivityConfig(formats=FORMATS[:2], rows=8, validation=True), sha, other.fingerprint)}
    assert len(keys) == 3 and artifact.manifest["input_key"] in keys
    with pytest.raises(OutputExistsError, match="holds something else"):
        sensitivity.run(cfg, quant_model, other.path, artifact.path)
    with pytest.raises(OutputExistsError, match="holds something else"):
        sensitivity.run(SensitivityConfig(formats=FORMATS[:2], rows=8, validation=True), quant_model, quant_calibration, artifact.path)
    elsewhere = sensitivity.run(SensitivityConfig(formats=("gptq-int4",), rows=4), quant_model, other.path, tmp_path / "copy")
    assert elsewhere.manifest["calibration"]["fingerprint"] == other.fingerprint and elsewhere.report["validation"] is None


def test_bad_input_is_one_typed_error(quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="unknown format 'int3'.*valid formats: gptq-int4"):
        SensitivityConfig(formats=("int3",))
    with pytest.raises(InputError, match="formats"):
        validated(SensitivityConfig, {"formats": ()}, "sensitivity config")
    with pytest.raises(InputError, match="group size"):
        validated(SensitivityConfig, {"formats": ("gptq-int4",), "group_size": 100}, "sensitivity config")
    with pytest.raises(InputError, match="does not exist"):
        sensitivity.run(SensitivityConfig(formats=("gptq-int4",)), quant_model, tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(InputError, match="rows: 99 asked"):
        sensitivity.run(SensitivityConfig(formats=("gptq-int4",), rows=99), quant_model, quant_calibration, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_or_damaged_artifact_is_refused(artifact: sensitivity.Sensitivity, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a sensitivity artifact"):
        sensitivity.load(tmp_path)
    damaged = Path(tmp_path / "damaged")
    damaged.mkdir()
    for name in ("manifest.json", "sensitivity.json"):
        (damaged / name).write_bytes((artifact.path / name).read_bytes())
    report = json.loads((damaged / "sensitivity.json").read_text())
    report["totals"]["gptq-int4"] = 0.0
    (damaged / "sensitivity.json").write_text(json.dumps(report))
    with pytest.raises(InputError, match="damaged sensitivity artifact"):
        sensitivity.load(damaged)


def test_rtn_fake_quantization_follows_the_preset_and_the_group_fallback() -> None:
    weight = torch.randn(8, 192, generator=torch.Generator().manual_seed(0))
    assert sensitivity.weight_args("gptq-int4", 192, 128) == {"num_bits": 4, "type": "int", "symmetric": True,
                                                              "strategy": "group", "group_size": 64}
    assert sensitivity.weight_args("gptq-int4", 48, 128) is None  # no kernel group size divides 48: left alone
    int8 = sensitivity.fake_quantize_weight(weight, sensitivity.weight_args("smoothquant-w8a8", 192, 128) or {})
    step = weight.abs().amax(dim=1, keepdim=True) / 127.5  # symmetric INT8 per channel: max / ((255) / 2)
    assert ((int8 - weight).abs() <= step / 2 + 1e-6).all()
    int4 = sensitivity.fake_quantize_weight(weight, sensitivity.weight_args("gptq-int4", 192, 128) or {})
    assert all(len(torch.unique(row)) <= 16 for row in int4[:, :64])  # 4 bits: at most 16 levels a group
    assert sensitivity.layer_score(weight, torch.zeros_like(weight), "gptq-int4", 128) == 0.0


def test_kl_per_token_is_zero_for_equal_distributions_and_exact_otherwise() -> None:
    base = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    other = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    kl = sensitivity.kl_per_token(base, other)
    assert kl[0] == 0.0
    assert math.isclose(float(kl[1]), 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5), rel_tol=1e-6)
    assert sensitivity.rank_correlation([1.0, 2.0, 3.0], [10.0, 30.0, 20.0])[0] == pytest.approx(0.5)
    assert sensitivity.rank_correlation([1.0], [2.0]) == (None, None)


def test_the_empirical_fisher_also_scores(quant_model: Path, quant_calibration: Path) -> None:
    loaded = sensitivity.load_model(quant_model, torch.float32)
    rows = calibration.load(quant_calibration)
    cfg = SensitivityConfig(formats=("gptq-int4",), fisher=FisherVariant.empirical, rows=4)
    report = sensitivity.score(loaded, rows.input_ids[:4], rows.attention_mask[:4], cfg)
    assert report["fisher"] == "empirical" and report["rows"] == 4
    assert all(math.isfinite(group["scores"]["gptq-int4"]) and group["scores"]["gptq-int4"] > 0 for group in report["groups"])


def test_cli_prints_the_table(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    result = cli("sensitivity", "--model", quant_model, "--calibration", quant_calibration,
                 "--formats", "gptq-int4,smoothquant-w8a8", "--out", tmp_path / "out", "--rows", "4", "--top", "3", "--validate")
    assert result.code == 0, result.err
    assert "gptq-int4: 8 groups, total" in result.out and "smoothquant-w8a8: 8 groups" in result.out
    assert result.out.count("model.layers.") == 6  # the top 3 of each format
    assert "validation: Spearman rho" in result.out
    assert sensitivity.load(tmp_path / "out").report["rows"] == 4


def test_cli_refuses_an_unknown_format_in_one_line(cli, quant_model: Path, quant_calibration: Path, tmp_path: Path) -> None:
    result = cli("sensitivity", "--model", quant_model, "--calibration", quant_calibration,
                 "--formats", "gptq-int4,gptq-int3", "--out", tmp_path / "out")
    assert_refused(result, "unknown format 'gptq-int3'", tmp_path / "out")
