"""`quantgate run` on the tiny model end to end: verdicts, the ledger, the report, exit codes,
resumption that redoes nothing; and `quantgate gate` on identical, damaged and re-policed
candidates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from quantgate.core.artifacts import read_json
from quantgate.gates import keys
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.executor import IN_PROCESS_ENV
from quantgate.pipeline.plan import from_mapping, load_plan
from tests.helpers import TINY_FORMATS, TINY_POLICY, plan_mapping, write_policy

FORMATS = TINY_FORMATS  # the formats plan_mapping's plan names


@pytest.fixture(scope="module")
def tiny_run(quant_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One finished run of the tiny model in two formats, made once for this module."""
    root = tmp_path_factory.mktemp("tiny-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("tiny-run-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        result = pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
        # the same user runs it again: their signing key, in each test's own (cache-less) home
        shutil.copytree(keys.keys_dir(), root.parent / f"{root.name}-keys")
    return root, result


@pytest.fixture(autouse=True)
def same_signing_key(request: pytest.FixtureRequest) -> None:
    """A test that runs the tiny run again does so as the user who made it (their key): a ledger
    record signed by another key is appended again, signed by the new one (gates/stage.py)."""
    if "tiny_run" in request.fixturenames:
        root, _ = request.getfixturevalue("tiny_run")
        shutil.copytree(root.parent / f"{root.name}-keys", keys.keys_dir(), dirs_exist_ok=True)


def copy_run(tiny_run, tmp_path: Path) -> Path:
    """A private copy of the finished run (paths inside it still name the original's checkpoints,
    so only stage-level behaviour is checked on a copy)."""
    root, _ = tiny_run
    shutil.copytree(root, tmp_path / "copy", symlinks=True)
    return tmp_path / "copy"


def test_run_gates_every_format_and_writes_ledger_and_report(tiny_run) -> None:
    root, result = tiny_run
    out = root / "run"
    assert set(result.verdicts) == set(FORMATS)
    for fmt in FORMATS:
        record = read_json(out / "verdicts" / f"{fmt}.json")["value"]
        assert record["verdict"] == result.verdicts[fmt].verdict
        gates = {gate["gate"]: gate for gate in record["gates"]}
        # metric gates with intervals, the size gate and the integrity gates, each with a reason
        assert {"wiki-text@v1 kl_divergence", "wiki-text@v1 top1_agreement", "lambada@v1 acc", "size bits_per_weight",
                "size unexplained_bytes", "integrity finite_logits", "integrity calibration_overlap"} <= set(gates)
        assert all(gate["reason"] for gate in gates.values())
        assert gates["wiki-text@v1 kl_divergence"]["low"] <= gates["wiki-text@v1 kl_divergence"]["estimate"] <= gates["wiki-text@v1 kl_divergence"]["high"]
        assert record["policy"]["name"] == "tiny" and len(record["policy"]["sha256"]) == 64
        assert {entry["name"] for entry in record["evalsets"]} == {"wiki-text", "lambada"}
    lines = (out / "ledger.jsonl").read_text().splitlines()
    assert [json.loads(line)["format"] for line in lines] == FORMATS
    report = read_json(out / "report" / "report.json")
    assert [row["format"] for row in report["rows"]] == ["baseline", *FORMATS]
    assert set(report["recommendation"]) == {"reference", "h200"}
    baseline, fp8, gptq = report["rows"]
    assert gptq["bytes"] < fp8["bytes"] < baseline["bytes"] and baseline["ratio_to_baseline"] == 1.0
    assert 4.0 < gptq["bits_per_weight_layers"] < 4.6 and 7.9 < fp8["bits_per_weight_layers"] < 8.1
    assert all(row["bounds"]["reference"]["batch1_ms"] > 0 for row in report["rows"])
    assert "wiki-text@v1 kl_divergence" in report["metric_columns"]
    assert (out / "report" / "report.html").read_text().count('class="point') == 3
    run = read_json(out / "run.json")
    assert run["status"] == "finished" and run["verdicts"].keys() == set(FORMATS)


def test_finished_run_started_again_does_nothing_and_prints_the_same_verdicts(tiny_run, quant_model: Path) -> None:
    root, first = tiny_run
    ledger_before = (root / "run" / "ledger.jsonl").read_bytes()
    again = pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    assert again.redone == []
    assert {stage.status for stage in again.stages} == {"reused"}
    assert {fmt: v.verdict for fmt, v in again.verdicts.items()} == {fmt: v.verdict for fmt, v in first.verdicts.items()}
    assert [v.reasons for v in again.verdicts.values()] == [v.reasons for v in first.verdicts.values()]
    assert (root / "run" / "ledger.jsonl").read_bytes() == ledger_before  # no duplicate records


def test_killed_run_redoes_only_what_is_missing(tiny_run, quant_model: Path) -> None:
    root, _ = tiny_run
    out = root / "run"
    # as if killed while evaluating gptq-int4: its results and its looks' record never landed,
    # and a half-written staging directory is left behind
    shutil.rmtree(out / "results" / "gptq-int4")
    (out / "sequential" / "gptq-int4.json").unlink()
    (out / "results" / ".gptq-int4.partial-dead").mkdir()
    ledger_before = (out / "ledger.jsonl").read_bytes()
    resumed = pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    assert resumed.redone == ["evaluate gptq-int4", "gate gptq-int4"]
    assert (out / "ledger.jsonl").read_bytes() == ledger_before  # the same verdict on the same bytes


def test_changed_checkpoint_is_quantized_again(tiny_run, quant_model: Path) -> None:
    root, _ = tiny_run
    out = root / "run"
    weights = out / "checkpoints" / "fp8-e4m3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")  # no longer what its manifest says
    resumed = pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    assert "quantize fp8-e4m3" in resumed.redone and "quantize gptq-int4" not in resumed.redone


