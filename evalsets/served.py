"""The serve check: does the serving engine load a checkpoint and compute what was gated?

The gate judged a checkpoint as transformers runs it (in its compute dtype, weights decompressed);
production runs it in vLLM, with other kernels. Given the checkpoint and the evaluation results
its gate saw, vLLM (serving/, in its own environment) scores the same token ids of the results'
text set, and the two are compared position by position:

- the log-probability of each scored token, served against gated: mean, p99 and max |difference|
  (nats); the gated side is rebuilt exactly from the results' cached output-layer inputs;
- KL(served || gated) from the served top-k (agreement.kl_from_topk: the KL of the two coarsened
  to the top-k and one bucket for the mass outside them, a lower bound on the whole KL);
- the mean NLL per token, served against gated (served, is it as good as what was gated?);
- top-1 agreement, served against gated;
- greedy continuations of a fixed prompt set (each of the first items' first tokens), served
  against the gated model's own (transformers, FP32), token by token;
- decode throughput (tokens/s at each batch size, median of runs) next to the memory-bandwidth
  bound at this machine's measured copy bandwidth.

The record is a ServeRecord (evalsets.serve_record; docs/serving.md, "The serve record");
gates/verdict.py judges it.
It names the device class it was made on (serving.device), the schemes the checkpoint asks for
and the scheme the engine computes for each under the settings it ran with (the serve check sets
those that serve what was gated, and where the engine's default would compute another scheme it
measures that too: `engine_default`), and the kernels vLLM selected. Its `status`:

- `served`: served and compared;
- `pending`: no usable path on this device class: a timed probe (one forward pass, before the full
  check) ran far past the baseline's twice (a stop is tried once more: one slow pass can be the
  machine's load), or the engine is known to have no kernel for the scheme here and could not
  load it. Missing evidence, not a failed checkpoint: serve it where it will run;
- `not_served`: vLLM could not load or serve it here for another reason, which blocks this class.

A serving environment that cannot import vLLM, or a worker that runs past its time, never loads
its engine by the load deadline (`load_deadline`: a multiple of the baseline's cold start on this
machine, at most 3 minutes) or by what is left of the check's cap, or dies, is an error (nothing
is recorded: the next run tries again; the run itself goes on, the verdict pending). The cap
(`load_cap_s`, `_Budget`) is one per check: its serves (the serve, a retry of a probe stop, the
engine-default serve) wait for their engines' first answer (the probe's first forward pass) at
most that long in all; a first pass still running when it runs out is a probe stop.

The scheme the engine computes (`schemes`' `served_as`) is evidence: the kernel vLLM logged for
each layer scheme and the flags of the loaded layers (serving.device.effective_schemes), checked
against what serving.device.RULES expect on this class (`expected`); a disagreement is the
entry's `mismatch`, said in the report.
"""

from __future__ import annotations

# torch and transformers are imported where used: they take seconds to import, and the CLI
# (and a cache hit) needs neither.
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypedDict, cast

from pydantic import Field

from quantgate import serving
from quantgate.core import memory
from quantgate.core.artifacts import MANIFEST, read_json, sha256_file
from quantgate.core.errors import InputError
from quantgate.core.headers import read_checkpoint
from quantgate.core.ids import SetRef
from quantgate.core.models import load_causal_lm, max_sequence_length, release_scratch
from quantgate.core.validation import Strict
from quantgate.evalsets import agreement
from quantgate.evalsets.evaluate import TOPK_FILE, EvaluationResults, load_side, model_identity
from quantgate.evalsets.serve_record import Agreement, EngineDefault, GatedSide, Greedy, SchemeServed, ServeRecord, Throughput
from quantgate.evalsets.text_eval import head_logits, prefix_token
from quantgate.quantize.measure.accounting import measure
from quantgate.quantize.measure.bounds import kv_bytes_per_sequence, memory_time, model_from_checkpoint
from quantgate.quantize.measure.measurement import Measurement
from quantgate.serving import device
from quantgate.serving.launch import LOG, PROGRESS, AnswerCap, ProbeStopped, loaded_at
from quantgate.serving.worker import (
    BandwidthTask,
    EngineSettings,
    GreedyTask,
    PromptLogprobs,
    PromptLogprobsTask,
    RequestBody,
    Task,
    TaskResult,
    ThroughputBatch,
    ThroughputTask,
)

# Bump when a change to the serve check or the worker changes a number, or the record's shape:
# cached serve records are redone (3: the record's schema_version 3; 4: load deadline, cold start,
# probe retry and the effective scheme from the kernel log)
SERVE_CHECK_VERSION = 4
SERVED, PENDING, NOT_SERVED = "served", "pending", "not_served"
FAILED: Final = "failed"  # a serve that timed out or whose worker died: no evidence (the run's record of the unit, never cached)
# The probe's first forward pass also warms the kernels up: it may take this much longer. 10 s,
# chosen after measuring: the demo's first passes took 0.04 to 0.05 s (baseline, smoothquant-w8a8;
# AVX-512 without AMX, vLLM 0.32, workers forked from the zygote), FP8's on AVX-512 with AMX 54.8 s.
# Until issue 36 it was 30 s: a path with no usable kernel (AMX's FP8) then took 2 x (load + 30 s)
# to be pending, over a minute; now 2 x (load + 11 s), within one.
PROBE_WARMUP_SECONDS = 10.0
# The baseline's own probe is only the reference of the others': a 16-bit model always has a path;
# this bounds it only against a hang (a large model's forward pass on a CPU takes seconds).
BASELINE_PROBE_SECONDS = 60.0
PROBE_PASSES = 3  # the first warms the kernels up; the fastest of the others is the probe's time
# No serve check waits longer than this, in all, for engines that have not answered (issue 35: a
# serve that never answers costs at most 3 minutes): its load, its probe's first forward pass, the
# retry of a probe stop and the engine-default serve's load and first pass share it (`_Budget`)
LOAD_CAP_SECONDS = 180.0
MIB = 2**20
BOUND_NOTE = ("an upper bound on tokens/s: every stored tensor byte read once a step at the copy bandwidth measured "
              "here; this CPU's peak FLOP/s is not known, so compute is not bounded")


