"""The worker protocol as evalsets speaks it: the tasks it sends to serving/worker.py (in the
request `serving.run` writes) and the results it reads back (docs/serving.md). TypedDicts of the
JSON, key for key: the wire format is serving/worker.py's, unchanged here; serving/ owns it, and
these name only what evalsets builds and reads."""

from __future__ import annotations

from typing import Literal, TypedDict


class EngineConfig(TypedDict, total=False):
    """A request's `engine`: vLLM's engine for one worker run."""

    max_model_len: int
    kv_cache_bytes: int
    tensor_parallel: int


class ProbeTask(TypedDict):
    kind: Literal["probe"]
    prompt: list[int]
    runs: int


class BandwidthTask(TypedDict):
    kind: Literal["bandwidth"]
    bytes: int
    runs: int


class PromptLogprobsTask(TypedDict):
    kind: Literal["prompt_logprobs"]
    prompts: list[list[int]]
    top_k: int


class GreedyTask(TypedDict):
    kind: Literal["greedy"]
    prompts: list[list[int]]
    max_tokens: int


class ThroughputTask(TypedDict):
    kind: Literal["throughput"]
    prompt: list[int]
    batch_sizes: list[int]
    tokens: int
    runs: int


class LoglikelihoodTask(TypedDict):
    kind: Literal["loglikelihood"]
    requests: list[list[list[int]]]  # [context token ids, continuation token ids] per request


WorkerTask = ProbeTask | BandwidthTask | PromptLogprobsTask | GreedyTask | ThroughputTask | LoglikelihoodTask


class PromptLogprobs(TypedDict):
    """A prompt_logprobs result's answer for one prompt, per position after the first (None: -inf)."""

    token_logprobs: list[float | None]
    top_ids: list[list[int]]
    top_logprobs: list[list[float | None]]


class BatchTiming(TypedDict):
    """A throughput result's runs at one batch size."""

    seconds: list[float]
    first_token_seconds: list[float]
    generated_tokens: int
    prompt_tokens: int


class WorkerResult(TypedDict, total=False):
    """One task's result in a worker response (`serving.Response.result`): its kind and seconds,
    and the answer fields of its kind."""

    kind: str
    seconds: float
    answers: list[list[float | bool]]  # loglikelihood: [summed log-probability, greedy] per request
    continuations: list[list[int]]  # greedy
    prompts: list[PromptLogprobs]  # prompt_logprobs
    batches: dict[str, BatchTiming]  # throughput, by batch size
    bytes_per_second: float  # bandwidth
    bytes_moved: int
    best_seconds: float
    threads: int
    forward_seconds: list[float]  # probe
    prompt_tokens: int
