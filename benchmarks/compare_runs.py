"""Two run directories of the same plan, compared: what differs in their report.json, their
verdicts and their checkpoints once times, durations and the run directories' own paths are set
aside. Made to check a refactor that must not change a run's outcome (issue 24: the demo's
report.json before and after, on the same machine and cache).

    .venv/bin/python benchmarks/compare_runs.py BEFORE_RUN_DIR AFTER_RUN_DIR [--show 40]

Prints every differing JSON path (at most --show of them) per file, and exits 1 when anything
but the ignored fields differs, 0 when nothing does. Ignored: any key naming a time or a duration
(`time`, `created_at`, `seconds`, `*_seconds`, `*_s`, `elapsed`, `wall_seconds`, `started`,
`finished`), `peak_memory_bytes`, and the run directory's absolute path inside strings; decode
rates measured on the machine (`tokens_per_s`) are reported separately, not counted (they are
measurements of the moment, not of the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TIME_KEYS = re.compile(r"^(time|created_at|date|started|finished|elapsed|seconds|wall_seconds|peak_memory_bytes|load_average"
                       r"|.*_seconds|.*_s|seconds_.*)$")
MEASURED_KEYS = re.compile(r"^(tokens_per_s|.*tokens_per_s|bytes_per_second|bandwidth_bytes_per_s|median_seconds|forward_seconds"
                           r"|first_token_seconds|best_seconds|load_seconds|probe_limit_seconds|speedup.*)$")


def differences(before: object, after: object, path: str, roots: tuple[str, str], measured: list[str]) -> list[str]:
    """The JSON paths where `before` and `after` differ, times and the run directories' paths aside;
    differences in measured rates are appended to `measured` instead."""
    if isinstance(before, dict) and isinstance(after, dict):
        found: list[str] = []
        for key in sorted(set(before) | set(after)):
            where = f"{path}.{key}"
            if TIME_KEYS.match(str(key)):
                continue
            if key not in before or key not in after:
                found.append(f"{where}: only in {'after' if key not in before else 'before'}")
                continue
            if MEASURED_KEYS.match(str(key)):
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
        before, after = before.replace(roots[0], "RUN"), after.replace(roots[1], "RUN")
    return [] if before == after else [f"{path}: {_short(before)} -> {_short(after)}"]


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
        print(f"{name}: {status}" + (f" (measured rates differ at {len(measured)} places, not counted)" if measured else ""))
        for line in found[:arguments.show]:
            print(f"    {line}")
        if len(found) > arguments.show:
            print(f"    ... and {len(found) - arguments.show} more")
    print(f"{differing} file(s) differ beyond times, paths and measured rates")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
