"""Two run directories of the same plan, compared: what differs in their report.json, their
verdicts and their checkpoints once times, durations and the run directories' own paths are set
aside. Made to check a refactor that must not change a run's outcome (issue 24: the demo's
report.json before and after, on the same machine and cache).

    .venv/bin/python benchmarks/compare_runs.py BEFORE_RUN_DIR AFTER_RUN_DIR [--show 40]

Prints every differing JSON path (at most --show of them) per file, and exits 1 when anything
but the ignored fields differs, 0 when nothing does. Ignored: any key naming a time or a duration
(`time`, `created_at`, `seconds`, `*_seconds`, `*_s`, `elapsed`, `wall_seconds`, `started`,
`finished`), `peak_memory_bytes`, and the run directory's absolute path (and its parent's, the
checkout a `make demo` runs in) inside strings.
Reported apart and not counted: what was measured on the machine at the moment, not of the
checkpoint (decode rates and copy bandwidth, the measured recommendation they decide, the text
that quotes them), and the hashes over records that hold times (a stage's `key` hashes its
inputs' manifests, which record when they were made; `value_sha256` its value, times included).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

TIME_KEYS = re.compile(r"^(time|created_at|date|started|finished|elapsed|seconds|wall_seconds|peak_memory_bytes|load_average"
                       r"|.*_seconds|.*_s|seconds_.*)$")
MEASURED_KEYS = re.compile(r"^(tokens_per_s|.*tokens_per_s|bytes_per_second|bandwidth_bytes_per_s|median_seconds|forward_seconds"
                           r"|first_token_seconds|best_seconds|load_seconds|probe_limit_seconds|speedup.*"
                           r"|measured_recommendation|measured|bytes_moved)$")
# Text that quotes measured rates: the report's serving note, a stage line's detail (and a table's
# cells under a `tokens/s` header: `_measured_cells`).
MEASURED_TEXT = re.compile(r"(\.serving_section\.note|\.stages\[\d+\]\.detail)$")
DERIVED_HASHES = frozenset({"key", "value_sha256", "manifest_sha256", "results_sha256", "record_hash", "prev_hash"})


def differences(before: object, after: object, path: str, roots: tuple[str, str], measured: list[str]) -> list[str]:
    """The JSON paths where `before` and `after` differ, times and the run directories' paths aside;
    differences in measured rates are appended to `measured` instead."""
    if MEASURED_TEXT.search(path):
        if before != after:
            measured.append(path)
        return []
    if isinstance(before, dict) and isinstance(after, dict):
        before, after = _measured_cells(before, after, path, measured)
        found: list[str] = []
        for key in sorted(set(before) | set(after)):
            where = f"{path}.{key}"
            if TIME_KEYS.match(str(key)) and not MEASURED_KEYS.match(str(key)):
                continue
            if key not in before or key not in after:
                found.append(f"{where}: only in {'after' if key not in before else 'before'}")
                continue
            if MEASURED_KEYS.match(str(key)) or str(key) in DERIVED_HASHES:
                if before[key] != after[key]:
                    measured.append(where)
                continue
            found += differences(before[key], after[key], where, roots, measured)
        return found
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            return [f"{path}: {len(before)} items before, {len(after)} after"]
        return [line for index, (one, two) in enumerate(zip(before, after, strict=True))
                for line in differences(one, two, f"{path}[{index}]", roots, measured)]
    if isinstance(before, str) and isinstance(after, str):
        for root, mark in ((roots[0], "RUN"), (str(Path(roots[0]).parent), "CHECKOUT")):
            before = before.replace(root, mark)
        for root, mark in ((roots[1], "RUN"), (str(Path(roots[1]).parent), "CHECKOUT")):
            after = after.replace(root, mark)
    return [] if before == after else [f"{path}: {_short(before)} -> {_short(after)}"]


def _measured_cells(before: dict[str, Any], after: dict[str, Any], path: str,
                    measured: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A table ({header, rows}: a row its cells, or {cells}) without its columns of measured rates
    (a header that names tokens/s); where those cells differ, their place goes to `measured`."""
    header = before.get("header")
    if not (isinstance(header, list) and header == after.get("header") and isinstance(before.get("rows"), list)
            and isinstance(after.get("rows"), list) and len(before["rows"]) == len(after["rows"])):
        return before, after
    rates = {index for index, name in enumerate(header) if "tokens/s" in str(name)}
    if not rates:
        return before, after

    def cells(row: object) -> list[Any]:
        found = row.get("cells") if isinstance(row, dict) else row
        return found if isinstance(found, list) else []

    def kept(row: object) -> object:
        left = [cell for index, cell in enumerate(cells(row)) if index not in rates]
        return {**row, "cells": left} if isinstance(row, dict) else left

    for number, (one, two) in enumerate(zip(before["rows"], after["rows"], strict=True)):
        measured += [f"{path}.rows[{number}].cells[{index}]" for index in sorted(rates)
                     if index < min(len(cells(one)), len(cells(two))) and cells(one)[index] != cells(two)[index]]
    return ({**before, "rows": [kept(row) for row in before["rows"]]},
            {**after, "rows": [kept(row) for row in after["rows"]]})


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def compared_files(before: Path, after: Path) -> list[str]:
    """The files of the run compared: the report's JSON, run.json, each verdict, each checkpoint's manifest."""
    names = {"report/report.json", "run.json"}
    for root in (before, after):
        names |= {str(path.relative_to(root)) for pattern in ("verdicts/*.json", "checkpoints/*/manifest.json", "measure/*.json")
                  for path in root.glob(pattern)}
    return sorted(names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--show", type=int, default=40, help="differing paths shown per file")
    arguments = parser.parse_args()
    roots = (str(arguments.before.resolve()), str(arguments.after.resolve()))
    differing = 0
    for name in compared_files(arguments.before, arguments.after):
        one, two = arguments.before / name, arguments.after / name
        if not (one.is_file() and two.is_file()):
            print(f"{name}: only in {'after' if two.is_file() else 'before'}")
            differing += 1
            continue
        measured: list[str] = []
        found = differences(json.loads(one.read_text()), json.loads(two.read_text()), "", roots, measured)
        differing += bool(found)
        status = "differs" if found else "same"
        apart = f" (measured rates, or hashes over times, differ at: {', '.join(measured)})" if measured else ""
        print(f"{name}: {status}{apart}")
        for line in found[:arguments.show]:
            print(f"    {line}")
        if len(found) > arguments.show:
            print(f"    ... and {len(found) - arguments.show} more")
    print(f"{differing} file(s) differ beyond times, paths and measured rates")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