class ServeCheckConfig(Strict):
    """What the serve check asks of vLLM (all in the serve stage's cache key)."""

    evalset: str | None = Field(default=None, description="the text set compared; default: the results' only text set")
    items: int = Field(default=16, gt=0, description="the first N items of the results' text set")
    top_k: int = Field(default=20, gt=0, le=100, description="served log-probs kept per position, for the KL estimate")
    greedy_prompts: int = Field(default=8, ge=0, description="prompts: the first tokens of the first items")
    prompt_tokens: int = Field(default=16, gt=0)
    greedy_tokens: int = Field(default=16, gt=0)
    batch_sizes: tuple[int, ...] = Field(default=(1, 8), min_length=1)
    decode_tokens: int = Field(default=32, gt=0, description="new tokens per timed decode run")
    runs: int = Field(default=3, gt=0, description="timed decode runs per batch size (the median is reported)")
    kv_cache_mib: int = Field(default=512, gt=0, description="vLLM's KV cache (on a CPU: bytes of memory)")
    bandwidth_mib: int = Field(default=256, gt=0, description="the copy that measures memory bandwidth")
    timeout_s: float = Field(default=900, gt=0)
    # The probe (docs/serving.md, "The probe"): a forward pass over `prompt_tokens` tokens may take
    # at most probe_factor times the baseline's (and never less than probe_floor_s); past that the
    # engine has no usable path for the scheme on this machine and the check stops: pending here.
    # 20x and 0.25 s, chosen after measuring the demo's paths (docs/serving.md, "The probe"): usable
    # ones at 0.7-1.2x the baseline's 0.054 s; FP8 on AVX-512 without AMX at 9.4x (slow, but it serves:
    # its decode rate is reported as measured); FP8 on AVX-512 with AMX at ~1,000x (54.8 s a pass)
    probe_factor: float = Field(default=20.0, gt=1, description="a forward pass at most this many times the baseline's")
    probe_floor_s: float = Field(default=0.25, gt=0, description="the probe's limit is never below this (seconds)")
    # The load deadline (docs/serving.md, "The load deadline"): a serve whose engine is not loaded
    # this long after it was asked for is stopped. A candidate's is load_margin times the
    # baseline's cold start measured on this machine (importing vLLM plus loading the engine),
    # never below load_floor_s, never above load_cap_s; the baseline's own (nothing measured yet)
    # is baseline_load_s. Measured on 2 AVX-512 cores (docs/serving.md): a cold start of 19.5-25 s
    # (16-21 s importing vLLM, 3.4-4.8 s loading the tiny model), 49 s on the first serve after the
    # serving environment was built (its modules compiled on first import); a candidate forked from
    # a warm zygote loaded in 3.4-4.1 s. 3x covers a machine shared with other work; 150 s is 3x
    # the slowest cold start.
    load_margin: float = Field(default=3.0, gt=1, description="a load may take at most this many times the baseline's cold start")
    load_floor_s: float = Field(default=30.0, gt=0, description="the load deadline is never below this (seconds)")
    # load_cap_s is also the check's whole budget for engines that have not answered (`_Budget`):
    # the serve's load and first forward pass, a retry's, and the engine-default serve's together
    load_cap_s: float = Field(default=LOAD_CAP_SECONDS, gt=0, le=LOAD_CAP_SECONDS,
                              description="the most a serve check waits, in all, for engines that have not answered (seconds; "
                                          "at most 180); the load deadline is never above it")
    baseline_load_s: float = Field(default=150.0, gt=0, le=LOAD_CAP_SECONDS,
                                   description="the baseline's own load deadline (seconds; nothing measured before it)")
    # GPUs vLLM splits the model over (its tensor_parallel_size): on a Ray cluster, give the serve
    # stage as many (`resources: {serve: {gpus: N}}`); they are the GPUs Ray hands the task
    tensor_parallel: int = Field(default=1, ge=1, description="GPUs vLLM shards the model over (tensor parallelism)")


def text_spec(results: EvaluationResults, wanted: str | None) -> str:
    """The text set of `results` to compare on: `wanted` (NAME or NAME@vN) or the only one."""
    texts = [spec for spec in results.manifest.sets if (results.set_dir(spec) / TOPK_FILE).is_file()]
    if wanted is not None:
        ref = SetRef.parse(wanted)
        matching = [spec for spec in texts if ref.matches(SetRef.parse(spec))]
        if not matching:
            raise InputError(f"results in {results.path} hold no text set {wanted}; text sets there: {', '.join(texts) or 'none'}")
        return matching[0]
    if not texts:
        raise InputError(f"results in {results.path} hold no text set (the serve check compares per-token log-probabilities)")
    return texts[0]


