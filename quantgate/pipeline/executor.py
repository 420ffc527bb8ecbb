"""Where a run's stage work executes (the plan's `executor:`, `quantgate run --executor`).

`LocalExecutor`: one unit after another on this machine; a quantization, an evaluation or the
sensitivity in a child process forked for it (`run_forked`), so that an OOM kill or a crash ends
that unit, not the run; the rest in this process. `RayExecutor`:
each unit a Ray task (the functions of quantgate.pipeline.units) with the resources the plan asks
for its stage kind; the driver (this process) keeps the order, the stage cache and the ledger.
Ray retries a task whose worker died (`max_retries`); an error the task raised itself comes back
as that error, as if it had run here; a task lost for good raises `TaskLost`.

Ray is an optional extra (`pip install 'quantgate[ray]'`): ray is imported where used, so that a
local run never needs it (and never pays its import).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeVar, cast

# ray and torch are imported where used: Ray is an optional extra a local run never loads, and
# torch is a worker's (it sets the task's threads)
from quantgate.core import artifacts, memory
from quantgate.core.console import stderr
from quantgate.core.errors import InputError, QuantgateError
from quantgate.core.exitcodes import Exit
from quantgate.core.models import release_every_scratch
from quantgate.evalsets import lm_eval_tasks
from quantgate.pipeline import units
from quantgate.pipeline.plan import ExecutorPlan, StageKind, StageResources
from quantgate.quantize import llmcompressor_backend

T = TypeVar("T")
# The environment a worker needs from the driver's (where quantgate keeps its caches, which
# vLLM serves, no hub traffic): passed to every task through Ray's runtime environment.
FORWARDED_ENV = ("QUANTGATE_HOME", "QUANTGATE_SERVING_PYTHON", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TRANSFORMERS_OFFLINE")
INSTALL_HINT = "the ray executor needs Ray: pip install 'quantgate[ray]' (on the driver and on every node of the cluster)"
_PROBE_TIMEOUT_S = 120


class TaskLost(QuantgateError):
    """A task Ray could not finish however often it tried: its worker or node died (after the
    retries), or it ran out of memory. Not the inputs' fault: nothing of it is cached."""

    exit_code = Exit.UNIT_FAILED

    def __init__(self, kind: str, label: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.label = kind, label

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaskLost, (self.kind, self.label, str(self)))


# A custom resource a task needs, in units a node advertises as 1: small, so that any number of
# tasks needing it run side by side there (it places, it does not ration).
NEED_AMOUNT = 0.001


class Executor(Protocol):
    """Runs a unit of stage work. A concurrent executor (units side by side, called from several
    driver threads) must run each unit in a process of its own: the units keep per-process state
    (quantgate.pipeline.units' models) and llmcompressor's tracing is not thread-safe."""

    name: str
    concurrent: bool  # whether independent units may run side by side

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T: ...

    def where(self, label: str) -> str: ...

    def check_shared(self, out: Path, paths: list[Path]) -> None: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class UnitDied(Exception):
    """A unit's child process ended without an answer: killed by a signal (the kernel's OOM
    killer's SIGKILL, a crash's SIGSEGV) or exited on its own; with the child's peak memory."""

    def __init__(self, label: str, signal_name: str | None, exit_status: int | None, peak_memory_bytes: int) -> None:
        how = f"killed by {signal_name}" if signal_name else f"exited with status {exit_status}"
        oom = " (the kernel's OOM killer sends SIGKILL: out of memory?)" if signal_name == "SIGKILL" else ""
        super().__init__(f"{label}: its child process was {how}{oom}, peak memory {peak_memory_bytes / 2**30:.2f} GiB")
        self.signal, self.exit_status, self.peak_memory_bytes = signal_name, exit_status, peak_memory_bytes


# The stage kinds whose units load a model and compute for minutes: each runs in a child process.
FORKED_KINDS = frozenset({"quantize", "evaluate", "sensitivity"})
# "1": the local executor runs every unit in the run's own process (a debugger's breakpoint in a
# unit, a test that watches what a unit does); a unit's crash then ends the run.
IN_PROCESS_ENV = "QUANTGATE_UNITS_IN_PROCESS"
# A child that could not send its answer (its run is gone, or it died mid-way) exits with this status
# (EX_SOFTWARE); one the run reads as "exited without an answer".
_EXIT_UNANSWERED = 70
# A child whose OpenMP pool hangs exits with this status (the parent then runs it again on one thread).
_POOL_HUNG = 75
# A parallel region over 1 Mi elements takes milliseconds; 5 s is one that will never return.
_POOL_PROBE_S = 5.0


