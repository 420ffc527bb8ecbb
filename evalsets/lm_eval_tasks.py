"""The lm-eval adapter: a golden set's manifest becomes an lm-eval task (YAML, offline: the
`json` dataset builder over the set's own items.jsonl), run in-process on an already-loaded
model, and lm-eval's per-sample log becomes quantgate's per-item results."""

from __future__ import annotations

# lm_eval, datasets and transformers are imported where used: they take seconds to import, and
# writing a task's YAML needs none of them.
import contextlib
import functools
import importlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict, cast

import yaml

from quantgate import serving
from quantgate.core.artifacts import read_json
from quantgate.core.errors import InputError
from quantgate.core.metrics import METRICS
from quantgate.core.models import is_streamed, quantgate_home
from quantgate.evalsets.config import GoldenItem, Kind, LmEvalPrompt
from quantgate.evalsets.loglikelihood import SharedContextScorer
from quantgate.evalsets.results import ItemRecord, LmEvalProvenance, SampleCounts
from quantgate.evalsets.sets import GoldenSet
from quantgate.quantize.measure.bounds import kv_bytes_per_sequence, model_from_checkpoint
from quantgate.serving.worker import EngineSettings, GreedyTask, LoglikelihoodTask, RequestBody, TaskResult

TASK_FILE = "task.yaml"


def task_name(golden: GoldenSet) -> str:
    return "quantgate_" + re.sub(r"[^a-z0-9]+", "_", golden.name) + "_" + golden.version


def _datasets_cache() -> Path:
    return quantgate_home() / "eval-cache" / "datasets"


class MetricEntry(TypedDict):
    metric: str
    aggregation: str
    higher_is_better: bool


class _DatasetKwargs(TypedDict):
    data_files: dict[str, str]
    cache_dir: str


class _TaskMetadata(TypedDict):
    version: float
    quantgate_evalset: str
    quantgate_sha256: str


class _GenerationKwargs(TypedDict):
    until: list[str]
    max_gen_toks: int
    do_sample: bool
    temperature: float


class _FilterStep(TypedDict):
    function: str


class _Filter(TypedDict):
    name: str
    filter: list[_FilterStep]


class TaskConfig(LmEvalPrompt, total=False):
    """An lm-eval task definition (lm-eval's TaskConfig, as its YAML): the fields quantgate sets;
    the templates and output_type are the set manifest's (LmEvalPrompt)."""

    task: str
    dataset_path: str
    dataset_kwargs: _DatasetKwargs
    test_split: str
    metadata: _TaskMetadata
    metric_list: list[MetricEntry]
    generation_kwargs: _GenerationKwargs
    filter_list: list[_Filter]


class LmEvalSample(TypedDict):
    """One entry of lm-eval's per-sample log (log_samples=True), with the fields quantgate reads:
    the item (`doc`, a line of the set's items.jsonl), its responses after the task's filters and
    the per-item scores of the task's metrics."""

    doc_id: int
    doc: GoldenItem
    filtered_resps: Any  # per request: (log-likelihood, greedy) pairs, or the generated text
    acc: float
    acc_norm: float
    exact_match: float
    doc_hash: str
    prompt_hash: str
    target_hash: str


# What lm_eval.simple_evaluate returns for one task with log_samples: the fields read here (per
# task name). The others `provenance` keeps are lm-eval's own, passed on untouched (results.get).
LmEvalRun = TypedDict(
    "LmEvalRun",
    {
        "results": dict[str, dict[str, float | str]],  # "<metric>,<filter>" -> value, and lm-eval's "alias"
        "samples": dict[str, list[LmEvalSample]],
        "n-samples": dict[str, SampleCounts],
        "configs": dict[str, object],  # lm-eval's own task config as it ran: kept, never read here
    },
)


