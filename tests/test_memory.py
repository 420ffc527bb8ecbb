"""What a run may use and what it needs (quantgate/core/memory.py; docs/models.md, "Memory"): the
limits read from /proc and the cgroup files (v1 and v2, each cgroup above too, page cache that can
be reclaimed not counted), a plan whose model does not fit even streamed from disk refused in
preflight in one line (exit 2, nothing written), and a run where two do not fit keeping one loaded
at a time. Choosing the streamed path: tests/test_placement.py."""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate import evalsets, pipeline
from quantgate.core import memory
from quantgate.pipeline import units
from quantgate.pipeline.executor import IN_PROCESS_ENV
from quantgate.pipeline.plan import from_mapping
from quantgate.pipeline.runner import Pipeline
from tests.helpers import plan_mapping


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    _write(tmp_path / "meminfo", "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000000 kB\n")
    found = memory.mem_available(tmp_path / "meminfo")
    assert found is not None and found.bytes == 2_000_000 * 1024 and "MemAvailable" in found.source
    assert memory.mem_available(tmp_path / "missing") is None


def test_a_v1_memory_cgroup_and_the_ones_above_it_each_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(tmp_path / "self", "4:memory:/outer/inner\n3:cpuset:/\n")
    inner, outer = root / "memory" / "outer" / "inner", root / "memory" / "outer"
    _write(inner / "memory.limit_in_bytes", f"{6 * 10**9}\n")
    _write(inner / "memory.usage_in_bytes", f"{2 * 10**9}\n")
    _write(inner / "memory.stat", f"cache 5\ntotal_inactive_file {10**9}\n")  # reclaimable: not counted as used
    _write(outer / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(root / "memory" / "memory.limit_in_bytes", f"{3 * 10**9}\n")
    _write(root / "memory" / "memory.usage_in_bytes", f"{10**9}\n")
    found = memory.cgroup_allowances(tmp_path / "self", root)
    assert [item.bytes for item in found] == [5 * 10**9, 2 * 10**9]
    assert str(inner) in found[0].source and "limit 6.0 GB" in found[0].source


def test_a_v2_cgroup_with_max_is_no_limit(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(tmp_path / "self", "0::/job\n")
    _write(root / "cgroup.controllers", "memory\n")
    _write(root / "job" / "memory.max", f"{4 * 10**9}\n")
    _write(root / "job" / "memory.current", f"{10**9}\n")
    _write(root / "job" / "memory.stat", f"anon 1\ninactive_file {5 * 10**8}\n")
    _write(root / "memory.max", "max\n")
    assert [item.bytes for item in memory.cgroup_allowances(tmp_path / "self", root)] == [int(3.5 * 10**9)]


def test_the_address_space_limit_counts_what_is_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / "status", "Name: python\nVmSize:  1000000 kB\n")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3 * 10**9, resource.RLIM_INFINITY))
    found = memory.address_space(tmp_path / "status")
    assert found is not None and found.bytes == 3 * 10**9 - 1_000_000 * 1024 and "RLIMIT_AS" in found.source
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memory.address_space(tmp_path / "status") is None


def test_in_memory_needs_follow_the_parameters_with_the_measured_factors(quant_model: Path) -> None:
    found = memory.shape(quant_model)
    evaluate, quantize = memory.stage_needs(found, "evaluate"), memory.stage_needs(found, "quantize")
    assert evaluate.memory == memory.BASE_BYTES + math.ceil(memory.EVALUATE_FACTOR * 4 * found.parameters)
    assert quantize.memory == memory.BASE_BYTES + math.ceil(memory.QUANTIZE_FACTOR * 4 * found.parameters)


def test_libraries_the_run_preloaded_are_not_counted_again(quant_model: Path) -> None:
    """A unit forked after the run imported its libraries (executor.preload) shares those pages:
    the allowance it reads has them taken off already, so its estimates count that much less."""
    found = memory.shape(quant_model)
    before = memory.stage_needs(found, "evaluate")
    memory.note_preloaded(400 * 10**6)
    after = memory.stage_needs(found, "evaluate")
    assert (before.memory - after.memory, before.streamed - after.streamed) == (400 * 10**6, 400 * 10**6)
    memory.note_preloaded(10 * memory.BASE_BYTES)  # never below nothing
    assert memory.stage_needs(found, "evaluate").memory == math.ceil(memory.EVALUATE_FACTOR * 4 * found.parameters)
    assert memory.resident_bytes() > 10**7  # this process's VmRSS, read


def _allow(monkeypatch: pytest.MonkeyPatch, fraction_between: float, model: Path) -> None:
    """This process allowed a point between what one model at a time needs in memory (0) and two (1)."""
    found = memory.shape(model)
    evaluate, quantize = memory.stage_needs(found, "evaluate").memory, memory.stage_needs(found, "quantize").memory
    one, two = max(evaluate, quantize), quantize + 2 * evaluate - 2 * memory.BASE_BYTES
    allowed = int(one + fraction_between * (two - one))
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(allowed, "the memory cgroup /sys/fs/cgroup/memory/test (limit 1.0 GB)"))


def test_a_model_that_does_not_fit_even_streamed_is_refused_in_preflight_in_one_line(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Any]) -> None:
    # less than the libraries alone: no stage fits on either path
    monkeypatch.setattr(memory, "allowance", lambda: memory.Allowance(memory.BASE_BYTES // 2,
                                                                      "the memory cgroup /sys/fs/cgroup/memory/test (limit 1.0 GB)"))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"])))
    result = cli("run", plan, "--quiet")
    assert result.code == 2
    err = result.err
    assert err.count("\n") == 1 and err.startswith("quantgate: error: plan: the model (")
    assert "needs about" in err and "even streamed from disk" in err and "the memory cgroup /sys/fs/cgroup/memory/test" in err
    assert "quantizing it" in err and "evaluating it" in err and "give the run more memory" in err
    assert not (tmp_path / "run").exists()  # refused before any work


def test_where_two_models_do_not_fit_one_is_loaded_at_a_time(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _allow(monkeypatch, 0.5, quant_model)
    kept_at_load: list[int] = []
    original = evalsets.Evaluator.__init__

    def counting(self: evalsets.Evaluator, *args: object, **kwargs: object) -> None:
        kept_at_load.append(len(units._EVALUATORS))  # the evaluators alive while this one loads its model
        original(self, *args, **kwargs)  # type: ignore[arg-type]  # the arguments as the caller gave them

    monkeypatch.setattr(evalsets.Evaluator, "__init__", counting)
    monkeypatch.setenv(IN_PROCESS_ENV, "1")  # `kept_at_load` is this process's: the units run here
    loaded = from_mapping(plan_mapping(quant_model, tmp_path, formats=["gptq-int4"]))
    resolved = Pipeline(loaded, show_progress=False).preflight()
    assert resolved.models_kept == 1 and resolved.memory_note is not None and "one model loaded at a time" in resolved.memory_note
    result = pipeline.run(loaded, show_progress=False)
    assert result.exit_code in (0, 1) and not result.failed_units
    assert kept_at_load and max(kept_at_load) == 0  # every model loaded with none other kept

    monkeypatch.setattr(memory, "allowance", lambda: None)  # nothing read (not Linux): as before, two kept
    assert Pipeline(loaded, show_progress=False).preflight().models_kept == 2