class PoolHung(Exception):
    """A forked child's OpenMP pool hung (see _probe_pool): nothing of the unit ran."""


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _probe_pool(threads: int) -> None:
    """In a forked child: torch on `threads` threads, and one parallel region run. GNU OpenMP
    (libgomp, which torch's wheels bundle) hangs in a forked child whose parent ran a parallel
    region on several threads (the child inherits a pool without its threads): where it hangs
    here, a timer ends the child with _POOL_HUNG, and the parent runs the unit again on one
    thread (measured: the first matmul of such a child never returns; on one thread it does)."""
    if threads <= 1:
        _set_torch_threads(1)
        return
    import torch

    timer = threading.Timer(_POOL_PROBE_S, os._exit, (_POOL_HUNG,))
    timer.daemon = True
    timer.start()
    _set_torch_threads(threads)
    torch.ones(1 << 20).add_(1.0)  # 1 Mi elements: past ATen's grain size (32768), so a parallel region
    timer.cancel()


def _die_with(run: int) -> None:
    """In a forked child: killed when the run (`run`, its parent) dies, as a unit in the run's own
    process would be (Linux's PR_SET_PDEATHSIG; elsewhere the child finishes its unit alone), and
    the run's pid where the atomic writes' testing hook kills the run (artifacts.UNIT_OF_RUN)."""
    os.environ[artifacts.UNIT_OF_RUN] = str(run)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG (prctl(2))
    if os.getppid() != run:  # the run died between the fork and the prctl
        os._exit(_EXIT_UNANSWERED)


def _fd_backed(stream: object) -> bool:
    """Whether a text stream writes to a file descriptor (what a forked child shares with its parent)."""
    try:
        return isinstance(stream.fileno(), int)  # type: ignore[attr-defined]  # any object: a stream without fileno raises
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return False


def _captured_streams() -> tuple[io.StringIO, io.StringIO] | None:
    """In a forked child whose sys.stdout or sys.stderr is no descriptor (a test's captured
    streams, a notebook's): both replaced by buffers, whose text goes back with the answer and
    is written to the parent's streams there; None where the child writes to the descriptors."""
    if _fd_backed(sys.stdout) and _fd_backed(sys.stderr):
        return None
    out, err = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = out, err
    return out, err


def _printed(captured: tuple[io.StringIO, io.StringIO] | None) -> tuple[str, str] | None:
    return None if captured is None else (captured[0].getvalue(), captured[1].getvalue())


def _answer(write_fd: int, outcome: tuple[bool, object, dict[str, int], tuple[str, str] | None]) -> None:
    """The child's answer to its parent: (True, the value) or (False, the error), pickled, with
    the atomic writes' testing-hook counters (artifacts._writes) and what it printed where its
    streams were no descriptors."""
    try:
        data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 - an unpicklable value or error: said in a RuntimeError of its own
        unsent = RuntimeError(f"the unit's answer could not be sent to the run: {type(error).__name__}: {error}; "
                              f"its {'value' if outcome[0] else 'error'} was {outcome[1]!r:.300}")
        data = pickle.dumps((False, (unsent, "".join(traceback.format_exception(error))), outcome[2], outcome[3]))
    view = memoryview(data)
    while view:
        view = view[os.write(write_fd, view):]


class ChildTraceback(Exception):
    """Where a unit's error was raised in its child process: the child's traceback, as the
    cause of the error raised in the run (the unit's log shows both)."""


def _error_answer(error: BaseException) -> tuple[bool, tuple[BaseException, str]]:
    """A unit's error as the child sends it: the error itself (its type decides what the run does
    with it: bad input, a full disk, a unit's failure), its traceback from the child as a note."""
    text = "".join(traceback.format_exception(error))
    if not isinstance(error, (Exception, KeyboardInterrupt)):
        # a library's sys.exit() (SystemExit) or another BaseException: raised in the run as it is, it would
        # end the run with the library's status (1 reads "blocked" to a CI); it is this unit's failure
        error = RuntimeError(f"the unit raised {type(error).__name__}({' '.join(str(error).split())})")
    try:
        sent: BaseException = pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an error that does not pickle: its type and message kept
        sent = RuntimeError(f"{type(error).__name__}: {error}")
    # a traceback does not pickle: its text travels beside the error, the cause of the error raised in the run
    return False, (sent, f"in the unit's child process (pid {os.getpid()}):\n{text.rstrip()}")


