"""The lm-eval adapter: a golden set's manifest becomes an lm-eval task (YAML, offline: the
`json` dataset builder over the set's own items.jsonl), run in-process on an already-loaded
model, and lm-eval's per-sample log becomes quantgate's per-item results."""

from __future__ import annotations

# lm_eval and datasets are imported where used: they take seconds to import, and writing a
# task's YAML needs neither.
import contextlib
import functools
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from evalsets.config import Kind
from evalsets.sets import GoldenSet
from quantgate.core.errors import InputError
from quantgate.core.metrics import METRICS
from quantgate.core.models import quantgate_home

TASK_FILE = "task.yaml"


def task_name(golden: GoldenSet) -> str:
    return "quantgate_" + re.sub(r"[^a-z0-9]+", "_", golden.name) + "_" + golden.version


def _datasets_cache() -> Path:
    return quantgate_home() / "eval-cache" / "datasets"


def _metric(name: str, aggregation: str) -> dict[str, Any]:
    """An lm-eval metric_list entry, its direction from quantgate's metrics table."""
    return {"metric": name, "aggregation": aggregation, "higher_is_better": METRICS[name].higher_is_better}


def task_config(golden: GoldenSet) -> dict[str, Any]:
    """The lm-eval task definition of a set, from its manifest alone."""
    prompt = dict(golden.manifest["prompt"]["lm_eval"])
    config: dict[str, Any] = {
        "task": task_name(golden),
        "dataset_path": "json",
        # the json builder reads the set's own file: no hub, no download; its arrow cache stays in ours
        "dataset_kwargs": {"data_files": {"test": str(golden.data_path.resolve())}, "cache_dir": str(_datasets_cache())},
        "test_split": "test",
        "output_type": prompt.pop("output_type"),
        **prompt,
        "metadata": {"version": 1.0, "quantgate_evalset": golden.spec, "quantgate_sha256": golden.sha256},
    }
    if golden.kind is Kind.multiple_choice:
        config["metric_list"] = [_metric("acc", "mean"), _metric("acc_norm", "mean")]
    elif golden.kind is Kind.last_word:
        config["metric_list"] = [_metric("perplexity", "perplexity"), _metric("acc", "mean")]
    elif golden.kind is Kind.generation:
        settings = golden.manifest["generation"]
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


def hf_model(model: Any, tokenizer: Any, batch_size: int) -> Any:
    """lm-eval's HF backend around an already-loaded model, reporting progress per forward batch."""
    from lm_eval.models.huggingface import HFLM

    class ProgressHFLM(HFLM):
        # lm-eval's own tqdm bars are turned off; each model call advances quantgate's bar instead
        on_rows: Callable[[int], None] = staticmethod(lambda rows: None)

        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood(requests, disable_tqdm=True)

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

    with _quiet_offline():
        return ProgressHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def vllm_model(model_dir: Path, batch_size: int) -> Any:
    try:
        from lm_eval.models.vllm_causallms import VLLM
    except ImportError as error:
        raise InputError("--backend vllm needs vllm installed (pip install vllm)") from error
    with _quiet_offline():
        return VLLM(pretrained=str(model_dir), batch_size=batch_size, dtype="auto")


def requests_per_item(golden: GoldenSet, items: list[dict[str, Any]]) -> float:
    if golden.kind is Kind.multiple_choice:
        return sum(len(item["choices"]) for item in items) / len(items)
    return 1.0


def run_task(
    lm: Any,
    golden: GoldenSet,
    task_dir: Path,
    limit: int | None,
    bootstrap_iters: int,
    samples: list[int] | None = None,
) -> dict[str, Any]:
    """Evaluate one set through lm-eval's simple_evaluate (its first `limit` items, or the items
    whose indices `samples` lists); returns its results with the samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_task(golden, task_dir)
    with _quiet_offline():
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)
        results = lm_eval.simple_evaluate(
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


def per_item(golden: GoldenSet, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """lm-eval's per-sample log as quantgate's per-item records (docs/evaluate.md, items.json)."""
    records = []
    for sample in sorted(samples, key=lambda sample: sample["doc_id"]):
        doc = sample["doc"]
        record: dict[str, Any] = {"index": int(sample["doc_id"]), "id": str(doc["id"])}
        if golden.kind is Kind.multiple_choice:
            loglikelihoods = [float(response[0]) for response in sample["filtered_resps"]]
            lengths = [len(choice) for choice in doc["choices"]]
            normalised = [value / length for value, length in zip(loglikelihoods, lengths, strict=True)]
            record.update(
                gold=int(doc["gold"]),
                loglikelihoods=loglikelihoods,
                choice_chars=lengths,
                predicted=max(range(len(loglikelihoods)), key=loglikelihoods.__getitem__),
                predicted_norm=max(range(len(normalised)), key=normalised.__getitem__),
                metrics={"acc": float(sample["acc"]), "acc_norm": float(sample["acc_norm"])},
            )
        elif golden.kind is Kind.last_word:
            loglikelihood, greedy = sample["filtered_resps"][0]
            record.update(
                loglikelihood=float(loglikelihood),
                greedy=bool(greedy),
                metrics={"acc": float(sample["acc"])},
            )
        else:
            response = sample["filtered_resps"][0] if isinstance(sample["filtered_resps"], list) else sample["filtered_resps"]
            record.update(
                response=str(response),
                reference=str(doc["reference"]).strip(),
                metrics={"exact_match": float(sample["exact_match"])},
            )
        records.append(record)
    return records


def summary(golden: GoldenSet, results: dict[str, Any]) -> dict[str, Any]:
    """Set-level metrics ('acc', 'acc_stderr', ...) without lm-eval's ',<filter>' suffixes."""
    metrics = {}
    for key, value in results["results"][task_name(golden)].items():
        if "," in key and isinstance(value, (int, float)):
            metrics[key.split(",")[0]] = float(value)
    return metrics


def summary_of_items(golden: GoldenSet, records: list[dict[str, Any]]) -> dict[str, float]:
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


def provenance(golden: GoldenSet, results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's own provenance of a run, made JSON-safe, with its task hash computed as lm-eval does."""
    from lm_eval.utils import handle_non_serializable, hash_string

    name = task_name(golden)
    samples = results["samples"][name]
    kept = {
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
    return json.loads(json.dumps(kept, default=handle_non_serializable))
