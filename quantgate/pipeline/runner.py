"""`quantgate run PLAN.yaml`: every stage for one model, resumable.

resolve plan -> calibrate (and the overlap with the golden sets) -> baseline (measure, evaluate,
serve) -> per format: quantize, measure and bound, evaluate, serve, gate (and the ledger) -> report.

Every stage is declared once in `quantgate.pipeline.stages` (what its key hashes, where it
writes, its unit of work, its typed output); its artifact goes through the stage cache
(`quantgate.core.stagecache`): a stage is skipped when its key matches and its artifact still
verifies against its own hashes, so a run killed at any point redoes only what is missing, and a
finished run started again does nothing and prints the same verdicts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pydantic import JsonValue

from quantgate import calibration, evalsets, quantize
from quantgate.core import memory
from quantgate.core.artifacts import (
    MANIFEST,
    read_json,
    remove_temporaries,
    sha256_file,
    sha256_json,
    write_json,
)
from quantgate.core.console import library_output, stderr, tail
from quantgate.core.errors import InputError, IntegrityError, QuantgateError
from quantgate.core.exitcodes import Exit, most_urgent
from quantgate.core.headers import read_checkpoint
from quantgate.core.ids import SERVING, GateId
from quantgate.core.models import weight_file_hashes
from quantgate.core.records import RecordPart
from quantgate.core.rundir import BASELINE, RUN_KIND, RunDir
from quantgate.core.stagecache import Cached, StageCache, stored_value
from quantgate.evalsets.evaluate import cache_root, model_identity
from quantgate.evalsets.serve_record import ServeRecord
from quantgate.evalsets.served import FAILED, cold_start_seconds, probe_seconds
from quantgate.gates.ledger import LedgerTampered
from quantgate.gates.ledger import read as read_ledger
from quantgate.gates.policy import LoadedPolicy, Outcome, mixed_precision_class
from quantgate.gates.report import build as build_report
from quantgate.gates.report import data_key as report_key
from quantgate.gates.report import write as write_report
from quantgate.gates.run_record import (
    BASELINE_FAILED,
    FINISHED,
    RUNNING,
    STOPPED,
    FailedUnit,
    PlannedPower,
    PlotAxes,
    RunPlan,
    RunPolicy,
    RunRecord,
    RunStage,
    RunVerdict,
)
from quantgate.gates.stage import item_records, record_verdict, verdict_record
from quantgate.gates.verdict import (
    GateResult,
    ServedNumerics,
    ServingEvidence,
    Verdict,
    blocked_verdict,
    differing_numerics,
    integrity_gates,
    judge,
    lost_verdict,
    served_quality_gates,
    size_gates,
    tails,
)
from quantgate.gates.verdict_record import (
    AsServedRecord,
    ClassVerdict,
    OverlapSummary,
    SequentialSummary,
    SmokeCheck,
    SplitItems,
    VerdictRecord,
)
from quantgate.pipeline import executor as executors
from quantgate.pipeline import units
from quantgate.pipeline.executor import Executor, TaskLost, UnitDied
from quantgate.pipeline.lock import RunLock
from quantgate.pipeline.plan import LoadedPlan
from quantgate.pipeline.progress import StageLog, StageStatus
from quantgate.pipeline.resolve import ResolvedPlan, Split, SplitKey, resolve_plan
from quantgate.pipeline.search import SearchRecord, SearchStopped, Trials, build_space, mixed_config, run_search, stopped_search
from quantgate.pipeline.stages import (
    BASELINE_EVALUATE,
    BASELINE_MEASURE,
    BLOCKED_GATE,
    CALIBRATION,
    GATE,
    MEASURE,
    OVERLAP,
    QUANTIZE,
    SENSITIVITY,
    SEQUENTIAL,
    SERVE,
    SERVED_RESULTS,
    TRIAL_QUANTIZE,
    DirectoryStage,
    JsonStage,
    SequentialStage,
)
from quantgate.quantize import MixedConfig, sensitivity
from quantgate.quantize.allocation import Allocation
from quantgate.quantize.checkpoint import CheckpointManifest
from quantgate.quantize.measure import MeasurementRecord, stage_measurement
from quantgate.quantize.presets import get_preset
from quantgate.serving import device

T = TypeVar("T")
PER_FORMAT = ("quantize", "measure", "evaluate", "gate")
# A full disk (or quota): the environment, not a bug; the run stops in one line, resumable.
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _out_of_space(error: BaseException) -> str | None:
    """What could not be written when `error` (or what caused it: a library's own error about
    a failed write) is a full disk or quota; None when it is not."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in OUT_OF_SPACE:
            written = seen.filename2 or seen.filename  # a copy's error names its source first
            return f"{written} ({seen.strerror})" if written else f"the run's artifacts ({seen.strerror})"
        if any(os.strerror(code) in str(seen) for code in OUT_OF_SPACE):  # a library's error that names only the reason
            return f"the run's artifacts ({' '.join(str(seen).split())[:300]})"
        seen = seen.__cause__ or seen.__context__
    return None


def _make_out(out: Path) -> bool:
    """Make the run directory (and its parents) and check that a file can be written in it;
    True when this call made it. One line when it cannot be made or written (a read-only place,
    /proc, a file in the way): checked before any work."""
    existed = out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=out, prefix=f".quantgate-probe.partial-{os.getpid()}-")  # a temporary's name
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        if not existed and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise InputError(f"out {out}: cannot write a run directory there ({error.strerror or error}); choose another out") from None
    return not existed


@dataclass
class RunResult:
    out: Path
    verdicts: dict[str, VerdictRecord]  # format -> verdict record
    stages: list[StageStatus] = field(default_factory=list)
    report: Path | None = None
    seconds: float = 0.0
    failed_units: list[FailedUnit] = field(default_factory=list)  # each unit that failed (the run went on)
    status: str = FINISHED  # run.json's: BASELINE_FAILED when there is no verdict at all

    @property
    def all_approved(self) -> bool:
        """Every format approved, and a search's held-out gate where there is one; a search
        trial's own verdict (on the search split) approves nothing, so it does not count."""
        return all(entry.verdict == "approved" for entry in self.verdicts.values() if entry.split != "search")

    @property
    def exit_code(self) -> Exit:
        """The run's outcome for a CI (quantgate.core.exitcodes): UNIT_FAILED when a unit failed
        (its record says which: the run is incomplete, the same command tries it again), else
        BLOCKED when a format (or the search's held-out gate) is blocked, else PENDING when one is
        approved pending serving, else APPROVED. A search trial's own verdict decides nothing."""
        outcomes = [Exit.UNIT_FAILED] if self.failed_units or self.status == BASELINE_FAILED else []
        for entry in self.verdicts.values():
            if entry.split != "search":
                outcomes += [Exit.BLOCKED] if entry.verdict == "blocked" else [Exit.PENDING] if entry.verdict == "pending" else []
        return most_urgent(outcomes)

    @property
    def redone(self) -> list[str]:
        return [stage.stage for stage in self.stages if stage.status not in ("reused", "skipped")]


class UnitFailed(Exception):
    """A unit of work (a quantization, an evaluation, a serve) that raised, died or never answered:
    its candidate is not judged on it this run, and the run goes on (a run started again does it
    again). `reason` names the unit, what happened and its log; `record` is run.json's of it."""

    def __init__(self, record: FailedUnit) -> None:
        super().__init__(record.reason)
        self.record = record
        self.kind, self.label, self.reason = record.kind, record.unit, record.reason


class LedgerUntrusted(QuantgateError):
    """The ledger this run appends to was found tampered: no verdict is added to a chain that
    cannot be trusted (exit UNTRUSTED, not bad input: the ledger, not the plan, is at fault)."""

    exit_code = Exit.UNTRUSTED


