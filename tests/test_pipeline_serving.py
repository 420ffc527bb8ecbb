"""The serve stage in `quantgate run`: the baseline and each format served by vLLM (the serving
environment, loopback-only), the serving gate in every verdict, the report's serving table and
its measured recommendation; a policy that gates serving without the environment is refused
before any work."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml

from quantgate import pipeline, serving
from quantgate.core.artifacts import read_json
from quantgate.evalsets import served as served_check
from quantgate.pipeline.plan import from_mapping
from quantgate.serving import device, environment
from tests.helpers import LENIENT_POLICY, SERVED_FORMAT, SERVING_RULES, TINY_POLICY, plan_mapping, write_policy
from tests.test_serve_deadline import HANG_VARIABLE, hanging_env

SERVING_POLICY = TINY_POLICY.replace("version: v1", "version: v2") + SERVING_RULES
# load_margin 1.1: a serve that never loads (below) is abandoned at about the floor, 30 s, not 3x a cold start
SERVE_SETTINGS = {"items": 4, "greedy_prompts": 2, "prompt_tokens": 8, "greedy_tokens": 4, "batch_sizes": [1, 8],
                  "decode_tokens": 4, "runs": 1, "kv_cache_mib": 64, "bandwidth_mib": 16, "load_margin": 1.1}


def _plan(model: Path, root: Path, **changes: object) -> dict:
    mapping = plan_mapping(model, root, formats=[SERVED_FORMAT], serving=SERVE_SETTINGS, **changes)
    # the reference numerics in FP32 on every CPU class: the disagreeing-class test needs the tiny
    # candidate served further from what was gated than the baseline is, which holds against FP32
    # references; against BF16 ones (a CPU with BF16 arithmetic, `auto`) vLLM's BF16 serve of either
    # may be the closer, by chance
    mapping["evaluation"] = {**mapping["evaluation"], "dtype": "float32"}
    mapping["policy"] = str(write_policy(root / "serving-policy.yaml", SERVING_POLICY))
    return mapping


@pytest.fixture(scope="module")
def served_run(quant_model: Path, serving_env: serving.ServingEnv, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("served-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("served-run-home")))
        patch.setenv(environment.PYTHON_ENV, str(serving_env.python))
        result = pipeline.run(from_mapping(_plan(quant_model, root)), show_progress=False)
    return root / "run", result


def test_the_serve_stage_serves_the_baseline_and_each_format_and_the_gate_judges_it(served_run) -> None:
    out, result = served_run
    for name in ("baseline", SERVED_FORMAT):
        record = read_json(out / "serve" / f"{name}.json")["value"]
        assert record["served"] and record["agreement"]["items"] == 4 and "1" in record["throughput"]["batches"]
        assert (out / "serve" / name / "worker.log").is_file()
        # the timed probe ran first: its forward passes, and the limit they were held to (the
        # baseline's own limit for the baseline; the candidate's scales with the baseline's probe)
        assert len(record["probe"]["forward_seconds"]) == served_check.PROBE_PASSES and record["probe_limit_seconds"] > 0
    assert read_json(out / "serve" / "baseline.json")["value"]["probe_limit_seconds"] == served_check.BASELINE_PROBE_SECONDS
    # the load deadline: the baseline's own default, then a margin of the baseline's cold start measured here
    cfg = served_check.ServeCheckConfig.model_validate(SERVE_SETTINGS)
    baseline_record = read_json(out / "serve" / "baseline.json")["value"]
    candidate_record = read_json(out / "serve" / f"{SERVED_FORMAT}.json")["value"]
    assert baseline_record["load_deadline_seconds"] == cfg.baseline_load_s and baseline_record["cold_start_seconds"] > 0
    assert candidate_record["load_deadline_seconds"] == served_check.load_deadline(cfg, baseline_record["cold_start_seconds"]).seconds
    assert 0 < candidate_record["startup_seconds"] < candidate_record["load_deadline_seconds"]
    # the effective scheme read from the kernel vLLM logged, agreeing with the table on this machine
    [scheme] = candidate_record["schemes"]
    assert scheme["served_as"] == scheme["expected"] and scheme["kernel"] and "mismatch" not in scheme
    line = {stage.stage: stage for stage in result.stages}[f"serve {SERVED_FORMAT}"].detail
    assert line.startswith(f"served on {candidate_record['device_class']}: ") and f"{scheme['scheme']} as {scheme['served_as']} " \
        f"({scheme['kernel']})" in line and "(deadline" in line
    verdict = read_json(out / "verdicts" / f"{SERVED_FORMAT}.json")["value"]
    gates = {gate["gate"]: gate for gate in verdict["gates"]}
    assert gates["serving loads"]["outcome"] == "pass"
    baseline = read_json(out / "serve" / "baseline.json")["value"]["agreement"]
    mean = gates["serving mean_logprob_difference"]
    margin = 0.05 if SERVED_FORMAT == "gptq-int4" else 0.25  # weight-only, or quantized activations (small-model@v4)
    assert mean["limit"] == pytest.approx(baseline["mean_abs_logprob_difference"] + margin)
    assert verdict["serving"]["served"] and verdict["serving"]["throughput"]["8"]["tokens_per_s"] > 0
    stages = [stage.stage for stage in result.stages]
    assert [stage for stage in stages if stage.startswith("serve")] == ["serve baseline", f"serve {SERVED_FORMAT}"]
    assert stages.index("serve baseline") < stages.index(f"quantize {SERVED_FORMAT}") < stages.index(f"serve {SERVED_FORMAT}") \
        < stages.index(f"gate {SERVED_FORMAT}")


def test_the_report_shows_served_agreement_and_measured_tokens_per_second(served_run) -> None:
    out, _ = served_run
    report = read_json(out / "report" / "report.json")
    rows = {row["format"]: row for row in report["rows"]}
    assert rows["baseline"]["serving"]["served"] and rows[SERVED_FORMAT]["serving"]["served"]
    markdown = (out / "report" / "report.md").read_text()
    assert "## Served in vLLM" in markdown and f"| {SERVED_FORMAT} | yes (bfloat16) |" in markdown
    assert 'id="served"' in (out / "report" / "report.html").read_text()
    measured = report["measured_recommendation"]
    assert measured["baseline_tokens_per_s"] > 0
    approved = rows[SERVED_FORMAT]["verdict"] == "approved"
    assert measured["format"] == (SERVED_FORMAT if approved else None)
    assert "On this machine (cpu, vLLM, measured)" in markdown
    assert f"the 16-bit baseline decodes at {measured['baseline_tokens_per_s']:.1f} tokens/s there" in markdown


def test_a_finished_run_started_again_serves_nothing_again(served_run, quant_model: Path, serving_env: serving.ServingEnv,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = served_run
    monkeypatch.setenv(environment.PYTHON_ENV, str(serving_env.python))
    again = pipeline.run(from_mapping(_plan(quant_model, out.parent)), show_progress=False)
    served = [stage for stage in again.stages if stage.stage.startswith("serve")]
    assert len(served) == 2 and all(stage.status == "reused" for stage in served)


def test_a_candidate_serve_that_never_loads_is_abandoned_at_its_load_deadline_and_the_run_goes_on(
        served_run, quant_model: Path, serving_env: serving.ServingEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine hangs for the candidate's checkpoint (inside the serving environment: the
    zygote's fork hangs too). Its serve stops at the load deadline the baseline's cold start here
    sets, the unit's line says how long it ran and why, the verdict is pending on the device class
    it was served on (named, not "unknown"), and the run goes on to its report."""
    out, _ = served_run
    root = tmp_path / "copy"
    shutil.copytree(out, root / "run")  # everything reused but the candidate's serve
    (root / "run" / "serve" / f"{SERVED_FORMAT}.json").unlink()
    monkeypatch.setenv(environment.PYTHON_ENV, str(hanging_env(serving_env, tmp_path / "env").python))
    monkeypatch.setenv(HANG_VARIABLE, f"/checkpoints/{SERVED_FORMAT}")
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    baseline = read_json(root / "run" / "serve" / "baseline.json")["value"]
    deadline = served_check.load_deadline(served_check.ServeCheckConfig.model_validate(SERVE_SETTINGS), baseline["cold_start_seconds"])
    assert deadline.seconds <= 180
    started = time.monotonic()
    result = pipeline.run(from_mapping(_plan(quant_model, root)), show_progress=False)
    assert time.monotonic() - started < deadline.seconds + 120  # not the 900 s timeout
    stages = {stage.stage: stage for stage in result.stages}
    assert stages["serve baseline"].status == "reused"
    serve = stages[f"serve {SERVED_FORMAT}"]
    assert serve.status == "failed" and deadline.seconds <= serve.seconds < deadline.seconds + 30, serve
    assert f"did not load the checkpoint within {deadline.seconds:.0f} s, its load deadline ({deadline.basis})" in serve.detail
    verdict = result.verdicts[SERVED_FORMAT].to_json()
    here = device.local_class()
    assert verdict["verdict"] == "pending" and list(verdict["classes"]) == [here]
    assert verdict["serving"]["status"] == "failed" and verdict["serving"]["device_class"] == here
    assert (root / "run" / "report" / "report.html").is_file()


