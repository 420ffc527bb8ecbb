"""Readers that must not say nothing: a key given twice in any YAML or JSON the tool reads (YAML
and JSON parsers keep the last one without a word: a second `policy:` line would change the policy
a run gates under), and a Ray address where nothing listens (Ray retries for minutes). Each is one
line and exit 2, the second within 15 seconds."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from quantgate.core.artifacts import read_json, read_yaml
from quantgate.core.errors import InputError
from quantgate.gates.policy import load_policy
from quantgate.quantize.measure.hardware import load_profile
from tests.helpers import TINY_POLICY, plan_mapping


def test_a_plan_that_gives_a_key_twice_is_refused_in_one_line_before_any_work(cli, quant_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    text = yaml.safe_dump(plan_mapping(quant_model, tmp_path))
    plan.write_text(text + "policy: small-model@v4\n")  # a second policy line, at the end
    result = cli("run", plan)
    first = next(number for number, line in enumerate(text.splitlines(), 1) if line.startswith("policy:"))
    assert result.code == 2 and result.err.count("\n") == 1
    assert f"`policy` is given twice (lines {first} and {text.count(chr(10)) + 1}): remove one" in result.err, result.err
    assert not (tmp_path / "run").exists()


def test_every_yaml_reader_refuses_a_key_twice_at_any_depth_and_merge_keys_still_work(tmp_path: Path) -> None:
    nested = tmp_path / "nested.yaml"
    nested.write_text("metrics:\n  lambada:\n    acc: {max_drop_points: 5}\n    acc: {max_drop_points: 50}\n")
    with pytest.raises(InputError, match=r"`acc` is given twice \(lines 3 and 4\)"):
        read_yaml(nested, "policy")
    policy = tmp_path / "policy.yaml"
    policy.write_text(TINY_POLICY + "version: v2\n")
    with pytest.raises(InputError, match=r"^policy .*policy.yaml: `version` is given twice"):
        load_policy(policy)
    profile = tmp_path / "profile.yaml"
    profile.write_text("name: mine\nmemory_bandwidth_gbps: 3000\nmemory_bandwidth_gbps: 30000\n")
    with pytest.raises(InputError, match="`memory_bandwidth_gbps` is given twice"):
        load_profile(str(profile))
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &base {a: 1, b: 2}\nmine:\n  <<: *base\n  b: 3\n")
    assert read_yaml(merged, "plan")["mine"] == {"a": 1, "b": 3}  # YAML's own way to repeat: not a key twice


def test_json_records_and_jsonl_input_that_give_a_key_twice_are_refused(cli, tmp_path: Path) -> None:
    record = tmp_path / "manifest.json"
    record.write_text('{"artifact": "evaluation-results", "artifact": "measurement"}')
    with pytest.raises(InputError, match=r"invalid JSON \(key 'artifact' appears twice\)"):
        read_json(record)
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"query": "2 + 2 =", "choices": ["4", "5"], "gold": 0}) + "\n"
                     + '{"query": "1 + 1 =", "choices": ["2", "3"], "gold": 0, "gold": 1}\n')
    result = cli("evalsets", "add", "--name", "mine", "--kind", "multiple-choice", "--from", items)
    assert result.code == 2 and result.err.count("\n") == 1 and "key 'gold' appears twice" in result.err, result.err


def test_a_ray_address_where_nothing_listens_is_refused_in_one_line_within_15_seconds(cli, quant_model: Path,
                                                                                      tmp_path: Path) -> None:
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path)))
    started = time.monotonic()
    result = cli("run", plan, "--executor", "ray", "--address", f"127.0.0.1:{port}")
    assert time.monotonic() - started < 15
    errors = [line for line in result.err.splitlines() if line.startswith("quantgate: error:")]
    assert result.code == 2 and len(errors) == 1, result.err  # (the plan's power warnings come before it)
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}: connection refused (is `ray start --head` running there?)" \
        in result.err
    assert not (tmp_path / "run" / "verdicts").exists()