def run_forked(label: str, work: Callable[[], T], threads: int) -> T:
    """`work` in a child process forked from this one (nothing of it is pickled: the child has
    this process's memory), its value pickled back through a pipe; its error raised here as if it
    had run here. A child killed by a signal, or that exited without an answer, is UnitDied with
    the signal and its peak memory (os.wait4's ru_maxrss: the child's peak resident set, counted
    from what it shared with this process when forked). The child's stdout and stderr are this
    process's at the fork (the unit's log, quantgate.core.console.library_output). PoolHung: the
    child's OpenMP pool could not be used on `threads` threads (nothing ran: run it on one)."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    run = os.getpid()
    # Ctrl-C is held off across the fork: a child must never unwind through the run's own frames (its
    # lock's release, its clean-up, its zygotes' shutdown); the run SIGKILLs its child on Ctrl-C instead
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = _EXIT_UNANSWERED
        with contextlib.suppress(ValueError):  # ValueError: forked from a thread that is not Python's main one
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:
            os.close(read_fd)
            _die_with(run)
            printed = _captured_streams()
            _probe_pool(threads)
            try:
                outcome: tuple[bool, object] = (True, work())
            except BaseException as error:  # noqa: BLE001 - every error goes back to the parent, Ctrl-C's too
                outcome = _error_answer(error)
            _answer(write_fd, (*outcome, dict(artifacts._writes), _printed(printed)))
            status = 0
        except BaseException:  # noqa: BLE001 - the answer could not be written (the parent is gone)
            pass
        finally:
            try:
                release_every_scratch()  # a streamed model's scratch directory: no finalizer runs past os._exit
            except BaseException:  # noqa: BLE001, S110 - a directory that cannot be removed: swept by the next streamed load
                pass
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001, S110 - a closed stream: nothing more to say; os._exit must run
                    pass
            os._exit(status)  # no atexit handler, no finaliser of the parent's objects runs twice
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a Ctrl-C held off is raised here: the child stops too
        os.close(write_fd)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_fd)
        raise
    return cast(T, _child_answer(label, pid, read_fd, threads))  # what `work` returned, through the pipe


def _child_answer(label: str, pid: int, read_fd: int, threads: int) -> object:
    """In the run: the forked child's answer read from its pipe, the child waited for, and its
    value returned or its error raised (see run_forked)."""
    chunks: list[bytes] = []
    try:
        while chunk := os.read(read_fd, 1 << 20):
            chunks.append(chunk)
    except BaseException:  # Ctrl-C here: the child stops too, and is waited for
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(read_fd)
    _, status, usage = os.wait4(pid, 0)
    peak = usage.ru_maxrss * 1024  # kilobytes on Linux (getrusage(2))
    try:
        answer = pickle.loads(b"".join(chunks)) if chunks else None
    except (pickle.UnpicklingError, EOFError, ValueError):
        if not os.WIFSIGNALED(status):
            raise
        answer = None  # a signal cut its answer short (an OOM kill as it wrote): the signal is the unit's failure
    if answer is not None:
        ok, value, writes, printed = answer
        artifacts._writes.update(writes)  # the atomic writes' testing hook numbers the child's writes as the run's
        if printed is not None:
            sys.stdout.write(printed[0])
            sys.stderr.write(printed[1])
        if ok:
            return value
        raised, where = value  # the unit's own error, and its traceback in the child (_error_answer)
        raise raised from ChildTraceback(where)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == _POOL_HUNG and threads > 1:
        raise PoolHung(label)
    name = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None
    raise UnitDied(label, name, os.WEXITSTATUS(status) if os.WIFEXITED(status) else None, peak)


# The libraries a forked unit of each kind imports, imported once in the run before its first such
# unit (`preload`): each child then finds them loaded (copy-on-write pages it shares with the run)
# instead of importing them again. Measured (AVX-512 without AMX, 2 cores): the tiny model's
# two-format run in 9.1 s against 18.4 and 22.6 s (docs/reliability.md, "No unit ends the run").
_PRELOADS: dict[str, Callable[[], None]] = {
    "quantize": llmcompressor_backend.preload,
    "sensitivity": llmcompressor_backend.preload,
    "evaluate": lm_eval_tasks.preload,
}
_preloaded: set[Callable[[], None]] = set()


def _accelerator_build() -> bool:
    """Whether this process's torch was built for an accelerator (CUDA, ROCm, XPU, MPS, a plug-in
    device; `torch.accelerator`, a compile-time check that does not poison a fork). llmcompressor
    asks for one when it is imported, and a CUDA driver initialised in the run does not survive the
    fork of a unit that uses it: there each unit imports its libraries itself, as before."""
    import torch

    return torch.accelerator.current_accelerator() is not None or bool(torch.version.cuda or getattr(torch.version, "hip", None))


def preload(kind: str) -> None:
    """Before the run forks its first unit of `kind`: that kind's libraries imported here, once
    (_PRELOADS), and what they added to this process's resident set noted for the memory estimates
    (core.memory.note_preloaded: a child shares those pages with the run). Not where the run's torch
    has an accelerator build, nor where this process's streams are no descriptors (a notebook, a
    test's capture): the libraries bind their loggers to the streams they find when imported, and a
    child's replacement streams (_captured_streams) would no longer reach them. An import that fails
    here is left to the unit, which fails as a unit with its own error; this one goes to the unit's
    log (the run calls units inside it)."""
    load = _PRELOADS.get(kind)
    if load is None or load in _preloaded or _accelerator_build() or not (_fd_backed(sys.stdout) and _fd_backed(sys.stderr)):
        return
    _preloaded.add(load)
    before = memory.resident_bytes()
    try:
        load()
    except (Exception, SystemExit):  # noqa: BLE001 - the unit imports it again and fails with its own error
        traceback.print_exc()
    memory.note_preloaded(max(0, memory.resident_bytes() - before))


class LocalExecutor:
    """Every unit on this machine, in order: a quantization, an evaluation and the sensitivity each
    in a child process of its own (`run_forked`), the rest in this process. While the run goes,
    torch in this process runs on one thread, so that no OpenMP pool of several threads exists
    here when a child is forked; each child runs on the threads this process had (`threads`).
    `fork`: False runs every unit in this process (where os.fork does not exist)."""

    name = "local"
    concurrent = False

    def __init__(self, fork: bool = hasattr(os, "fork"), threads: int | None = None) -> None:
        self.fork = fork
        self.threads = (threads or _torch_threads()) if fork else 0
        # what close() gives back: not self.threads, which a pool that hung (PoolHung) lowers to 1
        self.found = _torch_threads() if fork else 0
        if fork:
            _set_torch_threads(1)

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T:
        if not (self.fork and kind in FORKED_KINDS) or _cuda_initialized():
            return work()
        preload(kind)
        try:
            return run_forked(label, work, self.threads)
        except PoolHung:
            # torch ran on several threads in this process before the run (a notebook, a test): its
            # OpenMP pool hangs any forked child that uses it, so every child of this run gets one thread
            stderr.print(f"      [yellow]{label}: this process's OpenMP pool cannot be used in a child process; "
                         "units run on one thread[/yellow]", highlight=False, soft_wrap=True)
            self.threads = 1
            return run_forked(label, work, self.threads)

    def where(self, label: str) -> str:
        return ""

    def check_shared(self, out: Path, paths: list[Path]) -> None:
        return None

    def cancel(self) -> None:
        return None

    def close(self) -> None:
        if self.fork:
            _set_torch_threads(self.found)  # this process's torch as it was before this executor


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InputError(INSTALL_HINT) from None
    return ray


def _run_task(label: str, board: Any, threads: int, work: Callable[[], T]) -> tuple[tuple[str, str, int], T]:
    """A unit, inside its Ray worker: says where it runs (the driver's progress lines), limits
    torch to the task's CPUs, runs; returns where it ran with its value."""
    ray = _ray()
    here = (ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid())
    try:
        board.put_nowait((label, *here))
    except Exception:  # noqa: BLE001 - progress is a courtesy; the task runs whatever happened to it
        pass
    import torch

    torch.set_num_threads(max(1, threads))
    try:
        return here, work()
    finally:
        units.forget()  # an idle worker holds no model: the next task on its node gets the memory


class ProbeAnswer(TypedDict):
    """What a node's probe found: its id, whether `out` is a directory there, why it could not
    write its token into it (None: written), and the paths it cannot see."""

    node: str
    out: bool
    error: str | None
    missing: list[str]


def _probe(out: str, token: str, paths: list[str]) -> ProbeAnswer:
    """On one node: whether `out` exists there (never made: a worker must not create a run
    directory of its own), a token file written into it, and which of `paths` it cannot see."""
    ray = _ray()
    node = ray.get_runtime_context().get_node_id()
    seen, error = os.path.isdir(out), None
    if seen:
        try:
            Path(out, f".quantgate-probe-{token}-{node}").write_text(node, encoding="utf-8")
        except OSError as failed:  # read-only there, another owner (NFS root_squash)
            error = f"cannot write into it ({failed.strerror or failed})"
    return {"node": node, "out": seen, "error": error, "missing": [path for path in paths if not os.path.exists(path)]}


PROBE_SECONDS = 5.0  # a cluster's head answers a TCP connection at once; nothing answering in 5 s is no cluster


def _answers(address: str | None) -> None:
    """Refuse, in one line, a HOST:PORT (or ray://HOST:PORT) where nothing accepts a connection:
    `ray.init` would otherwise retry for minutes, printing Ray's own warnings, before it gives up.
    "auto", a bare host and no address are left to Ray (it finds a local cluster itself)."""
    import socket

    if not address or address == "auto":
        return
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as error:
        why = f"nothing answered within {PROBE_SECONDS:g} s" if isinstance(error, TimeoutError) else (error.strerror or type(error).__name__).lower()
        raise InputError(f"cannot reach the Ray cluster at {address}: {why} (is `ray start --head` running there?)") from None


class RayExecutor:
    """Units as Ray tasks on the cluster at `plan.address` (none: a Ray of this machine's own)."""

    name = "ray"
    concurrent = True

    def __init__(self, plan: ExecutorPlan, resources: Mapping[StageKind, StageResources], show: Callable[[str], None]) -> None:
        ray = self.ray = _ray()
        self.address = plan.address
        self.max_retries = plan.max_retries
        self.resources: dict[str, StageResources] = dict(resources.items())  # looked up by a unit's kind, a str
        self.show = show
        env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
        _answers(plan.address)
        try:
            ray.init(address=plan.address, include_dashboard=False if plan.address is None else None, log_to_driver=False,
                     logging_level="WARNING", runtime_env={"env_vars": env})
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise InputError(f"cannot reach the Ray cluster at {plan.address or '(a local Ray)'}: {' '.join(str(error).split())}") from None
        # each alive node's name in the progress lines: "node 2 (10.0.0.7)"
        self.nodes = {node["NodeID"]: (f"node {index + 1}", node["NodeManagerAddress"])
                      for index, node in enumerate(n for n in ray.nodes() if n["Alive"])}
        from ray.util.queue import Queue

        self.board = Queue(actor_options={"num_cpus": 0})
        self.remote = ray.remote(_run_task)
        self.inflight: dict[Any, str] = {}
        self.placed: dict[str, str] = {}
        self.attempts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.cancelled = threading.Event()  # Ctrl-C: no task starts after it
        self.watcher = threading.Thread(target=self._watch, name="quantgate-ray-progress", daemon=True)
        self.watcher.start()

    # ---- before any work ----------------------------------------------------------------------

    def check_resources(self) -> None:
        """Each stage kind's request fits some node of the cluster, or one line saying which does not."""
        alive = [node["Resources"] for node in self.ray.nodes() if node["Alive"]]
        for kind, asked in self.resources.items():
            if not any(res.get("CPU", 0) >= asked.cpus and res.get("GPU", 0) >= asked.gpus
                       and (asked.memory_gib is None or res.get("memory", 0) >= asked.memory_gib * 2**30) for res in alive):
                have = "; ".join(f"{res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU, {res.get('memory', 0) / 2**30:.1f} GiB"
                                 for res in alive)
                raise InputError(f"resources.{kind} asks for {asked.cpus:g} CPU, {asked.gpus:g} GPU"
                                 f"{f', {asked.memory_gib:g} GiB' if asked.memory_gib else ''}: no node of the Ray cluster has "
                                 f"that ({have})")

    def check_shared(self, out: Path, paths: list[Path]) -> None:
        """A worker on every node writes a token into `out`, which the driver reads back; every
        node must also see `paths` (the model, the serving environment). One line when not."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.check_resources()
        token = uuid.uuid4().hex[:12]
        probe = self.ray.remote(_probe)
        refs = {node: probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(str(out), token, [str(path) for path in paths]) for node in self.nodes}
        try:
            try:
                answers = dict(zip(refs, self.ray.get(list(refs.values()), timeout=_PROBE_TIMEOUT_S), strict=True))
            except self.ray.exceptions.GetTimeoutError:
                raise InputError(f"the Ray cluster ran no probe within {_PROBE_TIMEOUT_S} s: are its nodes busy or without CPUs?") from None
            except self.ray.exceptions.RayError as error:  # a node died, or quantgate is missing there
                raise InputError(f"a probe of the Ray cluster failed: {_first_line(error)}") from None
            for node, answer in answers.items():
                where, written = "{} ({})".format(*self.nodes[node]), out / f".quantgate-probe-{token}-{node}"
                if answer["error"]:
                    raise InputError(f"out {out} is not writable from {where}: {answer['error']}")
                if not answer["out"] or not written.is_file() or written.read_text(encoding="utf-8") != node:
                    raise InputError(f"out {out} is not on storage every Ray worker sees: {where} "
                                     f"{'wrote a token there that the driver cannot read' if answer['out'] else 'has no such directory'}; "
                                     "put out on a filesystem shared by the driver and every node")
                if answer["missing"]:
                    raise InputError(f"{where} cannot see {answer['missing'][0]}: the model and the serving environment must be "
                                     "at the same path on every node")
        finally:
            _, pending = self.ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
            for ref in pending:  # a probe that never ran (a finished task is not cancelled: Ray 2.60 aborts on that)
                self.ray.cancel(ref, force=True)
            for stale in out.glob(f".quantgate-probe-{token}-*"):
                stale.unlink(missing_ok=True)

    # ---- the units ----------------------------------------------------------------------------

    def call(self, kind: str, label: str, work: Callable[[], T], needs: Sequence[str] = ()) -> T:
        """`work` (a function of picklable arguments: functools.partial of a module's function) as
        a task with the resources of its stage kind; its value, or its own error, here. `needs`:
        custom resources a node must advertise to run it (a serve goes to a node whose engine has
        the scheme's kernel: `quantgate serving resources`); one no node advertises is not asked
        for (the task would wait forever): the serve then runs anywhere, its probe decides."""
        asked = self.resources.get(kind, StageResources())
        options: dict[str, Any] = {"num_cpus": asked.cpus, "num_gpus": asked.gpus, "max_retries": self.max_retries,
                                   "retry_exceptions": False, "name": label}
        advertised = {name for node in self.ray.nodes() if node["Alive"] for name in node["Resources"]}
        wanted = {name: NEED_AMOUNT for name in needs if name in advertised}
        if wanted:
            options["resources"] = wanted
        if asked.memory_gib is not None:
            options["memory"] = int(asked.memory_gib * 2**30)
        with self.lock:  # a cancel() either sees this task or comes first and stops it starting
            if self.cancelled.is_set():
                raise KeyboardInterrupt
            ref = self.remote.options(**options).remote(label, self.board, max(1, int(asked.cpus)), work)
            self.inflight[ref] = label
        try:
            here, value = self.ray.get(ref)
            self.placed[label] = self._where(*here)  # the attempt that finished
            return value  # type: ignore[no-any-return]  # what `work` returned, through Ray
        except self.ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, Exception) and not isinstance(cause, self.ray.exceptions.RayError):
                raise cause from None  # the task's own error, as a local run raises it
            raise TaskLost(kind, label, f"{label}: {_first_line(error)}") from None
        except self.ray.exceptions.TaskCancelledError:
            raise KeyboardInterrupt from None
        except KeyboardInterrupt:  # Ctrl-C while waiting here: this task stops too, before any cleanup
            self.cancel()
            raise
        except self.ray.exceptions.RayError as error:  # its worker or node died, after every retry
            tries = self.attempts.get(label, 1)
            raise TaskLost(kind, label, f"{label} was lost on the Ray cluster after {tries} attempt{'s' if tries != 1 else ''}: "
                           f"{_first_line(error)}") from None
        finally:
            with self.lock:
                self.inflight.pop(ref, None)

    def where(self, label: str) -> str:
        return self.placed.get(label, "")

    def _watch(self) -> None:
        """The driver's progress: a line when a task starts on a node (again, when Ray retries it)."""
        from ray.util.queue import Empty

        while not self.stopping.is_set():
            try:
                label, node, host, pid = self.board.get(block=True, timeout=0.5)
            except Empty:
                continue
            except Exception:  # noqa: BLE001 - the board is gone (shutdown): nothing more to show
                return
            attempt = self.attempts[label] = self.attempts.get(label, 0) + 1
            where = self._where(node, host, pid)
            again = f" (attempt {attempt}: Ray retried it)" if attempt > 1 else ""
            self.show(f"      [dim]{label} running on {where}{again}[/dim]")

    def _where(self, node: str, host: str, pid: int) -> str:
        name, address = self.nodes.get(node, (f"node {node[:8]}", "?"))
        return f"{name} ({address}, host {host}, pid {pid})"

    # ---- the end ------------------------------------------------------------------------------

    def cancel(self) -> None:
        """Ctrl-C: every task still running is cancelled (its worker killed) and waited for, so
        no task writes after the driver has cleaned up."""
        with self.lock:
            self.cancelled.set()
            refs = list(self.inflight)
        for ref in refs:
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - it finished meanwhile
                pass
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=30)

    def close(self) -> None:
        self.stopping.set()
        self.watcher.join(timeout=2)
        try:
            self.ray.kill(self.board.actor)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self.ray.shutdown()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(error).__name__


def forks(plan: ExecutorPlan) -> bool:
    """Whether a run under `plan` forks its units: the local executor, where os.fork exists and
    QUANTGATE_UNITS_IN_PROCESS is not 1."""
    return plan.kind == "local" and hasattr(os, "fork") and os.environ.get(IN_PROCESS_ENV) != "1"


def _cuda_initialized() -> bool:
    """Whether this process initialised CUDA: then a unit runs here, not in a forked child, since the
    CUDA runtime does not survive a fork (torch refuses: "Cannot re-initialize CUDA in forked
    subprocess"). A run keeps it uninitialised where it can (hold_one_thread)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def hold_one_thread() -> int:
    """Torch on one thread in this process from now on, before the run does any torch work here
    (its preflight converts a demo model on first use and runs it on the smoke prompt): one
    parallel region on several threads would leave the OpenMP pool that hangs every forked unit
    (_probe_pool), and the whole run would fall back to one thread. Returns the count it had: the
    threads the units' children get; `release_threads` gives it back."""
    # torch.cuda.is_available() asks NVML, not the CUDA driver, so that the run's own checks leave CUDA
    # uninitialised for the units' children (torch/cuda/__init__.py, PYTORCH_NVML_BASED_CUDA_CHECK)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    threads = _torch_threads()
    _set_torch_threads(1)
    return threads


def release_threads(threads: int) -> None:
    _set_torch_threads(threads)


def make(plan: ExecutorPlan, resources: Mapping[StageKind, StageResources], threads: int | None = None) -> Executor:
    """The executor a plan asks for; `threads`: what `hold_one_thread` returned, for the local
    executor's children (None: this process's count now)."""
    if plan.kind == "local":
        return LocalExecutor(fork=forks(plan), threads=threads)
    started = time.perf_counter()
    made = RayExecutor(plan, resources, show=lambda line: stderr.print(line, highlight=False, soft_wrap=True))
    nodes = ", ".join(f"{name} at {address}" for name, address in made.nodes.values())
    stderr.print(f"ray: {len(made.nodes)} node{'s' if len(made.nodes) != 1 else ''} ({nodes}), connected in "
                 f"{time.perf_counter() - started:.1f} s", highlight=False, soft_wrap=True)
    return made
