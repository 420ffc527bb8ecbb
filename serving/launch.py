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

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.core.artifacts import read_json, write_json
from serving.environment import ServingEnv, ServingError

WORKER = Path(__file__).with_name("worker.py")
PROTOCOL = 1
LOG = "worker.log"
# Offline, quiet, in one process: no hub, no usage report, no telemetry.
WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}
# Variables of the calling environment that would point the worker at the project's packages.
DROPPED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")


class WorkerFailed(ServingError):
    """vLLM could not do what the request asked: `reason` is its one line."""

    def __init__(self, reason: str, log: Path, phase: str | None = None, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log = log
        self.phase = phase  # "import", "load", a task's kind; None when the worker said nothing (it died)
        self.timed_out = timed_out

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable with its fields (a Ray task raises it back to the driver)."""
        return (_worker_failed, (self.reason, self.log, self.phase, self.timed_out))


def _worker_failed(reason: str, log: Path, phase: str | None, timed_out: bool) -> WorkerFailed:
    return WorkerFailed(reason, log, phase, timed_out=timed_out)


@dataclass(frozen=True)
class Response:
    value: dict[str, Any]
    log: Path
    isolated: bool = False  # run inside a loopback-only network namespace

    def result(self, kind: str) -> dict[str, Any]:
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


def run(env: ServingEnv, request: dict[str, Any], work: Path, timeout: float) -> Response:
    """Run one request in the serving environment; the response, or WorkerFailed with vLLM's reason."""
    work.mkdir(parents=True, exist_ok=True)
    request_path, response_path, log = work / "request.json", work / "response.json", work / LOG
    write_json(request_path, {"protocol": PROTOCOL, **request})
    response_path.unlink(missing_ok=True)
    environment = {key: value for key, value in os.environ.items() if key not in DROPPED} | WORKER_ENV
    prefix = loopback_prefix()
    command = [*prefix, str(env.python), str(WORKER), str(request_path), str(response_path)]
    with open(log, "wb") as stream:
        try:
            finished = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, env=environment, timeout=timeout,
                                      cwd=work)
        except subprocess.TimeoutExpired as error:
            raise WorkerFailed(f"{env.label} did not finish within {timeout:.0f} s", log, timed_out=True) from error
    answer = read_json(response_path) if response_path.is_file() else None
    if finished.returncode != 0 or answer is None or "error" in answer:
        died = f"the worker died (exit status {finished.returncode})" if answer is None else None
        reason = (answer or {}).get("error") or died or _last_line(log)
        raise WorkerFailed(reason, log, (answer or {}).get("phase"))
    return Response(answer, log, bool(prefix))


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""