class ServedEngine(TypedDict):
    """What a worker run reported of the engine (its response's fields), and the settings it ran under."""

    vllm_version: str | None
    torch_version: str | None
    dtype: str | None
    quantization: str | None
    device: str | None
    threads: int | None
    load_seconds: float | None
    engine_settings: dict[str, str]


class ServedModelInfo(TypedDict):
    """ServedLM's model info: what lm-eval keeps in its results' `config` (record.json lm_eval.config)."""

    served_by: str
    engine: dict[str, str]
    served: ServedEngine | dict[str, str]  # {} before the first worker run
    max_length: int


def _metric(name: str, aggregation: str) -> MetricEntry:
    """An lm-eval metric_list entry, its direction from quantgate's metrics table."""
    return {"metric": name, "aggregation": aggregation, "higher_is_better": METRICS[name].higher_is_better}


def task_config(golden: GoldenSet) -> TaskConfig:
    """The lm-eval task definition of a set, from its manifest alone."""
    config: TaskConfig = {
        "task": task_name(golden),
        "dataset_path": "json",
        # the json builder reads the set's own file: no hub, no download; its arrow cache stays in ours
        "dataset_kwargs": {"data_files": {"test": str(golden.data_path.resolve())}, "cache_dir": str(_datasets_cache())},
        "test_split": "test",
        # output_type and the templates (mypy's extra checks want every optional key in a ** item: the kind's come below)
        **golden.manifest["prompt"]["lm_eval"],  # type: ignore[typeddict-item]  # lm-eval takes every key the manifest gives
        "metadata": {"version": 1.0, "quantgate_evalset": golden.spec, "quantgate_sha256": golden.sha256},
    }
    if golden.kind is Kind.multiple_choice:
        config["metric_list"] = [_metric("acc", "mean"), _metric("acc_norm", "mean")]
    elif golden.kind is Kind.last_word:
        config["metric_list"] = [_metric("perplexity", "perplexity"), _metric("acc", "mean")]
    elif golden.kind is Kind.generation:
        settings = golden.manifest["generation"]  # a generation set has them (SetManifest)
        config["doc_to_target"] = "{{reference | trim}}"
        config["generation_kwargs"] = {
            "until": list(settings["until"]),
            "max_gen_toks": settings["max_new_tokens"],
            "do_sample": False,
            "temperature": 0.0,
        }
        config["filter_list"] = [
            {"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}
        ]
        config["metric_list"] = [_metric("exact_match", "mean")]
    else:
        raise InputError(f"evalset {golden.spec} is a {golden.kind.value} set, which lm-eval does not run here")
    return config


def write_task(golden: GoldenSet, directory: Path) -> Path:
    """Write the task YAML into `directory` (an lm-eval --include_path); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TASK_FILE
    path.write_text(yaml.safe_dump(task_config(golden), sort_keys=True, allow_unicode=True), encoding="utf-8")
    return path


@contextlib.contextmanager
def _quiet_offline() -> Iterator[None]:
    """lm-eval offline and quieter for the duration of one run; the previous state comes back after."""
    import datasets
    import lm_eval.api.task

    names = ("lm_eval", "datasets")
    levels = {name: logging.getLogger(name).level for name in names}
    keys = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "DISABLE_MULTIPROC")
    saved = {key: os.environ.get(key) for key in keys}
    # DISABLE_MULTIPROC: lm-eval's bootstrap stderr would otherwise fork a process pool under torch
    os.environ.update({key: "1" for key in keys})
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    # lm-eval's and datasets' own progress bars give way to quantgate's one bar per set
    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    task_tqdm = lm_eval.api.task.tqdm
    lm_eval.api.task.tqdm = functools.partial(task_tqdm, disable=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints; stdout is for results
            yield
    finally:
        lm_eval.api.task.tqdm = task_tqdm
        if bars_were_on:
            datasets.utils.logging.enable_progress_bar()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def hf_model(model: Any, tokenizer: Any, batch_size: int, shared_context: bool = True) -> Any:
    """lm-eval's HF backend around an already-loaded model, reporting progress per forward batch.

    Log-likelihoods go through `evalsets.loglikelihood.SharedContextScorer` (a shared context run
    once, the output layer only where scored: the same scores for less work), unless
    `shared_context` is False or the scorer's probe finds the model unsuited (then, and for
    seq2seq models, mixed precision or an automatic batch size, HFLM's own loop)."""
    from lm_eval.models.huggingface import HFLM

    class ProgressHFLM(HFLM):  # type: ignore[misc]  # lm-eval is untyped: HFLM is Any to mypy
        # lm-eval's own tqdm bars are turned off; each model call advances quantgate's bar instead
        on_rows: Callable[[int], None] = staticmethod(lambda rows: None)
        # None until the first loglikelihood request; then '' (the scorer is used) or why not
        scorer_unusable: str | None = None
        scorer: SharedContextScorer | None = None

        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests: Any, disable_tqdm: bool = False,
                                  override_bs: int | None = None) -> list[tuple[float, bool]]:
            scorer = self._shared_context_scorer()
            if scorer is None:
                return cast(list[tuple[float, bool]],
                            super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs))
            pairs = [(context, continuation) for _, context, continuation in requests]
            answers = scorer.score(pairs, max_length=self.max_length, batch_size=int(override_bs or self.batch_size),
                                   on_rows=self.on_rows)
            for (request, _, _), answer in zip(requests, answers, strict=True):
                if request is not None:  # loglikelihood_rolling's windows are cached per document, by lm-eval
                    self.cache_hook.add_partial("loglikelihood", request, answer)
            return answers

        def _shared_context_scorer(self) -> SharedContextScorer | None:
            if self.scorer_unusable is None:
                if not shared_context:
                    self.scorer_unusable = "turned off"
                elif self.backend != "causal" or self.mixed_precision_dtype is not None or self.batch_size == "auto":
                    self.scorer_unusable = "a seq2seq model, mixed precision or an automatic batch size"
                else:
                    self.scorer = SharedContextScorer(self.model, softmax_dtype=self.softmax_dtype)
                    self.scorer_unusable = self.scorer.unusable()
                if self.scorer_unusable:
                    self.scorer = None
                if self.scorer_unusable and shared_context:
                    logging.getLogger(__name__).warning("log-likelihoods through HFLM's own loop: %s", self.scorer_unusable)
            return None if self.scorer_unusable else self.scorer

        def get_model_info(self) -> dict[str, object]:  # lm-eval's own model info (passed on untouched), and one key
            # which loop computed the log-likelihoods (their numbers agree to 1e-4 nats in FP32; in BF16 HFLM's loop
            # takes the output layer in BF16, a few hundredths of a nat from the scorer's FP32 one)
            scorer = "shared-context" if self.scorer_unusable == "" else f"hflm ({self.scorer_unusable or 'not used'})"
            return {**super().get_model_info(), "loglikelihood_scorer": scorer}

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().generate_until(requests, disable_tqdm=True)

        def _model_call(self, inps: Any, attn_mask: Any = None, labels: Any = None) -> Any:
            logits = super()._model_call(inps, attn_mask, labels)
            self.on_rows(int(inps.shape[0]))
            return logits

        def _model_generate(self, context: Any, max_length: int, stop: list[str], **kwargs: Any) -> Any:
            output = super()._model_generate(context, max_length, stop, **kwargs)
            self.on_rows(int(context.shape[0]))
            return output

    import torch

    # a model computing in 16 bits: its log-softmax in FP32 (lm-eval's default keeps the logits' dtype,
    # and a BF16 log-probability holds ~3 digits), in HFLM's loop and in the scorer alike
    sixteen_bit = model.get_input_embeddings().weight.dtype in (torch.bfloat16, torch.float16)
    # HFLM ties the embeddings again (model.tie_weights) on a model it is given; a streamed model's
    # (core.models.load_causal_lm) are tied already, one offloaded tensor, which transformers' tying
    # cannot look up as a parameter: it is skipped there
    untie = is_streamed(model)
    if untie:
        model.tie_weights = lambda *args, **kwargs: None
    try:
        with _quiet_offline():
            return ProgressHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                                softmax_dtype=torch.float32 if sixteen_bit else None)
    finally:
        if untie:
            del model.tie_weights


