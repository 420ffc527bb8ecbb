"""Gate policies load, validate with useful errors, and decide without rounding."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate.core.errors import InputError
from quantgate.gates.policy import BOUNDS, POLICY_DIR, MetricGate, Outcome, decide, load_policy, resolve_policy

VALID = {"arc-easy": ["acc", "acc_norm"], "hellaswag": ["acc", "acc_norm"], "lambada": ["acc", "perplexity"],
         "wiki-text": ["perplexity", "bits_per_byte", "kl_divergence", "top1_agreement", "kl_median", "kl_p90", "kl_p99",
                       "kl_p999", "kl_max", "top_prob_change_mean", "top_prob_change_p01"]}


def test_default_policy_loads_with_its_hash() -> None:
    loaded = load_policy("default", VALID)
    assert loaded.identity["name"] == "default" and loaded.identity["version"] == "v4"  # the newest
    assert len(loaded.sha256) == 64
    gate = loaded.policy.metrics["hellaswag"]["acc_norm"]
    assert gate.kind == "max_drop_points" and gate.threshold("8bit") == 1.0 and gate.threshold("4bit") > 1.0


@pytest.mark.parametrize("text, fragment", [
    ("metrics: {arc-easy: {acc_nrom: {max_drop_points: {8bit: 1}}}}", "has no metric 'acc_nrom' (did you mean 'acc_norm'?)"),
    ("metrics: {arc-esay: {acc: {max_drop_points: {8bit: 1}}}}", "unknown golden set 'arc-esay' (did you mean 'arc-easy'?)"),
    ("metrics: {arc-easy: {acc: {max_drop_pts: {8bit: 1}}}}", "Extra inputs are not permitted"),
    ("metrics: {arc-easy: {acc: {max_drop_points: {2bit: 1}}}}", "unknown precision class '2bit'"),
    ("metrics: {arc-easy: {acc: {max_drop_points: {8bit: 1}, max_value: {8bit: 1}}}}", "exactly one of"),
    ("metrics: [1, 2", "invalid YAML"),
    ("sequential: {looks: [100, 50]}\nmetrics: {}", "looks must be positive item counts in increasing order, got [100, 50]"),
    ("sequential: {looks_by_set: {wiki-txt: [10]}}\nmetrics: {}", "names 'wiki-txt', which is no golden set (did you mean 'wiki-text'?)"),
    ("metrics: {arc-easy: {acc: {max_drop_points: {8bit: 1}, min_items: 0}}}", "greater than 0"),
])
def test_invalid_policy_is_refused_with_the_valid_names(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("name: mine\nversion: v1\n" + text + "\n")
    with pytest.raises(InputError, match=None) as error:
        load_policy(path, VALID)
    assert fragment in str(error.value) and "Value error" not in str(error.value)  # our words, not pydantic's prefix


def test_unknown_builtin_policy_and_version() -> None:
    with pytest.raises(InputError, match="unknown policy 'defualt' \\(did you mean 'default'\\?\\)"):
        load_policy("defualt")
    with pytest.raises(InputError, match="has no version v7"):
        load_policy("default@v7")


def test_decision_does_not_round_before_comparing() -> None:
    # 0.945 must not pass a 0.95 minimum (the llm-compressor CI gate rounds, and it does)
    assert decide(0.945, 0.94, 0.95, limit=0.95, margin=0.0, higher_is_better=True) is Outcome.failed
    assert decide(-1.0000001, -1.5, -0.5, limit=-1.0, margin=1.0, higher_is_better=True) is Outcome.failed
    assert decide(-0.9999999, -1.5, -0.5, limit=-1.0, margin=1.0, higher_is_better=True) is Outcome.passed


def test_wide_interval_on_the_failing_side_is_insufficient_evidence() -> None:
    assert decide(-0.5, -4.5, 3.5, limit=-1.0, margin=3.0, higher_is_better=True) is Outcome.insufficient
    assert decide(-0.5, -3.5, 2.5, limit=-1.0, margin=3.0, higher_is_better=True) is Outcome.passed
    assert decide(0.01, 0.0, 0.05, limit=0.02, margin=0.02, higher_is_better=False) is Outcome.insufficient
    assert decide(0.01, 0.0, 0.03, limit=0.02, margin=0.02, higher_is_better=False) is Outcome.passed


@pytest.mark.parametrize("name", ["default", "small-model"])
def test_builtin_policies_validate_against_the_builtin_sets(name: str) -> None:
    from quantgate.gates.stage import load_gate_policy

    policy = load_gate_policy(name, ["arc-easy@v1", "hellaswag@v1", "lambada@v1", "wiki-text@v1"])
    assert policy.policy.name == name and policy.policy.statistics.insufficient_evidence == "block"
    for gates in policy.policy.metrics.values():
        for gate in gates.values():
            assert gate.threshold("8bit") <= gate.threshold("4bit") or gate.kind == "min_value"


def test_narrowed_policy_gates_only_the_kept_sets_and_says_so() -> None:
    from quantgate.gates.stage import load_gate_policy

    whole = load_gate_policy("small-model@v2", ["arc-easy@v1", "hellaswag@v1", "lambada@v1", "wiki-text@v1"])
    narrowed = whole.narrowed(["wiki-text", "arc-easy@v1"])
    assert list(narrowed.policy.metrics) == ["arc-easy", "wiki-text"] and narrowed.sha256 == whole.sha256
    assert narrowed.identity["narrowed_to"] == ["arc-easy", "wiki-text"] and narrowed.identity["dropped"] == ["hellaswag", "lambada"]
    assert narrowed.label == "small-model@v2 narrowed to arc-easy, wiki-text" and "narrowed_to" not in whole.identity
    with pytest.raises(InputError, match="cannot narrow policy small-model@v2 to piqa: it gates arc-easy, hellaswag"):
        whole.narrowed(["piqa"])


def test_a_policy_gating_unevaluated_sets_is_refused_with_both_ways_out() -> None:
    from quantgate.gates.stage import load_gate_policy

    with pytest.raises(InputError) as error:
        load_gate_policy("small-model@v2", ["arc-easy@v1", "wiki-text@v1"])
    message = str(error.value)
    assert "gates hellaswag, lambada, which is not evaluated here" in message and "evaluate them too" in message
    assert "--narrow-policy arc-easy --narrow-policy wiki-text" in message
    narrowed = load_gate_policy("small-model@v2", ["arc-easy@v1", "wiki-text@v1"], ["arc-easy", "wiki-text"])
    assert narrowed.identity["dropped"] == ["hellaswag", "lambada"]


def test_v3_is_v2_with_a_rule_for_mixed_checkpoints_and_nothing_else() -> None:
    for name in ("default", "small-model"):
        v2, v3 = load_policy(f"{name}@v2", VALID).policy, load_policy(f"{name}@v3", VALID).policy
        assert v2.mixed_precision is None and v3.mixed_precision is not None and v3.mixed_precision.rule == "lowest-bits"
        assert v3.model_dump(exclude={"version", "mixed_precision"}) == v2.model_dump(exclude={"version", "mixed_precision"})
    from quantgate.gates.policy import mixed_precision_class

    v3_policy = load_policy("small-model@v3", VALID)
    assert mixed_precision_class(v3_policy, {4, 8}) == "4bit" and mixed_precision_class(v3_policy, {8}) == "8bit"
    with pytest.raises(InputError, match="has no rule for mixed-precision checkpoints"):
        mixed_precision_class(load_policy("small-model@v2", VALID), {4, 8})


def test_the_index_says_which_version_is_current_and_it_is_the_newest() -> None:
    """Policy files are hashed as they are, so which version is current is said in
    gates/policies/README.md: one row per policy, naming the version a bare name resolves to."""
    readme = (POLICY_DIR / "README.md").read_text(encoding="utf-8")
    current = dict(re.findall(r"^\| `([\w-]+)` \| (v\d+):", readme, re.MULTILINE))
    assert set(current) == {path.name for path in POLICY_DIR.iterdir() if path.is_dir()}
    for name, version in current.items():
        assert resolve_policy(name).stem == version, name


def per_unit_margin(gate: dict[str, Any]) -> float:
    """The margin as the rule before `undecided_margin` was one field read it: a gate's own
    kind's spelling, `undecided_margin` for the value kinds, else none."""
    kind = next(bound for bound in BOUNDS if bound in gate)
    spelled = {"max_drop_points": "undecided_margin_points", "max_increase_percent": "undecided_margin_percent"}
    return gate.get(spelled.get(kind, "undecided_margin")) or 0.0


