"""`quantgate run` with a mixed-precision search on the tiny model: the sensitivity, the trials as
ordinary candidates (quantized, measured to their allocation, evaluated on the search split,
gated, in the ledger), the held-out gate of the chosen trial, a second run that reuses every
trial; and the plans a search refuses before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate.core.artifacts import read_json
from quantgate.gates.ledger import verify_checkpoint
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import plan_mapping

FORMATS = ["gptq-int4", "smoothquant-w8a8"]
# the tiny model's gptq-int4 has KL about 0.0016 on these items and W8A8 about 0.00002: a 4bit
# bound of 0.0009 blocks uniform INT4 and leaves room for a mix
SEARCH_POLICY = """\
name: tiny-search
version: v1
sequential: {min_items: 2}
metrics:
  wiki-text:
    kl_divergence: {max_value: {8bit: 0.01, 4bit: 0.0009}}
    top1_agreement: {min_value: {8bit: 0.90, 4bit: 0.80}, undecided_margin: 0.05}
  lambada:
    acc: {max_drop_points: {8bit: 5.0, 4bit: 10.0}, undecided_margin: 50.0}
mixed_precision: {rule: lowest-bits}
"""


def search_plan(model: Path, root: Path, **search: Any) -> dict[str, Any]:
    policy = root / "search-policy.yaml"
    policy.write_text(SEARCH_POLICY, encoding="utf-8")
    return plan_mapping(model, root, formats=FORMATS, policy=str(policy),
                        search={"formats": FORMATS, "max_trials": 3, **search})


@pytest.fixture(scope="module")
def searched(quant_model: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("search-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("search-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        result = pipeline.run(from_mapping(search_plan(quant_model, root)), show_progress=False)
        again = pipeline.run(from_mapping(search_plan(quant_model, root)), show_progress=False)
    return root / "run", result, again


def test_trials_are_gated_candidates_and_the_chosen_one_is_gated_on_held_out_items(searched) -> None:
    out, result, _ = searched
    record = read_json(out / "search.json")
    assert result.verdicts["gptq-int4"].verdict == "blocked"  # why a search is wanted
    trials = record["trials"]
    assert 1 <= len(trials) <= 3 and record["chosen"] in {trial["name"] for trial in trials}
    for trial in trials:
        verdict = read_json(out / "verdicts" / f"{trial['name']}.json")["value"]
        assert verdict["split"] == "search" and verdict["verdict"] == trial["verdict"] == result.verdicts[trial["name"]].verdict
        assert verdict["precision"] == ("4bit" if "gptq-int4" in trial["groups_by_format"] else "8bit")
        gates = {gate["gate"]: gate for gate in verdict["gates"]}
        assert gates["size allocation_bytes"]["outcome"] == "pass"  # measured to the byte against the allocation
        assert trial["bytes"] <= trial["budget_bytes"]
    held = read_json(out / "verdicts" / f"{record['chosen']}@held-out.json")["value"]
    assert held["split"] == "held-out" and record["held_out"]["verdict"] == held["verdict"]
    # held-out items: after each set's ceiling (4), never evaluated for a trial or a format
    assert held["split_items"] == {"wiki-text@v1": {"offset": 4, "ceiling": 4}, "lambada@v1": {"offset": 4, "ceiling": 4}}
    assert {entry["limit"] for entry in held["evalsets"]} == {4}
    looked = {path.name for path in (out / "looks" / record["chosen"]).iterdir()}
    assert {"wiki-text@v1+4@4", "lambada@v1+4@4"} <= looked
    assert record["conclusion"].startswith(record["chosen"])


def test_the_ledger_approves_a_trial_only_through_its_held_out_gate(searched) -> None:
    out, _, _ = searched
    record = read_json(out / "search.json")
    lines = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [line.get("split") for line in lines] == [None, None, *["search"] * len(record["trials"]), "held-out"]
    held = lines[-1]
    trust = out / "trusted-keys.pem"  # the run's: the key that signed its ledger
    found = verify_checkpoint(out / "checkpoints" / record["chosen"], out / "ledger.jsonl", trust)
    assert found.deployable == (held["verdict"] == "approved")
    for trial in record["trials"]:
        if trial["name"] != record["chosen"] and trial["verdict"] == "approved":
            assert not verify_checkpoint(out / "checkpoints" / trial["name"], out / "ledger.jsonl", trust).deployable


def test_a_second_run_reuses_every_trial(searched) -> None:
    out, first, again = searched
    assert again.redone == []
    assert {name: v.verdict for name, v in again.verdicts.items()} == {name: v.verdict for name, v in first.verdicts.items()}
    report = read_json(out / "report" / "report.json")
    assert report  # the report is written after the search


def write_plan(tmp_path: Path, mapping: dict[str, Any]) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(mapping), encoding="utf-8")
    return path


@pytest.mark.parametrize(("search", "items", "fragment"), [
    ({"formats": ["gptq-int4"]}, None, "a search mixes at least two formats"),
    ({"formats": ["gptq-int4", "gptq-int3"]}, None, "unknown format 'gptq-int3'"),
    ({"formats": ["gptq-int4", "smoothquant-w8a8"], "max_bytes_ratio": 0.2}, None, "below the smallest format it mixes"),
    ({"formats": ["gptq-int4", "fp8-e4m3"]}, None, "which is not in formats"),
    (FORMATS, {"wiki-text": {"ceiling": 4, "held_out": 100000}, "lambada": 4}, "held out"),
    (FORMATS, {"wiki-text": {"ceiling": 4, "search": 8}, "lambada": 4}, "8 items on the search split, more than its ceiling 4"),
])
def test_a_search_that_cannot_run_is_refused_before_any_work(cli, quant_model: Path, tmp_path: Path, search: Any,
                                                             items: dict[str, Any] | None, fragment: str) -> None:
    mapping = search_plan(quant_model, tmp_path)
    mapping["search"] = {"formats": search} if isinstance(search, list) else search
    if items is not None:
        mapping["evaluation"]["items"] = items
    result = cli("run", write_plan(tmp_path, mapping))
    assert result.code == 2, result.err
    errors = [line for line in result.err.splitlines() if line.startswith("quantgate: error:")]
    assert len(errors) == 1 and fragment in errors[0], result.err
    assert not (tmp_path / "run").exists()


def test_a_policy_without_a_rule_for_mixed_checkpoints_is_refused_before_any_work(cli, quant_model: Path, tmp_path: Path) -> None:
    mapping = search_plan(quant_model, tmp_path)
    policy = Path(mapping["policy"])
    policy.write_text(SEARCH_POLICY.replace("mixed_precision: {rule: lowest-bits}\n", ""), encoding="utf-8")
    result = cli("run", write_plan(tmp_path, mapping))
    assert result.code == 2 and "has no rule for mixed-precision checkpoints" in result.err
    assert not (tmp_path / "run").exists()
