"""Running serving/worker.py in the serving environment: one request file in, one response file
out, the worker's log kept beside them.

vLLM's processes talk over local sockets. The worker runs inside a network namespace that has only
loopback (`unshare -n`, then `ip link set lo up`) wherever this process may make one (root on
Linux, with unshare and ip), so nothing it opens can reach another address; elsewhere it runs
as it is, with VLLM_HOST_IP=127.0.0.1. The engine runs in the worker's own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): measured on 2 cores it starts in about 4 s there against
about 25 s as separate engine and worker processes (docs/serving.md).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

from quantgate.core.artifacts import read_json, write_json
from quantgate.core.exitcodes import Exit
from quantgate.serving.environment import ServingEnv, ServingError
from quantgate.serving.worker import PROTOCOL as WORKER_PROTOCOL
from quantgate.serving.worker import ZYGOTE, Progress, RequestBody, TaskResult, WorkerResponse, ZygoteOrder

WORKER = Path(__file__).with_name("worker.py")
PROTOCOL = 1
LOG = "worker.log"
PROGRESS = "progress.json"
# A timed probe pass still running at this many times its limit is stopped without waiting for it
# (one pass at the limit could be jitter: a finished probe is judged by its fastest timed pass).
SLOW_PASS = 3.0
# Offline, quiet, in one process: no hub, no usage report, no telemetry.
WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # INFO: vLLM logs the linear kernel it selects for each scheme there (serving.device.kernels_in_log)
    "VLLM_LOGGING_LEVEL": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
}
# Variables of the calling environment that would point the worker at the project's packages.
DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


class ProbeStopped(TypedDict):
    """Why the probe stopped a worker (its engine has no usable path here), and its passes."""

    reason: str
    forward_seconds: list[float]
    limit_seconds: float
    warmup_limit_seconds: float


class WorkerFailed(ServingError):
    """vLLM could not do what the request asked: `reason` is its one line."""

    def __init__(self, reason: str, log: Path, phase: str | None = None, *, timed_out: bool = False,
                 probe: ProbeStopped | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log = log
        self.phase = phase  # "import", "load", a task's kind; None when the worker said nothing (it died)
        self.timed_out = timed_out
        self.probe = probe  # stopped by the probe: its forward passes (no usable path here)

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable with its fields (a Ray task raises it back to the driver)."""
        return (_worker_failed, (self.reason, self.log, self.phase, self.timed_out, self.probe))


def _worker_failed(reason: str, log: Path, phase: str | None, timed_out: bool, probe: ProbeStopped | None) -> WorkerFailed:
    return WorkerFailed(reason, log, phase, timed_out=timed_out, probe=probe)


class ServeFailed(ServingError):
    """A serve that died or never answered (past its time or its load deadline): that serve's own
    failure, maybe passing, not bad input: `serving check` exits 5 (a failed unit), as a run's
    serve unit is recorded failed (quantgate/core/exitcodes.py)."""

    exit_code = int(Exit.UNIT_FAILED)


@dataclass(frozen=True)
class ProbeLimit:
    """How long the probe's forward passes may take (the request's `probe` task): the first, which
    warms the kernels up, at most `warmup_seconds`; a later one at most `forward_seconds`. A worker
    past either is stopped at once: its engine has no usable path for the checkpoint here."""

    forward_seconds: float
    warmup_seconds: float


@dataclass(frozen=True)
class LoadDeadline:
    """How long a request may wait for its engine to be loaded, from the moment it is made (the
    zygote's start, where one starts for it, included): past it the worker is stopped, whatever
    it is doing (importing vLLM, forking, loading). `basis` says where the number comes from."""

    seconds: float
    basis: str


@dataclass(frozen=True)
class AnswerCap:
    """How long a request may go, from the moment it is made, without a first answer from its
    engine (its probe's first forward pass done): past it the worker is stopped, whether vLLM is
    still importing, loading, or in that first pass. The serve check's budget for engines that
    have not answered (evalsets.served: one per checkpoint's serve check, at most 3 minutes);
    `basis` says what is left of it and why. The tasks after a first answer are held only to the
    request's `timeout`."""

    seconds: float
    basis: str