def test_policy_edit_changes_the_verdict_of_a_run(tiny_run, quant_model: Path, tmp_path: Path) -> None:
    root, first = tiny_run
    strict = write_policy(tmp_path / "strict.yaml", TINY_POLICY.replace("4bit: 0.05", "4bit: 0.00001"))
    rerun = pipeline.run(from_mapping(plan_mapping(quant_model, root, policy=str(strict))), show_progress=False)
    # the looks are judged again (the policy's bounds decide when they stop) from cached
    # evaluations; nothing upstream of them is redone
    assert rerun.redone == ["evaluate fp8-e4m3", "gate fp8-e4m3", "evaluate gptq-int4", "gate gptq-int4", "report"]
    assert rerun.verdicts["gptq-int4"].verdict == "blocked" and rerun.exit_code == 1
    (reason,) = [r for r in rerun.verdicts["gptq-int4"].reasons if r.startswith("wiki-text kl_divergence")]
    assert reason.startswith("wiki-text kl_divergence 0.") and reason.endswith("exceeds 0.0000")
    # the ledger keeps both verdicts, each under its own policy hash
    policies = [json.loads(line)["policy"]["sha256"] for line in (root / "run" / "ledger.jsonl").read_text().splitlines()]
    assert len(set(policies)) == 2


