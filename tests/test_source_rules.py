"""The source rules of docs/architecture.md that neither ruff nor mypy checks: short functions
where the issue asks for them, keyword arguments past the fifth, and every `# noqa` or
`# type: ignore` with its reason on the same line. Each checker is first shown to catch a case."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("quantgate", "calibration", "quantize", "evalsets", "gates")
# Where a function may be at most MAX_FUNCTION_LINES long (docstring and comments included).
SHORT_FUNCTIONS = ("quantize/measure", "quantgate/pipeline")
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL_ARGUMENTS = 5
# Callees whose arguments are a sequence, not a list of parameters: rich's Table.add_row(*cells).
SEQUENCE_CALLEES = frozenset({"add_row"})


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


def unexplained_suppressions(files: dict[str, str]) -> list[str]:
    """Comments (real ones, not text in strings) that suppress a finding without a reason."""
    found = []
    for name, text in files.items():
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            match = SUPPRESSION.search(token.string) if token.type == tokenize.COMMENT else None
            if match and not re.search(r"[A-Za-z]{3}", match.group("rest")):
                found.append(f"{name}:{token.start[0]}: {match.group(0).strip()}")
    return found


def test_checkers_catch_what_they_look_for(tmp_path: Path) -> None:
    body = "\n".join(f"    x{n} = {n}" for n in range(59))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        f"def short():\n{body}\n\n\n@decorated\ndef long():\n{body}\n\n\n"
        "f(1, 2, 3, 4, 5, *rest)\ng(1, 2, 3, 4, 5, 6)\ntable.add_row(1, 2, 3, 4, 5, 6)\n"
        "import os  # noqa: F401\nimport sys  # noqa: F401 - re-exported\nx = 1  # type: ignore[assignment]\n"
        "y = 2  # type: ignore[assignment]  # pydantic fills it\n"
        "z = '# noqa'\n")
    files = sources("pkg", root=tmp_path)
    assert long_functions(files) == ["pkg/mod.py:64 long is 61 lines"]
    assert positional_calls(files) == ["pkg/mod.py:127 g(...) with 6 positional arguments"]
    assert unexplained_suppressions(files) == ["pkg/mod.py:129: # noqa: F401", "pkg/mod.py:131: # type: ignore[assignment]"]


def test_functions_are_short_in_the_measure_stage_and_the_pipeline() -> None:
    assert long_functions(sources(*SHORT_FUNCTIONS)) == []


def test_no_call_passes_more_than_five_arguments_by_position() -> None:
    assert positional_calls(sources(*PACKAGES)) == []


def test_every_suppression_says_why() -> None:
    assert unexplained_suppressions(sources(*PACKAGES, "tests", "benchmarks")) == []
