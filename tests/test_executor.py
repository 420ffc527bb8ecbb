"""The executor seam of `quantgate run` without a Ray cluster: the plan's `executor:` and
`resources:`, `--executor`/`--address`, the ray executor refused in one line where Ray is not
installed, formats prepared side by side by a concurrent in-process executor (gated in the
plan's order), a task the cluster lost for good (blocked, not cached, done again next run),
Ctrl-C (tasks cancelled, no temporaries, no lock left) and the sweep of staging temporaries.
tests/test_ray.py runs the same on a real two-node cluster."""

from __future__ import annotations

import faulthandler
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from quantgate.core import errors
from quantgate.core.artifacts import remove_temporaries
from quantgate.core.errors import InputError
from quantgate.core.exitcodes import Exit
from quantgate.pipeline import executor as executors
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.executor import LocalExecutor, TaskLost, UnitDied
from quantgate.pipeline.plan import PlanError, StageResources, from_mapping, with_executor
from quantgate.serving.launch import WorkerFailed
from tests.helpers import TINY_FORMATS, assert_refused, plan_mapping

T = TypeVar("T")
LOST = "quantize gptq-int4 was lost on the Ray cluster after 3 attempts: worker died"
# the smallest plan that validates (from_mapping resolves nothing: no model is needed)
MINIMAL = {"model": "tiny", "formats": ["fp8-e4m3"], "evaluation": {"sets": ["wiki-text"]}}


class Recording(LocalExecutor):
    """A concurrent executor in this process: the runner prepares the formats side by side and
    calls it from a thread per format. It runs one unit at a time (as Ray gives each its own
    worker process: two quantizations in one process collide in torch.fx's process-wide tracing)
    and keeps each call (kind, label, the calling thread) and when each unit began and ended."""

    concurrent = True

    def __init__(self) -> None:
        super().__init__(fork=False)  # every unit in this process, one at a time (below)
        self.calls: list[tuple[str, str, str]] = []
        self.events: list[tuple[str, str]] = []  # ("call" | "end", label), in the order they happened
        self.cancelled = 0
        self.lock = threading.Lock()
        self.working = threading.Lock()  # one unit at a time

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T:
        with self.lock:
            self.calls.append((kind, label, threading.current_thread().name))
            self.events.append(("call", label))
        with self.working:
            value = work()
        with self.lock:
            self.events.append(("end", label))
        return value

    def cancel(self) -> None:
        self.cancelled += 1

    def labels(self, prefix: str) -> list[str]:
        return [label for _, label, _ in self.calls if label.startswith(prefix)]

    def when(self, event: str, label: str) -> int:
        return self.events.index((event, label))


class FirstFormatLast(Recording):
    """fp8-e4m3's evaluation waits until gptq-int4's is done: the second format is prepared
    first, so the gates' (and the ledger's) plan order cannot come from the order work ended.
    Under an executor the runner did not run side by side, this wait would time out."""

    def __init__(self) -> None:
        super().__init__()
        self.second_evaluated = threading.Event()
        self.waited: bool | None = None

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T:
        if label == "evaluate fp8-e4m3":
            self.waited = self.second_evaluated.wait(timeout=90)
        value = super().call(kind, label, work)
        if label == "evaluate gptq-int4":
            self.second_evaluated.set()
        return value


class Losing(Recording):
    """The cluster loses gptq-int4's quantization for good (after Ray's retries)."""

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T:
        if label == "quantize gptq-int4":
            raise TaskLost(kind, label, LOST)
        return super().call(kind, label, work)