def _tampered(error: BaseException) -> bool:
    """Whether `error`, or what caused it, is the ledger found tampered (gates.ledger)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, LedgerTampered):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _unit_error(error: BaseException) -> bool:
    """Whether `error` is a unit's own failure, which the run survives: not bad input or
    configuration (exit 2 for the whole run), not a full disk, not Ctrl-C."""
    return isinstance(error, Exception) and not isinstance(error, (InputError, IntegrityError, TaskLost)) \
        and _out_of_space(error) is None


# What fails a search unit (its sensitivity, a trial's quantization) beside its own errors: a task lost
# on a cluster, and bad input only its unit finds (a mixed config llmcompressor refuses, a model the
# sensitivity cannot load): found after the formats' verdicts, it stops the search, not the run.
SEARCH_UNIT_ERRORS: tuple[type[Exception], ...] = (TaskLost, InputError, IntegrityError)


class _NoBaseline(Exception):
    """The baseline's measurement or evaluation failed (its failed unit says why): no verdict can
    be reached this run, and the run goes on to run.json and the report, which say so."""


@dataclass(frozen=True)
class _Overlap:
    summary: OverlapSummary
    key: str


@dataclass(frozen=True)
class _Served:
    """A serve check's record (evalsets.served) and its key."""

    record: ServeRecord
    key: str


@dataclass(frozen=True)
class _AsServed:
    """A checkpoint's golden sets evaluated as a device class serves it (numerics that differ from
    the gated ones beyond the agreement bound): the results, or why there are none."""

    numerics: ServedNumerics
    results: evalsets.EvaluationResults | None
    failure: str | None = None


@dataclass(frozen=True)
class _Baseline:
    """The baseline at every set's first look: what the report's baseline row and the record of a
    format blocked before any evaluation name (each look pairs its own baseline results), and its
    serve check: the base of every serving gate's bound (None: no serve stage)."""

    results: evalsets.EvaluationResults
    served: _Served | None = None


@dataclass(frozen=True)
class _Evidence:
    """What a candidate's looks decided (the sequential stage's value and key), and the results
    they leave: the candidate's and the baseline's on the same items (None: nothing evaluated)."""

    value: SequentialStage
    key: str
    results: evalsets.EvaluationResults | None
    baseline: evalsets.EvaluationResults | None


def sequential_summary(value: SequentialStage) -> SequentialSummary:
    """A verdict's record of its looks: the planned looks and the items evaluated per set, the
    error control, what stopped them, and the sets not evaluated, with why."""
    not_run = {spec: f"not evaluated: the candidate was blocked first by {value.blocked_by}"
               for spec, items in value.depths.items() if not items and value.blocked_by}
    return SequentialSummary(looks=value.looks, items=value.depths, error_control=value.error_control, confidence=value.confidence,
                             blocked_by=value.blocked_by, not_evaluated=not_run, trace=value.trace)


@dataclass(frozen=True)
class _Candidate:
    """One format's (or search trial's) checkpoint, as the quantize stage left it, and the items
    it is judged on."""

    fmt: str  # the checkpoint's name: a format, or a search trial ("search-2")
    precision: str  # its precision class (core.formats.PrecisionClass): which thresholds gate it
    checkpoint: Path
    quantize_key: str
    quantized: Cached[CheckpointManifest]  # the checkpoint's manifest, or the failure
    split: Split | None = None  # a search trial: the search split; its chosen one again: the held-out split
    allocation: dict[str, int] | None = None  # a search trial: the bytes its allocation gives each linear layer

    @property
    def name(self) -> str:
        """Its verdict's name: the checkpoint's, or `<trial>@held-out` for the held-out gate."""
        return f"{self.fmt}@{self.split.name}" if self.split is not None and self.split.name == "held-out" else self.fmt

    @property
    def split_key(self) -> SplitKey | None:
        split = self.split
        return None if split is None else {"name": split.name, "looks": split.looks_json, "offsets": dict(split.offsets)}

    @property
    def manifest(self) -> CheckpointManifest:
        assert self.quantized.value is not None, "a failed checkpoint is gated by _Run.blocked"
        return self.quantized.value


@dataclass(frozen=True)
class _Prepared:
    """A candidate made ready for its gate: measured, evaluated and served (what runs side by side
    under a concurrent executor); `lost`: a task of it that the cluster lost for good."""

    candidate: _Candidate
    measured: MeasurementRecord | None = None
    measure_key: str = ""
    evidence: _Evidence | None = None
    served: _Served | None = None
    lost: str | None = None


class Pipeline:
    """One run of a plan into its output directory. `run()` returns the verdicts; nothing in the
    plan is acted on before `preflight()` has checked all of it."""

    def __init__(self, loaded: LoadedPlan, out: Path | None = None, show_progress: bool = True, verbose: bool = False) -> None:
        self.loaded = loaded
        self.verbose = verbose  # other libraries' output on the terminal too, not only in logs/libraries.log
        self.plan = loaded.plan
        self.out = Path(out or loaded.out).absolute()
        self.run_dir = RunDir(self.out)
        self.ledger = loaded.ledger.absolute() if (out is None or loaded.plan.ledger) else self.run_dir.ledger
        self.show_progress = show_progress

    def preflight(self) -> ResolvedPlan:
        """Every check before any work: the plan, resolved."""
        return resolve_plan(self.loaded, self.show_progress, verbose=self.verbose)

    def planned_stages(self, resolved: ResolvedPlan) -> list[str]:
        search = self.plan.search
        served = ["serve"] if resolved.serve_cfg is not None else []
        per_format = [*PER_FORMAT[:3], *served, PER_FORMAT[3]]
        # a search: its sensitivity, at most max_trials trials, the held-out measure (reused), evaluation, serve and gate
        searched = ["sensitivity", *per_format * search.max_trials, "measure", "evaluate", *served, "gate"] if search else []
        return ["calibration", "overlap", "measure", "evaluate", *served, *per_format * len(self.plan.formats), *searched, "report"]

    def run(self) -> RunResult:
        # torch on one thread here before the preflight's own torch work, so that the units' forked
        # children can use every thread (quantgate.pipeline.executor.hold_one_thread)
        threads = executors.hold_one_thread() if executors.forks(self.plan.executor) else None
        try:
            return self.run_held(threads)
        finally:
            if threads is not None:
                executors.release_threads(threads)

    def run_held(self, threads: int | None) -> RunResult:
        resolved = self.preflight()
        try:  # a tampered ledger is refused before any work, not after the run's quantizations and evaluations
            read_ledger(self.ledger)
        except LedgerTampered as error:
            raise LedgerUntrusted(" ".join(str(error).split())) from error
        serve, gpus = resolved.serve_cfg, self.plan.resources.get("serve")
        if self.plan.executor.kind == "ray" and serve is not None and serve.tensor_parallel > (gpus.gpus if gpus else 0) >= 1:
            raise InputError(f"serving.tensor_parallel is {serve.tensor_parallel} but resources.serve gives each serve task "
                             f"{gpus.gpus if gpus else 0:g} GPUs: give it as many")
        created = _make_out(self.out)  # before any work: an `out` that cannot be made or written is refused here
        try:
            executor = executors.make(self.plan.executor, self.plan.resources, threads)
        except BaseException:
            if created:
                shutil.rmtree(self.out, ignore_errors=True)
            raise
        try:
            try:
                executor.check_shared(self.out, self.shared_paths(resolved))
            except InputError:
                if created:
                    shutil.rmtree(self.out, ignore_errors=True)  # made for this run only: nothing of it is left
                raise
            with RunLock(self.run_dir.lock):
                return self.locked(resolved, executor)
        finally:
            executor.close()

    def locked(self, resolved: ResolvedPlan, executor: Executor) -> RunResult:
        """The chain, under the run directory's lock; a full disk is one line, and what a killed
        run (or task, or write) left half-made is removed once its tasks ended."""
        try:
            remove_temporaries(self.out)  # what a killed run left half-made: never signed over, never reused
            with library_output(self.run_dir.library_log, enabled=not self.verbose):
                return _Run(self, resolved, executor).chain()
        except KeyboardInterrupt:
            executor.cancel()  # no task of this run writes after this
            raise
        except Exception as error:
            if _tampered(error) and not isinstance(error, LedgerUntrusted):
                raise LedgerUntrusted(" ".join(str(error).split())) from error
            full = _out_of_space(error)
            if full is None:
                raise
            executor.cancel()
            raise InputError(f"no space left to write {full}: every artifact written so far is whole; free some space (or "
                             "choose another out) and run the same command again to resume") from None
        finally:
            remove_temporaries(self.out)  # what a killed task or an interrupted write left half-made
            # the shared evaluation cache: only what a writer that no longer runs left
            remove_temporaries(cache_root(), only_stale=True)

    @staticmethod
    def shared_paths(resolved: ResolvedPlan) -> list[Path]:
        """What every worker must see besides the run directory: the model, a calibration source
        file, the golden sets' files, and the serving environment."""
        env, source = resolved.serving_env, Path(resolved.calibration_cfg.source).expanduser()
        return [resolved.model_dir, *([source.absolute()] if source.exists() else []),
                *(golden.path for golden in resolved.goldens.values()), *([Path(env.python)] if env is not None else [])]