@dataclass(frozen=True)
class Response:
    value: WorkerResponse
    log: Path
    isolated: bool = False  # run inside a loopback-only network namespace
    # the request to the engine loaded, as the caller waited (None: no engine, or no progress file)
    startup_seconds: float | None = None
    # what a start from nothing costs here: importing vLLM (the zygote's import, measured when it
    # came up, whether for this request or an earlier one) plus loading the engine
    cold_start_seconds: float | None = None
    # the request to its engine's first answer (the probe's first forward pass done), as the
    # caller waited: what it used of an AnswerCap (None: no probe, or no progress file)
    answered_seconds: float | None = None

    def result(self, kind: str) -> TaskResult:
        """The result of the task of `kind`: what its callers read of it depends on the kind."""
        return next(result for result in self.value["results"] if result["kind"] == kind)


@functools.cache
def loopback_prefix() -> tuple[str, ...]:
    """The command prefix that runs a program in a fresh loopback-only network namespace, or ()
    where this process cannot make one."""
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if not unshare or not ip:
        return ()
    prefix = (unshare, "-n", "sh", "-c", f'{ip} link set lo up && exec "$0" "$@"')
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return prefix if probe.returncode == 0 else ()


def run(env: ServingEnv, request: RequestBody, work: Path, timeout: float, *, settings: dict[str, str] | None = None,
        probe: ProbeLimit | None = None, load_deadline: LoadDeadline | None = None, cap: AnswerCap | None = None) -> Response:
    """Run one request in the serving environment; the response, or WorkerFailed with vLLM's reason.
    `settings`: engine settings (environment variables) the worker runs under; `probe`: the limits
    its probe task's forward passes are held to; `load_deadline`: how long it may take to have its
    engine loaded (a hang while vLLM imports or loads costs that, not `timeout`); `cap`: how long
    it may go without a first answer (with `probe` only: the probe's first forward pass is that
    answer; a hang in that pass costs at most what is left of the cap). The worker is a
    child of the serving environment's zygote where one is up or can start (`_Zygote`: vLLM
    imported once), else a process of its own."""
    work.mkdir(parents=True, exist_ok=True)
    request_path, response_path, log, progress = work / "request.json", work / "response.json", work / LOG, work / PROGRESS
    for stale in (response_path, progress):
        stale.unlink(missing_ok=True)
    if cap is not None and probe is None:
        raise ValueError("an answer cap needs the probe: its first forward pass is the engine's first answer")
    watched = probe is not None or load_deadline is not None
    write_json(request_path, {"protocol": PROTOCOL, **request, **({"progress": str(progress)} if watched else {})})
    base = {key: value for key, value in os.environ.items() if key not in DROPPED} | WORKER_ENV
    environment = base | (settings or {})
    prefix = loopback_prefix()
    started, wall_started = time.monotonic(), time.time()
    deadline = started + timeout
    load_by = started + load_deadline.seconds if load_deadline is not None else deadline
    answer_by = started + cap.seconds if cap is not None else deadline
    order: ZygoteOrder = {"request": str(request_path), "response": str(response_path), "log": str(log), "cwd": str(work),
                          "environment": environment}
    worker_command = [*prefix, str(env.python), str(WORKER)]
    zygote = _zygote(worker_command, base)
    forked = _fork(zygote, order, min(deadline, load_by, answer_by))
    if forked is None and cap is not None and time.monotonic() > answer_by and answer_by < load_by:
        raise _not_answered(env, cap, log, "vLLM was still being imported (the serving environment's zygote never came up)")
    if forked is None and load_deadline is not None and time.monotonic() > load_by:  # a zygote stuck importing vLLM
        raise _not_loaded(env, load_deadline, log, "vLLM was still being imported (the serving environment's zygote never came up)")
    if forked is None and time.monotonic() > deadline:  # a zygote that never came up: as a worker that never answered
        raise WorkerFailed(f"{env.label} did not finish within {timeout:.0f} s", log, timed_out=True)
    worker: _Worker
    if forked is not None:
        worker = forked  # it opened the log itself
    else:
        with open(log, "wb") as stream:  # its own session: a worker stopped early is stopped with every process it started
            worker = subprocess.Popen([*worker_command, str(request_path), str(response_path)], stdout=stream, stderr=subprocess.STDOUT,
                                      env=environment, cwd=work, start_new_session=True)
    answered: list[float] = []  # when the watch saw the engine's first answer (monotonic)
    try:
        returncode = _watch(worker, env, log, deadline=deadline, timeout=timeout, progress=progress if watched else None, probe=probe,
                            load=(load_by, load_deadline) if load_deadline is not None else None,
                            cap=(answer_by, cap) if cap is not None else None, answered=answered)
    finally:
        if worker.poll() is None:
            _stop(worker)
        if forked is not None:
            forked.release()
    answer = read_json(response_path) if response_path.is_file() else None
    if returncode != 0 or answer is None or "error" in answer:
        died = f"the worker died (exit status {returncode})" if answer is None else None
        reason = (answer or {}).get("error") or died or _last_line(log)
        raise WorkerFailed(reason, log, (answer or {}).get("phase"))
    loaded = loaded_at(progress) if watched else None
    load_seconds = answer.get("load_seconds")
    # a forked worker's own load excludes vLLM's import (the zygote did it); a worker of its own includes it
    imported = zygote.import_seconds if forked is not None and zygote is not None else 0.0
    return Response(answer, log, bool(prefix), startup_seconds=loaded - wall_started if loaded is not None else None,
                    cold_start_seconds=imported + float(load_seconds) if load_seconds is not None and imported is not None else None,
                    answered_seconds=answered[0] - started if answered else None)