def test_run_command_exit_codes_and_summary(cli, quant_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    mapping = plan_mapping(quant_model, tmp_path, formats=["fp8-e4m3"])
    plan.write_text(yaml.safe_dump(mapping))
    approved = cli("run", plan, "--quiet")
    assert approved.code == 0, approved.err
    assert "approved" in approved.out and "recommended on reference: fp8-e4m3" in approved.out
    strict = write_policy(tmp_path / "policy.yaml", TINY_POLICY.replace("8bit: 0.01,", "8bit: 0.0000001,"))
    blocked = cli("run", plan, "--quiet")
    assert blocked.code == 1 and "blocked" in blocked.out, blocked.err
    reason, *not_run = read_json(tmp_path / "run" / "verdicts" / "fp8-e4m3.json")["value"]["reasons"]
    assert reason.startswith("wiki-text kl_divergence") and strict.is_file()
    # fail fast: the KL gate blocked it, so lambada was never evaluated, and says why
    assert not_run and all(": not evaluated (blocked first by wiki-text kl_divergence" in r for r in not_run)
    again = cli("report", tmp_path / "run")
    assert again.code == 0 and "report written to" in again.out


@pytest.mark.parametrize("change, message", [
    ({"formats": ["gptq-imt4"]}, "unknown format 'gptq-imt4' (did you mean 'gptq-int4'?)"),
    ({"colour": "blue"}, "colour: unknown field; valid: schema_version, model, formats"),
    ({"calibration": {"sample": 8}}, "calibration.sample: unknown field (did you mean 'samples'?)"),
    ({"quantize": {"awq-int4": {"awq_n_grid": 5}}}, "quantize options for 'awq-int4', which is not in formats"),
    ({"quantize": {"gptq-int4": {"group_size": 100}}}, "quantize.gptq-int4.group_size: group size must be a positive multiple of 32"),
    ({"evaluation": {"sets": ["lambada"], "items": 4}}, "gates wiki-text, which is not evaluated here (sets: lambada@v1): "
     "evaluate it too, or narrow the policy to the sets evaluated (`narrow_policy: [lambada]` in the plan"),
    ({"narrow_policy": ["arc-easy"]}, "cannot narrow policy tiny@v1 to arc-easy: it gates wiki-text, lambada"),
    ({"narrow_policy": []}, "narrow_policy: Tuple should have at least 1 item"),
    ({"policy": "small-model@v2", "evaluation": {"sets": ["wiki-text", "lambada", "arc-easy", "hellaswag"], "items": 50}},
     "lambada@v1 is evaluated on 50 items at most, and policy small-model@v2 decides its acc gate on no fewer than 110"),
    ({"evaluation": {"sets": ["wiki-text", "lambda"]}}, "lambda"),
    ({"hardware": ["h300"]}, "unknown hardware profile 'h300'"),
    ({"model": "/nonexistent/model"}, "/nonexistent/model"),
])
def test_bad_plans_exit_2_in_one_line_before_any_work(cli, quant_model: Path, tmp_path: Path, change: dict, message: str) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path) | change))
    result = cli("run", plan)
    assert result.code == 2, result.err
    assert result.err.startswith("quantgate: error: ") and result.err.count("\n") == 1 and message in result.err
    assert not (tmp_path / "run").exists()  # nothing was started, nothing written


def test_missing_plan_and_broken_yaml_exit_2(cli, tmp_path: Path) -> None:
    assert cli("run", tmp_path / "none.yaml").code == 2
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    result = cli("run", broken)
    assert result.code == 2 and "cannot read it as YAML" in result.err


def test_demo_plan_is_embedded_and_validates() -> None:
    plan = load_plan("demo").plan
    # the four formats quantgate exists for (issue 36), FP8 in the variant vLLM's CPU build serves
    assert plan.formats == ("gptq-int4", "awq-int4", "smoothquant-w8a8", "fp8-e4m3")
    assert plan.quantize["fp8-e4m3"] == {"fp8_dynamic": True} and plan.quantize["awq-int4"] == {"awq_n_grid": 5}
    assert plan.model == "smollm2-135m" and plan.policy == "small-model@v5"
    assert plan.serving is not None and plan.serving.items == 16 and plan.serving.batch_sizes == (1,)
    assert plan.narrow_policy == ("lambada", "wiki-text")
    assert plan.search is not None and plan.search.formats == ("gptq-int4", "smoothquant-w8a8") and plan.search.max_bytes_ratio == 0.5
    assert plan.out == "demo-out" and plan.hardware == ("reference", "h200")
    assert set(plan.evaluation.items) == set(plan.evaluation.sets)  # every set has its ceiling
    assert plan.search.max_trials == 1


