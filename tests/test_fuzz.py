"""Fuzzing every file quantgate reads (tests/fuzzing.py names the readers and mutations): each
hostile input ends in exit 0 with a correct result, or exit 2 with exactly one error line;
never a traceback, a hang, or a file written outside the command's output. A bounded run, about
a minute in all; `benchmarks/fuzz_campaign.py` runs the same properties far longer."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from tests.fuzzing import (
    HARDWARE,
    Mutation,
    Reader,
    Sandbox,
    apply,
    check,
    environment,
    invoke,
    mutations,
    preflight_only,
    readers,
    run_one,
)
from tests.helpers import TINY_POLICY

READERS = readers()
# Inputs per reader, within the module's minute: readers whose command is cheap (a manifest, a
# header, a ledger: about 20 ms an input) get DEFAULT_EXAMPLES; those that tokenize, parse YAML
# in pure Python or gate (0.1 to 0.4 s an input) get fewer.
DEFAULT_EXAMPLES = 40
EXAMPLES = {
    "calibration source .txt": 12, "calibration source .jsonl": 12, "policy YAML (evalsets plan)": 12,
    "hardware profile YAML (bounds)": 12, "run plan YAML (run, preflight)": 15, "evaluation results manifest.json (gate)": 15,
    "evaluation results mine@v1/items.json (gate)": 15, "evaluation results mine@v1/record.json (gate)": 15,
}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def seeds(sandbox: Sandbox) -> dict[str, bytes]:
    """Each reader's valid file, made once (the readers share the tiny model and the sets)."""
    made = {}
    with environment(sandbox):
        for reader in READERS:
            made[reader.name] = reader.setup(sandbox)
    return made


@pytest.mark.parametrize("reader", READERS, ids=[reader.name for reader in READERS])
def test_every_input_is_read_or_refused_in_one_line(reader: Reader, sandbox: Sandbox, seeds: dict[str, bytes]) -> None:
    valid = seeds[reader.name]

    @settings(max_examples=EXAMPLES.get(reader.name, DEFAULT_EXAMPLES), deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutation=mutations(valid, reader.format))
    def property_(mutation: Mutation) -> None:
        with preflight_only():
            failure = check(reader, sandbox, mutation)
        assert failure is None, f"{reader.name}: {mutation.describe()}\n  -> {failure}"

    property_()


def test_the_valid_files_are_accepted(sandbox: Sandbox, seeds: dict[str, bytes]) -> None:
    """The property can fail: each reader's own valid file is read with exit 0 and a correct
    result, and a file of the wrong kind entirely is refused in one line."""
    for reader in READERS:
        with preflight_only():
            outcome, failure = run_one(reader, sandbox, Mutation("valid", seeds[reader.name]))
        assert failure is None and outcome is not None and outcome.code == 0, (reader.name, failure, outcome)
    txt = READERS[0]
    failure = check(txt, sandbox, Mutation("not UTF-8", b"caf\xe9 au lait\n"))
    assert failure is None
    with environment(sandbox):
        from tests.fuzzing import invoke

        outcome = invoke(txt.args(sandbox))
    assert outcome.code == 2 and outcome.err.count("\n") == 1 and "not UTF-8" in outcome.err


# ---- inputs the fuzzing found (or that its mutations stand for), each a crash (exit 3) or a
# hang before its fix: now exit 2 with the line's fragment, or exit 0 where the input is fine

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n" for previous, name in zip("abcdefgh", "bcdefghi", strict=True))