@pytest.mark.parametrize("path", sorted(POLICY_DIR.glob("*/v*.yaml")), ids=lambda path: f"{path.parent.name}@{path.stem}")
def test_every_shipped_version_reads_with_the_margins_it_always_had(path: Path) -> None:
    """The v1 files spell margins per unit; read into the one field, every gate of every version
    keeps the margin, hence the verdicts, it had (the files and their sha256 unchanged)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    loaded = load_policy(path, VALID)
    for set_name, gates in raw["metrics"].items():
        for metric, gate in gates.items():
            assert loaded.policy.metrics[set_name][metric].undecided_margin == per_unit_margin(gate), (set_name, metric)


@pytest.mark.parametrize("gate, margin", [
    ({"max_drop_points": {"8bit": 1.0}, "undecided_margin": 3.0}, 3.0),  # points, the bound's own unit
    ({"max_drop_points": {"8bit": 1.0}, "undecided_margin_points": 3.0}, 3.0),  # v1's spelling, the same
    ({"max_increase_percent": {"8bit": 3.0}, "undecided_margin_percent": 2.0}, 2.0),
    ({"max_drop_points": {"8bit": 1.0}, "undecided_margin_percent": 5.0}, 0.0),  # another kind's: never read, as before
    ({"max_drop_points": {"8bit": 1.0}, "undecided_margin_points": 3.0, "undecided_margin": 9.0}, 3.0),  # as v1 read it
    ({"max_value": {"8bit": 0.05}, "undecided_margin_points": 3.0, "undecided_margin": 0.01}, 0.01),
    ({"min_value": {"8bit": 0.9}}, 0.0),
])
def test_the_undecided_margin_is_one_field_in_the_bounds_unit(gate: dict[str, Any], margin: float) -> None:
    read = MetricGate.model_validate(gate)
    assert read.undecided_margin == margin
    assert set(read.model_dump(exclude_none=True)) <= {*BOUNDS, "undecided_margin", "min_items"}