def test_a_format_that_fails_its_checks_is_blocked_and_stays_blocked(quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantgate import quantize
    from quantgate.quantize.checkpoint import QuantizationFailed

    calls = []

    def broken(cfg, *args, **kwargs):
        calls.append(cfg.format)
        raise QuantizationFailed("the quantized checkpoint produces NaN or Inf logits on the smoke prompt (12 values); not published")

    monkeypatch.setattr(quantize, "run", broken)
    monkeypatch.setenv(IN_PROCESS_ENV, "1")  # `calls` is this process's: the units run here
    mapping = plan_mapping(quant_model, tmp_path, formats=["gptq-int4"])
    result = pipeline.run(from_mapping(mapping), show_progress=False)
    assert result.exit_code == 1 and calls == ["gptq-int4"]
    (reason,) = result.verdicts["gptq-int4"].reasons
    assert reason.startswith("integrity: the quantized checkpoint produces NaN or Inf logits")
    assert not (tmp_path / "run" / "checkpoints" / "gptq-int4").exists()
    again = pipeline.run(from_mapping(mapping), show_progress=False)
    assert calls == ["gptq-int4"] and again.redone == []  # the same inputs fail the same way: not retried
    report = read_json(tmp_path / "run" / "report" / "report.json")
    assert report["rows"][1]["verdict"] == "blocked" and report["recommendation"]["reference"] is None


def test_one_run_at_a_time_in_a_run_directory(tiny_run, quant_model: Path) -> None:
    import fcntl
    import os

    from quantgate.core.errors import InputError

    root, _ = tiny_run
    lock = root / "run" / ".lock"
    lock.write_text("4242")
    with open(lock, "rb+") as held:  # another run holds it (a lock is per open file, so this process's own counts)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(InputError, match="another quantgate run \\(pid 4242\\) is using"):
            pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    assert lock.read_text() == "4242"  # the refused run left it alone
    lock.write_text(str(os.getpid() + 999999))  # left by a killed run (no one holds it): taken, and released at the end
    pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    assert not lock.exists()


@pytest.mark.parametrize("where", ["/proc/quantgate-run", "a-file/run", "a-file"])
def test_an_out_that_cannot_be_written_is_refused_in_one_line_before_any_work(cli, quant_model: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from quantgate.pipeline import executor as executors

    (tmp_path / "a-file").write_text("in the way")
    started: list[str] = []
    monkeypatch.setattr(executors, "make", lambda *args, **kwargs: started.append("executor"))
    plan = tmp_path / "plan.yaml"
    out = where if where.startswith("/") else str(tmp_path / where)
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path) | {"out": out}))
    result = cli("run", plan)
    assert result.code == 2, result.err
    # the tiny plan's ceilings are below the planner's: preflight warns of each such gate first (docs/gates.md)
    errors = [line for line in result.err.splitlines() if not line.startswith("quantgate: warning: plan: ")]
    assert len(errors) == 1 and errors[0].startswith(f"quantgate: error: out {out}: cannot write a run directory there ("), result.err
    assert started == []  # refused before the executor starts
    assert (tmp_path / "a-file").read_text() == "in the way"


def test_a_crash_is_a_traceback_and_exit_code_3_never_1(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(self):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pipeline.Pipeline, "run", bug)
    result = cli("run", "demo")
    assert result.code == 3  # 1 means "a format was blocked": a crash must not look like a verdict
    assert "Traceback (most recent call last)" in result.err and "RuntimeError: a bug" in result.err