class _Run:
    """The chain of stages of one run, each through the stage cache."""

    def __init__(self, pipeline: Pipeline, plan: ResolvedPlan, executor: Executor) -> None:
        self.pipeline = pipeline
        self.plan = plan
        self.dir = pipeline.run_dir
        self.executor = executor
        self.call = executor.call
        self.log = StageLog(pipeline.planned_stages(plan), pipeline.show_progress, executor.where)
        self.cache = StageCache(self.dir, self.log)
        self.started = time.perf_counter()
        self.failed_units: list[FailedUnit] = []
        self.calibration_failed: str | None = None  # why the calibration set failed (its unit's reason)
        # the baseline's serve record: its probe's forward pass is the base of every candidate's limit
        self.baseline_served: Future[_Served | None] = Future()

    def attempt(self, kind: str, label: str, name: str, work: Callable[[], T],
                also: tuple[type[Exception], ...] = ()) -> T:
        """Run one unit of work; a failure of its own (it raised, ran out of memory, its worker died
        or never answered) becomes UnitFailed, with its traceback in logs/, and the run goes on.
        `also`: errors that otherwise end a run (bad input, a lost task) and here only fail this unit."""
        log = self.dir.unit_log(kind, name)
        started = time.perf_counter()
        try:
            # each unit's own log of what the libraries printed (the run's libraries.log keeps what
            # is printed between units). Not under a concurrent executor: units then overlap in
            # time, and their output is printed where their tasks run (docs/scale-out.md)
            with library_output(log, enabled=not (self.pipeline.verbose or self.executor.concurrent)):
                done = work()
            if log.is_file() and log.stat().st_size == 0:
                log.unlink()  # a reused stage, or one that printed nothing: no empty log
            return done
        except Exception as error:
            if not (_unit_error(error) or isinstance(error, also)):
                raise
            printed = tail(log)  # what the libraries printed last, before the traceback
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a", encoding="utf-8") as stream:  # appended after what it printed
                stream.write("".join(traceback.format_exception(error)))
            reason = f"{label} failed: {type(error).__name__}: {' '.join(str(error).split())[:400]} (log {log})"
            died = error if isinstance(error, UnitDied) else None
            record = FailedUnit(kind=kind, unit=label, reason=reason, log=str(log), signal=died.signal if died else None,
                                peak_memory_bytes=died.peak_memory_bytes if died else None)
            self.failed_units.append(record)
            self.log.end(kind, label, "failed", time.perf_counter() - started, reason)
            if self.pipeline.show_progress:
                for line in printed:
                    stderr.print(f"  | {line}", highlight=False, markup=False, soft_wrap=True)
            raise UnitFailed(record) from error

    def stored(self, stage: JsonStage[..., T], *names: str, key: str, label: str, work: Callable[[], object],
               attempt: str | None = None, needs: Sequence[str] = (), task: str | None = None,
               reuse: Callable[[dict[str, JsonValue]], bool] | None = None) -> T:
        """A JSON stage's artifact (quantgate.pipeline.stages) for `names`, read back as its record:
        reused when it was stored with `key` (and `reuse` accepts it), else `work` (the stage's unit,
        run by the executor as `task`, default `label`; a stage without a unit: run here) and stored.
        `attempt`: its unit log's name, when a failure of its own fails this unit only (`_Run.attempt`)."""
        path = stage.where(self.dir, *names)
        run = partial(self.call, stage.kind, task or label, work, needs=needs) if stage.unit is not None else work

        def cached() -> T:
            return stage.read(self.cache.json(kind=stage.kind, label=label, path=path, key=key, produce=lambda: _stored_json(run()),
                                              reuse=reuse), str(path))

        return cached() if attempt is None else self.attempt(stage.kind, label, attempt, cached)

    def made(self, stage: DirectoryStage[..., T], *names: str, key: str, label: str, work: Callable[[], T],
             attempt: str | None = None, needs: Sequence[str] = (), also: tuple[type[Exception], ...] = ()) -> Cached[T]:
        """A directory stage's artifact (quantgate.pipeline.stages) for `names`: reused when its
        record in stages/ has `key` and it still verifies, else `work` (the stage's unit, which
        writes it) run by the executor; `attempt`, `also`: as `_Run.attempt`."""
        def cached() -> Cached[T]:
            return self.cache.directory(kind=stage.kind, name=stage.record(*names), label=label, key=key,
                                        artifact=stage.where(self.dir, *names), load=stage.load,
                                        produce=lambda: self.call(stage.kind, label, work, needs=needs), failures=stage.failures)

        return cached() if attempt is None else self.attempt(stage.kind, label, attempt, cached, also)

    def chain(self) -> RunResult:
        """Every stage, then run.json and the report, whatever unit failed: the baseline's failure
        leaves no verdict at all (run.json's status says so), any other unit's its candidates'."""
        self.manifest(status=RUNNING).write(self.dir.run_file)
        try:
            verdicts, status = self.verdicts(), FINISHED
        except _NoBaseline:
            verdicts, status = {}, BASELINE_FAILED
        except BaseException:
            # what ends the run itself (Ctrl-C, bad input found mid-run, a tampered ledger, a bug): run.json
            # never stays "running", and keeps the failed units so far; the error says the rest
            with contextlib.suppress(OSError):  # a full disk: the error being raised says so
                self.manifest(status=STOPPED).write(self.dir.run_file)
            raise
        units.forget()  # the models this process kept for the run
        self.manifest(status=status, verdicts=verdicts).write(self.dir.run_file)
        self.report()
        result = RunResult(self.dir.root, verdicts, self.log.stages, self.dir.report, seconds=time.perf_counter() - self.started,
                           failed_units=list(self.failed_units), status=status)
        self.manifest(status=status, verdicts=verdicts, seconds=result.seconds).write(self.dir.run_file)
        return result

    def verdicts(self) -> dict[str, VerdictRecord]:
        """Each format's verdict, then the search's; _NoBaseline when the baseline failed."""
        formats = self.plan.plan.formats
        if self.executor.concurrent and len(formats) > 1:
            calibration_set, overlap, baseline, verdicts = self.side_by_side()
        else:
            calibration_set = self.calibrate()
            overlap = self.overlap(calibration_set) if calibration_set is not None else None
            results = self.baseline_results()
            baseline = _Baseline(results, self.serve_baseline(results))
            verdicts = {fmt: self.conclude(self.prepare(fmt, calibration_set, overlap), baseline, overlap)
                        if calibration_set is not None and overlap is not None else self.uncalibrated(fmt, baseline)
                        for fmt in formats}
        if self.plan.plan.search is not None:
            if calibration_set is None or overlap is None:
                self.stop_search(f"the calibration set failed ({self.calibration_failed})")
            else:
                verdicts.update(self.search(calibration_set, baseline, overlap, verdicts))
        return verdicts

    def uncalibrated(self, fmt: str, baseline: _Baseline) -> VerdictRecord:
        """A format's verdict when the run's calibration set failed: it cannot be quantized, so it
        is blocked for this run, not evaluated, with the calibration's failure as its reason."""
        reason = f"the calibration set failed, so it was not quantized ({self.calibration_failed})"
        begun = self.cache.begin(f"quantize {fmt}")
        self.cache.finish("quantize", f"quantize {fmt}", "skipped", begun, "no calibration set")
        candidate = _Candidate(fmt, get_preset(fmt).precision, QUANTIZE.where(self.dir, fmt), "no-calibration-set",
                               Cached(None, {"failed": reason, "lost": reason}))
        return self.blocked(candidate, baseline, reason)

    # ---- once a run -------------------------------------------------------------------------

    def calibrate(self) -> calibration.CalibrationSet | None:
        """calibration.run reuses the set itself when its inputs' key matches. None when it failed
        (a unit's failure, in failed_units): no format can be quantized this run."""
        begun = self.cache.begin("calibration")
        try:
            made: calibration.CalibrationSet = self.attempt("calibration", "calibration", "set", lambda: self.call(
                "calibration", "calibration", CALIBRATION.task(self.plan.calibration_cfg, CALIBRATION.where(self.dir), overwrite=True)))
        except UnitFailed as failed:
            self.calibration_failed = failed.reason
            return None
        self.cache.finish("calibration", "calibration", "reused" if made.reused else "done", begun,
                          f"{made.samples} x {made.input_ids.shape[1]} tokens, fingerprint {made.fingerprint[:12]}")
        return made

    def overlap(self, calibration_set: calibration.CalibrationSet) -> _Overlap:
        key = OVERLAP.key(self.plan, calibration_set.fingerprint)
        summary = self.stored(OVERLAP, key=key, label="overlap of calibration and golden sets", task="overlap",
                              work=OVERLAP.task(calibration_set, list(self.plan.goldens.values())))
        return _Overlap(summary, key)

    def serve_baseline(self, results: evalsets.EvaluationResults) -> _Served | None:
        """The baseline's serve check, handed to every candidate's (the base of its probe's limit)."""
        try:
            served = self.serve(BASELINE, self.plan.model_dir, results)
        except BaseException:
            self.baseline_served.set_result(None)
            raise
        self.baseline_served.set_result(served)
        return served

    def baseline_results(self) -> evalsets.EvaluationResults:
        """The baseline measured, and evaluated at every set's first look; _NoBaseline when either
        failed (in failed_units): every verdict pairs with it, so there is none this run."""
        plan = self.plan
        try:
            self.stored(BASELINE_MEASURE, BASELINE, key=BASELINE_MEASURE.key(plan), label="measure baseline", attempt=BASELINE,
                        work=BASELINE_MEASURE.task(plan.model_dir, None, plan.profiles))
            evaluated = self.made(BASELINE_EVALUATE, BASELINE, key=BASELINE_EVALUATE.key(plan), label="evaluate baseline",
                                  attempt=BASELINE, work=BASELINE_EVALUATE.task(plan, BASELINE_EVALUATE.where(self.dir, BASELINE)))
        except UnitFailed as failed:
            raise _NoBaseline(failed.reason) from failed
        results = evaluated.value
        assert results is not None  # no failure is caught: a value or an exception
        return results

    def report(self) -> None:
        """The report of the run directory; its report.json carries the key of its data."""
        begun = self.cache.begin("report")
        report = build_report(self.dir.root)
        key = report_key(report)
        existing = self.dir.report_json
        if existing.is_file() and read_json(existing).get("key") == key:
            self.cache.finish("report", "report", "reused", begun)
        else:
            write_report(report.model_copy(update={"key": key}), self.dir.report)
            self.cache.finish("report", "report", "done", begun, str(self.dir.report_html))

    # ---- per format -------------------------------------------------------------------------

    def side_by_side(self) -> tuple[calibration.CalibrationSet | None, _Overlap | None, _Baseline, dict[str, VerdictRecord]]:
        """Under a concurrent executor, what does not wait for anything runs at once: the baseline
        (its first looks, then every look a format can ask for) beside the calibration set, each
        format's quantization and measurement as soon as the calibration set is made, each
        format's evaluation once the baseline's looks are made (they all read them), the serve
        checks as they come; the gates follow in the plan's order, so the ledger's order is a
        local run's. Returns the calibration set, the overlap, the baseline and the verdicts."""
        formats = self.plan.plan.formats
        with ThreadPoolExecutor(max_workers=len(formats) + 1, thread_name_prefix="quantgate-unit") as pool:
            try:
                looked = pool.submit(self.baseline_looked)
                calibration_set = self.calibrate()
                if calibration_set is None:  # no format can be quantized: each is blocked, once the baseline is there
                    results = looked.result()
                    baseline = _Baseline(results, self.serve_baseline(results))
                    return None, None, baseline, {fmt: self.uncalibrated(fmt, baseline) for fmt in formats}
                overlap = self.overlap(calibration_set)
                prepared = {fmt: pool.submit(self.prepare, fmt, calibration_set, overlap, looked) for fmt in formats}
                results = looked.result()
                baseline = _Baseline(results, self.serve_baseline(results))
                verdicts = {fmt: self.conclude(prepared[fmt].result(), baseline, overlap) for fmt in formats}
            except BaseException:
                self.executor.cancel()  # Ctrl-C or an error: the other units' tasks stop too
                if not self.baseline_served.done():
                    self.baseline_served.set_result(None)  # no candidate waits for it any longer
                raise
        return calibration_set, overlap, baseline, verdicts

    def baseline_looked(self) -> evalsets.EvaluationResults:
        """The baseline's results at the first looks, and its looks made for the formats."""
        results = self.baseline_results()
        self.baseline_looks()
        return results

    def baseline_looks(self) -> None:
        """The baseline at each look a format can ask for, a task per set, before the formats run
        side by side (quantgate.pipeline.units.baseline_looks); each look is kept in the run
        directory and reused, so nothing here is made twice."""
        # a set whose looks are all there already (a resumed run) sends no task: each format's
        # evaluation still checks what it reads, and makes again a look found damaged
        specs = [spec for spec in self.plan.set_specs if not all(self.dir.look(BASELINE, spec, items).is_dir()
                                                   for items in units.baseline_look_counts(self.plan, spec))]
        if not specs:
            return
        with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="quantgate-looks") as pool:
            try:
                for made in [pool.submit(self.call, "evaluate", f"baseline looks {spec}",
                                         partial(units.baseline_looks, self.plan, self.dir, spec)) for spec in specs]:
                    made.result()
            except BaseException:
                self.executor.cancel()
                raise

    def prepare(self, fmt: str, calibration_set: calibration.CalibrationSet, overlap: _Overlap,
                baseline: Future[evalsets.EvaluationResults] | None = None) -> _Prepared:
        """One format quantized, measured, evaluated (once `baseline`, where given, is done) and
        served: what its gate needs."""
        return self.examine(self.quantize(fmt, calibration_set), overlap, baseline)

    def judge(self, candidate: _Candidate, baseline: _Baseline, overlap: _Overlap) -> VerdictRecord:
        """A search trial's checkpoint (or its held-out gate), measured, evaluated on its split and
        gated: its verdict record. A unit of it that failed, or a task lost on a cluster, is no
        verdict to bisect on: SearchStopped (the search ends saying why; the run goes on)."""
        try:
            prepared = self.examine(candidate, overlap, lose=False)
        except TaskLost as lost:
            self.failed_units.append(FailedUnit(kind=lost.kind, unit=lost.label, reason=str(lost)))
            raise SearchStopped(f"{candidate.name}: {lost}") from lost
        if prepared.lost is not None:
            raise SearchStopped(f"{candidate.name} was not judged ({prepared.lost})")
        return self.conclude(prepared, baseline, overlap)

    def examine(self, candidate: _Candidate, overlap: _Overlap, baseline: Future[evalsets.EvaluationResults] | None = None,
                lose: bool = True) -> _Prepared:
        """A checkpoint measured, evaluated on its split and served; a task of it the cluster lost
        for good leaves it `lost` (blocked with the reason; nothing of it is cached as a failure)."""
        if candidate.quantized.value is None:  # it failed its own checks, or its quantization was lost
            return _Prepared(candidate, lost=candidate.quantized.record.get("lost"))
        name = candidate.name
        try:
            measured, measure_key = self.attempt("measure", f"measure {name}", name, lambda: self.measure(candidate))
            if baseline is not None:
                baseline.result()  # the baseline's looks, which the candidate's evaluation reads
            evidence = self.attempt("evaluate", f"evaluate {name}", name, lambda: self.evaluate_sequentially(
                candidate, measured=measured, measure_key=measure_key, overlap=overlap))
        except TaskLost as lost:
            self.log.end(lost.kind, lost.label, "failed", 0.0, str(lost))
            if not lose:  # a search trial: a lost one is no verdict to bisect on; the search stops (_Run.judge)
                raise
            self.failed_units.append(FailedUnit(kind=lost.kind, unit=lost.label, reason=str(lost)))
            return _Prepared(candidate, lost=str(lost))
        except UnitFailed as failed:  # no verdict on this candidate this run; the run goes on
            return _Prepared(candidate, lost=failed.reason)
        if evidence.value.blocked_by and self.plan.serve_cfg is not None:  # blocked by quality: no serve changes that
            begun = self.cache.begin(f"serve {name}")
            self.cache.finish("serve", f"serve {name}", "skipped", begun, "blocked by its quality gates")
            return _Prepared(candidate, measured, measure_key, evidence, None)
        if name != candidate.fmt and self.dir.results(candidate.fmt).is_dir():
            # a search trial's held-out gate: the same checkpoint its trial served, and how it serves is the
            # weights' and the kernels' (not the items'): the trial's serve record answers it, no vLLM starts again
            trial = evalsets.load_results(self.dir.results(candidate.fmt))
            return _Prepared(candidate, measured, measure_key, evidence, self.serve(candidate.fmt, candidate.checkpoint, trial))
        return _Prepared(candidate, measured, measure_key, evidence, self.serve(name, candidate.checkpoint, evidence.results))

    def conclude(self, prepared: _Prepared, baseline: _Baseline, overlap: _Overlap) -> VerdictRecord:
        """The verdict on a prepared candidate: its gates (and the ledger), or blocked for what
        stopped it before them."""
        if prepared.evidence is None or prepared.measured is None:
            return self.blocked(prepared.candidate, baseline, prepared.lost)
        as_served = self.gate_what_serves(prepared.candidate, prepared.evidence, prepared.served, baseline)
        return self.gate(prepared.candidate, measured=prepared.measured, measure_key=prepared.measure_key, evidence=prepared.evidence,
                         baseline=baseline, overlap=overlap, served=prepared.served, as_served=as_served)

    def gate_what_serves(self, candidate: _Candidate, evidence: _Evidence, served: _Served | None,
                         baseline: _Baseline) -> list[_AsServed]:
        """Where this device class serves the checkpoint in other numerics than were gated (its
        serve disagrees beyond the bound, or the engine's default would compute another scheme that
        does: INT4 as W4A8 on an AMX CPU), the items its gate judged, evaluated again through the
        engine under those settings: that class's quality evidence (docs/serving.md, "Gating what
        serves"). None for a search trial (its held-out gate is the one a user deploys), a
        candidate its quality blocked, or one with no set the engine evaluates."""
        plan = self.plan
        if served is None or evidence.results is None or evidence.value.blocked_by or plan.serving_env is None:
            return []
        if candidate.split is not None and candidate.split.name != "held-out":
            return []
        reference = baseline.served
        found = differing_numerics(plan.policy, ServingEvidence(served.record, reference.record if reference else None))
        if not found or evalsets.as_served(evidence.results, {}, plan.policy.policy.metrics) is None:
            return []
        return [self.evaluate_as_served(candidate, evidence.results, numerics) for numerics in found]

    def evaluate_as_served(self, candidate: _Candidate, results: evalsets.EvaluationResults, numerics: ServedNumerics) -> _AsServed:
        plan, name = self.plan, candidate.name
        label = f"evaluate {name} as served ({numerics.which.replace('_', ' ')} on {numerics.device_class})"
        out = SERVED_RESULTS.where(self.dir, name, numerics.which)
        key = SERVED_RESULTS.key(plan, checkpoint=candidate.quantize_key, results=sha256_file(results.path / MANIFEST),
                                      settings=numerics.settings, device_class=numerics.device_class)
        # on a cluster: a node of the class whose numerics these are (an AMX node for W4A8), with the kernels
        needs = [f"{device.RESOURCE_PREFIX}{numerics.device_class}",
                 *(device.serve_resource(scheme) for scheme in device.checkpoint_schemes(read_checkpoint(candidate.checkpoint).config))]
        work = SERVED_RESULTS.task(plan, candidate.checkpoint, gated=results.path, settings=numerics.settings,
                                   device_class=numerics.device_class, out=out)
        try:  # a task the engine refuses (InputError) or a node lost: evidence missing, not a reason to end the run
            made = self.made(SERVED_RESULTS, name, numerics.which, key=key, label=label, work=work, attempt=f"{name}-{numerics.which}",
                             needs=needs, also=(InputError, TaskLost))
        except UnitFailed as failed:  # nothing cached: the next run evaluates it again
            return _AsServed(numerics, None, failed.reason)
        return _AsServed(numerics, made.value)

    def serve(self, name: str, model: Path, results: evalsets.EvaluationResults | None) -> _Served | None:
        """The serve check of `name` (BASELINE or a verdict's name) against the results its gate
        saw (none holding the text set: load and throughput only); None without a serve stage."""
        plan = self.plan
        if plan.serve_cfg is None or plan.serving_env is None:
            return None
        cfg, env = plan.serve_cfg, plan.serving_env
        key = SERVE.key(plan, checkpoint=model_identity(model).numbers(),
                             results=sha256_file(results.path / MANIFEST) if results is not None else None)
        baseline = None if name == BASELINE else _record_of(self.baseline_served.result())
        # the baseline's probe pass and cold start here: the bases of this serve's probe limit and load deadline
        reference, reference_load = probe_seconds(baseline), cold_start_seconds(baseline)
        label = f"serve {name}"
        # on a cluster: a node whose engine serves the checkpoint's schemes (serving.device.node_resources)
        needs = [device.serve_resource(scheme) for scheme in device.checkpoint_schemes(read_checkpoint(model).config)]
        try:
            # pending for want of memory: served again next run, which may have more (the key cannot know)
            record = self.stored(SERVE, name, key=key, label=label, attempt=name, needs=needs, work=SERVE.task(
                model, results, cfg, env, work=self.dir.serve_work(name), reference_probe=reference, reference_load=reference_load),
                reuse=lambda value: value.get("memory_needed_bytes") is None)
        except UnitFailed as failed:  # nothing cached: the next run serves it again; the verdict is pending
            # the class it was to serve on is known though nothing served: the summary names it, not "unknown"
            device_class = device.local_class("cuda" if env.engine == "vllm" else "cpu")
            return _Served(ServeRecord(served=False, status=FAILED, reason=failed.reason, engine=env.identity(),
                                       device_class=device_class), f"failed:{key}")
        self.log.amend(label, _served_summary(record), done=False)
        return _Served(record, key)

    def quantize(self, fmt: str, calibration_set: calibration.CalibrationSet) -> _Candidate:
        plan, checkpoint = self.plan, QUANTIZE.where(self.dir, fmt)
        key = QUANTIZE.key(plan, fmt, calibration_set.fingerprint)
        label = f"quantize {fmt}"
        try:
            quantized = self.made(QUANTIZE, fmt, key=key, label=label, attempt=fmt,
                                  work=QUANTIZE.task(plan, fmt, calibration_set.path, checkpoint))
        except TaskLost as lost:  # lost for good on a cluster: no checkpoint, and no record of it on disk
            self.log.end(lost.kind, label, "failed", 0.0, str(lost))
            self.failed_units.append(FailedUnit(kind=lost.kind, unit=label, reason=str(lost)))
            quantized = Cached(None, {"failed": str(lost), "lost": str(lost)})
        except UnitFailed as failed:  # not the inputs' fault as far as anyone knows: the next run quantizes again
            quantized = Cached(None, {"failed": failed.reason, "lost": failed.reason})
        return _Candidate(fmt, get_preset(fmt).precision, checkpoint, key, quantized)

    def blocked(self, candidate: _Candidate, baseline: _Baseline, lost: str | None = None) -> VerdictRecord:
        """The verdict on a checkpoint that failed its own checks (nothing to measure or deploy),
        or one whose task the cluster lost for good."""
        fmt, failure = candidate.name, lost or candidate.quantized.failed or ""
        for kind in ("measure", "evaluate") if lost is None else ():  # a lost task's stage is in the log already
            begun = self.cache.begin(f"{kind} {fmt}")
            self.cache.finish(kind, f"{kind} {fmt}", "skipped", begun, "no checkpoint")
        verdict = lost_verdict(failure) if lost else blocked_verdict(failure)
        return self.stored(BLOCKED_GATE, fmt, key=BLOCKED_GATE.key(self.plan, candidate.quantize_key, failure), label=f"gate {fmt}",
                           work=lambda: _with_split(verdict_record(fmt, verdict, precision=candidate.precision, policy=self.plan.policy,
                                                                   checkpoint=None, baseline_results=baseline.results,
                                                                   candidate_results=None), candidate).to_json())

    def measure(self, candidate: _Candidate) -> tuple[MeasurementRecord, str]:
        """The checkpoint's byte accounting (its decode bounds are stored beside it, for the
        report), and the key they were made with."""
        key = MEASURE.key(self.plan, candidate.quantized.manifest_sha256)
        return self.stored(MEASURE, candidate.fmt, key=key, label=f"measure {candidate.fmt}",
                           work=MEASURE.task(candidate.checkpoint, self.plan.model_dir, self.plan.profiles)), key

    def evaluate_sequentially(self, candidate: _Candidate, *, measured: MeasurementRecord, measure_key: str,
                              overlap: _Overlap) -> _Evidence:
        """The candidate's looks (quantgate.pipeline.looks), then its results and the baseline's on
        the same items, published for the gate and the report."""
        plan, name = self.plan, candidate.name
        blocked_before = _pre_gates(plan.policy, candidate, measured, overlap)
        key = SEQUENTIAL.key(plan, candidate.quantized.manifest_sha256, precision=candidate.precision,
                             blocked_before=blocked_before, split=candidate.split_key)
        path, label = SEQUENTIAL.where(self.dir, name), f"evaluate {name}"
        unit = units.SequentialUnit(fmt=candidate.fmt, name=name, precision=candidate.precision, blocked_before=blocked_before)
        published = _published(self.dir, name, key)
        if published is None:  # its results went missing or were damaged: looked at again (cached items)
            path.unlink(missing_ok=True)
            for damaged in (self.dir.results(name), self.dir.paired_baseline(name)):
                shutil.rmtree(damaged, ignore_errors=True)  # never read again as they are
        value = self.stored(SEQUENTIAL, name, key=key, label=label, work=SEQUENTIAL.task(plan, self.dir, unit, candidate.split))
        if not any(value.depths.values()):
            return _Evidence(value, key, None, None)
        if published is None or not published:  # just made: loaded (and verified) once, here
            published = (evalsets.load_results(self.dir.results(name)), evalsets.load_results(self.dir.paired_baseline(name)))
        return _Evidence(value, key, *published)

    def gate(self, candidate: _Candidate, *, measured: MeasurementRecord, measure_key: str, evidence: _Evidence,
             baseline: _Baseline, overlap: _Overlap, served: _Served | None = None,
             as_served: list[_AsServed] | None = None) -> VerdictRecord:
        """The verdict record, appended to the ledger unless the ledger holds it already."""
        plan, fmt = self.plan, candidate.name
        # the policy's serving gates judge every candidate, a search's trials included: a trial vLLM
        # cannot serve as gated is no solution, and is blocked on the search split
        gates_serving = plan.policy.policy.serving is not None
        reference = baseline.served
        # the serve records themselves (a record made again under the same key may differ)
        # (a serve that failed is no evidence: one key for every such failure, so a rerun that fails again judges nothing anew)
        serve_keys = [(FAILED if part.record.status == FAILED else sha256_json(part.record.to_json())) if part else None
                      for part in (served, reference)] if plan.serve_cfg is not None else None
        key = GATE.key(plan, precision=candidate.precision, evidence=evidence.key, measure=measure_key, overlap=overlap.key,
                            results=[sha256_file(results.path / MANIFEST) for results in (evidence.results, evidence.baseline) if results],
                            allocation=candidate.allocation, serve=serve_keys,
                            as_served=[[entry.numerics.which, sha256_file(entry.results.path / MANIFEST) if entry.results else FAILED]
                                       for entry in as_served or []])

        def verdict() -> VerdictRecord:
            manifest = candidate.manifest
            metric_gates = [GateResult.from_record(gate) for gate in evidence.value.gates]
            candidate_items = item_records(evidence.results) if evidence.results else None
            serving = ServingEvidence(served.record if served else None, reference.record if reference else None) \
                if gates_serving else None
            judged = judge({}, candidate_items, plan.policy, candidate.precision, measurement=measured,
                           smoke=_smoke(manifest), overlap=overlap.summary, metric_gates=metric_gates,
                           allocation=candidate.allocation, serving=serving)
            # the weight files' sha256s from the checkpoint's manifest, which the quantize stage
            # just wrote or verified against the bytes: not hashed a third time
            record = verdict_record(fmt, judged, precision=candidate.precision, policy=plan.policy, checkpoint=candidate.checkpoint,
                                    baseline_results=evidence.baseline or baseline.results, candidate_results=evidence.results,
                                    weights=weight_file_hashes(manifest.files))
            summary = sequential_summary(evidence.value)
            gated_as_served = [as_served_record(entry, baseline=evidence.baseline, policy=plan.policy, precision=candidate.precision)
                               for entry in as_served or []]
            record = record.with_fields(sequential=summary, not_evaluated=summary.not_evaluated,
                                        tails=tails(candidate_items or {}, plan.policy.policy.statistics))
            if served:
                record = record.with_fields(serving=served.record.summary(),
                                            classes=serving_classes(judged, served.record, record, self.dir.root, gated_as_served))
            if gated_as_served:
                record = record.with_fields(as_served=gated_as_served)
            return _with_split(record, candidate)

        record = self.stored(GATE, fmt, key=key, label=f"gate {fmt}", work=lambda: verdict().to_json())
        # the driver is this run's only writer; another run may share the ledger (record_verdict holds its lock)
        # signed, with what `serving check --run` reads there: the serve check's settings, the results' hashes
        appended = record_verdict(self.pipeline.ledger, record, self.plan.signing_key, serving=self.plan.serve_cfg,
                                  baseline_results=self.dir.results(BASELINE))
        self.log.amend(f"gate {fmt}", f"{record.verdict}; ledger {'appended' if appended else 'already holds this verdict'}",
                       done=appended)
        return record

    # ---- the mixed-precision search ---------------------------------------------------------

    def search(self, calibration_set: calibration.CalibrationSet, baseline: _Baseline, overlap: _Overlap,
               uniform: dict[str, VerdictRecord]) -> dict[str, VerdictRecord]:
        """The search (quantgate.pipeline.search): its record in search.json; the verdicts of its
        trials and of the held-out gate, by name."""
        plan, search = self.plan, self.plan.plan.search
        assert search is not None
        self.dir.search_file.unlink(missing_ok=True)  # an earlier run's record never stands for this one
        # a format without a checkpoint this run (its quantization failed, its checkpoint failed its own checks, its task
        # was lost on a cluster): its bytes are no point of the search (a measurement an earlier run left is not this run's)
        unmeasured = [name for name in search.formats
                      if not self.dir.measure(name).is_file() or (name in uniform and uniform[name].checkpoint is None)]
        if unmeasured:
            why = uniform[unmeasured[0]].reasons[0] if unmeasured[0] in uniform and uniform[unmeasured[0]].reasons else "no checkpoint"
            return self.stop_search(f"it mixes {unmeasured[0]}, which this run did not measure ({why})")
        cfg = _sensitivity_config(plan)
        try:
            scores = self.made(SENSITIVITY, key=SENSITIVITY.key(plan, cfg, calibration_set.fingerprint), label="sensitivity",
                               attempt="layer-groups", also=SEARCH_UNIT_ERRORS,
                               work=SENSITIVITY.task(cfg, plan.model_dir, calibration_set.path, SENSITIVITY.where(self.dir),
                                                     overwrite=True, allow_pickle=plan.plan.allow_pickle)).value
        except UnitFailed as failed:
            return self.stop_search(f"the sensitivity stage failed ({failed.reason})")
        assert scores is not None  # the sensitivity stage caches no failure: a value or an exception
        measurements = {name: stage_measurement(stored_value(self.dir.measure(name)), str(self.dir.measure(name)))
                        for name in (BASELINE, *search.formats)}
        measurements[quantize.UNQUANTIZED] = measurements.pop(BASELINE)
        space = build_space(search.formats, measurements, {fmt: scores.scores(fmt) for fmt in search.formats})
        made: dict[str, _Candidate] = {}

        judged: dict[str, VerdictRecord] = {}

        # quantgate.pipeline.search decides on the verdicts' JSON; the records themselves are kept here
        def trial(name: str, allocation: Allocation) -> VerdictRecord:
            try:
                made[name] = self.quantize_trial(name, mixed_config(plan, space, allocation), calibration_set,
                                                 space.trial_layers(allocation))
            except UnitFailed as failed:  # no verdict to bisect on: the search stops, saying why
                raise SearchStopped(f"{name}'s quantization failed ({failed.reason})") from failed
            judged[name] = self.judge(made[name], baseline, overlap)
            return judged[name]

        def held_out(name: str) -> VerdictRecord:
            judged[f"{name}@held-out"] = self.judge(replace(made[name], split=plan.holdout), baseline, overlap)
            return judged[f"{name}@held-out"]

        record = run_search(plan, space, Trials(lambda name, allocation: trial(name, allocation).to_json(),
                                                lambda name: held_out(name).to_json(),
                                                {fmt: verdict.to_json() for fmt, verdict in uniform.items()}))
        self.write_search(record)
        return {name: judged[name] for name in record["verdicts"]}

    def stop_search(self, reason: str) -> dict[str, VerdictRecord]:
        """A search that stops before its first trial: its record says why; no verdict of it."""
        self.write_search(stopped_search(self.plan, reason))
        return {}

    def write_search(self, record: SearchRecord) -> None:
        write_json(self.dir.search_file, {key: value for key, value in record.items() if key != "verdicts"})
        stderr.print(f"search: {record['conclusion']}", highlight=False, soft_wrap=True)

    def quantize_trial(self, name: str, cfg: MixedConfig, calibration_set: calibration.CalibrationSet,
                       layer_bytes: dict[str, int]) -> _Candidate:
        """A search trial's mixed checkpoint, judged on the search split and held to `layer_bytes`."""
        plan, checkpoint = self.plan, TRIAL_QUANTIZE.where(self.dir, name)
        key = TRIAL_QUANTIZE.key(plan, cfg, calibration_set.fingerprint)
        # raised, died, or lost on a cluster: UnitFailed (the search stops: no verdict to bisect on)
        quantized = self.made(TRIAL_QUANTIZE, name, key=key, label=f"quantize {name}", attempt=name, also=SEARCH_UNIT_ERRORS,
                              work=TRIAL_QUANTIZE.task(plan, cfg, calibration_set.path, checkpoint))
        bits = {get_preset(fmt).bits for fmt in cfg.formats}
        precision = mixed_precision_class(plan.policy, bits)
        return _Candidate(name, precision, checkpoint, key, quantized, split=plan.search_split, allocation=layer_bytes)

    # ---- run.json ---------------------------------------------------------------------------

    def manifest(self, status: str, verdicts: dict[str, VerdictRecord] | None = None, seconds: float | None = None) -> RunRecord:
        plan, loaded = self.plan, self.pipeline.loaded
        return RunRecord(
            kind=RUN_KIND,
            schema_version=1,
            status=status,
            plan=RunPlan.model_validate(plan.plan.model_dump(mode="json")),
            plan_file=str(loaded.path) if loaded.path else None,
            plan_sha256=loaded.sha256,
            model=str(plan.model_dir),
            formats=list(plan.plan.formats),
            sets=plan.set_specs,
            hardware=list(plan.hardware),
            policy=RunPolicy(**plan.policy.identity, path=str(plan.policy.path)),
            confidence=plan.policy.policy.statistics.confidence,
            looks=plan.looks_json,
            # each gate's planned power at its ceiling (gates.samplesize; docs/gates.md, "Planned ceilings")
            planned_power=[PlannedPower(**power.as_dict()) for power in plan.powers],
            plot=PlotAxes.model_validate(dict(plan.plot_metric)),
            ledger=str(self.pipeline.ledger),
            stages=[RunStage(**vars(stage)) for stage in self.log.stages],
            verdicts={fmt: RunVerdict.of(entry) for fmt, entry in (verdicts or {}).items()},
            failed_units=list(self.failed_units),
            seconds=seconds,
            quantgate_version=plan.version,
            placement={"quantize": memory.taken(plan.quantize_placement), "evaluate": memory.taken(plan.eval_cfg.placement)},
            memory_note=plan.memory_note,
        )