def _not_loaded(env: ServingEnv, limit: LoadDeadline, log: Path, doing: str) -> WorkerFailed:
    return WorkerFailed(f"{env.label} did not load the checkpoint within {limit.seconds:.0f} s, its load deadline ({limit.basis}); "
                        f"{doing}", log, "load", timed_out=True)


def _not_answered(env: ServingEnv, cap: AnswerCap, log: Path, doing: str) -> WorkerFailed:
    return WorkerFailed(f"{env.label} did not load the checkpoint within {cap.seconds:.0f} s, {cap.basis}; {doing}",
                        log, "load", timed_out=True)


def _first_answer(progress: Path) -> tuple[bool, bool]:
    """Whether the worker said its engine was loaded, and whether its probe's first forward pass
    is done (the engine's first answer)."""
    try:
        state: Progress = read_json(progress)
    except (OSError, ValueError):
        return False, False  # not written yet (or being renamed into place)
    answered = bool(state.get("forward_seconds")) or state.get("phase") == "probed"
    return answered or state.get("phase") == "loaded" or state.get("loaded") is not None, answered


def loaded_at(progress: Path) -> float | None:
    """When the worker said its engine was loaded (wall clock), or None: not yet (or never)."""
    try:
        state: Progress = read_json(progress)
    except (OSError, ValueError):
        return None  # not written yet (or being renamed into place)
    if state.get("phase") == "loaded":
        return float(state.get("time", time.time()))
    loaded = state.get("loaded")  # the later phases carry it on
    return float(loaded) if loaded is not None else None


