from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from quantgate import calibration, quantize, serving
from quantgate.cli import main
from quantgate.core.models import pull
from tests.factories import build_tiny_llama


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Never touch the user's cache or a hub: each test sees its own QUANTGATE_HOME, offline."""
    home = tmp_path_factory.mktemp("quantgate-home")
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


# Where this machine's serving environment (vLLM) is built: the real cache home's, found at import,
# before `isolated_home` points QUANTGATE_HOME at a test's own (which never holds one).
SERVING_ROOT = serving.environment.default_root()


@pytest.fixture(scope="session")
def serving_env() -> serving.ServingEnv:
    """The serving environment, built at SERVING_ROOT first if it is missing (about two minutes and
    a package registry, once per machine; `serving.setup` does nothing when it is built)."""
    env, _ = serving.setup(root=SERVING_ROOT)
    return env


@pytest.fixture
def served(serving_env: serving.ServingEnv, monkeypatch: pytest.MonkeyPatch) -> serving.ServingEnv:
    """The serving environment, found by the code under test: $QUANTGATE_SERVING_PYTHON names its
    python for this test (`serving.find` then ignores the test's empty QUANTGATE_HOME)."""
    monkeypatch.setenv(serving.environment.PYTHON_ENV, str(serving_env.python))
    return serving_env


@pytest.fixture(scope="session")
def tiny_model_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
def tiny_model(tiny_model_template: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model, so a test may damage it."""
    return Path(shutil.copytree(tiny_model_template, tmp_path / "tiny-llama"))


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """Run `quantgate ARGS...` in-process through the real entry point; return code and output."""
    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["quantgate", *map(str, args)])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="session")
def quant_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama shaped like the demo model where it matters for quantization: hidden
    size 192 (not a multiple of 128, like 576) and intermediate size 512 (a multiple)."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("quant") / "tiny-192",
        hidden_size=192, intermediate_size=512, heads=3, kv_heads=1, layers=2,
    )


@pytest.fixture(scope="session")
def quant_calibration(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quant-calibration") / "calib"
    calibration.run(calibration.CalibrationConfig(model=str(quant_model), source="demo", samples=16, seq_len=64), out)
    return out


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory):
    """The real demo model, pulled once per test session into its own cache."""
    home = tmp_path_factory.mktemp("demo-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(home))
        return pull("smollm2-135m")


DEMO_FORMATS = ("gptq-int4", "awq-int4", "smoothquant-w8a8", "fp8-e4m3")


@pytest.fixture(scope="session")
def demo_calibration(demo_model, tmp_path_factory: pytest.TempPathFactory):
    """A small calibration set (4 x 256 tokens) for the demo model: the four formats' quantization
    (GPTQ's and SmoothQuant's layer passes, AWQ's grid) costs in proportion to it; the demo itself
    calibrates on 16 x 256."""
    out = tmp_path_factory.mktemp("demo-calibration") / "calib"
    return calibration.run(calibration.CalibrationConfig(model=str(demo_model.path), source="demo", samples=4, seq_len=256), out)


@pytest.fixture(scope="session")
def demo_checkpoints(demo_model, demo_calibration, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model in each of the four formats, made once per test session."""
    root = tmp_path_factory.mktemp("demo-checkpoints")
    # AWQ's scale search runs the model once per grid point: 5 points instead of 20 keep the
    # suite in budget on 2 cores (a coarser search, still AWQ).
    knobs = {"awq-int4": {"awq_n_grid": 5}}
    return {name: quantize.run(quantize.QuantizeConfig(format=name, **knobs.get(name, {})), demo_model.path,
                               demo_calibration.path, root / name).path
            for name in DEMO_FORMATS}