def _stored_json(value: object) -> Any:
    """A JSON stage's value as the cache stores it: a record part its unit returned (the
    overlap's summary), dumped; a unit's JSON as it is."""
    return value.model_dump(mode="json") if isinstance(value, RecordPart) else value


def _pre_gates(policy: LoadedPolicy, candidate: _Candidate, measured: MeasurementRecord, overlap: _Overlap) -> str | None:
    """The first size or integrity gate that blocks the candidate before any evaluation
    (fail fast: they are exact numbers, decided without a single item), or None."""
    gates = integrity_gates(policy, _smoke(candidate.manifest), overlap.summary) + size_gates(
        measured, policy, allocation=candidate.allocation)
    return next((gate.reason for gate in gates if gate.outcome is not Outcome.passed), None)


def _published(run_dir: RunDir, name: str, key: str) -> tuple[evalsets.EvaluationResults, ...] | None:
    """The candidate's and the paired baseline's results a stored sequential stage with this key
    left, verified; () when it left none or will not be reused (another key, none yet); None
    when they are missing or damaged."""
    path = SEQUENTIAL.where(run_dir, name)
    try:
        stored = read_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return None  # unreadable: looked at again
    value = stored.get("value") if isinstance(stored, dict) else None
    depths = value.get("depths") if isinstance(value, dict) else None
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(depths, dict) or not any(depths.values()):
        return ()
    try:
        return evalsets.load_results(run_dir.results(name)), evalsets.load_results(run_dir.paired_baseline(name))
    except (InputError, IntegrityError, OSError, ValueError, KeyError):
        return None  # missing, or bytes changed since: never trusted, looked at again


