"""The nightly-size fuzz campaign: the properties of tests/test_fuzz.py (tests/fuzzing.py holds the
readers and mutations) with many more inputs per reader.

    .venv/bin/python benchmarks/fuzz_campaign.py --minutes 5
    .venv/bin/python benchmarks/fuzz_campaign.py --examples-per-reader 2000 --reader plan --seed 7

Each reader runs in a child process of its own (one sandbox, one tiny model, the CLI driven in
that process), so an input that kills its process (a fatal signal, memory) is a failure of that
reader, not the end of the campaign. Per reader it prints the inputs tried and the failures
found; each failure's input is kept under --keep as a reproducer: the
file's bytes, what mutation made it, and the command that reads it.

Property: every input ends in exit 0 with a correct result (1 where that is a verdict) or exit 2
with exactly one line on stderr; never a traceback (exit 3), a hang, or a file written outside
the command's output. Exit code: 0 when no failure was found, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class TimeUp(BaseException):
    """The reader's share of the campaign is spent (a BaseException: hypothesis stops, never shrinks)."""


def worker(index: int, examples: int, seconds: float, seed: int, progress: Path, keep: Path) -> None:
    """Run one reader's campaign in this process, appending a JSON line to `progress` before and
    after each input (a process killed mid-input leaves its last 'trying' line)."""
    from hypothesis import HealthCheck, given, settings

    from tests.fuzzing import Mutation, Sandbox, check, environment, mutations, preflight_only, readers

    reader = readers()[index]
    deadline = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix="quantgate-fuzz-") as root:
        sandbox = Sandbox(Path(root))
        with environment(sandbox):
            valid = reader.setup(sandbox)
        tried = 0

        def log(record: dict[str, object]) -> None:
            with open(progress, "a", encoding="utf-8") as stream:
                stream.write(json.dumps(record) + "\n")

        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(mutation=mutations(valid, reader.format))
        def campaign(mutation: Mutation) -> None:
            nonlocal tried
            if time.monotonic() > deadline:
                raise TimeUp
            tried += 1
            saved = keep / _slug(reader.name) / f"{seed}-{tried}.bin"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_bytes(mutation.data)
            log({"trying": tried, "input": str(saved), "how": mutation.describe()[:300], "outside": mutation.outside})
            try:
                with preflight_only():
                    failure = check(reader, sandbox, mutation)
            except Exception as error:  # noqa: BLE001 - the harness's own error (the CLI's are its exit 3): kept as a failure
                failure = f"harness error {type(error).__name__}: {error}"
            if failure is None:
                saved.unlink()
            else:
                saved.with_suffix(".txt").write_text(
                    f"reader: {reader.name}\nmutation: {mutation.describe()}\nsymlink outside: {mutation.outside}\n"
                    f"written to: {reader.target(sandbox).relative_to(sandbox.root)} of the sandbox\n"
                    f"command: quantgate {' '.join(reader.args(sandbox))}\nfailure: {failure}\n", encoding="utf-8")
            log({"done": tried, "failure": failure, "input": str(saved) if failure else None})

        import hypothesis

        campaign = hypothesis.seed(seed)(campaign)
        try:
            campaign()
        except TimeUp:
            pass


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def run_reader(index: int, name: str, args: argparse.Namespace, seconds: float) -> dict[str, object]:
    """One reader's campaign in a child process; what its progress file says."""
    progress = Path(tempfile.mkstemp(prefix="fuzz-progress-", suffix=".jsonl")[1])
    command = [sys.executable, __file__, "--worker", str(index), "--examples-per-reader", str(args.examples_per_reader),
               "--seed", str(args.seed), "--keep", str(args.keep), "--progress", str(progress), "--seconds", str(seconds)]
    started = time.monotonic()
    child = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds + 600)
    records = [json.loads(line) for line in progress.read_text(encoding="utf-8").splitlines() if line.strip()]
    progress.unlink()
    done = [record for record in records if "done" in record]
    failures = [(record["failure"], record["input"]) for record in done if record["failure"]]
    last = records[-1] if records else None
    if child.returncode != 0:
        if last is not None and "trying" in last:  # killed in the middle of an input
            failures.append((f"the process died (exit {child.returncode}) on this input", last["input"]))
        else:
            log = args.keep / f"{_slug(name)}-{args.seed}.stderr.txt"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(child.stderr or "", encoding="utf-8")
            errors = [line for line in (child.stderr or "").splitlines() if line[:1].isalpha() and ("Error" in line or "Exception" in line)]
            failures.append((f"the campaign process failed (exit {child.returncode}): {errors[-1] if errors else ''}", str(log)))
    return {"reader": name, "tried": len(done) + (1 if last is not None and "trying" in last else 0),
            "failures": failures, "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples-per-reader", type=int, default=100_000, help="inputs per reader at most")
    parser.add_argument("--minutes", type=float, default=10.0, help="the whole campaign's time, shared by the readers")
    parser.add_argument("--reader", action="append", help="only readers whose name contains this; repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=Path(tempfile.gettempdir()) / "quantgate-fuzz-failures",
                        help="where failing inputs are kept (default: quantgate-fuzz-failures in the temporary directory)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.keep = args.keep.absolute()
    if args.worker is not None:
        worker(args.worker, args.examples_per_reader, args.seconds, args.seed, args.progress, args.keep)
        return

    from tests.fuzzing import readers

    chosen = [(index, reader.name) for index, reader in enumerate(readers())
              if not args.reader or any(part.lower() in reader.name.lower() for part in args.reader)]
    if not chosen:
        parser.error("no reader matches --reader")
    share = args.minutes * 60 / len(chosen)
    print(f"fuzz campaign: {len(chosen)} readers, {share:.0f} s each (incl. setup), at most {args.examples_per_reader} inputs each, "
          f"seed {args.seed}", flush=True)
    results = []
    for index, name in chosen:
        result = run_reader(index, name, args, share)
        results.append(result)
        failures = result["failures"]
        assert isinstance(failures, list)
        kinds = Counter(str(failure).splitlines()[0][:120] for failure, _ in failures)
        print(f"{name:58} {result['tried']:>7} inputs  {len(failures):>4} failures  ({result['seconds']:.0f} s)", flush=True)
        for kind, count in kinds.most_common(5):
            example = next(path for failure, path in failures if str(failure).splitlines()[0][:120] == kind)
            print(f"    {count:>4} x {kind}\n           reproducer: {example}", flush=True)
    total = sum(int(str(result["tried"])) for result in results)
    failed = sum(len(result["failures"]) for result in results)  # type: ignore[arg-type,misc]  # a list, built above
    print(f"total: {total} inputs over {len(results)} readers, {failed} failures")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