def served_model(model_dir: Path, env: serving.ServingEnv, batch_size: int) -> Any:
    """lm-eval's requests answered by vLLM in the serving environment (`serving.run`), tokenized
    here exactly as lm-eval's HF backend tokenizes them (the checkpoint's own tokenizer, lm-eval's
    context/continuation split, the same prefix token and left truncation), so that per-item
    results compare with the HF backend's. All requests of one lm-eval call go to one worker run:
    the engine starts once per call (a worker run costs ~20 s before it answers, on 2 CPU cores). vLLM schedules its own batches:
    `batch_size` is only recorded."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        DEFAULT_MAX_LENGTH,
        configure_pad_token,
        handle_stop_sequences,
        has_bos_prefix,
        normalize_gen_kwargs,
        postprocess_generated_text,
        resolve_max_length,
    )
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    class ServedLM(TemplateLM):  # type: ignore[misc]  # lm-eval is untyped: TemplateLM is Any to mypy
        # the Evaluator's progress hook: advanced once per worker run, by the requests it answered
        on_rows: Callable[[int], None] = staticmethod(lambda rows: None)

        def __init__(self) -> None:
            super().__init__()
            self.model_dir, self.env, self.batch_size = model_dir, env, batch_size
            config = AutoConfig.from_pretrained(model_dir)
            self.tokenizer = configure_pad_token(AutoTokenizer.from_pretrained(model_dir), model_config=config)
            self.max_length = resolve_max_length(config, self.tokenizer, default=DEFAULT_MAX_LENGTH)  # as HFLM.max_length
            try:
                eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
            except OSError:  # no generation_config.json: the tokenizer's eos alone
                eos = None
            self.stop_ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
            self.served: ServedEngine | dict[str, str] = {}  # what the last worker run reported of the engine
            self.settings: dict[str, str] = {}  # the engine settings (environment variables) each worker run gets

        @property
        def eot_token_id(self) -> int:
            return cast(int, self.tokenizer.eos_token_id)

        @property
        def prefix_token_id(self) -> int:
            return cast(int, self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                       **kwargs: Any) -> list[int]:
            # HFLM.tok_encode with its default add_bos_token (None): the tokenizer's own special
            # tokens, unless the text already starts with the prefix token
            special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
                special = {"add_special_tokens": False}
            encoding: list[int] = self.tokenizer.encode(string, **special)
            return encoding[-left_truncate_len:] if left_truncate_len else encoding

        def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
            return cast(str, self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood(requests, disable_tqdm=True)  # quantgate's bar, not lm-eval's

        def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                                  disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            if not requests:
                return []
            pairs = scored_pairs([(context, continuation) for _, context, continuation in requests], self.max_length)
            longest = max(len(context) + len(continuation) for context, continuation in pairs)
            task: LoglikelihoodTask = {"kind": "loglikelihood", "requests": pairs}
            answers = self._serve([task], longest + 1)[0]["answers"]
            results = [(float(total), bool(greedy)) for total, greedy in answers]
            for (request, _, _), result in zip(requests, results, strict=True):
                self.cache_hook.add_partial("loglikelihood", request, result)
            self.on_rows(len(requests))
            return results

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> list[float]:
            raise InputError("--backend vllm answers loglikelihood and greedy generate_until requests; a "
                             "loglikelihood_rolling task needs --backend hf")

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> list[str]:
            """Greedy generation as HFLM.generate_until does it: the context left-truncated to leave room
            for the new tokens, generation ended at an end-of-sequence token, the text cut at the
            first stop sequence."""
            if not requests:
                return []
            eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
            work: list[tuple[list[int], int, list[str]]] = []
            for context, gen_kwargs in (request.args for request in requests):
                settings = normalize_gen_kwargs(dict(gen_kwargs), 256)  # 256: HFLM.max_gen_toks
                if settings.get("do_sample") or settings.get("temperature", 0.0) > 0:
                    raise InputError("--backend vllm generates greedily only (a task asked for sampling)")
                until, new_tokens = handle_stop_sequences(settings.get("until"), eos=eos), int(settings["max_gen_toks"])
                if new_tokens >= self.max_length:
                    raise InputError(f"a task asks for {new_tokens} new tokens; the model has {self.max_length} positions")
                work.append((self._generation_prompt(context, self.max_length - new_tokens), new_tokens, until))
            budgets = sorted({new_tokens for _, new_tokens, _ in work})  # one greedy task per token budget
            tasks: list[GreedyTask] = [{"kind": "greedy", "max_tokens": budget, "prompts": [ids for ids, n, _ in work if n == budget]}
                                       for budget in budgets]
            answered = self._serve(tasks, max(len(ids) + n for ids, n, _ in work))
            continuations = {budget: iter(result["continuations"]) for budget, result in zip(budgets, answered, strict=True)}
            texts = []
            for (context, gen_kwargs), (_, budget, until) in zip((r.args for r in requests), work, strict=True):
                tokens = list(next(continuations[budget]))
                ends = [position for position, token in enumerate(tokens) if token in self.stop_ids]
                text = self.tok_decode(tokens[: ends[0]] if ends else tokens)
                texts.append(postprocess_generated_text(generation=text, stop=until, think_end_token=None))
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), texts[-1])
            self.on_rows(len(requests))
            return texts

        def _generation_prompt(self, context: str, room: int) -> list[int]:
            # HFLM.tok_batch_encode's special-token rule, one context at a time (no padding)
            special = {"add_special_tokens": False} if has_bos_prefix(context, self.tokenizer.bos_token) else {}
            return cast(list[int], self.tokenizer.encode(context, **special)[-room:])

        def _serve(self, tasks: Sequence[LoglikelihoodTask | GreedyTask], longest: int) -> list[TaskResult]:
            request: RequestBody = {"model": str(self.model_dir), "engine": engine_settings(self.model_dir, longest), "tasks": [*tasks]}
            prompts = sum(len(task["requests"] if task["kind"] == "loglikelihood" else task["prompts"]) for task in tasks)
            work = Path(tempfile.mkdtemp(prefix="quantgate-vllm-eval-"))
            try:
                response = serving.run(self.env, request, work, timeout=ENGINE_START_S + prompts * longest / MIN_TOKENS_PER_S,
                                       settings=self.settings)
            except serving.WorkerFailed as failure:  # the work directory stays, with the worker's log
                raise serving.WorkerFailed(f"{self.env.label} on {self.model_dir}: {failure.reason} (log: {failure.log})",
                                           failure.log, failure.phase) from failure
            shutil.rmtree(work, ignore_errors=True)
            value = response.value
            self.served = {"vllm_version": value.get("vllm_version"), "torch_version": value.get("torch_version"),
                           "dtype": value.get("dtype"), "quantization": value.get("quantization"), "device": value.get("device"),
                           "threads": value.get("threads"), "load_seconds": value.get("load_seconds"),
                           "engine_settings": dict(self.settings)}
            return list(response.value["results"])  # the tasks' answers, in their order

        def get_model_info(self) -> ServedModelInfo:
            return {"served_by": self.env.label, "engine": self.env.identity(), "served": self.served,
                    "max_length": self.max_length}

    return ServedLM()


# Engine start plus scoring at no fewer than this many tokens a second bounds one worker run.
ENGINE_START_S = 180.0
MIN_TOKENS_PER_S = 20.0
# The KV cache vLLM is given (on a CPU: bytes of memory), unless two sequences of the longest
# prompt need more.
KV_CACHE_BYTES = 256 * 2**20


def scored_pairs(pairs: list[tuple[list[int], list[int]]], max_length: int) -> list[list[list[int]]]:
    """(context, continuation) token ids as the worker scores them, left-truncated as HFLM does.

    HFLM feeds `(context + continuation)[-(max_length + 1):][:-1]`: up to `max_length` positions,
    the last continuation token scored from them. vLLM scores a token only as part of its prompt,
    and a prompt plus the one token it must generate fits in the model's positions: a prompt holds
    at most `max_length - 1` tokens. Where a request is longer, the context loses one or two more
    tokens from the left than under HFLM (never the continuation: HFLM asserts it fits)."""
    scored = []
    for context, continuation in pairs:
        if not context or not continuation or len(continuation) >= max_length - 1:  # at least one context token fits
            raise InputError(f"a loglikelihood request with {len(context)} context and {len(continuation)} continuation tokens "
                             f"cannot be scored in {max_length} positions")
        keep = max_length - 1 - len(continuation)
        scored.append([list(context[-keep:]) if len(context) > keep else list(context), list(continuation)])
    return scored


def engine_settings(model_dir: Path, longest: int) -> EngineSettings:
    """vLLM's engine for one run: positions for the longest prompt with what it generates (already
    within the model's own), and a KV cache that holds at least two such sequences."""
    shape = model_from_checkpoint(model_dir, read_json(model_dir / "config.json"), parameters=1)  # (parameters: unused here)
    # 4 bytes an element: vLLM may compute (and cache) a 16-bit checkpoint in FP32 on a CPU
    two = 2 * kv_bytes_per_sequence(shape.layers, shape.kv_heads, shape.head_dim, 4, longest)
    return {"max_model_len": longest, "kv_cache_bytes": int(max(KV_CACHE_BYTES, two))}