REGRESSIONS = [
    # reader, input, exit code, fragment of the error line
    ("calibration source .txt", b"caf\xe9 au lait\n", 2, "not UTF-8 text"),
    ("calibration source .jsonl", b'{"text": "\\ud800"}\n', 2, "unpaired surrogate"),
    ("calibration source: datasets directory state.json", b'{"_data_files": [', 2, "not a readable datasets directory"),
    ("calibration set manifest.json", b"\xff\xfe{}", 2, "not UTF-8 text"),
    # a manifest of another schema_version (or none) is refused before any field is read
    ("calibration set manifest.json", b'{"kind": "calibration-set", "fingerprint": "f", "files": {"a\\u0000b": "0"}}', 2,
     "no schema_version; this quantgate reads 1"),
    ("golden set source JSONL (evalsets add)", b"[" * 50_000 + b"]" * 50_000 + b"\n", 2, "nested too deeply"),
    ("golden set source JSONL (evalsets add)", b'{"query": "q", "choices": ["a"], "gold": ' + b"9" * 5000 + b"}\n", 2, "digits"),
    ("golden set items.jsonl", b"\x00\n", 2, "line 1: not valid JSON"),
    ("golden set items.jsonl", b"caf\xe9\n", 2, "not UTF-8 text"),
    ("policy YAML (evalsets plan)", LAUGHS.encode(), 2, "aliases expand to more than"),
    ("policy YAML (evalsets plan)", b"name: &n [*n]\n", 2, "an alias refers to a node that contains it"),
    ("policy YAML (evalsets plan)", b"name: t\nversion: v1\nmetrics:\n  ? wiki-text@v" + b"1" * 5000
     + b"\n  : kl_divergence: {max_value: {8bit: 0.01, 4bit: 0.05}, undecided_margin: 0.01}\n", 2, "no set version is that long"),
    # a NaN bound compares false with every estimate: the gate passed anything (exit 0, approved)
    ("policy YAML (evalsets plan)", TINY_POLICY.replace("8bit: 0.01", "8bit: .nan").encode(), 2, "Input should be a finite number"),
    ("hardware profile YAML (bounds)", b"hbm_bytes_per_second: " + b"9" * 5000 + b"\n", 2, "digits"),
    ("hardware profile YAML (bounds)", b"[" * 5000 + b"]" * 5000, 2, "nested too deeply"),
    ("hardware profile YAML (bounds)", HARDWARE.replace("4.8e12", "1e999").encode(), 2, "invalid hbm_bytes_per_second: Input should be a finite number"),
    ("evaluation results manifest.json (gate)", b'{"artifact": "evaluation-results", "schema_version": 7, "files": [], "sets": 1}', 2,
     "schema_version 7; this quantgate reads 1"),
    ("evaluation results mine@v1/items.json (gate)", b'{"items": 7}', 2, "holds no `items` list"),
]


@pytest.mark.parametrize("name, data, code, fragment", REGRESSIONS, ids=[f"{row[0]}: {row[3]}" for row in REGRESSIONS])
def test_found_inputs(name: str, data: bytes, code: int, fragment: str, sandbox: Sandbox, seeds: dict[str, bytes]) -> None:
    reader = next(reader for reader in READERS if reader.name == name)
    outcome, failure = run_one(reader, sandbox, Mutation("found", data))
    assert failure is None, failure
    assert outcome is not None and outcome.code == code and fragment in outcome.err, outcome


PLAN_CHANGES = [
    # (section, field, value), the error line's fragment
    (("evaluation", "sets", ["a" * 1000]), "unknown evalset"),  # ENAMETOOLONG: an OSError traceback
    (("evaluation", "sets", ["wiki-text@v" + "1" * 5000]), "not NAME or NAME@vN"),  # int() past its digit limit
    ((None, "policy", ""), "unknown policy ''"),  # the policies folder itself, no version in it: IndexError
    ((None, "policy", "x" * 5000 + ".yaml"), "does not exist"),
    ((None, "model", "/" + "m" * 5000), "is no path, demo model or hub id"),
    ((None, "hardware", ["h" * 5000 + ".yaml"]), "unknown hardware profile"),
    ((None, "out", "o" * 5000), "not a path (5000 characters)"),
    (("calibration", "source", "s\x00.txt"), "with a NUL"),
]


@pytest.mark.parametrize("change, fragment", PLAN_CHANGES, ids=[fragment for _, fragment in PLAN_CHANGES])
def test_plan_naming_what_no_file_can_be(change: tuple[str | None, str, object], fragment: str, sandbox: Sandbox,
                                         seeds: dict[str, bytes]) -> None:
    """A plan naming a set, a policy, a model, a profile or a path that no file can be (too long,
    a NUL, an empty name): one line, not an OSError, ValueError or IndexError traceback."""
    reader = next(reader for reader in READERS if reader.name.startswith("run plan"))
    plan = yaml.safe_load(seeds[reader.name])
    section, field, value = change
    (plan[section] if section else plan)[field] = value
    with preflight_only():
        outcome, failure = run_one(reader, sandbox, Mutation("found", yaml.safe_dump(plan).encode()))
    assert failure is None, failure
    assert outcome is not None and outcome.code == 2 and fragment in outcome.err, outcome


