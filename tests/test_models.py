"""Resolving baseline models: local directories, demo names, hub ids, and pickle refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantgate import calibration
from quantgate.core.errors import ModelError
from quantgate.core.models import check_model_dir, pull, quantgate_home, resolve_model


def test_local_directory_resolves_to_itself(tiny_model: Path) -> None:
    assert resolve_model(str(tiny_model)) == tiny_model


def test_pickle_only_weights_are_refused_unless_allowed(tiny_model: Path) -> None:
    (tiny_model / "model.safetensors").rename(tiny_model / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pickle files .*pytorch_model.bin.*--allow-pickle"):
        resolve_model(str(tiny_model))
    assert resolve_model(str(tiny_model), allow_pickle=True) == tiny_model


def test_directory_without_weights_or_config_is_refused(tiny_model: Path) -> None:
    (tiny_model / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no weight files"):
        check_model_dir(tiny_model)
    (tiny_model / "config.json").unlink()
    with pytest.raises(ModelError, match="no config.json"):
        check_model_dir(tiny_model)


def test_demo_model_not_pulled_says_how_to_pull() -> None:
    with pytest.raises(ModelError, match="quantgate models pull smollm2-135m"):
        resolve_model("smollm2-135m")


def test_unknown_demo_model_suggests_the_known_one() -> None:
    with pytest.raises(ModelError, match="did you mean 'smollm2-135m'"):
        pull("smollm2-135")


def test_hub_id_without_a_reachable_hub_fails_in_one_line() -> None:
    with pytest.raises(ModelError, match="could not fetch someorg/some-model from the hub"):
        resolve_model("someorg/some-model")


def test_cache_directory_follows_quantgate_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTGATE_HOME", str(tmp_path / "home"))
    assert quantgate_home() == tmp_path / "home"
    monkeypatch.delenv("QUANTGATE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert quantgate_home() == tmp_path / "xdg" / "quantgate"


def test_tokenizer_code_is_never_trusted_implicitly(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    seen = {}
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen["trust_remote_code"] = kwargs.get("trust_remote_code")
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    cfg = calibration.CalibrationConfig(model=str(tiny_model), source="demo", samples=2, seq_len=16)
    calibration.run(cfg, tmp_path / "set")
    assert seen["trust_remote_code"] is False