def test_a_policy_that_gates_serving_without_the_environment_is_refused_before_any_work(cli, quant_model: Path, tmp_path: Path,
                                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.PYTHON_ENV, raising=False)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(_plan(quant_model, tmp_path)))
    result = cli("run", plan)
    assert result.code == 2 and not (tmp_path / "run").exists()
    assert result.err.strip().splitlines()[-1].endswith("the serving environment is not built: run `quantgate serving setup` "
                                                        "(or `make serving`)")


# serving margins no quantized checkpoint meets (its served log-probs differ from gated more than
# the unquantized baseline's own), and quality bounds every tiny model meets: its serve disagrees,
# its quality passes, and what it serves is gated on the golden sets the engine evaluates
DISAGREEING_POLICY = LENIENT_POLICY.replace("name: lenient", "name: strict-serving") + SERVING_RULES.replace(
    "weight_only: 0.05, quantized_activations: 0.25", "weight_only: 1.0e-9, quantized_activations: 1.0e-9")


def test_what_a_disagreeing_class_serves_is_gated_on_the_golden_sets_the_engine_evaluates(
        served_run, quant_model: Path, serving_env: serving.ServingEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = served_run
    root = tmp_path / "copy"
    shutil.copytree(out, root / "run")  # its serve records answer this run: no vLLM starts for them again
    monkeypatch.setenv(environment.PYTHON_ENV, str(serving_env.python))
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    mapping = _plan(quant_model, root)
    mapping["policy"] = str(write_policy(root / "disagreeing.yaml", DISAGREEING_POLICY))
    result = pipeline.run(from_mapping(mapping), show_progress=False)
    verdict = read_json(root / "run" / "verdicts" / f"{SERVED_FORMAT}.json")["value"]
    served = read_json(root / "run" / "serve" / f"{SERVED_FORMAT}.json")["value"]
    device_class = served["device_class"]
    assert verdict["verdict"] == "pending" and verdict["classes"][device_class]["status"] == "blocked"
    # what the serve stage served is gated; where the engine's default serves other numerics on this
    # class (INT4 as W4A8 on an AMX CPU), and disagrees too, those are gated beside it
    entries = {entry["numerics"]: entry for entry in verdict["as_served"]}
    default = served.get("engine_default")
    assert set(entries) == {"served"} | ({"engine_default"} if default else set()), list(entries)
    gated = entries["served"]
    assert gated["settings"] == served["engine_settings"]
    if default:
        assert entries["engine_default"]["settings"] == default["settings"] and entries["engine_default"]["status"] == "passed"
    assert gated["served_as"] == {entry["scheme"]: entry["served_as"] for entry in served["schemes"]}
    assert gated["because"].startswith("serving: served log-probs differ from gated")
    # the lambada items its gate judged, evaluated again through vLLM, paired with the baseline's and gated
    assert [gate["gate"] for gate in gated["gates"]] == ["lambada@v1 acc"] and gated["status"] == "passed"
    results = read_json(Path(gated["results"]) / "manifest.json")
    assert results["config"]["backend"] == "vllm" and list(results["sets"]) == ["lambada@v1"]
    assert results["sets"]["lambada@v1"]["limit"] == verdict["sequential"]["items"]["lambada@v1"]
    # the class's entry, the CLI's and the report's lines say it
    assert [entry["status"] for entry in verdict["classes"][device_class]["as_served"]] == ["passed"] * len(entries)
    html = (root / "run" / "report" / "report.html").read_text()
    assert f"{SERVED_FORMAT} on {device_class}, as the serve stage served it" in html
    assert f"evaluate {SERVED_FORMAT} as served (served on {device_class})" in [stage.stage for stage in result.stages]
    # started again: nothing evaluated again
    again = pipeline.run(from_mapping(mapping), show_progress=False)
    assert {stage.stage: stage.status for stage in again.stages}[f"evaluate {SERVED_FORMAT} as served (served on {device_class})"] \
        == "reused"
