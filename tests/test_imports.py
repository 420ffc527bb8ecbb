"""The layer rule of docs/architecture.md, checked on the source: every first-party import (at
module top or inside a function, relative ones resolved) goes down the layers, never sideways
or up; no two modules import each other, directly or round a longer loop; no first-party import
hides inside a function; and `import quantgate.cli` loads no heavy library.

The checker is a small AST walk written for this repository. It is tested on synthetic trees
first, so that none of its checks can pass vacuously.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The layers, bottom first. A package may import its own modules and any package of a LOWER
# rank; packages of equal rank are siblings and import neither each other nor anything above.
# The order is the pipeline's: calibrate -> quantize | measure -> evaluate -> gate -> run -> CLI.
LAYERS: dict[str, int] = {
    "quantgate.core": 0,
    "quantgate.calibration": 1,
    "quantgate.quantize": 2,
    "quantgate.quantize.measure": 2,
    "quantgate.serving": 2,
    "quantgate.evalsets": 3,
    "quantgate.gates": 4,
    "quantgate.pipeline": 5,
    "quantgate.cli": 6,
}
# The distribution's own package only groups its layers (quantgate.core, .pipeline, .cli, and the
# stage folders at the top of the repository, linked in as quantgate.calibration, ...): its
# __init__ runs before any of them, so it imports nothing first-party.
NAMESPACE = "quantgate"
# Directories at the repository root that hold no package of the distribution.
NOT_PACKAGES = frozenset({"tests", "benchmarks", "docs", "build", "dist"})

# First-party imports allowed inside a function: (module, imported module) -> why. A deferred
# import is only ever a way to dodge a cycle or an upward import, and the stage packages are
# light at import, so this list stays empty unless a reason is written next to an entry.
DEFERRED_ALLOWED: dict[tuple[str, str], str] = {}

# Libraries that cost seconds to import; the CLI must start without them.
HEAVY = ("torch", "transformers", "llmcompressor", "compressed_tensors", "lm_eval", "awq", "datasets")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the first-party module it names
    line: int
    deferred: bool  # inside a function body


# --- the checker ---------------------------------------------------------------------------------


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _walk(top: Path) -> list[Path]:
    """Every directory below `top`, through symbolic links, as the import system walks it."""
    return [Path(folder) for folder, _, _ in os.walk(top, followlinks=True)]


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of every package at the root (a directory with an __init__.py), named as it is
    imported: a folder linked into another package (quantgate/gates -> ../gates) by the link's path,
    never by its own."""
    tops = [top for top in sorted(root.iterdir())
            if top.name not in NOT_PACKAGES and not top.name.startswith(".") and (top / "__init__.py").is_file()]
    linked = {folder.resolve() for top in tops for folder in _walk(top) if folder.is_symlink()}
    modules: dict[str, Path] = {}
    for top in tops:
        if top.resolve() in linked:
            continue
        for folder in _walk(top):
            for path in sorted(folder.glob("*.py")):
                modules[module_name(root, path)] = path
    return modules


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (`from . import x` in a.b -> a)."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> set[str]:
    """The first-party modules an import statement loads, by the innermost module each name is in."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve(node, module, modules[module].name == "__init__.py")
        # `from pkg import name`: the submodule pkg.name when there is one, else an attribute of pkg.
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names] if base else []
    found = {_innermost_module(name, modules) for name in names}
    return {target for target in found if target and target != module}


def _innermost_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    inside = {id(node) for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(function) if node is not function}
    found = [Import(module, target, node.lineno, id(node) in inside)
             for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for target in _targets(node, module, modules)]
    return sorted(found, key=lambda edge: (edge.line, edge.target))


def all_imports(root: Path) -> list[Import]:
    modules = find_modules(root)
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> str | None:
    """The layer package a module belongs to: the longest entry of `layers` that contains it."""
    owners = [package for package in layers if module == package or module.startswith(package + ".")]
    return max(owners, key=len) if owners else None


def layer_violations(edges: list[Import], layers: dict[str, int] = LAYERS, namespace: str = NAMESPACE) -> list[str]:
    problems = []
    for edge in edges:
        source, target = layer_of(edge.source, layers), layer_of(edge.target, layers)
        where = f"{edge.source}:{edge.line} imports {edge.target}"
        if edge.source == namespace:
            problems.append(f"{where}: the {namespace} package itself imports nothing first-party")
        elif source is None or target is None:
            problems.append(f"{where}: {edge.source if source is None else edge.target} is in no layer")
        elif source != target and layers[target] > layers[source]:
            problems.append(f"{where}: upward ({source} is layer {layers[source]}, {target} layer {layers[target]})")
        elif source != target and layers[target] == layers[source]:
            problems.append(f"{where}: sideways ({source} and {target} are siblings in layer {layers[source]})")
    return problems


def unplaced_modules(modules: dict[str, Path], layers: dict[str, int] = LAYERS, namespace: str = NAMESPACE) -> list[str]:
    """Modules of no layer: in a new top-level package, or in a new package inside the namespace."""
    return sorted(module for module in modules if module != namespace and layer_of(module, layers) is None)


def module_cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def deferred_imports(edges: list[Import], allowed: dict[tuple[str, str], str] = DEFERRED_ALLOWED) -> list[str]:
    return [f"{edge.source}:{edge.line} imports {edge.target} inside a function" for edge in edges
            if edge.deferred and (edge.source, edge.target) not in allowed]


# --- the checker, on synthetic trees ---------------------------------------------------------------


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for name in files:  # every directory on the way is a package
        for parent in (root / name).parents:
            if parent == root:
                break
            (parent / "__init__.py").touch()
    return root


TOY_LAYERS = {"base": 0, "left": 1, "right": 1, "top": 2}


def test_checker_resolves_relative_and_deferred_imports(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        "base/util.py": "X = 1\n",
        "base/deep/__init__.py": "VALUE = 1\n",
        "base/deep/leaf.py": "from .. import util\nfrom ..util import X\nfrom . import VALUE\n",
        "top/cli.py": "import os\n\ndef main():\n    from base.deep import leaf\n    return leaf\n",
    })
    edges = all_imports(root)
    assert {(edge.source, edge.target, edge.deferred) for edge in edges} == {
        ("base.deep.leaf", "base.util", False), ("base.deep.leaf", "base.deep", False), ("top.cli", "base.deep.leaf", True),
    }
    assert deferred_imports(edges) == ["top.cli:4 imports base.deep.leaf inside a function"]
    assert deferred_imports(edges, allowed={("top.cli", "base.deep.leaf"): "a reason"}) == []


def test_checker_refuses_an_upward_import(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"base/util.py": "def f():\n    import top.cli\n", "top/cli.py": ""})
    problems = layer_violations(all_imports(root), TOY_LAYERS)
    assert problems == ["base.util:2 imports top.cli: upward (base is layer 0, top layer 2)"]


def test_checker_refuses_a_sibling_import(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"left/a.py": "from right.b import thing\n", "right/b.py": "thing = 1\n"})
    assert layer_violations(all_imports(root), TOY_LAYERS) == [
        "left.a:1 imports right.b: sideways (left and right are siblings in layer 1)",
    ]


def test_checker_refuses_a_nested_sibling_and_a_package_in_no_layer(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        "left/__init__.py": "NAME = 1\n", "left/x.py": "", "left/sub/m.py": "from left import x\nfrom left import NAME\n",
        "stray/s.py": "import left.x\n",
    })
    layers = {**TOY_LAYERS, "left.sub": 1}
    assert layer_violations(all_imports(root), layers) == [
        "left.sub.m:1 imports left.x: sideways (left.sub and left are siblings in layer 1)",
        "left.sub.m:2 imports left: sideways (left.sub and left are siblings in layer 1)",
        "stray.s:1 imports left.x: stray.s is in no layer",
    ]


def test_checker_finds_cycles_between_modules(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {
        "base/a.py": "from base import b\n",
        "base/b.py": "def f():\n    from base.c import y\n",
        "base/c.py": "from base.a import z\n",
        "base/d.py": "from base import a\n",
    })
    assert module_cycles(all_imports(root)) == [["base.a", "base.b", "base.c"]]
    assert layer_violations(all_imports(root), TOY_LAYERS) == []  # one package: only the cycle check sees it


def test_checker_finds_packages_without_a_layer(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"ns/core/a.py": "", "ns/extra/b.py": "", "ns/loose.py": "", "stray/c.py": ""})
    (root / "scripts").mkdir()
    (root / "scripts" / "tool.py").write_text("import stray\n")  # not a package: no __init__.py
    assert unplaced_modules(find_modules(root), {"ns.core": 0}, namespace="ns") == [
        "ns.extra", "ns.extra.b", "ns.loose", "stray", "stray.c",
    ]


def test_checker_names_a_linked_folder_by_its_link(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"ns/core/a.py": "", "stage/deep/b.py": "from ns.stage.deep import c\n", "stage/deep/c.py": ""})
    (root / "ns" / "stage").symlink_to(Path("..") / "stage")
    assert sorted(find_modules(root)) == ["ns", "ns.core", "ns.core.a", "ns.stage", "ns.stage.deep", "ns.stage.deep.b",
                                          "ns.stage.deep.c"]
    assert [(edge.source, edge.target) for edge in all_imports(root)] == [("ns.stage.deep.b", "ns.stage.deep.c")]


def test_checker_refuses_imports_in_the_namespace_package(tmp_path: Path) -> None:
    root = make_tree(tmp_path, {"ns/__init__.py": "from ns.core import x\n", "ns/core/x.py": ""})
    assert layer_violations(all_imports(root), {"ns.core": 0}, namespace="ns") == [
        "ns:1 imports ns.core.x: the ns package itself imports nothing first-party",
    ]


# --- the rule, on this repository ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo_imports() -> list[Import]:
    return all_imports(ROOT)


def test_every_package_has_a_layer() -> None:
    """A new top-level package, or a new package inside quantgate/, must be placed in LAYERS."""
    modules = find_modules(ROOT)
    tops = {module.split(".")[0] for module in modules}
    assert tops == {NAMESPACE}, "every package imports as quantgate.*: link a new stage folder in as quantgate/<name>"
    assert unplaced_modules(modules) == [], "add these modules' packages to LAYERS (and to docs/architecture.md)"
    assert all(any(layer_of(module) == layer for module in modules) for layer in LAYERS), "a layer names no package"


def test_imports_only_go_down_the_layers(repo_imports: list[Import]) -> None:
    assert layer_violations(repo_imports) == []


def test_no_import_cycles_between_modules(repo_imports: list[Import]) -> None:
    assert module_cycles(repo_imports) == []


def test_no_first_party_import_inside_a_function(repo_imports: list[Import]) -> None:
    assert deferred_imports(repo_imports) == []
    stale = [pair for pair in DEFERRED_ALLOWED if not any((edge.source, edge.target) == pair and edge.deferred for edge in repo_imports)]
    assert stale == [], "allowed deferred imports that no longer exist"


def _heavy_loaded_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.splitlines()[-1])


def test_importing_the_cli_loads_no_heavy_library() -> None:
    assert _heavy_loaded_after("import quantgate.cli") == []


def test_help_runs_without_a_heavy_library() -> None:
    """`quantgate --help` prints the commands and loads nothing heavy (its time: benchmarks/cli_startup.py)."""
    code = ("from contextlib import redirect_stdout\nimport io\nfrom quantgate.cli import main\nsys.argv = ['quantgate', '--help']\n"
            "out = io.StringIO()\ntry:\n    with redirect_stdout(out):\n        main()\nexcept SystemExit as exit_:\n"
            "    assert exit_.code in (0, None), exit_.code\nassert 'calibrate' in out.getvalue() and 'run' in out.getvalue()")
    assert _heavy_loaded_after(code) == []


def test_stage_folders_install_under_the_namespace() -> None:
    """The design card's folders stay at the top of the repository and install as quantgate.<stage>
    (pyproject's package-dir); each is linked in as quantgate/<stage>, so that a checkout (python,
    mypy, pytest) resolves the same names as an installed wheel. Nothing installs a top-level stage."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    with open(ROOT / "pyproject.toml", "rb") as handle:
        setuptools = tomllib.load(handle)["tool"]["setuptools"]
    mapped = setuptools["package-dir"]
    stages = {top.name for top in ROOT.iterdir() if (top / "__init__.py").is_file() and top.name != NAMESPACE
              and top.name not in NOT_PACKAGES}
    assert mapped == {f"{NAMESPACE}.{stage}": stage for stage in stages}
    for stage in stages:
        link = ROOT / NAMESPACE / stage
        assert link.is_symlink() and link.resolve() == (ROOT / stage).resolve(), f"{link} should link to ../{stage}"
    assert setuptools["packages"]["find"]["include"] == [f"{NAMESPACE}*"]
    assert set(setuptools["package-data"]) <= set(find_modules(ROOT))