def requests_per_item(golden: GoldenSet, items: list[GoldenItem]) -> float:
    if golden.kind is Kind.multiple_choice:
        return sum(len(item["choices"]) for item in items) / len(items)
    return 1.0


# What an evaluation unit imports, in the order it imports them (preload)
EVALUATION_LIBRARIES = ("transformers", "datasets", "lm_eval", "lm_eval.api.task", "lm_eval.evaluator", "lm_eval.models.huggingface",
                        "lm_eval.tasks")


def preload() -> None:
    """Import what an evaluation imports (EVALUATION_LIBRARIES) in this process, so that the units
    a run forks from it find them loaded instead of importing them again (docs/reliability.md,
    "No unit ends the run")."""
    for name in EVALUATION_LIBRARIES:
        importlib.import_module(name)


def run_task(
    lm: Any,
    golden: GoldenSet,
    task_dir: Path,
    limit: int | None,
    bootstrap_iters: int,
    samples: list[int] | None = None,
) -> LmEvalRun:
    """Evaluate one set through lm-eval's simple_evaluate (its first `limit` items, or the items
    whose indices `samples` lists); returns its results with the samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_task(golden, task_dir)
    with _quiet_offline():
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)
        results: LmEvalRun | None = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task_name(golden)],
            task_manager=manager,
            limit=limit,
            samples=None if samples is None else {task_name(golden): samples},
            log_samples=True,
            bootstrap_iters=bootstrap_iters,
        )
    if results is None:
        raise InputError(f"lm-eval returned no results for {golden.spec}")
    return results


def per_item(golden: GoldenSet, samples: list[LmEvalSample]) -> list[ItemRecord]:
    """lm-eval's per-sample log as quantgate's per-item records (docs/evaluate.md, items.json)."""
    records = []
    for sample in sorted(samples, key=lambda sample: sample["doc_id"]):
        doc = sample["doc"]
        record: ItemRecord = {"index": int(sample["doc_id"]), "id": str(doc["id"])}
        if golden.kind is Kind.multiple_choice:
            loglikelihoods = [float(response[0]) for response in sample["filtered_resps"]]
            lengths = [len(choice) for choice in doc["choices"]]
            normalised = [value / length for value, length in zip(loglikelihoods, lengths, strict=True)]
            record.update({
                "gold": int(doc["gold"]),
                "loglikelihoods": loglikelihoods,
                "choice_chars": lengths,
                "predicted": max(range(len(loglikelihoods)), key=loglikelihoods.__getitem__),
                "predicted_norm": max(range(len(normalised)), key=normalised.__getitem__),
                "metrics": {"acc": float(sample["acc"]), "acc_norm": float(sample["acc_norm"])},
            })
        elif golden.kind is Kind.last_word:
            loglikelihood, greedy = sample["filtered_resps"][0]
            record.update({
                "loglikelihood": float(loglikelihood),
                "greedy": bool(greedy),
                "metrics": {"acc": float(sample["acc"])},
            })
        else:
            response = sample["filtered_resps"][0] if isinstance(sample["filtered_resps"], list) else sample["filtered_resps"]
            record.update({
                "response": str(response),
                "reference": str(doc["reference"]).strip(),
                "metrics": {"exact_match": float(sample["exact_match"])},
            })
        records.append(record)
    return records


def summary(golden: GoldenSet, results: LmEvalRun) -> dict[str, float]:
    """Set-level metrics ('acc', 'acc_stderr', ...) without lm-eval's ',<filter>' suffixes."""
    metrics = {}
    for key, value in results["results"][task_name(golden)].items():
        if "," in key and isinstance(value, (int, float)):
            metrics[key.split(",")[0]] = float(value)
    return metrics