def not_comparable(results: EvaluationResults | None, wanted: str | None) -> str | None:
    """Why `results` give the serve check nothing to compare with, or None when they do: a text set
    with the output layer's inputs cached (the evaluator's exact mode), so the gated
    distributions can be rebuilt."""
    from safetensors import safe_open

    if results is None:
        return "no gated results (the candidate was blocked before any evaluation)"
    try:
        spec = text_spec(results, wanted)
    except InputError:
        return f"its gated results hold no text set{f' {wanted}' if wanted else ''} (blocked before one was evaluated)"
    with safe_open(str(results.set_dir(spec) / TOPK_FILE), framework="numpy") as cached:
        if "head_inputs" not in set(cached.keys()):
            return (f"its gated results hold {spec} in top-k mode (the model's output layer could not be rebuilt), "
                    "so the gated distributions are unknown")
    return None


class MachineInfo(TypedDict):
    """The machine a decode rate is measured on (the serve record's `machine`, serve_record.ServeMachine)."""

    cpu: str
    cores: int | None
    system: str


def machine() -> MachineInfo:
    """The machine a decode rate is measured on (in the serve stage's key)."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text(errors="replace").splitlines()
                      if line.startswith("model name")), model)
    return {"cpu": model, "cores": os.cpu_count(), "system": platform.system()}


SERVE_FILE = "serve.json"


def load_record(path: Path) -> ServeRecord:
    """A serve record: `quantgate serving check`'s output directory or its serve.json, or a run's
    serve/<name>.json (the stage cache's {"key", "value"})."""
    file = path / SERVE_FILE if path.is_dir() else path
    if not file.is_file():
        raise InputError(f"{path} is no serve record (quantgate serving check's output or a run's serve/<name>.json)")
    try:
        value = read_json(file)
    except ValueError as error:
        raise InputError(f"{file} is not JSON: {error}") from error
    if isinstance(value, dict) and "key" in value and isinstance(value.get("value"), dict):
        return ServeRecord.from_json(value["value"], f"{file}: value")
    return ServeRecord.from_json(value, str(file))


def quantized_activations(checkpoint: Path) -> bool:
    """Whether any layer of the checkpoint quantizes its input activations (W8A8, FP8): its served
    and gated numbers then differ by more than compute precision (docs/serving.md)."""
    return any(not scheme.endswith("A16") for scheme in device.checkpoint_schemes(read_checkpoint(checkpoint).config))


def probe_limit(cfg: ServeCheckConfig, reference_seconds: float | None) -> serving.ProbeLimit:
    """The probe's limits: `probe_factor` times the baseline's forward pass (`reference_seconds`),
    never below the floor; for the baseline itself (None) BASELINE_PROBE_SECONDS."""
    forward = max(cfg.probe_floor_s, cfg.probe_factor * reference_seconds) if reference_seconds else BASELINE_PROBE_SECONDS
    return serving.ProbeLimit(forward_seconds=forward, warmup_seconds=forward + PROBE_WARMUP_SECONDS)


def load_deadline(cfg: ServeCheckConfig, reference_cold_start: float | None) -> serving.LoadDeadline:
    """How long a serve may wait for its engine: `load_margin` times the baseline's cold start
    (`reference_cold_start`, seconds), between `load_floor_s` and `load_cap_s`; for the baseline
    itself (None) `baseline_load_s`."""
    if reference_cold_start is None:
        return serving.LoadDeadline(min(cfg.baseline_load_s, cfg.load_cap_s), "the baseline's default: nothing measured before it")
    wanted = cfg.load_margin * reference_cold_start
    seconds = min(max(wanted, cfg.load_floor_s), cfg.load_cap_s)
    bound = " (the floor)" if seconds > wanted else " (the cap)" if seconds < wanted else ""
    return serving.LoadDeadline(seconds, f"{cfg.load_margin:g} x the baseline's cold start of {reference_cold_start:.1f} s here{bound}")


def cold_start_seconds(record: ServeRecord | None) -> float | None:
    """A serve record's cold start (importing vLLM and loading the engine, measured), or None."""
    return record.cold_start_seconds if record is not None else None


def probe_seconds(record: ServeRecord | None) -> float | None:
    """A serve record's forward pass after warm-up (the probe's fastest later pass), or None."""
    return record.probe_seconds() if record is not None else None


def check(checkpoint: Path, results: EvaluationResults | None, cfg: ServeCheckConfig, env: serving.ServingEnv,
          work: Path, reference_probe: float | None = None, reference_load: float | None = None) -> ServeRecord:
    """Serve `checkpoint` in vLLM and compare it with `results` (the evaluation its gate saw; None,
    or results with no comparable text set: load and throughput only, `not_compared` says why).
    `reference_probe`: the baseline's probe forward pass, the base of this one's limit;
    `reference_load`: the baseline's cold start here, the base of its load deadline (None: the
    baseline's own default). The record's `status` says served, pending (no usable path here)
    or not served (the reason); an environment that cannot import vLLM, a timeout, an engine not
    loaded by the load deadline or a worker that died raises ServingError."""
    budget = _Budget(cfg.load_cap_s)  # this checkpoint's serve check's, shared by its serves
    missing = not_comparable(results, cfg.evalset)
    gated = _Gated(checkpoint, results, cfg) if results is not None and missing is None else None
    prompts = gated.greedy_prompts() if gated else []
    positions = max_sequence_length(checkpoint)
    alone = cfg.prompt_tokens + 1 + cfg.decode_tokens  # throughput only: its prompt and new tokens
    engine_cfg: EngineSettings = {"max_model_len": gated.max_model_len() if gated else min(alone, positions or alone),
                                "kv_cache_bytes": cfg.kv_cache_mib * MIB, "tensor_parallel": cfg.tensor_parallel}
    probe_prompt = prompts[0] if prompts else [0] * cfg.prompt_tokens
    request: RequestBody = {"model": str(checkpoint.absolute()), "engine": engine_cfg,
                            "tasks": [{"kind": "probe", "prompt": probe_prompt, "runs": PROBE_PASSES}, *_tasks(cfg, gated, prompts)]}
    device_class = device.local_class("cuda" if env.engine == "vllm" else "cpu")
    schemes = device.checkpoint_schemes(read_checkpoint(checkpoint).config)
    settings = device.serve_settings(env.engine, device_class, schemes)
    limit = probe_limit(cfg, reference_probe)
    deadline = load_deadline(cfg, reference_load)
    record: dict[str, Any] = {"served": False, "engine": env.identity(), "checkpoint": str(checkpoint),
                              "settings": cfg.model_dump(mode="json"), "quantized_activations": quantized_activations(checkpoint),
                              "machine": machine(), "serve_check_version": SERVE_CHECK_VERSION,
                              "device_class": device_class, "engine_settings": settings,
                              "schemes": scheme_entries(env.engine, device_class, schemes, settings, None),
                              "probe_limit_seconds": limit.forward_seconds, "load_deadline_seconds": deadline.seconds,
                              "load_deadline_basis": deadline.basis, "answer_cap_seconds": budget.seconds}
    if gated is not None:
        record["gated"] = gated.describe()
    else:
        record["not_compared"] = missing
    short = memory_short(checkpoint, env, cfg, positions=sum(map(len, gated.prompts())) if gated else cfg.prompt_tokens * max(cfg.batch_sizes))
    if short is not None:  # started, the kernel's OOM killer would end the worker (or this run) part-way
        where = f"{env.label} on {device.describe_class(device_class)}"
        return ServeRecord.model_validate({**record, "status": PENDING, "reason": f"{where}: {short.reason()}",
                                           "memory_needed_bytes": short.needs, "answer_cap_spent_seconds": 0.0}, strict=False)
    note: _RetryNote = {}
    try:
        response = _run_retrying_a_probe_stop(env, request, work, cfg, settings=settings, probe=limit, deadline=deadline, note=note,
                                              budget=budget)
    except serving.WorkerFailed as failure:
        record.update(note, answer_cap_spent_seconds=budget.spent)
        return ServeRecord.model_validate({**record, **_not_served(failure, env, device_class, schemes)}, strict=False)
    answer = response.value
    log_text = response.log.read_text(errors="replace")
    record.update(note)
    record.update(served=True, status=SERVED, log=str(response.log), isolated=response.isolated, dtype=answer.get("dtype"),
                  device=answer.get("device"), threads=answer.get("threads"), load_seconds=answer.get("load_seconds"),
                  startup_seconds=response.startup_seconds, cold_start_seconds=response.cold_start_seconds,
                  seconds=answer.get("seconds"), kernels=device.kernels_in_log(log_text),
                  schemes=scheme_entries(env.engine, device_class, schemes, settings, log_text), probe=response.result("probe"))
    if gated is not None:
        record["agreement"] = gated.compare(_result(response, "prompt_logprobs")["prompts"])
        if prompts:
            record["greedy"] = gated.compare_greedy(prompts, _result(response, "greedy")["continuations"])
        default = _engine_default(checkpoint, gated, env, device_class=device_class, schemes=schemes, engine_cfg=engine_cfg, work=work,
                                  cfg=cfg, deadline=deadline, probe=limit, probe_prompt=probe_prompt, budget=budget,
                                  load_seconds=response.startup_seconds)
        if default is not None:
            record["engine_default"] = default
    record["answer_cap_spent_seconds"] = budget.spent
    bandwidth = _result(response, "bandwidth")
    record["throughput"] = throughput(_result(response, "throughput")["batches"], bandwidth, checkpoint, cfg)
    return ServeRecord.model_validate(record, strict=False)


@dataclass(frozen=True)
class MemoryShort:
    """vLLM's CPU worker would not fit: what it needs (core.memory.serve_needs) and what is left."""

    needs: int
    limit: memory.Allowance

    def reason(self) -> str:
        return (f"serving it needs about {memory.gb(self.needs)} of memory (vLLM's CPU worker: its weights, KV cache and scored "
                f"logits), and {self.limit.source} leaves {memory.gb(self.limit.bytes)}; pending on this machine: serve it "
                "where memory allows (quantgate serving check --run)")


def memory_short(checkpoint: Path, env: serving.ServingEnv, cfg: ServeCheckConfig, *, positions: int) -> MemoryShort | None:
    """Whether vLLM's CPU worker cannot serve `checkpoint`, scoring `positions` prompt positions,
    beside this process in the memory it may use now (the serve check; preflight, for the
    baseline); None where it fits, or where the engine keeps the weights on a GPU."""
    if env.engine == "vllm":  # the CUDA build: the weights and the KV cache are on the GPU
        return None
    limit = memory.allowance()
    needs = memory.serve_needs(checkpoint, kv_bytes=cfg.kv_cache_mib * MIB, scored_positions=positions)
    return MemoryShort(needs, limit) if limit is not None and limit.bytes < needs else None


def scheme_entries(engine: str, device_class: str, schemes: list[str], settings: dict[str, str], log: str | None) -> list[SchemeServed]:
    """Each scheme the checkpoint asks for: what the engine computes for it (`served_as`: from the
    kernel its log names where the log decides it, else what RULES expect), what RULES expect
    (`expected`), the kernel, the evidence, and a mismatch of the two; `log` None: not served."""
    evidence = {found.scheme: found for found in device.effective_schemes(log, schemes)} if log is not None else {}
    entries = []
    for scheme in schemes:
        expected = device.effective_scheme(engine, device_class, scheme, settings)
        found = evidence.get(scheme)
        computes = found.computes if found is not None else None
        entry = {"scheme": scheme, "served_as": computes or expected, "engine_default": device.effective_scheme(engine, device_class, scheme, {}),
                 "expected": expected, "kernel": found.kernel if found is not None else None,
                 "evidence": found.basis if found is not None else "not served: what serving.device.RULES expect, no kernel seen",
                 "mismatch": device.scheme_mismatch(found, expected, device_class, settings) if found is not None else None}
        # absent, not null, where the check did not reach it (serve_record's module docstring)
        entries.append(SchemeServed.model_validate({key: value for key, value in entry.items() if value is not None}, strict=False))
    return entries


class _Budget:
    """A serve check's cap (`load_cap_s`, at most 3 minutes): the time its serves spend waiting on
    engines that have not answered (from the moment each is asked for: vLLM importing, the engine
    loading, the probe's first forward pass), the serve's, its retry's and its engine-default
    serve's together; each serve is stopped when none is left (launch.AnswerCap). The time a serve
    runs after its engine's first answer (its tasks: held to timeout_s alone), and this process's
    own work between serves (the gated side's comparison), are not the cap's."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent = 0.0  # seconds serves waited for a first answer

    def left(self) -> float:
        return max(0.0, self.seconds - self.spent)

    def cap(self, what: str) -> AnswerCap:
        return AnswerCap(self.left(), f"what was left of the serve check's {self.seconds:.0f} s cap for engines that have not answered "
                                      f"({what})")

    def run(self, env: serving.ServingEnv, request: RequestBody, work: Path, cfg: ServeCheckConfig, what: str, *,
            settings: dict[str, str], probe: serving.ProbeLimit, deadline: serving.LoadDeadline | None) -> serving.Response:
        """serving.run held to what is left of the cap; what it waited for its first answer is spent."""
        started = time.monotonic()
        try:
            response = serving.run(env, request, work, cfg.timeout_s, settings=settings, probe=probe, load_deadline=deadline,
                                   cap=self.cap(what))
        except serving.WorkerFailed:
            self.spent += time.monotonic() - started  # a stop before a first answer (after one, the check ends anyway)
            raise
        self.spent += response.answered_seconds if response.answered_seconds is not None else time.monotonic() - started
        return response

    def short(self, load_seconds: float | None, probe: serving.ProbeLimit, what: str) -> str | None:
        """Why `what` is not started (too little left of the cap for a load as long as
        `load_seconds` and a first forward pass as long as the probe's limit for it), or None."""
        left, needs = self.left(), (load_seconds or 0.0) + probe.warmup_seconds
        if left >= needs:
            return None
        load = f"a load as long as the serve's here ({load_seconds:.1f} s) and " if load_seconds is not None else ""
        return (f"{what} not started: {left:.1f} s left of the serve check's {self.seconds:.0f} s cap for engines that have not answered, "
                f"it needs {needs:.1f} s: {load}the probe's {probe.warmup_seconds:.1f} s limit on the first forward pass")


class ProbeRetried(ProbeStopped):
    """A first attempt the probe stopped, tried once more: why, its passes, and its log."""

    log: str


class _RetryNote(TypedDict, total=False):
    """What a probe's retry adds to the serve record (ServeRecord's fields of the same names)."""

    probe_retried: ProbeRetried  # the first stop, tried once more
    probe_not_retried: str  # why a stop was not tried again: too little left of the check's cap


def _run_retrying_a_probe_stop(env: serving.ServingEnv, request: RequestBody, work: Path, cfg: ServeCheckConfig, *,
                               settings: dict[str, str], probe: serving.ProbeLimit, deadline: serving.LoadDeadline,
                               note: _RetryNote, budget: _Budget) -> serving.Response:
    """serving.run, tried once more where the probe stopped it: a slow pass can be the machine's
    load (other work on its cores) rather than the engine's path, and a second stop is the
    verdict ("no usable path"). The first stop is kept in `note` (`probe_retried`) and its log
    beside the second's. Both are held to the check's cap (`budget`); a retry with too little left
    of it (less than the first try's load and the probe's first-pass limit) is not started: the
    first stop is the verdict and the record says why (`probe_not_retried`)."""
    asked = time.time()
    try:
        return budget.run(env, request, work, cfg, "the serve", settings=settings, probe=probe, deadline=deadline)
    except serving.WorkerFailed as failure:
        if failure.probe is None:
            raise
        loaded = loaded_at(work / PROGRESS)
        short = budget.short(loaded - asked if loaded is not None else None, probe, "a retry of the probe's stop")
        if short is not None:
            note["probe_not_retried"] = short
            stopped: ProbeStopped = {**failure.probe, "reason": f"{failure.probe['reason']} ({short})"}
            raise serving.WorkerFailed(stopped["reason"], failure.log, failure.phase, timed_out=failure.timed_out,
                                       probe=stopped) from failure
        first = work / f"first-{LOG}"
        if failure.log.is_file():
            failure.log.replace(first)
        note["probe_retried"] = {**failure.probe, "log": str(first)}
    return budget.run(env, request, work, cfg, "the retry of a probe stop", settings=settings, probe=probe, deadline=deadline)


def _result(response: serving.Response, kind: str) -> TaskResult:
    """The result of the response's task of `kind` (serving/worker.py's answer to it)."""
    return response.result(kind)


class _NotServedBase(TypedDict):
    served: bool
    status: str
    reason: str
    log: str
    kernels: list[str]


class NotServed(_NotServedBase, total=False):
    """A serve record's fields when the worker did not answer (`_not_served`)."""

    probe: ProbeStopped  # stopped by the probe: its forward passes (serving.WorkerFailed.probe)


def _not_served(failure: serving.WorkerFailed, env: serving.ServingEnv, device_class: str, schemes: list[str]) -> NotServed:
    """The record's verdict part when the worker did not answer: pending (no usable path here:
    the probe stopped it, or a kernel the engine is known to lack here), not served (the reason),
    or ServingError (the environment's or the machine's fault, maybe passing: nothing recorded)."""
    where = f"{env.label} on {device.describe_class(device_class)}"
    log, kernels = str(failure.log), device.kernels_in_log(failure.log.read_text(errors="replace")) if failure.log.is_file() else []
    if failure.probe is not None:
        return {"served": False, "status": PENDING, "reason": f"{where}: {failure.reason}", "probe": failure.probe, "log": log,
                "kernels": kernels}
    if failure.timed_out or failure.phase is None:  # died or never answered: this serve failed (exit 5), nothing recorded
        raise serving.ServeFailed(f"{failure.reason} (serving {failure.log.parent}; log {failure.log})") from failure
    if failure.phase == "import":  # the serving environment cannot import vLLM: its set-up is at fault
        raise serving.ServingError(f"{failure.reason} (serving {failure.log.parent}; log {failure.log})") from failure
    # a kernel missing from this class's build shows at the load or at the first forward pass (the probe):
    # on an AVX2-only CPU a W4A16 checkpoint loads, then its first forward pass finds no cpu_gemm_wna16
    gaps = device.known_gaps(env.engine, device_class, schemes) if failure.phase in ("load", "probe") else []
    if gaps:
        gap = gaps[0]
        return {"served": False, "status": PENDING, "log": log, "kernels": kernels,
                "reason": f"{where} has {gap.what} for {gap.scheme} ({gap.source}); it said: {failure.reason}"}
    cannot = "cannot load it" if failure.phase == "load" else f"failed at {failure.phase}"
    return {"served": False, "status": NOT_SERVED, "reason": f"{env.label} {cannot}: {failure.reason}", "log": log, "kernels": kernels}


def _engine_default(checkpoint: Path, gated: _Gated, env: serving.ServingEnv, *, device_class: str, schemes: list[str],
                    engine_cfg: EngineSettings, work: Path, cfg: ServeCheckConfig,
                    deadline: serving.LoadDeadline | None = None, probe: serving.ProbeLimit | None = None,
                    probe_prompt: list[int] | None = None, budget: _Budget | None = None,
                    load_seconds: float | None = None) -> EngineDefault | None:
    """Where the engine's default would compute another scheme on this class (INT4 as W4A8 on AMX),
    what it would serve and how far that is from the gated numerics: the same prompts served
    under the default settings, held to the same load deadline as the serve itself and, with
    `probe` (as check() calls it), to the same probe and to what is left of the check's cap
    (`budget`; not started when less is left than a load as long as the serve's, `load_seconds`,
    and the probe's first-pass limit); None where it would compute the same. What it computes is
    read from its log (`served_as`), beside what RULES expect (`expected`)."""
    rules = device.default_differs(env.engine, device_class, schemes)
    if not rules:
        return None
    expected = {rule.scheme: rule.default_scheme for rule in rules}
    described = {"settings": {rule.setting[0]: rule.default for rule in rules}, "served_as": expected, "expected": expected,
                 "because": [rule.source for rule in rules]}
    task: PromptLogprobsTask = {"kind": "prompt_logprobs", "prompts": gated.prompts(), "top_k": cfg.top_k}
    tasks: list[Task] = [task]
    if probe is not None:  # the probe's first pass is its first answer, the cap's end: as the serve's
        tasks.insert(0, {"kind": "probe", "prompt": probe_prompt or [0] * cfg.prompt_tokens, "runs": PROBE_PASSES})
    request: RequestBody = {"model": str(checkpoint.absolute()), "engine": engine_cfg, "tasks": tasks}
    # the default set explicitly: a variable in this process's environment would otherwise reach the worker
    defaults = {rule.setting[0]: rule.default for rule in rules}
    try:
        if budget is not None and probe is not None:
            short = budget.short(load_seconds, probe, "the engine-default serve")
            if short is not None:
                return EngineDefault.model_validate({**described, "served": False, "reason": short}, strict=False)
            response = budget.run(env, request, work / "engine-default", cfg, "the engine-default serve", settings=defaults, probe=probe,
                                  deadline=deadline)
        else:
            response = serving.run(env, request, work / "engine-default", cfg.timeout_s, settings=defaults, probe=probe,
                                   load_deadline=deadline)
    except serving.WorkerFailed as failure:
        return EngineDefault.model_validate({**described, "served": False, "reason": failure.reason}, strict=False)
    agreement = gated.compare(_result(response, "prompt_logprobs")["prompts"])
    log = response.log.read_text(errors="replace")
    entries = scheme_entries(env.engine, device_class, [rule.scheme for rule in rules], defaults, log)
    mismatches = [entry.mismatch for entry in entries if entry.mismatch]
    return EngineDefault.model_validate({**described, "served": True, "agreement": agreement.kept(), "kernels": device.kernels_in_log(log),
                                         "served_as": {entry.scheme: entry.served_as for entry in entries},
                                         **({"mismatch": "; ".join(mismatches)} if mismatches else {})}, strict=False)


def _tasks(cfg: ServeCheckConfig, gated: _Gated | None, prompts: list[list[int]]) -> list[Task]:
    bandwidth: BandwidthTask = {"kind": "bandwidth", "bytes": cfg.bandwidth_mib * MIB, "runs": 5}
    tasks: list[Task] = [bandwidth]
    if gated is not None:
        logprobs: PromptLogprobsTask = {"kind": "prompt_logprobs", "prompts": gated.prompts(), "top_k": cfg.top_k}
        tasks.append(logprobs)
        if prompts:
            greedy: GreedyTask = {"kind": "greedy", "prompts": prompts, "max_tokens": cfg.greedy_tokens}
            tasks.append(greedy)
    decode_prompt = prompts[0] if prompts else [0] * cfg.prompt_tokens
    decode: ThroughputTask = {"kind": "throughput", "prompt": decode_prompt, "batch_sizes": list(cfg.batch_sizes),
                              "tokens": cfg.decode_tokens, "runs": cfg.runs}
    tasks.append(decode)
    return tasks


def throughput(batches: dict[str, ThroughputBatch], bandwidth: TaskResult, checkpoint: Path, cfg: ServeCheckConfig) -> Throughput:
    """Measured decode tokens/s per batch size (median of the runs) and the bound beside it."""
    measured = measure(checkpoint)
    shape = _shape(checkpoint, measured)
    per_second = float(bandwidth["bytes_per_second"])
    table = {}
    for batch, entry in batches.items():
        median, first = statistics.median(entry["seconds"]), statistics.median(entry["first_token_seconds"])
        kv = kv_bytes_per_sequence(shape["layers"], shape["kv_heads"], shape["head_dim"], 2.0, int(entry["prompt_tokens"]))
        step = memory_time(measured.tensor_bytes, int(batch), kv, per_second)
        # decode alone: the tokens after each sequence's first, over the time after the first step
        decoded = entry["generated_tokens"] - int(batch)
        rate = decoded / (median - first) if median > first and decoded > 0 else entry["generated_tokens"] / median
        table[batch] = {"tokens_per_s": rate, "seconds": entry["seconds"], "first_token_seconds": entry["first_token_seconds"],
                        "median_seconds": median, "generated_tokens": entry["generated_tokens"],
                        "bound_tokens_per_s": int(batch) / step}
    return Throughput.model_validate({"batches": table, "bandwidth_bytes_per_s": per_second, "tensor_bytes": measured.tensor_bytes,
                                      "decode_tokens": cfg.decode_tokens, "bound": BOUND_NOTE}, strict=False)


def _shape(checkpoint: Path, measured: Measurement) -> dict[str, int]:
    shape = model_from_checkpoint(checkpoint, read_checkpoint(checkpoint).config, measured.parameters)
    return {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}


class _Gated:
    """The gated side: the results' text set (its first `items` items) and the checkpoint itself."""

    def __init__(self, checkpoint: Path, results: EvaluationResults, cfg: ServeCheckConfig) -> None:
        from transformers import AutoTokenizer

        self.checkpoint, self.results, self.cfg = checkpoint, results, cfg
        self.spec = text_spec(results, cfg.evalset)
        self.side = load_side(results, self.spec, "")
        if not self.side.exact:
            raise InputError(f"results in {results.path} hold {self.spec} in top-k mode (no output-layer inputs): the serve "
                             "check needs the exact cache the evaluator keeps for a model whose head it can rebuild")
        self.count = min(cfg.items, len(self.side.item_tokens))
        self.starts = [0]
        for tokens in self.side.item_tokens[: self.count]:
            self.starts.append(self.starts[-1] + tokens)
        self.prefix = prefix_token(AutoTokenizer.from_pretrained(checkpoint))
        # the model's positions bound a prompt: the prefix, the scored tokens and one generated token
        self.positions = max_sequence_length(checkpoint)
        self.limit = None if self.positions is None else self.positions - 2

    def describe(self) -> GatedSide:
        identity = model_identity(self.checkpoint)
        recorded = self.results.manifest.model
        return GatedSide.model_validate(
            {"results": str(self.results.path), "results_sha256": sha256_file(self.results.path / MANIFEST),
             "evalset": self.spec, "items": self.count, "tokens": self.starts[-1], "weights_sha256": identity.weights_sha256,
             "weights_match": (identity.weights_sha256, identity.config_sha256) == (recorded.weights_sha256, recorded.config_sha256)},
            strict=False)

    def ids(self, index: int) -> list[int]:
        return [int(token) for token in self.side.token_ids[self.starts[index] : self.starts[index + 1]].tolist()]

    def scored(self, index: int) -> list[int]:
        """Item `index`'s tokens the served model scores: all, unless the model's positions end first
        (the evaluator scores an item of exactly max positions tokens; vLLM needs two more slots)."""
        return self.ids(index)[: self.limit]

    def prompts(self) -> list[list[int]]:
        return [[self.prefix, *self.scored(index)] for index in range(self.count)]

    def greedy_prompts(self) -> list[list[int]]:
        long_enough = [index for index in range(self.count) if len(self.ids(index)) >= self.cfg.prompt_tokens]
        return [[self.prefix, *self.ids(index)[: self.cfg.prompt_tokens]] for index in long_enough[: self.cfg.greedy_prompts]]

    def max_model_len(self) -> int:
        longest = max(len(prompt) for prompt in self.prompts())
        wanted = max(longest + 1, self.cfg.prompt_tokens + 1 + max(self.cfg.greedy_tokens, self.cfg.decode_tokens))
        return wanted if self.positions is None else min(wanted, self.positions)

    def logprobs(self, index: int) -> Any:
        """The gated model's log-probabilities at item `index`'s positions, rebuilt from its head."""
        import torch

        span = slice(self.starts[index], self.starts[index + 1])
        side = self.side
        return torch.log_softmax(head_logits(side.head_inputs[span], side.head_weight, side.head_bias), dim=-1)

    def compare(self, served: list[PromptLogprobs]) -> Agreement:
        """Served against gated, position by position over the compared items."""
        import torch

        differences, kls, top1, items = [], [], [], []
        for index, item in enumerate(served):
            targets = torch.tensor(self.scored(index))
            gated = self.logprobs(index)[: len(targets)]
            token = torch.tensor([value if value is not None else float("-inf") for value in item["token_logprobs"]]).double()
            gated_token = gated.gather(-1, targets[:, None])[:, 0].double()
            differences.append((token - gated_token).abs())
            items.append({"tokens": len(targets), "nll_served": float(-token.sum()), "nll_gated": float(-gated_token.sum())})
            ids = torch.tensor(item["top_ids"], dtype=torch.int64)
            values = torch.tensor([[v if v is not None else float("-inf") for v in row] for row in item["top_logprobs"]])
            residual = (1.0 - values.double().exp().sum(-1)).clamp(min=0.0)
            kls.append(agreement.kl_from_topk(ids, values, residual, gated))
            top1.append(ids[:, 0] == gated.argmax(-1))
        difference = torch.cat(differences).numpy()
        kl = torch.cat(kls).double()
        tokens = sum(item["tokens"] for item in items)
        served_nll, gated_nll = (sum(item[key] for item in items) / tokens for key in ("nll_served", "nll_gated"))
        return Agreement.model_validate({"positions": int(difference.size), "items": len(served), "evalset": self.spec,
                # the quality served against the quality gated: mean NLL per token on the same tokens
                "nll_served": served_nll, "nll_gated": gated_nll, "nll_change": served_nll - gated_nll, "per_item": items,
                "mean_abs_logprob_difference": float(difference.mean()),
                "p99_abs_logprob_difference": agreement.quantile(difference, 0.99),
                "max_abs_logprob_difference": float(difference.max()),
                "kl_served_gated_mean": float(kl.mean()), "kl_served_gated_p99": agreement.quantile(kl.numpy(), 0.99),
                "top1_agreement": float(torch.cat(top1).double().mean())}, strict=False)

    def compare_greedy(self, prompts: list[list[int]], served: list[list[int]]) -> Greedy:
        gated = self.greedy(prompts)
        matched = [next((step for step, (a, b) in enumerate(zip(one, other, strict=False)) if a != b), min(len(one), len(other)))
                   for one, other in zip(served, gated, strict=True)]
        tokens = self.cfg.greedy_tokens
        return Greedy.model_validate({"prompts": len(prompts), "tokens": tokens, "identical": sum(count == tokens for count in matched),
                                      "matched_tokens": matched, "mean_matched_fraction": sum(matched) / (tokens * len(matched))},
                                     strict=False)

    def greedy(self, prompts: list[list[int]]) -> list[list[int]]:
        """The gated model's greedy continuations (transformers, FP32, as the evaluator loads it;
        end-of-sequence ignored, as the served side is asked to)."""
        import torch

        # streamed from disk where the machine's memory does not hold the model in FP32 (the same tokens)
        work = memory.Work(batch=len(prompts), tokens=max((len(prompt) for prompt in prompts), default=1) + self.cfg.greedy_tokens)
        chosen = memory.choose(memory.Placement.auto, memory.stage_needs(memory.shape(self.checkpoint), "evaluate", work),
                               memory.allowance(), "the greedy reference")
        model = load_causal_lm(self.checkpoint, torch.float32, chosen.placement is memory.Placement.streamed).eval()
        try:
            with torch.no_grad():
                ids = torch.tensor(prompts)
                past, step_input, out = None, ids, []
                for _ in range(self.cfg.greedy_tokens):
                    output = model(input_ids=step_input, past_key_values=past, use_cache=True)
                    past = output.past_key_values
                    step_input = output.logits[:, -1].argmax(-1, keepdim=True)
                    out.append(step_input)
        finally:
            release_scratch(model)
        return cast(list[list[int]], torch.cat(out, dim=-1).tolist())  # torch is untyped here