def _watch(worker: _Worker, env: ServingEnv, log: Path, *, deadline: float, timeout: float, progress: Path | None,
           probe: ProbeLimit | None, load: tuple[float, LoadDeadline] | None = None,
           cap: tuple[float, AnswerCap] | None = None, answered: list[float] | None = None) -> int:
    """Wait for the worker; stop it past the deadline, past its load deadline with no engine
    loaded, past its answer cap with no first answer, or as soon as its probe shows no usable
    path. `answered` gets the moment the first answer was seen (monotonic)."""
    loaded = False
    first = False
    while True:
        try:
            return worker.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            _stop(worker)
            raise WorkerFailed(f"{env.label} did not finish within {timeout:.0f} s", log, timed_out=True)
        if load is not None and progress is not None and not loaded:
            loaded = loaded_at(progress) is not None
            if not loaded and time.monotonic() > load[0]:
                _stop(worker)
                raise _not_loaded(env, load[1], log, "the worker was started but its engine never said it was loaded")
        if progress is not None and probe is not None and not first:
            engine_loaded, first = _first_answer(progress)
            if first and answered is not None:
                answered.append(time.monotonic())
            if not first and cap is not None and time.monotonic() > cap[0]:
                _stop(worker)
                if not engine_loaded:
                    raise _not_answered(env, cap[1], log, "the worker was started but its engine never said it was loaded")
                stopped: ProbeStopped = {
                    "reason": f"no usable path here: its first forward pass had not ended {cap[1].seconds:.0f} s after the serve was asked for, "
                              f"{cap[1].basis}",
                    "forward_seconds": [], "limit_seconds": probe.forward_seconds,
                    "warmup_limit_seconds": min(probe.warmup_seconds, cap[1].seconds)}
                raise WorkerFailed(stopped["reason"], log, "probe", probe=stopped)
        if progress is None or probe is None:
            continue
        slow = _too_slow(progress, probe)
        if slow is not None:
            _stop(worker)
            raise WorkerFailed(slow["reason"], log, "probe", probe=slow)


def _too_slow(progress: Path, limit: ProbeLimit) -> ProbeStopped | None:
    """What the probe shows when a forward pass ran past its limit (finished or still running), else None."""
    try:
        state: Progress = read_json(progress)
    except (OSError, ValueError):
        return None  # not written yet (or being renamed into place)
    done = [float(seconds) for seconds in state.get("forward_seconds") or []]
    if state.get("phase") == "probe" and "started" in state:  # a pass is running: stopped once it is clearly past
        allowed = SLOW_PASS * limit.forward_seconds if done else limit.warmup_seconds
        running = time.time() - float(state["started"])
        if running <= allowed:
            return None
        what = f"{'a' if done else 'its first'} forward pass ran past {allowed:.1f} s"
    elif state.get("phase") == "probed" and done:
        timed = done[1:] or done
        allowed = limit.forward_seconds if len(done) > 1 else limit.warmup_seconds
        if min(timed) <= allowed:
            return None
        what = f"its fastest forward pass after warm-up took {min(timed):.2f} s (limit {allowed:.2f} s)"
    else:
        return None
    return {"reason": f"no usable path here: {what}", "forward_seconds": done,
            "limit_seconds": limit.forward_seconds, "warmup_limit_seconds": limit.warmup_seconds}


def _stop(worker: _Worker) -> None:
    """SIGKILL the worker's whole session (vLLM may have started processes of its own)."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        worker.kill()
    worker.wait()


# ---- the zygote: vLLM imported once, a worker forked from it per request --------------------------

# Environment variables that torch and vLLM may read as they are imported: a zygote serves only
# requests that agree with it on these (the rest of a request's environment, its engine settings
# among them, is the child's own, set before vLLM makes the engine, which is when vLLM reads them).
IMPORT_TIME = ("VLLM_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "CUDA_", "NCCL_", "HF_", "TRANSFORMERS_", "TRITON",
               "TOKENIZERS_", "LD_", "PYTHON")
ZYGOTES_KEPT = 2  # idle zygotes kept (each holds torch and vLLM imported: about half a GB)
ZYGOTE_SWITCH = "QUANTGATE_SERVING_ZYGOTE"  # "0": every worker a process of its own


class _Worker(Protocol):
    pid: int

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...


class _Zygote:
    """`worker.py --zygote` in the serving environment: one worker at a time forked from it."""

    def __init__(self, command: list[str], environment: Mapping[str, str]) -> None:
        self.process = subprocess.Popen([*command, ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=dict(environment), cwd="/", start_new_session=True)
        self.busy = threading.Lock()
        self.started = time.monotonic()
        self.import_seconds: float | None = None  # from its start to "ready": vLLM's import here
        self.ready = False
        self.dead = False
        self.pending = b""  # what it said that no message has been read from yet

    def hear(self, until: float) -> dict[str, int] | None:
        """Its next message, or None: nothing by `until` (then `dead` says whether it ended). Read
        from the pipe's descriptor into a buffer of our own: two messages may arrive in one read
        ("started" and "ended" of a worker that failed at once), and a buffered reader would keep
        the second where select() cannot see it."""
        assert self.process.stdout is not None
        descriptor = self.process.stdout.fileno()
        while not self.dead:
            if b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:  # not the protocol: not a zygote (a stand-in's python, a broken environment)
                    self.dead = True
                    break
                if isinstance(message, dict):
                    return message
                continue
            left = until - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([descriptor], [], [], min(left, 1.0))
            if readable:
                chunk = os.read(descriptor, 65536)
                if not chunk:
                    self.dead = True
                self.pending += chunk
        return None

    def up(self, until: float) -> bool:
        while not self.ready and not self.dead:
            message = self.hear(until)
            if message is None:
                return False
            self.ready = message.get("ready") == WORKER_PROTOCOL
            self.dead = not self.ready
            if self.ready:
                self.import_seconds = time.monotonic() - self.started
        return self.ready

    def order(self, order: ZygoteOrder, until: float) -> int | None:
        """The pid of the worker it forked for `order`, or None (it has ended, or said nothing by `until`)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(order) + "\n").encode())
            self.process.stdin.flush()
        except OSError:
            self.dead = True
            return None
        message = self.hear(until)
        return message.get("started") if message is not None else None

    def close(self) -> None:
        self.dead = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()
        self.process.wait()


