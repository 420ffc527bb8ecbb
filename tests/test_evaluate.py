"""The evaluator on the tiny model: every kind runs offline and stores per-item results with
lm-eval's provenance; a candidate identical to its baseline has KL 0 and top-1 agreement 1;
asking again is a cache hit that loads no model; --limit takes the first N of the seeded order."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from quantgate import evalsets
from quantgate.core.artifacts import read_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.evalsets import evaluate as evaluate_module

LIMIT = 3


def config(*specs: str, **settings) -> evalsets.EvaluateConfig:
    return evalsets.EvaluateConfig(evalsets=specs, limit=settings.pop("limit", LIMIT), **settings)


def test_builtin_sets_evaluate_offline_with_per_item_results_and_provenance(tiny_model: Path, tmp_path: Path) -> None:
    results = evalsets.run(config("arc-easy", "hellaswag", "lambada", "wiki-text"), tiny_model, tmp_path / "results")
    manifest = read_json(tmp_path / "results" / "manifest.json")
    assert manifest["artifact"] == "evaluation-results" and set(manifest["sets"]) == {
        "arc-easy@v1", "hellaswag@v1", "lambada@v1", "wiki-text@v1"}
    for spec, entry in manifest["sets"].items():
        golden = evalsets.load(spec)
        items = results.items(spec)
        assert items["schema_version"] == 1 and items["sha256"] == golden.sha256 and items["limit"] == LIMIT
        assert [item["id"] for item in items["items"]] == [item["id"] for item in golden.items(LIMIT)]  # first N, seeded order
        assert entry["items"] == LIMIT and not entry["from_cache"]
    arc = results.items("arc-easy@v1")["items"][0]
    assert len(arc["loglikelihoods"]) == len(arc["choice_chars"]) == 4 and set(arc["metrics"]) == {"acc", "acc_norm"}
    assert {"loglikelihood", "greedy"} <= set(results.items("lambada@v1")["items"][0])
    record = results.record("arc-easy@v1")
    lm_eval = record["lm_eval"]
    assert lm_eval["lm_eval_version"] and lm_eval["task_hashes"]["quantgate_arc_easy_v1"]
    assert lm_eval["config"]["random_seed"] == 0 and lm_eval["evalset"] == {"spec": "arc-easy@v1", "sha256": evalsets.load("arc-easy").sha256}
    machine = evaluate_module.compute_dtype_name("cpu", "BF16")  # the tiny model is stored in BF16
    assert record["settings"]["dtype"] == machine.dtype and record["settings"]["dtype_basis"] == machine.basis
    assert record["provenance"]["libraries"]["lm-eval"]
    wiki = results.record("wiki-text@v1")
    assert wiki["primary"] == "perplexity" and wiki["metrics"]["bits_per_byte"] > 0  # no baseline: no agreement
    assert (tmp_path / "results" / "wiki-text@v1" / "topk.safetensors").is_file()
    assert (tmp_path / "results" / "arc-easy@v1" / "task.yaml").is_file()


@pytest.fixture(params=["exact", "top-k"])
def agreement_mode(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """exact: the baseline's distributions rebuilt from its cached hidden states and head;
    top-k: the fallback for a head that cannot be rebuilt (forced here by a negative tolerance)."""
    if request.param == "top-k":
        from quantgate.evalsets import text_eval

        monkeypatch.setattr(text_eval, "HEAD_TOLERANCE", -1.0)
    return request.param


@pytest.fixture
def text_runs(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every TextRun evaluate_text returns during the test, in order (its per-token values)."""
    from quantgate.evalsets import text_eval

    runs: list = []
    evaluate_text = text_eval.evaluate_text

    def keep(*args, **kwargs):
        runs.append(evaluate_text(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(text_eval, "evaluate_text", keep)
    return runs


TAILS = ("kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "top_prob_change_mean", "top_prob_change_p01")


def assert_token_values_match_the_items(run) -> None:
    """Per-token values in item order: each item's span sums to its kl_sum and top_prob_change_sum."""
    import torch

    assert set(run.token_values) == {"kl", "top_prob_change"}
    tokens = [item["tokens"] for item in run.items]
    for key, summed in (("kl", "kl_sum"), ("top_prob_change", "top_prob_change_sum")):
        values = run.token_values[key]
        assert values.dtype == torch.float32 and values.shape == (sum(tokens),)
        spans = torch.split(values.double(), tokens)
        assert [float(span.sum()) for span in spans] == pytest.approx([item[summed] for item in run.items], abs=1e-4)
    assert run.metrics["kl_max"] == float(run.token_values["kl"].max())
    assert run.metrics["top_prob_change_mean"] == pytest.approx(float(run.token_values["top_prob_change"].double().mean()), abs=1e-6)


def test_identical_candidate_has_kl_zero_and_top1_agreement_one(agreement_mode: str, tiny_model: Path, tmp_path: Path,
                                                               text_runs: list) -> None:
    baseline = evalsets.run(config("wiki-text", limit=4), tiny_model, tmp_path / "baseline")
    twin = Path(shutil.copytree(tiny_model, tmp_path / "twin"))  # another directory, the same model
    candidate = evalsets.run(config("wiki-text", limit=4), twin, tmp_path / "candidate", baseline_results=baseline.path)
    metrics = candidate.manifest.sets["wiki-text@v1"].metrics
    assert metrics["kl_divergence"] == 0.0 and metrics["top1_agreement"] == 1.0
    items = candidate.items("wiki-text@v1")
    assert items["primary"] == "kl_divergence" and items["baseline"]["weights_sha256"] == baseline.manifest.model.weights_sha256
    assert all(item["kl_sum"] == 0.0 and item["top1_matches"] == item["tokens"] for item in items["items"])
    # per token too: KL and the change in the probability of the baseline's top token are exactly 0
    unagreed, run = text_runs
    assert unagreed.token_values == {} and not set(TAILS) & set(unagreed.metrics)
    assert all(item["top_prob_change_sum"] == 0.0 for item in items["items"])
    assert all(not values.any() for values in run.token_values.values())
    assert {name: run.metrics[name] for name in TAILS} == dict.fromkeys(TAILS, 0.0)
    assert_token_values_match_the_items(run)
    details = candidate.record("wiki-text@v1")["details"]
    assert details["agreement_mode"] == agreement_mode
    if agreement_mode == "top-k":
        assert details["exact_check"]["positions"] > 0 and details["exact_check"]["shortfall_max"] == 0.0


def exact_kl_by_hand(baseline_dir: Path, candidate_dir: Path, texts: list[str]) -> float:
    """Mean KL(baseline || candidate) over every scored token, from both models' full logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(baseline_dir)
    models = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in (baseline_dir, candidate_dir)]
    total, positions = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False).input_ids[:255]
            inputs = torch.tensor([[tokenizer.bos_token_id, *ids[:-1]]])
            p, q = (torch.log_softmax(model(inputs).logits[0].double(), dim=-1) for model in models)
            total += float((p.exp() * (p - q)).sum())
            positions += len(ids)
    return total / positions


def test_exact_mode_equals_the_kl_of_the_full_distributions_and_top_k_never_exceeds_it(
    agreement_mode: str, tiny_model_template: Path, tmp_path: Path, text_runs: list
) -> None:
    from tests.factories import build_tiny_llama

    baseline = evalsets.run(config("wiki-text", limit=3), tiny_model_template, tmp_path / "baseline")
    other = build_tiny_llama(tmp_path / "other", seed=1)  # same tokenizer, other weights
    candidate = evalsets.run(config("wiki-text", limit=3), other, tmp_path / "candidate", baseline_results=baseline.path)
    kl = candidate.manifest.sets["wiki-text@v1"].metrics["kl_divergence"]
    truth = exact_kl_by_hand(tiny_model_template, other, [item["text"] for item in evalsets.load("wiki-text").items(3)])
    assert truth > 0
    run = text_runs[-1]
    assert_token_values_match_the_items(run)
    assert run.metrics["kl_median"] <= run.metrics["kl_p90"] <= run.metrics["kl_p99"] <= run.metrics["kl_max"]
    assert run.metrics["kl_max"] > run.metrics["kl_divergence"] > 0
    assert -1.0 <= run.metrics["top_prob_change_p01"] <= run.metrics["top_prob_change_mean"] <= 1.0
    if agreement_mode == "exact":
        assert kl == pytest.approx(truth, rel=1e-4)
    else:
        exact = candidate.record("wiki-text@v1")["details"]["exact_check"]
        assert 0 < kl <= truth * (1 + 1e-6)  # a lower bound: the tail is one bucket
        assert 0.0 <= exact["kl_topk_mean"] <= exact["kl_exact_mean"] + 1e-9
        assert exact["shortfall_mean"] <= exact["worst_case_shortfall_mean"] + 1e-9


def test_asking_again_is_a_cache_hit_that_loads_no_model(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config("arc-easy", "wiki-text")
    first = evalsets.run(cfg, tiny_model, tmp_path / "first")
    monkeypatch.setattr(evaluate_module._LoadedModel, "transformers", lambda self: pytest.fail("the model was loaded"))
    started = time.perf_counter()
    again = evalsets.run(cfg, tiny_model, tmp_path / "again")
    assert time.perf_counter() - started < 1.0
    assert again.from_cache == {"arc-easy@v1": True, "wiki-text@v1": True}
    assert again.items("arc-easy@v1") == first.items("arc-easy@v1")


def test_no_cache_recomputes_and_a_damaged_cache_entry_is_recomputed(tiny_model: Path, tmp_path: Path, isolated_home: Path) -> None:
    cfg = config("lambada", limit=2)
    first = evalsets.run(cfg, tiny_model, tmp_path / "first")
    again = evalsets.run(cfg.model_copy(update={"use_cache": False}), tiny_model, tmp_path / "again")
    assert again.from_cache == {"lambada@v1": False}
    assert again.items("lambada@v1")["items"] == first.items("lambada@v1")["items"]  # deterministic
    entry = isolated_home / "eval-cache" / first.manifest.sets["lambada@v1"].cache_key
    (entry / "items.json").write_text("{}")
    assert evalsets.run(cfg, tiny_model, tmp_path / "third").from_cache == {"lambada@v1": False}


def test_changed_settings_or_weights_miss_the_cache(tiny_model: Path, tmp_path: Path) -> None:
    evalsets.run(config("lambada", limit=2), tiny_model, tmp_path / "a")
    assert evalsets.run(config("lambada", limit=1), tiny_model, tmp_path / "b").from_cache == {"lambada@v1": False}
    from tests.factories import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", seed=3)
    assert evalsets.run(config("lambada", limit=2), other, tmp_path / "c").from_cache == {"lambada@v1": False}


@pytest.mark.parametrize("kind", ["multiple-choice", "last-word", "generation", "text"])
def test_user_sets_of_every_kind_evaluate(kind: str, tiny_model: Path, tmp_path: Path) -> None:
    from tests.helpers import USER_ITEMS, write_jsonl

    items = USER_ITEMS[evalsets.Kind(kind)]
    options = {"generation": evalsets.GenerationSettings(max_new_tokens=4)} if kind == "generation" else {}
    evalsets.add(evalsets.AddConfig(name="mine", kind=kind, **options), write_jsonl(tmp_path / "mine.jsonl", items))
    results = evalsets.run(config("mine", limit=None), tiny_model, tmp_path / "results")
    stored = results.items("mine@v1")
    assert [item["id"] for item in stored["items"]] == [item["id"] for item in evalsets.load("mine").items()]
    if kind == "generation":
        assert all(set(item) >= {"response", "reference", "metrics"} for item in stored["items"])
        assert stored["items"][0]["reference"] == "Paris"


def test_baseline_with_other_settings_or_tampered_results_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    baseline = evalsets.run(config("wiki-text", limit=2), tiny_model, tmp_path / "baseline")
    with pytest.raises(InputError, match="the baseline was evaluated with limit=2"):
        evalsets.run(config("wiki-text", limit=3), tiny_model, tmp_path / "candidate", baseline_results=baseline.path)
    other_sets = evalsets.run(config("lambada", limit=2), tiny_model, tmp_path / "other-sets")
    with pytest.raises(InputError, match="hold no wiki-text@v1; evaluate the baseline on it first"):
        evalsets.run(config("wiki-text", limit=2), tiny_model, tmp_path / "candidate", baseline_results=other_sets.path)
    items = baseline.path / "wiki-text@v1" / "items.json"
    items.write_text(items.read_text().replace('"tokens": ', '"tokens": 1', 1))
    with pytest.raises(IntegrityError, match="wiki-text@v1/items.json does not match"):
        evalsets.run(config("wiki-text", limit=2), tiny_model, tmp_path / "candidate", baseline_results=baseline.path)
    assert not (tmp_path / "candidate").exists()


def test_per_set_limits_and_the_demo_table(tiny_model: Path, tmp_path: Path) -> None:
    cfg = evalsets.EvaluateConfig(evalsets=("arc-easy", "lambada"), limit=2, limits={"lambada": 1})
    results = evalsets.run(cfg, tiny_model, tmp_path / "results")
    assert {spec: entry.items for spec, entry in results.manifest.sets.items()} == {"arc-easy@v1": 2, "lambada@v1": 1}


def test_evaluate_command_prints_one_line_per_set_and_refuses_an_existing_out(cli, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    result = cli("evaluate", "--model", tiny_model, "--evalset", "arc-easy", "--evalset", "wiki-text",
                 "--limit", "2", "--limit", "wiki-text=1", "--out", out)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("arc-easy@v1\t2 items\t") and "acc " in lines[0]
    assert lines[1].startswith("wiki-text@v1\t1 items\t") and "perplexity " in lines[1]
    again = cli("evaluate", "--model", tiny_model, "--evalset", "arc-easy", "--evalset", "wiki-text",
                "--limit", "2", "--limit", "wiki-text=1", "--out", out, "--overwrite", "--json")
    assert {entry["from_cache"] for entry in json.loads(again.out)["sets"].values()} == {True}
    refused = cli("evaluate", "--model", tiny_model, "--evalset", "arc-easy", "--out", out)
    assert refused.code == 2 and "already exists" in refused.err
    bad = cli("evaluate", "--model", tiny_model, "--evalset", "arc-easy", "--limit", "many", "--out", tmp_path / "x")
    assert bad.code == 2 and "expected N or NAME=N" in bad.err


def test_vllm_backend_without_the_serving_environment_is_refused_in_one_line(
        cli, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM runs in the serving environment: where none is built (this test's QUANTGATE_HOME holds
    none, and no $QUANTGATE_SERVING_PYTHON names one), or the one named does not exist, one line
    says so and nothing is written."""
    from quantgate.serving.environment import PYTHON_ENV
    from tests.helpers import assert_refused

    monkeypatch.delenv(PYTHON_ENV, raising=False)
    out = tmp_path / "results"
    result = cli("evaluate", "--model", tiny_model, "--evalset", "arc-easy", "--backend", "vllm", "--out", out)
    assert_refused(result, "--backend vllm needs the serving environment: run `quantgate serving setup`", out)
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nothing" / "python"))
    result = cli("evaluate", "--model", tiny_model, "--evalset", "arc-easy", "--backend", "vllm", "--out", out)
    assert_refused(result, f"${PYTHON_ENV} is {tmp_path / 'nothing' / 'python'}, which does not exist", out)


def test_offsets_take_the_items_after_them_and_key_apart(tiny_model: Path, tmp_path: Path) -> None:
    """A held-out split: the first N items after an offset, for every kind, paired with a baseline
    evaluated on the same items; an offset of 0 keys as before (no `offset` in the settings)."""
    sets = ("arc-easy", "lambada", "wiki-text")
    plain = evalsets.EvaluateConfig(evalsets=sets, limit=2)
    shifted = plain.model_copy(update={"offsets": {"arc-easy": 3, "lambada": 3, "wiki-text": 3}})
    base = evalsets.run(shifted, tiny_model, tmp_path / "base")
    cand = evalsets.run(shifted, tiny_model, tmp_path / "cand", baseline_results=tmp_path / "base")
    for spec in ("arc-easy@v1", "lambada@v1", "wiki-text@v1"):
        golden = evalsets.load(spec)
        expected = [item["id"] for item in golden.items(5)[3:]]
        assert [str(item["id"]) for item in base.items(spec)["items"]] == [str(i) for i in expected], spec
        assert base.items(spec)["offset"] == 3 and base.manifest.sets[spec].offset == 3
    assert cand.record("wiki-text@v1")["metrics"]["kl_divergence"] == pytest.approx(0.0, abs=1e-6)
    assert "offset" not in evalsets.run(plain, tiny_model, tmp_path / "plain").record("arc-easy@v1")["settings"]
    with pytest.raises(InputError, match="offset"):
        evalsets.run(plain, tiny_model, tmp_path / "mismatch", baseline_results=tmp_path / "base")


def test_the_output_layer_applied_here_scores_as_the_models_own_logits(tiny_model_template: Path, tmp_path: Path,
                                                                       text_runs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model asked for a few positions' logits (the head check's, then one) and the output
    layer applied here to the decoder's output: the same bits as the model's logits everywhere."""
    import torch

    from quantgate.evalsets import text_eval
    from tests.factories import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", seed=1)
    original_init = text_eval._HeadInputs.__init__
    kept: list[int] = []  # positions the model's own output layer was applied at, per forward

    def init(self, model, selective: bool) -> None:
        original_init(self, model)
        self.module.register_forward_hook(lambda module, inputs, output: kept.append(int(inputs[0].shape[1])))
        if not selective:  # the model's logits at every position, as before
            self.selective = False

    runs = {}
    for way in ("selective", "whole"):
        monkeypatch.setattr(text_eval._HeadInputs, "__init__", lambda self, model, way=way: init(self, model, way == "selective"))
        kept.clear()
        cfg = config("wiki-text", limit=3, batch_size=2, use_cache=False)
        baseline = evalsets.run(cfg, tiny_model_template, tmp_path / way / "baseline")
        evalsets.run(cfg, other, tmp_path / way / "candidate", baseline_results=baseline.path)
        runs[way] = (text_runs[-2], text_runs[-1], list(kept))
    for side in (0, 1):  # the baseline, the candidate
        selective, whole = runs["selective"][side], runs["whole"][side]
        assert selective.metrics == whole.metrics and selective.items == whole.items
        assert selective.details["head"]["rebuilt_from_hidden_states"] and whole.details["head"]["rebuilt_from_hidden_states"]
        assert set(selective.tensors) == set(whole.tensors)
        assert all(torch.equal(selective.tensors[name], whole.tensors[name]) for name in whole.tensors)
        assert all(torch.equal(selective.token_values[name], whole.token_values[name]) for name in whole.token_values)
    # selective: the check's positions on a model's first batch, one position after; whole: every position
    whole_kept, selective_kept = runs["whole"][2], runs["selective"][2]
    assert len(selective_kept) == len(whole_kept) == 2 * 2  # two models, two batches of the 3 items each (batch size 2)
    first = min(max(whole_kept), text_eval.HEAD_CHECK_POSITIONS)
    assert selective_kept == [first, 1, first, 1] and max(whole_kept) > 1


def test_a_decoder_whose_output_is_not_the_heads_input_is_scored_from_the_models_own_logits(
        tiny_model_template: Path, tmp_path: Path, text_runs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Something between the decoder and the output layer (here a pre-hook scaling the layer's input):
    the check finds it, and the set is scored from the model's own logits, as with the check made
    on every position's logits (forced to fail there too)."""
    import torch

    from quantgate.evalsets import text_eval

    original_init = text_eval._HeadInputs.__init__

    def init(self, model, selective: bool) -> None:
        model.get_output_embeddings().register_forward_pre_hook(lambda module, inputs: (inputs[0] * 1.5,))
        original_init(self, model)
        if not selective:
            self.selective = False

    runs = {}
    for way in ("selective", "whole"):
        monkeypatch.setattr(text_eval._HeadInputs, "__init__", lambda self, model, way=way: init(self, model, way == "selective"))
        if way == "whole":  # the model's logits everywhere: its own scaled head rebuilds, so the check is made to fail
            monkeypatch.setattr(text_eval, "HEAD_TOLERANCE", -1.0)
        cfg = config("wiki-text", limit=3, batch_size=2, use_cache=False)
        evalsets.run(cfg, tiny_model_template, tmp_path / way)
        runs[way] = text_runs[-1]
    selective, whole = runs["selective"], runs["whole"]
    assert not selective.details["head"]["rebuilt_from_hidden_states"] and not whole.details["head"]["rebuilt_from_hidden_states"]
    assert selective.metrics == whole.metrics and selective.items == whole.items
    assert all(torch.equal(selective.tensors[name], whole.tensors[name]) for name in ("topk_ids", "topk_logprobs", "topk_residual"))
