"""The source rules of docs/architecture.md that neither ruff nor mypy checks: short functions
where the issue asks for them, keyword arguments past the fifth, every `# noqa` or
`# type: ignore` with its reason on the same line, and a note at the top of every module that
defers a heavy import. Each checker is first shown to catch a case."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("quantgate", "calibration", "quantize", "evalsets", "gates", "serving")
# Where a function may be at most MAX_FUNCTION_LINES long (docstring and comments included).
SHORT_FUNCTIONS = ("quantize/measure", "quantgate/pipeline")
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL_ARGUMENTS = 5
# Records still passed between functions as `dict[str, Any]` (issue 24: at most 60; every artifact
# that crosses a layer has its class, and a dict's fields are named by a TypedDict where its JSON
# shape is kept).
MAX_UNTYPED_RECORDS = 20  # the issue asks at most 60; held near the 17 reached
# Callees whose arguments are a sequence, not a list of parameters: rich's Table.add_row(*cells).
SEQUENCE_CALLEES = frozenset({"add_row"})
# Libraries that take seconds to import: imported inside the functions that use them, and a
# module that does so says it once, above its imports ("... are imported where used: why").
HEAVY_LIBRARIES = frozenset({"torch", "transformers", "llmcompressor", "compressed_tensors", "lm_eval", "awq",
                             "datasets", "pyarrow", "safetensors", "huggingface_hub"})
DEFERRED_NOTE = re.compile(r"^# .*\bimported where used\b", re.M)


def sources(*folders: str, root: Path = ROOT) -> dict[str, str]:
    """The text of every Python file under the folders, by its path relative to `root`."""
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
            for folder in folders for path in sorted((root / folder).rglob("*.py"))}


def long_functions(files: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    found = []
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > limit:
                    found.append(f"{name}:{node.lineno} {node.name} is {lines} lines")
    return found


def positional_calls(files: dict[str, str], limit: int = MAX_POSITIONAL_ARGUMENTS) -> list[str]:
    found = []
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            callee = node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if isinstance(node, ast.Call) and callee not in SEQUENCE_CALLEES:
                count = sum(not isinstance(argument, ast.Starred) for argument in node.args)
                if count > limit:
                    found.append(f"{name}:{node.lineno} {ast.unparse(node.func)}(...) with {count} positional arguments")
    return found


# `# noqa: F401 - why`, `# type: ignore[arg-type]  # why`: after the codes, some words.
SUPPRESSION = re.compile(r"#\s*(noqa|type:\s*ignore)\b(?P<codes>(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*|\[[a-z0-9_,\- ]+\])?)(?P<rest>.*)$")


def untyped_records(files: dict[str, str]) -> list[str]:
    """Each `dict[str, Any]` in a function's signature (a parameter's or the return annotation)."""
    found = []
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                annotations = [argument.annotation for argument in arguments if argument.annotation] + [node.returns]
                count = sum(ast.unparse(annotation).replace(" ", "").count("dict[str,Any]") for annotation in annotations if annotation)
                found += [f"{name}:{node.lineno} {node.name}"] * count
    return found


def unexplained_suppressions(files: dict[str, str]) -> list[str]:
    """Comments (real ones, not text in strings) that suppress a finding without a reason."""
    found = []
    for name, text in files.items():
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            match = SUPPRESSION.search(token.string) if token.type == tokenize.COMMENT else None
            if match and not re.search(r"[A-Za-z]{3}", match.group("rest")):
                found.append(f"{name}:{token.start[0]}: {match.group(0).strip()}")
    return found


def _deferred_heavy_imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module.split(".")[0])
    return found & HEAVY_LIBRARIES


def unannounced_deferrals(files: dict[str, str]) -> list[str]:
    """Modules that import a heavy library inside a function without the note at their top
    (before the first definition) that says which and why."""
    found = []
    for name, text in files.items():
        tree = ast.parse(text)
        deferred = _deferred_heavy_imports(tree)
        first_definition = min((node.lineno for node in tree.body if isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))), default=len(text.splitlines()) + 1)
        head = "\n".join(text.splitlines()[:first_definition - 1])
        if deferred and not DEFERRED_NOTE.search(head):
            found.append(f"{name}: defers {', '.join(sorted(deferred))} without saying so at the top")
    return found


def test_deferred_heavy_imports_are_announced(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "silent.py").write_text("def f():\n    import torch\n")
    (tmp_path / "pkg" / "said.py").write_text("# torch is imported where used: it is slow.\nimport os\n\n\ndef f():\n    import torch\n")
    (tmp_path / "pkg" / "light.py").write_text("def f():\n    import json\n")
    assert unannounced_deferrals(sources("pkg", root=tmp_path)) == ["pkg/silent.py: defers torch without saying so at the top"]
    assert unannounced_deferrals(sources(*PACKAGES)) == []


def test_checkers_catch_what_they_look_for(tmp_path: Path) -> None:
    body = "\n".join(f"    x{n} = {n}" for n in range(59))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        f"def short():\n{body}\n\n\n@decorated\ndef long():\n{body}\n\n\n"
        "f(1, 2, 3, 4, 5, *rest)\ng(1, 2, 3, 4, 5, 6)\ntable.add_row(1, 2, 3, 4, 5, 6)\n"
        "import os  # noqa: F401\nimport sys  # noqa: F401 - re-exported\nx = 1  # type: ignore[assignment]\n"
        "y = 2  # type: ignore[assignment]  # pydantic fills it\n"
        "z = '# noqa'\n"
        "def untyped(a: dict[str, Any], b: dict[str, dict[str, Any]]) -> dict[str, int]: ...\n")
    files = sources("pkg", root=tmp_path)
    assert long_functions(files) == ["pkg/mod.py:64 long is 61 lines"]
    assert positional_calls(files) == ["pkg/mod.py:127 g(...) with 6 positional arguments"]
    assert unexplained_suppressions(files) == ["pkg/mod.py:129: # noqa: F401", "pkg/mod.py:131: # type: ignore[assignment]"]
    assert untyped_records(files) == ["pkg/mod.py:134 untyped"] * 2


def test_functions_are_short_in_the_measure_stage_and_the_pipeline() -> None:
    assert long_functions(sources(*SHORT_FUNCTIONS)) == []


def test_no_call_passes_more_than_five_arguments_by_position() -> None:
    assert positional_calls(sources(*PACKAGES)) == []


def test_every_suppression_says_why() -> None:
    assert unexplained_suppressions(sources(*PACKAGES, "tests", "benchmarks")) == []


def test_records_crossing_functions_are_typed() -> None:
    found = untyped_records(sources(*PACKAGES))
    assert len(found) <= MAX_UNTYPED_RECORDS, "\n".join(found)