def _sensitivity_config(plan: ResolvedPlan) -> sensitivity.SensitivityConfig:
    """The search's sensitivity: its formats, the Fisher variant, and the ignored layers and
    group size of its first grouped format (else its first)."""
    search = plan.plan.search
    assert search is not None
    grouped = [plan.quantize_cfgs[fmt] for fmt in search.formats if get_preset(fmt).grouped] or [plan.quantize_cfgs[search.formats[0]]]
    return sensitivity.SensitivityConfig(formats=search.formats, fisher=sensitivity.FisherVariant(search.fisher),
                                         ignore=grouped[0].ignore, group_size=grouped[0].group_size, rows=search.sensitivity_rows)


def as_served_record(made: _AsServed, *, baseline: evalsets.EvaluationResults | None, policy: LoadedPolicy,
                     precision: str) -> AsServedRecord:
    """What a device class serves, gated: the numerics (which, the settings, the schemes it
    computes, why they differ), the policy's metric gates on the served results, paired item by
    item with the baseline's, and `status`: passed, failed, or not evaluated (the unit failed)."""
    numerics, results, failure = made.numerics, made.results, made.failure
    record = partial(AsServedRecord, numerics=numerics.which, device_class=numerics.device_class, settings=numerics.settings,
                     served_as=numerics.served_as, because=numerics.why)
    if results is None or baseline is None:
        return record(status="not evaluated", reason=failure or "no baseline results to pair with")
    try:
        gates = served_quality_gates(item_records(baseline), item_records(results), policy, precision)
    except InputError as error:  # results that do not pair with the baseline's: no evidence, said so
        return record(status="not evaluated", reason=str(error), results=str(results.path))
    failing = [gate for gate in gates if gate.outcome is not Outcome.passed]
    status = "failed" if failing else "passed" if gates else "not evaluated"
    reason = "; ".join(gate.reason for gate in (failing or gates)) or "the policy gates none of the sets the engine evaluated"
    return record(status=status, reason=reason, results=str(results.path), gates=[gate.record() for gate in gates])