class Interrupting(Recording):
    """Ctrl-C while gptq-int4 is quantized: its writer leaves a half-made staging directory."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.staging = out / "checkpoints" / ".gptq-int4.partial-test"
        self.interrupted = False

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T:
        if label == "quantize gptq-int4":
            self.staging.mkdir(parents=True)
            (self.staging / "model.safetensors").write_bytes(b"half")
            self.interrupted = True
            raise KeyboardInterrupt
        return super().call(kind, label, work)


def use_executor(patch: pytest.MonkeyPatch, executor: Any) -> None:
    """The runner makes its executor with quantgate.pipeline.executor.make: it gets `executor`."""
    patch.setattr(executors, "make", lambda plan, resources, threads=None: executor)


def outcomes(result: pipeline.RunResult) -> dict[str, tuple[str, list[str]]]:
    return {fmt: (entry.verdict, entry.reasons) for fmt, entry in result.verdicts.items()}


def ledger_formats(out: Path) -> list[str]:
    return [json.loads(line)["format"] for line in (out / "ledger.jsonl").read_text().splitlines()]


@dataclass(frozen=True)
class Runs:
    local: pipeline.RunResult  # the tiny plan with the plain local executor
    side_by_side: pipeline.RunResult  # the same plan with FirstFormatLast
    executor: FirstFormatLast
    out: Path  # side_by_side's run directory


@pytest.fixture(scope="module")
def runs(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The tiny plan run once locally and once side by side, each in its own directory and home."""
    local_root, side_root = tmp_path_factory.mktemp("local-run"), tmp_path_factory.mktemp("side-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("local-home")))
        local = pipeline.run(from_mapping(plan_mapping(quant_model, local_root)), show_progress=False)
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("side-home")))
        executor = FirstFormatLast()
        use_executor(patch, executor)
        side = pipeline.run(from_mapping(plan_mapping(quant_model, side_root)), show_progress=False)
    return Runs(local, side, executor, side_root / "run")


# ---- the plan ---------------------------------------------------------------------------------


def test_plan_executor_by_name_or_mapping_and_resources_per_stage_kind() -> None:
    assert from_mapping(MINIMAL).plan.executor.kind == "local"
    by_name = from_mapping(MINIMAL | {"executor": "ray"}).plan.executor
    assert (by_name.kind, by_name.address, by_name.max_retries) == ("ray", None, 2)
    plan = from_mapping(MINIMAL | {"executor": {"kind": "ray", "address": "10.0.0.1:6379", "max_retries": 4},
                                   "resources": {"quantize": {"cpus": 4, "gpus": 1, "memory_gib": 16}, "evaluate": {"gpus": 0.5}}}).plan
    assert (plan.executor.kind, plan.executor.address, plan.executor.max_retries) == ("ray", "10.0.0.1:6379", 4)
    assert plan.resources == {"quantize": StageResources(cpus=4, gpus=1, memory_gib=16),
                              "evaluate": StageResources(cpus=1, gpus=0.5, memory_gib=None)}


@pytest.mark.parametrize("change, message", [
    ({"executor": "slurm"}, "executor.kind: Input should be 'local' or 'ray'"),
    ({"executor": {"kind": "local", "address": "10.0.0.1:6379"}}, "executor: an address is for the ray executor"),
    ({"executor": {"address": "10.0.0.1:6379"}}, "executor: an address is for the ray executor"),
    ({"resources": {"quantise": {"cpus": 2}}}, "resources.quantise"),
    ({"resources": {"quantize": {"cpu": 2}}}, "resources.quantize.cpu: unknown field (did you mean 'cpus'?)"),
])
def test_bad_executor_or_resources_is_one_line_naming_the_place(change: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError) as raised:
        from_mapping(MINIMAL | change)
    text = str(raised.value)
    assert text.startswith("plan (mapping): ") and "\n" not in text and message in text, text


def test_command_line_executor_overrides_the_plans_and_keeps_its_retries() -> None:
    local = from_mapping(MINIMAL | {"executor": {"kind": "local", "max_retries": 5}})
    implied = with_executor(local, None, "10.0.0.1:6379").plan.executor  # an address alone: the ray executor
    assert (implied.kind, implied.address, implied.max_retries) == ("ray", "10.0.0.1:6379", 5)
    plain = with_executor(local, "ray", None).plan.executor
    assert (plain.kind, plain.address, plain.max_retries) == ("ray", None, 5)
    clustered = from_mapping(MINIMAL | {"executor": {"kind": "ray", "address": "10.0.0.1:6379", "max_retries": 3}})
    assert with_executor(clustered, "ray", None).plan.executor.address == "10.0.0.1:6379"  # the plan's cluster stays
    back = with_executor(clustered, "local", None).plan.executor  # --executor local: the plan's address goes with its kind
    assert (back.kind, back.address, back.max_retries) == ("local", None, 3)
    assert clustered.plan.executor.kind == "ray"  # the loaded plan itself is unchanged
    for kind, address, fragment in [("local", "10.0.0.1:6379", "--address names a Ray cluster: it goes with --executor ray"), ("slurm", None, "--executor")]:
        with pytest.raises(InputError) as raised:
            with_executor(local, kind, address)
        assert "\n" not in str(raised.value) and fragment in str(raised.value), str(raised.value)


