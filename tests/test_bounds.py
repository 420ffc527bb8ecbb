"""The bound model of docs/sources.md: the reference table reproduced to its printed precision,
the sweeps against values worked by hand, and bad settings refused as errors, not numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantgate.core.errors import InputError
from quantgate.quantize.measure import bounds
from quantgate.quantize.measure.hardware import HardwareProfile, builtin_profiles, load_profile
from tests.helpers import assert_refused


@pytest.fixture(scope="module")
def reference() -> dict:
    return bounds.compute(bounds.reference_case(load_profile("reference")))


def by_name(result: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in result["formats"]}


# --- the reference table, every cell at the precision docs/sources.md prints ---------------------

REFERENCE_TABLE = {  # quantity: (bf16, fp8_e4m3, int4_g128, decimals)
    "weight_gb": (140.0, 70.0, 36.3125, 4),
    "weight_gib": (130.39, 65.19, 33.82, 2),
    "batch1_weight_bound_ms": (46.667, 23.333, 12.104, 3),
    "step_bound_ms": (53.825, 30.492, 19.262, 3),
    "verify_cost_ratio": (1.0, 1.0, 1.1629, 4),
    "speedup": (2.4011, 2.4011, 2.1509, 4),
}


def cell(entry: dict, quantity: str) -> float:
    return {
        "step_bound_ms": entry["step"]["bound_ms"],
        "verify_cost_ratio": entry["verify"]["verify_cost_ratio"],
        "speedup": entry["speculative"]["with_verify_cost"]["speedup"],
    }.get(quantity, entry.get(quantity))


@pytest.mark.parametrize("quantity", list(REFERENCE_TABLE))
def test_reference_table_is_reproduced(reference: dict, quantity: str) -> None:
    *expected, decimals = REFERENCE_TABLE[quantity]
    formats = by_name(reference)
    for name, value in zip(("bf16", "fp8_e4m3", "int4_g128"), expected, strict=True):
        assert round(cell(formats[name], quantity), decimals) == value, (name, quantity)


def test_reference_scalars_are_reproduced(reference: dict) -> None:
    assert reference["kv_bytes_per_sequence"] == 671_088_640
    assert round(reference["expected_tokens_per_target_step"], 4) == 3.3616
    bf16 = by_name(reference)["bf16"]["speculative"]["free_verification"]
    assert round(bf16["speedup"], 4) == 2.4011
    assert round(bf16["iteration_time_ms"], 1) == 35.0
    assert round(bf16["average_tpot_ms"], 4) == 10.4117
    int4 = next(c for c in reference["comparisons"] if c["format"] == "int4_g128")
    assert round(int4["byte_ratio"], 2) == 3.86 and round(int4["step_bound_improvement"], 2) == 2.79
    assert round(reference["kv_bytes_per_step"] / 1e9, 2) == 21.47  # the KV reads that do not shrink


def test_reference_formats_are_memory_bound_at_batch_32_and_int4_verifies_compute_bound(reference: dict) -> None:
    formats = by_name(reference)
    assert all(entry["step"]["binds"] == "memory" for entry in formats.values())
    assert formats["int4_g128"]["verify"]["binds"] == "compute" and formats["bf16"]["verify"]["binds"] == "memory"
    # the verify pass: 2 x 70e9 x 32 x 5 / 1e15 = 22.4 ms, over 19.2625 ms of memory time
    assert formats["int4_g128"]["verify"]["bound_ms"] == pytest.approx(22.4)


def test_every_time_is_labelled_a_lower_bound(reference: dict, cli) -> None:
    assert reference["lower_bounds"] is True and any("lower bound" in note for note in reference["notes"])
    assert any("extension" in note for note in reference["notes"])
    result = cli("bounds", "--reference-case")
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "lower bounds" in text and "(ms, >=)" in text and "46.667" in text and "2.1509" in text


# --- the formulas on tiny inputs with known answers ------------------------------------------

def test_formulas_on_hand_worked_inputs() -> None:
    hardware = HardwareProfile(name="toy", kind="assumption", hbm_bytes_per_second=100.0, peak_dense_flops=1000.0, source="test")
    assert bounds.kv_bytes_per_sequence(2, 3, 4, 1, 10) == 2 * 2 * 3 * 4 * 10
    assert bounds.weight_bytes(1000, 4) == 500
    # memory: (500 + 2 x 50) / 100 = 6 s; compute: 2 x 1000 x 2 x 1 / 1000 = 4 s
    decode = bounds.Decode(weight_bytes=500, parameters=1000, kv_per_sequence=50, hardware=hardware)
    assert decode.step_bound(batch=2, positions=1) == (6.0, "memory")
    assert decode.step_bound(batch=2, positions=2) == (8.0, "compute")
    assert decode.verify_cost_ratio(batch=2, gamma=1) == pytest.approx(8 / 6)
    assert bounds.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert bounds.speedup(0.5, 2, 0.25, 1.0) == pytest.approx(1.75 / 1.5)
    assert bounds.expected_tokens_per_step(0.0, 5) == 1.0


def test_alpha_sweep_against_hand_values() -> None:
    cfg = bounds.reference_case(load_profile("reference")).model_copy(update={"alphas": (0.6, 0.9)})
    bf16 = by_name(bounds.compute(cfg))["bf16"]
    # alpha 0.6: (1 - 0.6^5) / 0.4 = 2.3056, over 0.4 + 1 = 1.64686; alpha 0.9: 4.09510 / 1.4 = 2.92507
    assert [round(entry["speedup"], 5) for entry in bf16["alpha_sweep"]] == [1.64686, 2.92507]


def test_best_gamma_in_a_range_against_hand_values() -> None:
    cfg = bounds.reference_case(load_profile("reference")).model_copy(update={"gamma_range": (1, 8)})
    formats = by_name(bounds.compute(cfg))
    # BF16 verifies memory bound up to gamma 8 (2 x 70e9 x 32 x 9 / 1e15 = 40.3 ms < 53.8 ms), so the
    # paper's free-verification curve holds: gamma 5 -> 3.68928 / 1.5 = 2.45952, 6 -> 3.95142 / 1.6 =
    # 2.46964, 7 -> 4.16114 / 1.7 = 2.44773. Best: 6.
    assert formats["bf16"]["best_gamma"]["gamma"] == 6
    assert round(formats["bf16"]["best_gamma"]["speedup"], 5) == 2.46964
    # INT4 turns compute bound at gamma 4 (22.4 ms > 19.26 ms): gamma 3 -> 2.952 / 1.3 = 2.27077 wins
    assert formats["int4_g128"]["best_gamma"]["gamma"] == 3
    assert round(formats["int4_g128"]["best_gamma"]["speedup"], 5) == 2.27077
    assert formats["int4_g128"]["best_gamma"]["free_verification"]["gamma"] == 6


def test_smallest_compute_bound_batch_against_hand_values(reference: dict) -> None:
    # B (2 P (gamma+1) / F - kv / BW) > W / BW: per sequence 0.7 ms - 0.22370 ms = 0.47630 ms;
    # BF16 46.667 / 0.47630 = 97.98 -> 98; FP8 23.333 / 0.47630 = 48.99 -> 49; INT4 12.104 / 0.47630 = 25.41 -> 26
    formats = by_name(reference)
    assert [formats[name]["compute_bound_batch"] for name in ("bf16", "fp8_e4m3", "int4_g128")] == [98, 49, 26]
    hardware = load_profile("reference")
    int4 = formats["int4_g128"]["weight_bytes"]
    kv = reference["kv_bytes_per_sequence"]
    decode = bounds.Decode(weight_bytes=int4, parameters=70e9, kv_per_sequence=kv, hardware=hardware)
    assert decode.step_bound(batch=26, positions=5)[1] == "compute"
    assert decode.step_bound(batch=25, positions=5)[1] == "memory"
    # with a KV cache so large each sequence adds more memory than compute time: never
    large_kv = bounds.Decode(weight_bytes=int4, parameters=70e9, kv_per_sequence=kv * 10, hardware=hardware)
    assert large_kv.compute_bound_batch(positions=5) is None


def test_break_even_alpha_against_hand_values() -> None:
    # gamma 1, c 0.5: 1 + alpha = 1.5 -> 0.5; gamma 2, c 0.5: 1 + alpha + alpha^2 = 2 -> (sqrt 5 - 1) / 2
    assert bounds.break_even_alpha(1, 0.5) == pytest.approx(0.5, abs=1e-12)
    assert bounds.break_even_alpha(2, 0.5) == pytest.approx((math.sqrt(5) - 1) / 2, abs=1e-12)
    assert bounds.break_even_alpha(4, 0.0) == 0.0  # a free draft never loses
    assert bounds.break_even_alpha(2, 1.0) is None  # 2c + 1 = 3 = gamma + 1: no alpha < 1 reaches it
    alpha = bounds.break_even_alpha(4, 0.1)
    assert bounds.speedup(alpha, 4, 0.1) == pytest.approx(1.0, abs=1e-12)


def test_bound_with_one_byte_fp8_kv() -> None:
    cfg = bounds.reference_case(load_profile("reference")).model_copy(update={"compare_kv_bytes": (1.0,)})
    alternative = bounds.compute(cfg)["kv_alternatives"][0]
    assert alternative["kv_bytes_per_sequence"] == 335_544_320
    formats = by_name(alternative)
    # (140e9 + 32 x 335,544,320) / 3e12 = 50.2458 ms; INT4 (36.3125e9 + 10.7374e9) / 3e12 = 15.6833 ms
    assert round(formats["bf16"]["step"]["bound_ms"], 4) == 50.2458
    assert round(formats["int4_g128"]["step"]["bound_ms"], 4) == 15.6833
    assert round(formats["int4_g128"]["verify"]["verify_cost_ratio"], 4) == round(22.4 / 15.68331, 4)


# --- hardware profiles --------------------------------------------------------------------------

def test_builtin_profiles_are_sourced_and_labelled() -> None:
    assert set(builtin_profiles()) == {"reference", "h100-sxm", "h200"}
    reference, h100, h200 = (load_profile(name) for name in ("reference", "h100-sxm", "h200"))
    assert (reference.hbm_bytes_per_second, reference.peak_dense_flops, reference.kind) == (3.0e12, 1.0e15, "assumption")
    assert (h100.hbm_bytes_per_second, h100.peak_dense_flops, h100.kind) == (3.35e12, 989e12, "spec sheet")
    assert (h200.hbm_bytes_per_second, h200.peak_dense_flops, h200.kind) == (4.8e12, 989e12, "spec sheet")
    assert "datasheet" in h100.source and "datasheet" in h200.source


def test_profile_from_a_yaml_file(tmp_path: Path, cli) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nkind: assumption\nhbm_bytes_per_second: 1.0e12\npeak_dense_flops: 1.0e14\nsource: a guess\n")
    result = cli("bounds", "--hardware", path, "--parameters", 1e9, "--layers", 16, "--kv-heads", 8, "--head-dim", 64, "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["hardware"]["name"] == "mine"
    assert by_name(data)["bf16"]["batch1_weight_bound_ms"] == pytest.approx(2.0)  # 2e9 B / 1e12 B/s


@pytest.mark.parametrize("text, fragment", [
    ("name: bad\nkind: assumption\nhbm_bytes_per_second: -3.0e12\npeak_dense_flops: 1.0e15\nsource: x\n", "invalid hbm_bytes_per_second: Input should be greater than 0"),
    ("name: bad\nkind: rumour\nhbm_bytes_per_second: 3.0e12\npeak_dense_flops: 1.0e15\nsource: x\n", "invalid kind"),
    ("name: bad\nkind: assumption\nhbm_bytes_per_second: 3.0e12\npeak_dense_flops: 1.0e15\nsource: x\nboost: 2\n", "invalid boost"),
    ("- just\n- a list\n", "expected a YAML mapping"),
])
def test_bad_profiles_are_one_line_errors(tmp_path: Path, cli, text: str, fragment: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert_refused(cli("bounds", "--hardware", path, "--reference-case"), fragment, tmp_path / "nothing")


def test_unknown_profile_lists_the_builtins(cli, tmp_path: Path) -> None:
    assert_refused(cli("bounds", "--hardware", "h300", "--reference-case"), "did you mean 'h200'?", tmp_path / "nothing")


# --- settings that are errors, not numbers --------------------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    (("--alpha", "1.0"), "invalid alpha"),
    (("--alpha", "-0.1"), "invalid alpha"),
    (("--gamma", "0"), "invalid gamma"),
    (("--draft-cost", "-0.5"), "invalid draft-cost"),
    (("--batch", "0"), "invalid batch"),
    (("--kv-bytes", "0"), "invalid kv-bytes"),
    (("--alphas", "0.5,1.5"), "every alpha must be in [0, 1)"),
    (("--gamma-range", "5:2"), "gamma range must satisfy"),
    (("--gamma-range", "a:b"), "expected LOW:HIGH"),
    (("--format", "int4"), "expected NAME=BITS_PER_WEIGHT"),
    (("--format", "int4=-4"), "invalid format"),
    (("--format", "x=4", "--format", "x=8"), "format names must be unique"),
    (("--compare-kv-bytes", "-1"), "KV bytes per element must be positive"),
])
def test_invalid_settings_are_one_line_errors(cli, tmp_path: Path, args: tuple[str, ...], fragment: str) -> None:
    assert_refused(cli("bounds", "--reference-case", *args), fragment, tmp_path / "nothing")


def test_a_model_is_required(cli, tmp_path: Path) -> None:
    assert_refused(cli("bounds"), "give a model", tmp_path / "nothing")
    assert_refused(cli("bounds", "--parameters", "7e9", "--layers", "32"), "needs --kv-heads, --head-dim", tmp_path / "nothing")


@pytest.mark.parametrize("call", [
    lambda: bounds.speedup(1.0, 4, 0.1),
    lambda: bounds.speedup(0.8, 0, 0.1),
    lambda: bounds.speedup(0.8, 4, -0.1),
    lambda: bounds.memory_time(1.0, 0, 1.0, 1.0),
    lambda: bounds.memory_time(1.0, 1, 1.0, -3.0e12),
    lambda: bounds.compute_time(1.0, 1, 1, 0.0),
])
def test_library_refuses_bad_settings_with_an_input_error(call) -> None:
    with pytest.raises(InputError):
        call()


# --- models from checkpoints and the JSON schema ----------------------------------------------------

def test_model_from_a_checkpoint_uses_config_and_measured_bytes(tmp_path: Path, cli) -> None:
    from tests.helpers import write_header_only

    root = tmp_path / "ckpt"
    root.mkdir()
    write_header_only(root / "model.safetensors", {"model.layers.0.mlp.up_proj.weight": ("BF16", [256, 64]), "model.norm.weight": ("BF16", [64])})
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    result = cli("bounds", "--checkpoint", root, "--json", "--batch", "2", "--context", "100")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert (data["model"]["parameters"], data["model"]["layers"], data["model"]["kv_heads"], data["model"]["head_dim"]) == (256 * 64 + 64, 2, 2, 16)
    measured = by_name(data)["ckpt"]
    assert measured["weight_bytes"] == (256 * 64 + 64) * 2 and measured["source"].startswith("measured: unquantized BF16")
    assert [entry["name"] for entry in data["formats"]] == ["bf16", "fp8_e4m3", "int4_g128", "ckpt"]
    assert data["kv_bytes_per_sequence"] == 2 * 2 * 2 * 16 * 2 * 100


def test_bounds_json_has_the_documented_schema(cli) -> None:
    result = cli("bounds", "--reference-case", "--json", "--alphas", "0.7", "--gamma-range", "1:4", "--compare-kv-bytes", "1")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["kind"] == "bounds" and data["schema_version"] == 1 and data["lower_bounds"] is True
    assert set(data) == {"kind", "schema_version", "lower_bounds", "hardware", "model", "inputs", "kv_bytes_per_sequence",
                         "kv_bytes_per_step", "expected_tokens_per_target_step", "break_even_alpha_free_verification",
                         "formats", "comparisons", "kv_alternatives", "notes"}
    entry = data["formats"][0]
    assert set(entry) == {"name", "source", "bits_per_weight", "weight_bytes", "weight_gb", "weight_gib", "kv_bytes_per_element",
                          "batch1_weight_bound_ms", "step", "verify", "speculative", "compute_bound_batch", "break_even_alpha",
                          "alpha_sweep", "best_gamma"}
    assert set(entry["speculative"]) == {"expected_tokens_per_target_step", "plain_step_ms", "plain_step_source",
                                         "free_verification", "with_verify_cost"}


def test_a_profiles_figures_leave_out_its_prose() -> None:
    """The pipeline keys measurements by a profile's figures: rewording its description or source
    must not redo them, a changed number must."""
    profile = load_profile("h200")
    reworded = profile.model_copy(update={"description": "other words", "source": "another document"})
    faster = profile.model_copy(update={"hbm_bytes_per_second": profile.hbm_bytes_per_second * 2})
    assert reworded.figures() == profile.figures() != faster.figures()
    assert "description" not in profile.figures() and profile.figures()["name"] == "h200"
    # every field but the prose is a figure: a field added to the profile and not to its figures
    # would decide a bound without keying it
    assert set(profile.figures()) == set(HardwareProfile.model_fields) - {"description", "source"}