def serving_classes(judged: Verdict, served: ServeRecord, record: VerdictRecord, run_dir: Path,
                    as_served: list[AsServedRecord] | None = None) -> dict[str, ClassVerdict]:
    """The verdict per device class, from this run's serve record: its status (approved, pending or
    blocked), why, and for a pending one the command that adds serving evidence from a machine
    of the class where it will serve (`quantgate serving check --run`, docs/serving.md); where the
    class serves other numerics than were gated, how those fared on the golden sets (`as_served`)."""
    status = judged.serving
    if status is None:
        return {}
    device_class = served.device_class or "unknown"
    reasons = [gate.reason for gate in judged.gates if GateId.parse(gate.gate).scope == SERVING and gate.outcome is not Outcome.passed]
    entry = ClassVerdict(status=status, reason=reasons[0] if reasons else served.reason or "served as gated")
    checkpoint = record.checkpoint.path if record.checkpoint is not None else None
    if status != "approved" and checkpoint and record.quality == "passed":
        entry = entry.model_copy(update={"next": f"quantgate serving check {checkpoint} --run {run_dir}"})
    if as_served:
        entry = entry.model_copy(update={"as_served": [gated.summary() for gated in as_served]})
    return {device_class: entry}


def _record_of(served: _Served | None) -> ServeRecord | None:
    return served.record if served is not None else None