# ---- without Ray --------------------------------------------------------------------------------


@pytest.mark.parametrize("plan_executor, options", [
    ("local", ["--executor", "ray"]),
    ("local", ["--address", "10.0.0.1:6379"]),
    ("ray", []),
])
def test_ray_executor_without_ray_installed_exits_2_in_one_line_before_any_work(
        cli, quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan_executor: str, options: list[str]) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_mapping(quant_model, tmp_path) | {"executor": plan_executor}))
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    result = cli("run", plan, "--quiet", *options)
    assert_refused(result, "pip install 'quantgate[ray]'", tmp_path / "run")
    assert result.err.count("\n") == 1, result.err


# ---- formats side by side ---------------------------------------------------------------------


def test_formats_side_by_side_reach_the_verdicts_of_a_local_run(runs: Runs) -> None:
    assert outcomes(runs.side_by_side) == outcomes(runs.local)
    assert set(runs.side_by_side.verdicts) == set(TINY_FORMATS)


def test_formats_side_by_side_are_gated_in_the_plans_order(runs: Runs) -> None:
    executor = runs.executor
    assert executor.waited is True  # fp8-e4m3's evaluation began only once gptq-int4's had ended
    assert executor.when("end", "evaluate gptq-int4") < executor.when("end", "evaluate fp8-e4m3")
    assert ledger_formats(runs.out) == TINY_FORMATS
    assert list(runs.side_by_side.verdicts) == TINY_FORMATS
    gates = [stage.stage for stage in runs.side_by_side.stages if stage.stage.startswith("gate ")]
    assert gates == [f"gate {fmt}" for fmt in TINY_FORMATS]


def test_baseline_looks_come_before_any_evaluation_and_formats_run_in_threads_of_their_own(runs: Runs) -> None:
    executor = runs.executor
    looks = executor.labels("baseline looks ")
    assert sorted(looks) == ["baseline looks lambada@v1", "baseline looks wiki-text@v1"]
    # every look of the baseline was made (ended) before any format's evaluation began; the
    # quantizations need only the calibration set, so they do not wait for the baseline
    first_evaluation = min(executor.when("call", f"evaluate {fmt}") for fmt in TINY_FORMATS)
    assert all(executor.when("end", label) < first_evaluation for label in looks)
    assert executor.when("call", "calibration") < min(executor.when("call", label) for label in executor.labels("quantize "))
    quantizing = {thread for _, label, thread in executor.calls if label.startswith("quantize ")}
    assert len(executor.labels("quantize ")) == len(TINY_FORMATS) and len(quantizing) == 2
    assert all(thread.startswith("quantgate-unit") for thread in quantizing)


# ---- a task lost for good ---------------------------------------------------------------------


