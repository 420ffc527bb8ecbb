from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from quantgate import calibration, quantize, serving
from quantgate.cli import main
from quantgate.core import memory
from quantgate.core.models import pull
from quantgate.evalsets import served as serve_check
from tests.factories import build_tiny_llama

# `make test` runs the suite in two pytest-xdist workers, each test file whole in one worker, so
# that a module's fixtures (a Ray cluster, a served model) are made once; the files that use the
# real demo model's session fixtures all go to one worker, so that its four quantized checkpoints
# (about 90 s) are made once, not by both workers at once. By file name, since the scheduler sees
# node ids only (xdist's own `xdist_group` rewrites node ids, which pytest 9 no longer lets it do);
# the collection check below keeps the list true.
DEMO_FIXTURES = frozenset({"demo_model", "demo_calibration", "demo_checkpoints"})
DEMO_FILES = frozenset({"test_concurrency.py", "test_demo_model.py", "test_evaluate_demo.py", "test_measure_demo.py",
                        "test_models.py", "test_pipeline_demo.py", "test_placement_demo.py", "test_quantize_demo.py"})


def scope_of(nodeid: str) -> str:
    """The group a test runs in: its file, or "demo-model" for the demo model's files."""
    path = nodeid.split("::", 1)[0]
    return "demo-model" if Path(path).name in DEMO_FILES else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: not called without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        """A file's tests to one worker; the demo model's files to the same one."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ByFile(config, log)


# The longest groups first, so that neither worker is left with one at the end: the demo model's
# files, then the Ray cluster's.
FIRST = ("demo-model", "tests/test_ray.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unlisted = sorted({item.path.name for item in items if DEMO_FIXTURES & set(getattr(item, "fixturenames", ()))} - DEMO_FILES)
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(unlisted)} to DEMO_FILES (it uses the demo model's fixtures)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        def rank(item: pytest.Item) -> int:
            scope = scope_of(item.nodeid)
            return FIRST.index(scope) if scope in FIRST else len(FIRST)

        items.sort(key=rank)  # stable: each file's own order is kept


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one thread of torch each (and in what they start), as two
    # threads each would spin on cores the other worker needs.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Never touch the user's cache or a hub: each test sees its own QUANTGATE_HOME, offline."""
    home = tmp_path_factory.mktemp("quantgate-home")
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture(autouse=True)
def serve_memory_unchecked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The serve check's memory check (evalsets.served: vLLM's CPU worker against what this
    process may use) passes, but in tests marked `serve_memory`: a test of a fake or a tiny
    worker must not turn pending on a machine that happens to have little memory free."""
    if request.node.get_closest_marker("serve_memory") is None:
        monkeypatch.setattr(serve_check, "memory_short", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True)
def nothing_preloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory estimates as a fresh process makes them: what an earlier test's run preloaded in
    this worker (pipeline.executor.preload, core.memory.note_preloaded) is not taken off them."""
    monkeypatch.setitem(memory._preloaded, "bytes", 0)


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