def test_progress_names_each_stage_with_elapsed_time_an_estimate_and_items_per_second(
        quant_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    pipeline.run(from_mapping(plan_mapping(quant_model, tmp_path, formats=["fp8-e4m3"])), show_progress=True)
    err = capsys.readouterr().err
    labels = re.findall(r"^\[(\d+)/9\] (.+?)   run \d+s, ", err, flags=re.MULTILINE)
    assert [label for _, label in labels] == [
        "calibration", "overlap of calibration and golden sets", "measure baseline", "evaluate baseline",
        "quantize fp8-e4m3", "measure fp8-e4m3", "evaluate fp8-e4m3", "gate fp8-e4m3", "report"]
    assert "estimate after the first long stage" in err  # before anything long has run
    assert re.search(r"\[6/9\] measure fp8-e4m3   run \d+s, ~\d+s left \(estimate\)", err)  # after quantize and evaluate
    assert re.search(r"wiki-text@v1: 4 items in [\d.]+ s \([\d.]+ items/s\)", err)
    assert len(re.findall(r"^      done [a-z][^\n]* in [\d.]+ s", err, flags=re.MULTILINE)) == 9


class _Heard:
    """A stage reporter that keeps what the stage cache told it."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str, str]] = []

    def begin(self, label: str) -> None:
        self.heard.append(("begin", label, ""))

    def end(self, kind: str, label: str, status: str, seconds: float, detail: str = "") -> None:
        assert seconds >= 0
        self.heard.append((status, label, detail))


def test_stage_cache_reuses_by_key_remakes_what_changed_and_keeps_failures(tmp_path: Path) -> None:
    from quantgate.core.artifacts import MANIFEST, sha256_json, write_json
    from quantgate.core.errors import InputError
    from quantgate.core.rundir import RunDir
    from quantgate.core.stagecache import StageCache

    run_dir = RunDir(tmp_path)
    artifact = run_dir.results("x")
    made: list[str] = []
    loads_fail: list[bool] = []

    def produce() -> str:
        made.append("x")
        write_json(artifact / MANIFEST, {"made": len(made)})
        return "value"

    def load(path: Path) -> str:
        if loads_fail or read_json(path / MANIFEST).get("damaged"):
            raise InputError("damaged")
        return "loaded"

    heard = _Heard()
    cache = StageCache(run_dir, heard)

    def stage(key: str, failures: tuple[type[Exception], ...] = ()):
        return cache.directory(kind="evaluate", name="evaluate-x", label="evaluate x", key=key, artifact=artifact,
                               load=load, produce=produce, failures=failures)

    assert stage("k1").value == "value" and made == ["x"]
    record = read_json(run_dir.stage_record("evaluate-x"))
    assert record["key"] == "k1" and record["artifact"] == "results/x"
    assert stage("k1").value == "loaded" and made == ["x"]  # same key, same manifest: reused
    assert stage("k2").value == "value" and made == ["x", "x"]  # new inputs: made again
    write_json(artifact / MANIFEST, {"made": 2, "damaged": True})  # no longer the recorded manifest
    assert stage("k2").value == "value" and len(made) == 3
    loads_fail.append(True)  # the recorded manifest, but the artifact no longer loads (a file it names changed)
    assert stage("k2").value == "value" and len(made) == 4
    assert [status for status, _, _ in heard.heard if status != "begin"] == ["done", "reused", "done", "done", "done"]

    def fail() -> str:
        raise ValueError("no  good\nat all")

    failed = cache.directory(kind="quantize", name="quantize-y", label="quantize y", key="k", artifact=tmp_path / "y",
                             load=load, produce=fail, failures=(ValueError,))
    assert failed.value is None and failed.failed == "no good at all"
    again = cache.directory(kind="quantize", name="quantize-y", label="quantize y", key="k", artifact=tmp_path / "y",
                            load=load, produce=produce, failures=(ValueError,))
    assert again.value is None and heard.heard[-1] == ("reused", "quantize y", "failed before with these inputs: no good at all")

    value = cache.json(kind="measure", label="measure x", path=run_dir.measure("x"), key="j", produce=lambda: {"n": 1})
    assert value == {"n": 1} and read_json(run_dir.measure("x")) == {"key": "j", "value": {"n": 1}, "value_sha256": sha256_json({"n": 1})}
    assert cache.json(kind="measure", label="measure x", path=run_dir.measure("x"), key="j", produce=lambda: {"n": 2}) == {"n": 1}
    assert cache.json(kind="measure", label="measure x", path=run_dir.measure("x"), key="j2", produce=lambda: {"n": 2}) == {"n": 2}


# looks at 2 and 4 items before the ceiling (8); lambada's accuracy is decided on no fewer than 6
SEQUENTIAL_POLICY = TINY_POLICY.replace("version: v1\n", "version: v1\nsequential: {looks: [2, 4], min_items: 2}\n").replace(
    "undecided_margin: 50.0}", "min_items: 6}")


def test_looks_stop_each_set_when_its_gates_are_decided_and_record_the_items(quant_model: Path, tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "sequential.yaml", SEQUENTIAL_POLICY)
    mapping = plan_mapping(quant_model, tmp_path, policy=str(policy), evaluation={"sets": ["wiki-text", "lambada"], "items": 8})
    result = pipeline.run(from_mapping(mapping), show_progress=False)
    out = tmp_path / "run"
    for fmt in FORMATS:
        record = read_json(out / "verdicts" / f"{fmt}.json")["value"]
        sequential = record["sequential"]
        assert sequential["looks"] == {"wiki-text@v1": [2, 4, 8], "lambada@v1": [2, 4, 8]}
        assert sequential["error_control"] == "bonferroni"
        metric_gates = [gate for gate in record["gates"] if "@" in gate["gate"]]
        for gate in metric_gates:
            spec = gate["gate"].split()[0]
            if gate["outcome"] == "not evaluated":
                assert gate["estimate"] is None and record["verdict"] == "blocked"
                continue
            # the items that decided it are one of its set's looks, at that look's Bonferroni confidence
            assert gate["items"] == sequential["looks"][spec][gate["look"] - 1] and gate["looks"] == 3
            assert gate["confidence"] == pytest.approx(1 - 0.05 / 3)
            if gate["decided_by"] == "interval":  # wholly on one side of its limit
                assert gate["low"] >= gate["limit"] or gate["high"] <= gate["limit"]
            else:  # undecided until the ceiling
                assert gate["decided_by"] == "ceiling" and gate["items"] == 8
        # a set went on to a look only while one of its gates was open, and nothing was evaluated past a blocking gate
        for spec, items in sequential["items"].items():
            gates = [gate for gate in metric_gates if gate["gate"].startswith(spec)]
            # every gate of a set records how far its set went (0: never evaluated)
            assert gates and items == max(gate["items"] for gate in gates)
            looked = sorted(int(path.name.rsplit("@", 1)[1]) for path in (out / "looks" / fmt).glob(f"{spec}@*"))
            assert looked == [n for n in sequential["looks"][spec] if n <= items]
        assert [entry["format"] for entry in map(json.loads, (out / "ledger.jsonl").read_text().splitlines())].count(fmt) == 1
        # the accuracy gate needs 6 items: it looked at 2 and 4 in vain and was decided at the ceiling,
        # lambada's last look grown from the cached items of the earlier ones
        (accuracy,) = [gate for gate in metric_gates if gate["gate"] == "lambada@v1 acc"]
        if accuracy["outcome"] != "not evaluated":
            assert accuracy["items"] == 8 and accuracy["look"] == 3
            grown = read_json(out / "looks" / fmt / "lambada@v1@8" / "lambada@v1" / "record.json")
            assert grown["details"]["grown_from"]["items"] == 4 and grown["details"]["evaluated_here"] == 4
    assert any(gate["gate"] == "lambada@v1 acc" and gate["items"] == 8 for fmt in FORMATS
               for gate in read_json(out / "verdicts" / f"{fmt}.json")["value"]["gates"])
    again = pipeline.run(from_mapping(mapping), show_progress=False)
    assert again.redone == [] and {fmt: v.verdict for fmt, v in again.verdicts.items()} == {
        fmt: v.verdict for fmt, v in result.verdicts.items()}


def test_a_plan_can_narrow_the_policy_and_every_verdict_says_so(quant_model: Path, tmp_path: Path) -> None:
    mapping = plan_mapping(quant_model, tmp_path, formats=["fp8-e4m3"], narrow_policy=["wiki-text"],
                           evaluation={"sets": ["wiki-text"], "items": 4})
    pipeline.run(from_mapping(mapping), show_progress=False)
    record = read_json(tmp_path / "run" / "verdicts" / "fp8-e4m3.json")["value"]
    assert record["policy"]["narrowed_to"] == ["wiki-text"] and record["policy"]["dropped"] == ["lambada"]
    assert not any(gate["gate"].startswith("lambada") for gate in record["gates"])
    (entry,) = map(json.loads, (tmp_path / "run" / "ledger.jsonl").read_text().splitlines())
    assert entry["policy"]["narrowed_to"] == ["wiki-text"]
