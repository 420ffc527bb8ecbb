"""Every stage's key, pinned, and the registry against the plan's stage kinds: the registry (quantgate.pipeline.stages) hashes exactly what the
keys of earlier releases hashed, so that the run directories and stage caches they left are
reused. The digests were recorded from quantgate/pipeline/keys.py before its functions moved
into the registry; the libraries' versions and the machine are fixed here, the plan is a stand-in
holding only what the keys read."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args

import pytest

from quantgate.pipeline import stages as module
from quantgate.pipeline.plan import STAGE_KINDS, StageKind


class _Dumps:
    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def model_dump(self, mode: str = "python", exclude: set[str] | None = None) -> dict[str, Any]:
        return {name: value for name, value in self.value.items() if name not in (exclude or set())}

    def keyed(self) -> dict[str, Any]:  # EvaluateConfig.keyed: all but the placement
        return self.model_dump(mode="json", exclude={"placement"})


def _plan() -> Any:
    policy = SimpleNamespace(identity={"name": "default", "sha256": "p" * 8}, policy=SimpleNamespace(metrics={"wiki": {}, "arc": {}}))
    env = SimpleNamespace(identity=lambda: {"engine": "vllm", "version": "0.6"})
    return SimpleNamespace(
        golden_shas={"wiki@v1": "a" * 8, "arc@v1": "b" * 8}, version="9.9.9", identity_key={"sha256": "m" * 8},
        profile_key={"reference": {"bandwidth": 1}}, first_look_cfg=_Dumps({"limit": {"wiki@v1": 8}, "placement": "streamed"}),
        quantize_cfgs={"gptq-int4": _Dumps({"format": "gptq-int4", "group_size": 128})}, policy=policy,
        eval_settings={"batch_size": 4}, looks_json={"wiki@v1": [8, 16]}, serve_cfg=_Dumps({"tokens": 16}), serving_env=env)


@pytest.fixture
def plan(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(module, "library_versions", lambda: {"torch": "2.0", "transformers": "4.0"})
    monkeypatch.setattr(module, "machine", lambda: {"cpu": "x"})
    monkeypatch.setattr(module, "EVALUATOR_VERSION", 7)
    monkeypatch.setattr(module, "SERVE_CHECK_VERSION", 3)
    return _plan()


def test_the_keys_of_every_stage_are_unchanged(plan: Any) -> None:
    cfg = _Dumps({"formats": ["gptq-int4", "fp8-e4m3"]})
    made = {
        "overlap": module.overlap_key(plan, "c" * 8),
        "baseline measure": module.baseline_measure_key(plan),
        "baseline evaluate": module.baseline_evaluate_key(plan),
        "quantize": module.quantize_key(plan, "gptq-int4", "c" * 8),
        "blocked gate": module.blocked_gate_key(plan, "q" * 8, "no load"),
        "measure": module.measure_key(plan, "s" * 8),
        "sequential": module.sequential_key(plan, "s" * 8, precision="4bit", blocked_before=None),
        "sequential split": module.sequential_key(plan, "s" * 8, precision="4bit", blocked_before="size",
                                                  split={"name": "search", "looks": {"wiki@v1": [8]}, "offsets": {}}),
        "serve": module.serve_key(plan, checkpoint={"sha256": "w" * 8}, results=None),
        "served-results": module.served_results_key(plan, checkpoint="q" * 8, results="r" * 8, settings={"b": "2", "a": "1"},
                                                    device_class="amx"),
        "gate": module.gate_key(plan, precision="4bit", evidence="e" * 8, measure="m" * 8, overlap="o" * 8, results=["r" * 8]),
        "gate full": module.gate_key(plan, precision="4bit", evidence="e" * 8, measure="m" * 8, overlap="o" * 8, results=[],
                                     allocation={"layer": 4}, serve=[None, "x"], as_served=[["served", "r"]]),
        "sensitivity": module.sensitivity_key(plan, cfg, "c" * 8),
        "trial quantize": module.trial_quantize_key(plan, cfg, "c" * 8),
    }
    assert made == RECORDED


RECORDED = {
    "overlap": "a16f008249b5c9f68c348dd6ca1225470f119f2fe149b9cd9c70309af041eab7",
    "baseline measure": "841722b588b5b5b637bd87276fc5f645b8837ad64b2a779fa0a997ffa84abdec",
    "baseline evaluate": "5300408e0e2078340f980cb6364bf79b7671c6c4325f6b9cca891126c4629721",
    "quantize": "9298adcee1691d3ff7fb7c4738582cf4555090264b9faf792e473b10785d92b3",
    "blocked gate": "a786a9d00f6ef3ab7ec2890f5ca0ce65a950f6ac5efd3f4a4e6f21fce82a5084",
    "measure": "fe1fb6e98f18bc20f443cb6440c02ef49fafba76fb2e2a6953d4c47e8df44fe8",
    "sequential": "315d478c7fb2c6e806fa3524c11a9180a1562e8034afb9c8105435c0c2fc87ad",
    "sequential split": "601b4802d3bd11ae4bac1ef6200245fa7dcfbd771aef439e3eaec54aad664794",
    "serve": "f08cfa19162cb387fb1e3d5e2b8bd7b9ef37a52bd1f1d95a99e2cd39ee056884",
    "served-results": "bcb6861cbfe5effce921e9d85cfb09b466428e944c8f24499ce75458360a1683",
    "gate": "80265129790535f57f6b2fab4d37088f54c946dc144face2f8683e801b3f3a1e",
    "gate full": "865efa04bb98847a75107e99e39119b2023511db8a225b4ba6bec05d871c2652",
    "sensitivity": "22828e7fc63ebefa248b320fdd50577fcb32fd850357a077db02466585a9f8ab",
    "trial quantize": "77fc96c32c8e0a5abe81b7332a6e582001ccf3b092d44dc4f35b7d5201b3c946",
}


def test_every_unit_of_the_registry_is_a_stage_kind_a_plan_can_name() -> None:
    """A plan's `resources:` name the executor's stage kinds (a Literal, written out): every
    stage whose work is a unit runs under one of them, and each of them is some stage's."""
    assert set(STAGE_KINDS) == set(get_args(StageKind))
    assert module.executor_kinds() == set(get_args(StageKind))


def test_each_stage_writes_where_the_run_directory_says(tmp_path: Any) -> None:
    from quantgate.core.rundir import BASELINE, RunDir

    run_dir = RunDir(tmp_path)
    assert module.QUANTIZE.where(run_dir, "gptq-int4") == run_dir.checkpoint("gptq-int4")
    assert module.BASELINE_EVALUATE.record(BASELINE) == "evaluate-baseline"
    assert module.SERVED_RESULTS.record("fp8", "served") == "served-results-fp8-served"
    assert module.SENSITIVITY.record() == "sensitivity" and module.SENSITIVITY.where(run_dir) == run_dir.sensitivity()
    assert module.OVERLAP.where(run_dir) == run_dir.overlap and module.CALIBRATION.where(run_dir) == run_dir.calibration