@pytest.mark.parametrize("field, value", [("kl_sum", {"nats": 1}), ("id", 5), ("nll", [1.0]), ("index", -1)])
def test_results_item_of_the_wrong_type(field: str, value: object, sandbox: Sandbox, seeds: dict[str, bytes]) -> None:
    """A per-item record (its manifest hash recomputed) whose field the gates compute with is of
    the wrong type: one line, not a TypeError from deep in the verdict's arithmetic."""
    reader = next(reader for reader in READERS if reader.name.startswith("evaluation results mine@v1/items.json"))
    items = json.loads(seeds[reader.name])
    items["items"][0][field] = value
    outcome, failure = run_one(reader, sandbox, Mutation("found", json.dumps(items).encode()))
    assert failure is None, failure
    assert outcome is not None and outcome.code == 2 and f"item 0: `{field}` is" in outcome.err, outcome


def test_results_naming_a_model_path_no_file_can_have(sandbox: Sandbox, seeds: dict[str, bytes]) -> None:
    """The candidate's manifest names its model by a 5000-character path: the gate looked for it
    (OSError ENAMETOOLONG, exit 3); now the manifest is refused in one line."""
    reader = next(reader for reader in READERS if reader.name == "evaluation results manifest.json (gate)")
    manifest = json.loads(seeds[reader.name])
    manifest["model"]["path"] = "/" + "m" * 5000
    outcome, failure = run_one(reader, sandbox, Mutation("found", json.dumps(manifest).encode()))
    assert failure is None, failure
    assert outcome is not None and outcome.code == 2 and "field model.path: no file can have this path" in outcome.err, outcome


DAMAGED_MANIFESTS = [
    # reader, a change to its valid manifest, the error line's fragment: each once a crash or a
    # check of its own, now the record's one line naming the field
    ("calibration set manifest.json", lambda manifest: manifest["files"].update({"a\x00b": "0"}), "field files: 'a\\x00b' cannot name a file"),
    ("calibration set manifest.json", lambda manifest: manifest["files"].update({"a" * 1000: "0"}), "cannot name a file"),
    ("calibration set manifest.json", lambda manifest: manifest["tokenizer"].update(sha256=7), "field tokenizer.sha256: Input should be a valid string"),
    ("evaluation results manifest.json (gate)", lambda manifest: manifest.update(files=[]), "field files: Input should be a valid dictionary"),
    ("evaluation results manifest.json (gate)", lambda manifest: manifest["sets"]["mine@v1"].update(items="4"),
     "field sets.mine@v1.items: Input should be a valid integer"),
    ("evaluation results manifest.json (gate)", lambda manifest: manifest["sets"]["mine@v1"].update(dir="../elsewhere"),
     "is not a directory inside it"),
]


@pytest.mark.parametrize("name, change, fragment", DAMAGED_MANIFESTS, ids=[row[2] for row in DAMAGED_MANIFESTS])
def test_damaged_manifests_are_refused_naming_the_field(name: str, change: Any, fragment: str, sandbox: Sandbox,
                                                        seeds: dict[str, bytes]) -> None:
    reader = next(reader for reader in READERS if reader.name == name)
    manifest = json.loads(seeds[reader.name])
    change(manifest)
    outcome, failure = run_one(reader, sandbox, Mutation("found", json.dumps(manifest).encode()))
    assert failure is None, failure
    assert outcome is not None and outcome.code == 2 and outcome.err.count("\n") == 1 and fragment in outcome.err, outcome


@pytest.mark.parametrize("data", [b"[1, 2]", b"\xff\xfe", b'{"kind": 7, "items": "many"}'])
def test_list_and_audit_with_a_users_manifest_that_is_no_manifest(data: bytes, sandbox: Sandbox, seeds: dict[str, bytes]) -> None:
    """`evalsets list` shows a user's set whose manifest is no JSON object (it raised AttributeError)
    or not UTF-8, as unreadable; `evalsets audit` names it among the failures in one line."""
    reader = next(reader for reader in READERS if reader.name == "golden set manifest.json")
    reader.outputs(sandbox)  # the pristine user set back in place
    apply(reader, sandbox, Mutation("found", data))
    with environment(sandbox):
        listed, verified = invoke(["evalsets", "list"]), invoke(["evalsets", "audit"])
    assert listed.code == 0 and "mine@v1" in listed.out, listed
    assert verified.code == 2 and verified.err.count("\n") == 1 and "mine@v1" in verified.err, verified
    assert "FAILED\tmine@v1" in verified.out and "ok\twiki-text@v1" in verified.out
