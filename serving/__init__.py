"""The serving engine (vLLM) in an environment of its own: building and finding that environment,
and running serving/worker.py in it (loopback-only). It knows nothing of golden sets or gates:
evalsets compares what it serves with what was gated, gates judge the comparison."""

from quantgate.serving.environment import ServingEnv, ServingError, find, require, setup
from quantgate.serving.launch import LoadDeadline, ProbeLimit, Response, ServeFailed, WorkerFailed, run

__all__ = ["LoadDeadline", "ProbeLimit", "Response", "ServeFailed", "ServingEnv", "ServingError", "WorkerFailed", "find", "require", "run", "setup"]