def test_a_lost_task_blocks_its_format_only_and_is_done_again_next_run(
        runs: Runs, quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mapping, out = plan_mapping(quant_model, tmp_path), tmp_path / "run"
    with monkeypatch.context() as patch:
        use_executor(patch, Losing())
        lost = pipeline.run(from_mapping(mapping), show_progress=False)
    verdict, reasons = outcomes(lost)["gptq-int4"]
    assert verdict == "blocked" and any(LOST in reason for reason in reasons), reasons
    assert outcomes(lost)["fp8-e4m3"] == outcomes(runs.local)["fp8-e4m3"]  # the other format went on
    assert lost.exit_code == Exit.UNIT_FAILED  # a lost task is a failed unit, not a verdict
    assert [(unit.kind, unit.unit) for unit in lost.failed_units] == [("quantize", "quantize gptq-int4")]
    (quantized,) = [stage for stage in lost.stages if stage.stage == "quantize gptq-int4"]
    assert quantized.status == "failed" and LOST in quantized.detail
    # not the inputs' fault: no stage record keeps the loss, and no checkpoint was published
    records = {path.name: json.loads(path.read_text()) for path in (out / "stages").glob("*.json")}
    assert "quantize-gptq-int4.json" not in records
    assert not any(record.get("failed") for record in records.values())
    assert not (out / "checkpoints" / "gptq-int4").exists()

    again = pipeline.run(from_mapping(mapping), show_progress=False)  # the plain local executor
    assert "quantize gptq-int4" in again.redone and "quantize fp8-e4m3" not in again.redone
    assert outcomes(again) == outcomes(runs.local)
    assert ledger_formats(out) == TINY_FORMATS  # one verdict each: the loss left none


# ---- Ctrl-C -----------------------------------------------------------------------------------


def test_ctrl_c_cancels_the_tasks_and_leaves_no_temporary_and_no_lock(
        quant_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    executor = Interrupting(out)
    use_executor(monkeypatch, executor)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(from_mapping(plan_mapping(quant_model, tmp_path)), show_progress=False)
    assert executor.interrupted and executor.staging.parent.is_dir()  # the interrupt came, and left its staging there
    assert executor.cancelled >= 1
    assert not executor.staging.exists()
    assert [path for path in out.rglob("*") if ".partial-" in path.name or ".old-" in path.name] == []
    assert not (out / ".lock").exists()


# ---- the sweep --------------------------------------------------------------------------------


def test_remove_temporaries_removes_exactly_the_staging_and_retired_siblings(tmp_path: Path) -> None:
    (tmp_path / ".a.partial-1").mkdir()
    (tmp_path / ".a.partial-1" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".b.json.partial-x").write_text("{")
    (tmp_path / ".c.old-12ab").mkdir()
    (tmp_path / ".c.old-12ab" / "manifest.json").write_text("{}")
    ordinary = [".lock", ".hidden", "a", "notes.partial-1", ".partial-1", "c/.keep", "c/manifest.json"]
    (tmp_path / "c").mkdir()
    for name in ordinary:
        (tmp_path / name).write_text("kept")
    (tmp_path / ".hidden-dir").mkdir()
    (tmp_path / ".hidden-dir" / "x").write_text("kept")
    removed = remove_temporaries(tmp_path)
    assert sorted(path.name for path in removed) == [".a.partial-1", ".b.json.partial-x", ".c.old-12ab"]
    left = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    assert left == sorted([*ordinary, "c", ".hidden-dir", ".hidden-dir/x"])


def test_every_quantgate_error_survives_the_trip_back_from_a_task() -> None:
    """A Ray task's error comes back pickled: one that cannot be unpickled would reach the driver
    as a lost task instead of itself."""
    made = [errors.InputError("bad input"), errors.Interrupted("stop"), errors.IntegrityError("damaged"),
            TaskLost("quantize", "quantize x", "quantize x was lost"), WorkerFailed("cannot load", Path("/log"), "load", timed_out=True)]
    for error in made:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
    failed = pickle.loads(pickle.dumps(made[-1]))
    assert (failed.reason, failed.log, failed.phase, failed.timed_out) == ("cannot load", Path("/log"), "load", True)
    lost = pickle.loads(pickle.dumps(made[3]))
    assert (lost.kind, lost.label) == ("quantize", "quantize x")


# ---- a unit in a child process (the local executor) -------------------------------------------

CHILD_AFTER_TORCH = """
import json, sys, time, torch
from quantgate.pipeline.executor import LocalExecutor
torch.set_num_threads(2)
# a run made before any parallel region of this process (as `quantgate run` makes it): torch here on one thread
executor = LocalExecutor()
square = torch.randn(512, 512)
for _ in range(3):
    square @ square  # the run's own torch work, in this process
def work():
    started = time.perf_counter()
    total = float((square @ square).sum())
    return {"threads": torch.get_num_threads(), "seconds": time.perf_counter() - started, "finite": total == total}
answer = executor.call("evaluate", "evaluate x", work)
parent = torch.get_num_threads()
executor.close()
print(json.dumps({**answer, "parent": parent, "restored": torch.get_num_threads()}))
"""

POLLUTED_POOL = """
import json, torch
from quantgate.pipeline import executor as executors
executors._POOL_PROBE_S = 2.0
torch.set_num_threads(2)
square = torch.randn(512, 512)
for _ in range(3):
    square @ square  # an OpenMP pool of two threads, made before the run: a forked child that uses it hangs
executor = executors.LocalExecutor()
first = executor.call("quantize", "quantize x", lambda: (torch.get_num_threads(), float((square @ square).sum())))
second = executor.call("evaluate", "evaluate x", lambda: torch.get_num_threads())
executor.close()
print(json.dumps({"first": first[0], "second": second, "threads": executor.threads, "restored": torch.get_num_threads()}))
"""


def _python(script: str) -> dict[str, Any]:
    """`script` in a fresh interpreter (its torch threads and OpenMP pool its own): its last line as JSON."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_forked_units_torch_runs_on_the_runs_threads_after_the_run_ran_torch_and_does_not_hang() -> None:
    answer = _python(CHILD_AFTER_TORCH)
    assert answer["threads"] == 2 and answer["finite"] and answer["seconds"] < 30  # the child's matmul returned
    assert answer["parent"] == 1 and answer["restored"] == 2  # one thread here while the run goes, two again after


def test_a_pool_made_before_the_run_falls_back_to_one_thread_instead_of_hanging() -> None:
    answer = _python(POLLUTED_POOL)
    assert answer == {"first": 1, "second": 1, "threads": 1,  # probed once, then one thread for every child
                      "restored": 2}  # and this process's two threads given back, not the children's one


def test_a_unit_killed_by_a_signal_is_unit_died_naming_the_signal_and_the_childs_peak_memory() -> None:
    executor = LocalExecutor()
    try:
        def swell_and_die() -> None:
            ballast = bytearray(128 * 2**20)
            ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident, not only reserved
            faulthandler.disable()  # pytest's: it would print every thread's stack of this child
            os.kill(os.getpid(), signal.SIGSEGV)

        with pytest.raises(UnitDied) as died:
            executor.call("quantize", "quantize x", swell_and_die)
        assert died.value.signal == "SIGSEGV" and died.value.peak_memory_bytes >= 128 * 2**20
        assert str(died.value).startswith("quantize x: its child process was killed by SIGSEGV, peak memory ")
        # the next unit runs, in a child of its own
        assert executor.call("evaluate", "evaluate y", os.getpid) != os.getpid()
        assert executor.call("measure", "measure y", os.getpid) == os.getpid()  # a cheap unit stays in this process
    finally:
        executor.close()


def test_a_units_own_error_comes_back_as_itself_with_the_childs_traceback() -> None:
    executor = LocalExecutor()
    try:
        def refuses() -> None:
            raise errors.InputError("no such set: wiki-txt")

        with pytest.raises(errors.InputError, match="no such set: wiki-txt") as refused:
            executor.call("evaluate", "evaluate x", refuses)
        cause = refused.value.__cause__
        assert cause is not None and "in the unit's child process" in str(cause) and "in refuses" in str(cause)
    finally:
        executor.close()


def test_a_unit_that_calls_sys_exit_is_its_own_failure_not_the_runs_exit_status() -> None:
    """A library's sys.exit(1) inside a unit: raised in the run as SystemExit, it would end the run
    with status 1, which a CI reads as "blocked"; it comes back as that unit's failure."""
    executor = LocalExecutor(threads=1)  # one thread: no probe of the pool
    try:
        def exits() -> None:
            sys.exit(1)

        with pytest.raises(RuntimeError, match=r"the unit raised SystemExit\(1\)") as raised:
            executor.call("quantize", "quantize x", exits)
        assert pipeline._unit_error(raised.value)  # the run records it as this unit's failure and goes on
        assert "in exits" in str(raised.value.__cause__)  # where it exited, from the child's traceback
    finally:
        executor.close()


def test_a_child_killed_while_it_sends_its_answer_is_unit_died_naming_the_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child killed half-way through writing its answer (an OOM kill as it pickles a large
    value): the unit's failure names the signal, not a truncated pickle."""
    def cut_short(write_fd: int, outcome: object) -> None:
        data = pickle.dumps(outcome)
        os.write(write_fd, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(executors, "_answer", cut_short)  # the child is forked with it
    executor = LocalExecutor(threads=1)
    try:
        with pytest.raises(UnitDied) as died:
            executor.call("evaluate", "evaluate x", lambda: list(range(1000)))
        assert died.value.signal == "SIGKILL" and "killed by SIGKILL" in str(died.value)
    finally:
        executor.close()


def test_a_ctrl_c_reaching_a_units_child_is_left_to_the_run_never_unwinding_the_child_through_the_runs_frames() -> None:
    """Ctrl-C goes to the whole process group: a child that took it would raise KeyboardInterrupt
    through the run's own frames (its lock's release, its clean-up). The child ignores it (the run
    stops its child itself): its unit finishes and its value comes back."""
    executor = LocalExecutor()
    try:
        def interrupted() -> str:
            os.kill(os.getpid(), signal.SIGINT)  # what a Ctrl-C at the terminal sends the child too
            time.sleep(0.2)  # where a KeyboardInterrupt would have been raised
            return "finished"

        assert executor.call("evaluate", "evaluate x", interrupted) == "finished"
    finally:
        executor.close()


def test_a_process_that_initialised_cuda_runs_its_units_here_not_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA does not survive a fork: where the run's own process initialised it, a unit runs in that
    process, as before (a GPU machine's run would otherwise fail every unit)."""
    import torch

    executor = LocalExecutor()
    try:
        assert executor.call("evaluate", "evaluate x", os.getpid) != os.getpid()
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        assert executor.call("evaluate", "evaluate x", os.getpid) == os.getpid()
    finally:
        executor.close()


PRELOADED = """
import json, sys
from quantgate.pipeline import executor as executors
from quantgate.pipeline.executor import LocalExecutor
executors._accelerator_build = lambda: False  # what a CPU build of torch answers: the same test on a CUDA build
LIBRARIES = ("lm_eval.models.huggingface", "llmcompressor")
def seen():
    return [name in sys.modules for name in LIBRARIES]
executor = LocalExecutor(threads=1)
before = seen()
measure = executor.call("measure", "measure x", seen)  # a unit in this process: nothing imported for it
evaluate = executor.call("evaluate", "evaluate x", seen)  # forked: lm-eval imported in the run first
quantize = executor.call("quantize", "quantize x", seen)  # and llmcompressor
executor.close()
print(json.dumps({"before": before, "measure": measure, "evaluate": evaluate, "quantize": quantize, "after": seen()}))
"""


def test_a_forked_unit_finds_its_kinds_libraries_imported_by_the_run() -> None:
    """The run imports lm-eval before its first evaluation unit and llmcompressor before its first
    quantization (each kind its own), so each forked child finds them loaded instead of importing
    them again."""
    answer = _python(PRELOADED)
    assert answer == {"before": [False, False], "measure": [False, False], "evaluate": [True, False], "quantize": [True, True],
                      "after": [True, True]}


def test_the_preload_runs_once_a_kind_not_on_an_accelerator_build_and_a_failing_one_is_left_to_the_unit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []

    def load_evaluation() -> None:
        loads.append("evaluate")
        monkeypatch.setenv("QUANTGATE_TEST_PRELOADED", "1")  # what the child inherits from the run

    def failing() -> None:
        loads.append("quantize")
        raise ImportError("no module named llmcompressor")

    monkeypatch.setattr(executors, "_PRELOADS", {"evaluate": load_evaluation, "quantize": failing})
    monkeypatch.setattr(executors, "_preloaded", set())
    monkeypatch.delenv("QUANTGATE_TEST_PRELOADED", raising=False)
    monkeypatch.setattr(executors, "_fd_backed", lambda stream: True)  # a terminal's streams, not pytest's capture
    executor = LocalExecutor(threads=1)
    try:
        monkeypatch.setattr(executors, "_accelerator_build", lambda: True)  # a CUDA build: each unit imports its own
        assert executor.call("evaluate", "evaluate x", lambda: os.environ.get("QUANTGATE_TEST_PRELOADED")) is None
        assert loads == []
        monkeypatch.setattr(executors, "_accelerator_build", lambda: False)
        for _ in range(2):
            assert executor.call("evaluate", "evaluate x", lambda: os.environ.get("QUANTGATE_TEST_PRELOADED")) == "1"
        assert executor.call("quantize", "quantize x", lambda: "ran") == "ran"  # its preload failed: the unit still runs
        assert executor.call("quantize", "quantize x", lambda: "ran") == "ran"
        assert loads == ["evaluate", "quantize"]  # once a kind
    finally:
        executor.close()


def test_no_preload_where_the_runs_streams_are_no_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a notebook (or under a test's capture) a forked child swaps its streams for buffers whose
    text goes back with its answer; libraries imported in the run would have bound their loggers to
    the run's streams, past the swap. There each unit imports its own, as before."""
    loads: list[str] = []
    monkeypatch.setattr(executors, "_PRELOADS", {"evaluate": lambda: loads.append("evaluate")})
    monkeypatch.setattr(executors, "_preloaded", set())
    monkeypatch.setattr(executors, "_accelerator_build", lambda: False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    executors.preload("evaluate")
    assert loads == []