def _served_summary(record: ServeRecord) -> str:
    """One line for the stage log: 'served on cpu-avx512: |logprob diff| 0.043 mean, 36.6 tokens/s
    at batch 1, loaded in 4.2 s (deadline 75 s), W4A16 as W4A16 (CPUWNA16LinearKernel)', and a
    mismatch of the logged kernel with serving.device.RULES where there is one."""
    where = f" on {record.device_class}" if record.device_class else ""
    retried = f" (the probe stopped a first attempt and was tried once more: {record.probe_retried.reason})" \
        if record.probe_retried is not None and record.probe_retried.reason else ""
    if not record.served:
        return f"{record.status.replace('_', ' ')}{where}: {record.reason}{retried}"
    parts = []
    if record.agreement is not None:
        parts.append(f"|logprob diff| {record.agreement.mean_abs_logprob_difference:.3f} mean")
    first = next(iter(record.throughput.batches.items()), None) if record.throughput is not None else None
    if first is not None:
        parts.append(f"{first[1].tokens_per_s:.1f} tokens/s at batch {first[0]}")
    if record.startup_seconds is not None and record.load_deadline_seconds is not None:
        parts.append(f"loaded in {record.startup_seconds:.1f} s (deadline {record.load_deadline_seconds:.0f} s)")
    parts += [f"{entry.scheme} as {entry.served_as}" + (f" ({entry.kernel})" if entry.kernel else "") for entry in record.schemes or []]
    mismatches = record.mismatches()
    return f"served{where}: " + ", ".join(parts) + retried + (f"; MISMATCH with the table: {'; '.join(mismatches)}" if mismatches else "")


def _with_split(record: VerdictRecord, candidate: _Candidate) -> VerdictRecord:
    """A search trial's verdict says which split judged it (`search`: it approves nothing, the
    ledger's verify skips it; `held-out`: the search's answer) and which items, seeded and recorded."""
    split = candidate.split
    if split is None:
        return record
    return record.with_fields(checkpoint_name=candidate.fmt, split=split.name,
                              split_items={spec: SplitItems(offset=split.offsets.get(spec, 0), ceiling=looks[-1])
                                           for spec, looks in split.looks.items()})


def run(loaded: LoadedPlan, out: Path | None = None, show_progress: bool = True, verbose: bool = False) -> RunResult:
    """Run a plan; see the module docstring for the chain, quantgate.core.rundir for what lands where.
    What other libraries print goes to the run's logs/libraries.log (on the terminal too: `verbose`)."""
    return Pipeline(loaded, out, show_progress, verbose).run()


def _smoke(manifest: CheckpointManifest) -> SmokeCheck:
    """The quantize stage's smoke check, as the integrity gate reads it."""
    return {"prompt": manifest.smoke.prompt, "completion": manifest.smoke.completion, "logits_finite": manifest.smoke.logits_finite}