class _Forked:
    """A worker the zygote forked: waited for through the zygote, which reports how it ended."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        until = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.returncode is None:
            message = self.zygote.hear(until)
            if message is not None and message.get("ended") == self.pid:
                self.returncode = int(message.get("status", -1))
            elif message is None and self.zygote.dead:
                self.returncode = -int(signal.SIGKILL)  # the zygote ended under it: the worker did not answer
            elif message is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def release(self) -> None:
        """The zygote is free for the next request (or let go, if it ended)."""
        if self.zygote.dead:
            _forget(self.zygote)
        self.zygote.busy.release()


_ZYGOTES: dict[tuple[str, ...], _Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def _zygote(command: list[str], environment: Mapping[str, str]) -> _Zygote | None:
    """The zygote for this command and import-time environment: kept up since an earlier request,
    else started now; None where switched off (QUANTGATE_SERVING_ZYGOTE=0)."""
    if os.environ.get(ZYGOTE_SWITCH) == "0":
        return None
    key = (*command, *sorted(f"{name}={value}" for name, value in environment.items() if name.startswith(IMPORT_TIME)))
    with _ZYGOTES_LOCK:
        found = _ZYGOTES.pop(key, None)
        if found is not None and (found.dead or found.process.poll() is not None):
            found.close()
            found = None
        if found is None:
            idle = [name for name, zygote in _ZYGOTES.items() if not zygote.busy.locked()]  # the least recently used first
            while idle and len(_ZYGOTES) >= ZYGOTES_KEPT:
                _ZYGOTES.pop(idle.pop(0)).close()
            found = _Zygote(command, environment)
        _ZYGOTES[key] = found  # the most recently used last
        return found


def _fork(zygote: _Zygote | None, order: ZygoteOrder, deadline: float) -> _Forked | None:
    """The request's worker forked by `zygote`, or None: no zygote, a busy one (a serve beside
    this one), or one that ended or is not up by `deadline` (the caller starts the worker itself)."""
    if zygote is None or not zygote.busy.acquire(blocking=False):
        return None
    if zygote.up(deadline):
        pid = zygote.order(order, deadline)
        if pid is not None:
            return _Forked(zygote, pid)
        zygote.dead = True  # an order it did not answer: it may still act on it, so it serves no other
    if zygote.dead or time.monotonic() > deadline:
        _forget(zygote)
    zygote.busy.release()
    return None


def _forget(zygote: _Zygote) -> None:
    with _ZYGOTES_LOCK:
        for name in [name for name, found in _ZYGOTES.items() if found is zygote]:
            del _ZYGOTES[name]
    zygote.close()


@atexit.register
def _close_zygotes() -> None:
    with _ZYGOTES_LOCK:
        for zygote in _ZYGOTES.values():
            zygote.close()
        _ZYGOTES.clear()


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""