def test_installed_names_are_under_the_namespace_only(tmp_path: Path) -> None:
    """Outside a checkout (no stage folder on the path), `import gates` fails and
    `import quantgate.gates` works: nothing installs a top-level stage name."""
    code = ("import importlib.util, json\n"
            "print(json.dumps({name: importlib.util.find_spec(name) is not None for name in "
            "('gates', 'serving', 'quantize', 'evalsets', 'calibration', 'quantgate.gates', 'quantgate.serving')}))")
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(found.stdout) == {"gates": False, "serving": False, "quantize": False, "evalsets": False, "calibration": False,
                                        "quantgate.gates": True, "quantgate.serving": True}


def test_the_wheel_holds_only_the_namespace(tmp_path: Path) -> None:
    """The wheel a user installs: every file under quantgate/ (the stage folders mapped in, their
    data with them) or its metadata; no top-level stage package."""
    import shutil
    import zipfile

    # built from a copy (links kept as links), so that setuptools' build/ stays out of the checkout
    source = tmp_path / "source"
    source.mkdir()
    packages = {top.name for top in ROOT.iterdir() if (top / "__init__.py").is_file() and top.name not in NOT_PACKAGES}
    for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE", *sorted(packages)):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif (ROOT / name).is_file():
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "--quiet",
                            "--wheel-dir", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("quantgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {NAMESPACE, next(top for top in tops if top.endswith(".dist-info"))}, sorted(tops)
    for expected in ("quantgate/gates/verdict.py", "quantgate/serving/worker.py", "quantgate/quantize/measure/hardware/h200.yaml",
                     "quantgate/gates/policies/small-model/v4.yaml", "quantgate/pipeline/plans/demo.yaml"):
        assert expected in names, expected