def summary_of_items(golden: GoldenSet, records: list[ItemRecord]) -> dict[str, float]:
    """A set's metrics from per-item records (results grown over several looks): each per-item
    score's mean with its standard error (sample standard deviation / sqrt(n), as lm-eval's
    mean_stderr), and for last-word sets the target perplexity exp(-mean log-likelihood) with a
    delta-method standard error (lm-eval bootstraps it; not repeated here)."""
    metrics: dict[str, float] = {}
    for name in records[0]["metrics"]:
        values = [float(record["metrics"][name]) for record in records]
        metrics[name] = sum(values) / len(values)
        metrics[f"{name}_stderr"] = _stderr(values)
    if golden.kind is Kind.last_word:
        loglikelihoods = [float(record["loglikelihood"]) for record in records]
        perplexity = math.exp(-sum(loglikelihoods) / len(loglikelihoods))
        metrics["perplexity"] = perplexity
        metrics["perplexity_stderr"] = perplexity * _stderr(loglikelihoods)
    return metrics


def _stderr(values: list[float]) -> float:
    if len(values) < 2:
        return float("nan")
    mean = sum(values) / len(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1) / len(values))


def provenance(golden: GoldenSet, results: LmEvalRun) -> LmEvalProvenance:
    """lm-eval's own provenance of a run, made JSON-safe, with its task hash computed as lm-eval does."""
    from lm_eval.utils import handle_non_serializable, hash_string

    name = task_name(golden)
    samples = results["samples"][name]
    kept: dict[str, object] = {
        key: results.get(key)
        for key in (
            "versions", "n-shot", "higher_is_better", "n-samples", "config", "git_hash", "date",
            "transformers_version", "lm_eval_version", "tokenizer_pad_token", "tokenizer_eos_token",
            "tokenizer_bos_token", "eot_token_id", "max_length", "pretty_env_info",
        )
    }
    kept["configs"] = results["configs"]
    kept["task_hashes"] = {name: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples))}
    kept["evalset"] = {"spec": golden.spec, "sha256": golden.sha256}
    return cast(LmEvalProvenance, json.loads(json.dumps(kept, default=handle_non_serializable)))
