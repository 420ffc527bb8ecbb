"""Crash anywhere, resume (bounded; benchmarks/kill_campaign.py is the long campaign): `quantgate
run` SIGKILLed inside a write (the testing hook `QUANTGATE_FAULT_KILL_AT_WRITE`), in time, and
on a full disk; the resumed run must leave what an uninterrupted run leaves: the same verdicts,
per-item results and ledger records (but their times), a ledger that verifies without
duplicates, no temporary and no lock."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate.core import artifacts
from quantgate.gates import ledger as ledger_module
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import plan_mapping

TEMPORARY = re.compile(r"^\..+\.(partial|old)-[A-Za-z0-9_-]+$")
# what differs between two runs' ledgers: times, the chain, the signature (a random ECDSA nonce, each
# home's own key), the verdict's hash (over the checkpoint's file manifest: see _same_files) and the
# results' manifests' hashes (a manifest holds the times of the run that wrote it)
UNCHAINED = ("time", "record_hash", "prev_hash", "signature", "verdict_sha256", "results_sha256")


def small_plan(model: Path, root: Path) -> dict[str, Any]:
    """The cheapest plan with every stage: one format, one set, a small calibration set."""
    return plan_mapping(model, root, formats=["fp8-e4m3"], narrow_policy=["wiki-text"], evaluation={"sets": ["wiki-text"], "items": 4},
                        calibration={"samples": 4, "seq_len": 32})


def _same_files(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its checkpoint's file manifest: the checkpoint's manifest.json holds the
    times of the run that made it (the weights, compared, do not)."""
    checkpoint = record.get("checkpoint")
    return {**record, "checkpoint": {key: value for key, value in checkpoint.items() if key != "files"}} \
        if isinstance(checkpoint, dict) else record


def snapshot(out: Path) -> dict[str, Any]:
    verdicts = {path.stem: _same_files(json.loads(path.read_text())["value"]) for path in sorted((out / "verdicts").glob("*.json"))}
    items = {str(path.relative_to(out)): json.loads(path.read_text())["items"]
             for folder in ("results", "baselines") for path in sorted((out / folder).glob("*/*/items.json"))}
    ledger = [_same_files({key: value for key, value in json.loads(line).items() if key not in UNCHAINED})
              for line in (out / "ledger.jsonl").read_text().splitlines()]
    return {"verdicts": verdicts, "items": items, "ledger": ledger, "status": json.loads((out / "run.json").read_text())["status"]}


def assert_whole(out: Path, home: Path) -> None:
    """No temporary or lock left; every JSON whole; a ledger that verifies, without duplicates."""
    left = [path for base in (out, home) for path in base.rglob(".*") if TEMPORARY.match(path.name)]
    assert left == [] and not (out / ".lock").exists()
    for path in out.rglob("*.json"):
        json.loads(path.read_text())
    records = ledger_module.read(out / "ledger.jsonl")
    assert len({record.verdict_sha256 for record in records}) == len(records)


class Crash:
    """The plan, the uninterrupted run's snapshot and its writes; each test crashes its own run
    at the same path (so paths in records compare), with its own $QUANTGATE_HOME."""

    def __init__(self, root: Path, reference: dict[str, Any], writes: list[str]) -> None:
        self.root, self.reference, self.writes = root, reference, writes
        self.out, self.plan = root / "run", root / "plan.yaml"

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-c", "from quantgate.cli import main; main()", "run", str(self.plan), *extra]

    def resume_and_compare(self) -> None:
        home = Path(os.environ["QUANTGATE_HOME"])
        result = pipeline.run(from_mapping(yaml.safe_load(self.plan.read_text())), show_progress=False)
        assert result.exit_code == 0
        assert snapshot(self.out) == self.reference
        assert_whole(self.out, home)


@pytest.fixture(scope="module")
def crash(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Crash:
    """One uninterrupted run, its atomic writes numbered (QUANTGATE_FAULT_WRITE_LOG); its run
    directory moved aside, so that each test runs at the same path from nothing."""
    root = tmp_path_factory.mktemp("crash")
    plan = root / "plan.yaml"
    plan.write_text(yaml.safe_dump(small_plan(quant_model, root)))
    log = root / "writes.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(root / "home"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv(artifacts.FAULT_WRITE_LOG, str(log))
        patch.setitem(artifacts._writes, "count", 0)  # numbered as in a fresh process
        result = pipeline.run(from_mapping(yaml.safe_load(plan.read_text())), show_progress=False)
    assert result.exit_code == 0
    reference = snapshot(root / "run")
    assert_whole(root / "run", root / "home")
    (root / "run").rename(root / "reference")
    return Crash(root, reference, [line.split("\t", 1)[1] for line in log.read_text().splitlines()])


@pytest.fixture
def fresh(crash: Crash) -> Crash:
    shutil.rmtree(crash.out, ignore_errors=True)
    return crash


def staged_temporaries(*bases: Path) -> list[Path]:
    return [path for base in bases for path in base.rglob(".*") if TEMPORARY.match(path.name)]


def test_a_run_killed_inside_writes_and_in_time_resumes_to_the_same_results(fresh: Crash) -> None:
    """One run killed three times, each resumed by the next: inside the write of the evaluation
    cache's first entry (a directory), in time while the format is quantized, inside the ledger's
    write (a file); then resumed to the end."""
    home = Path(os.environ["QUANTGATE_HOME"])
    for target in (r"/eval-cache/[0-9a-f]{64}$", "quantize", r"/ledger\.jsonl$"):
        if target == "quantize":
            process = subprocess.Popen(fresh.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
            assert process.stderr is not None
            for line in process.stderr:
                if "] quantize fp8-e4m3" in line:
                    break
            time.sleep(0.5)
            os.killpg(process.pid, signal.SIGKILL)
            assert process.wait() == -signal.SIGKILL
            continue
        assert any(re.search(target, write) for write in fresh.writes)  # a write the uninterrupted run made
        env = os.environ | {artifacts.FAULT_KILL_AT_WRITE: f"1:{target}"}
        killed = subprocess.run(fresh.command("--quiet"), env=env, capture_output=True, text=True, check=False)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        # what the kill left: that write's staging sibling, half written, and not its target
        staged = [path for path in staged_temporaries(fresh.out, home) if re.search(target.rstrip("$"), str(path.parent / path.name[1:]))]
        assert staged and all(".partial-" in path.name for path in staged), staged_temporaries(fresh.out, home)
    fresh.resume_and_compare()


@functools.cache
def _mounts_tmpfs() -> str | None:
    """Why a tmpfs cannot be mounted in a mount namespace here, or None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a mount namespace (root needed): {probe.stderr.strip()}"


@pytest.mark.skipif(_mounts_tmpfs() is not None, reason=str(_mounts_tmpfs()))
def test_a_full_disk_stops_the_run_in_one_line_with_nothing_half_written_and_a_later_run_completes(
        fresh: Crash, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk is the environment's state, not a bug: one line and exit 2 (no traceback),
    every artifact whole, and the same command completes once there is space."""
    home = fresh.root / "home"  # the uninterrupted run's cache: its evaluations are found there, `out` fills
    monkeypatch.setenv("QUANTGATE_HOME", str(home))
    fresh.out.mkdir()
    kept = fresh.root / "full-disk"
    shutil.rmtree(kept, ignore_errors=True)
    command = shlex.join(fresh.command("--quiet"))
    # the run needs about 2.5 MB in `out`: the disk fills once the calibration set is written
    inner = f"mount -t tmpfs -o size=300k tmpfs {fresh.out} && {command}; code=$?; cp -a {fresh.out} {kept}; exit $code"
    full = subprocess.run(["unshare", "-m", "sh", "-c", inner], capture_output=True, text=True, check=False)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    (line,) = [line for line in full.stderr.splitlines() if line.startswith("quantgate: error:")]
    assert line.startswith("quantgate: error: no space left to write ") and "run the same command again" in line
    left = [path for path in kept.rglob(".*") if TEMPORARY.match(path.name)]
    assert left == [] and (kept / "calibration" / "manifest.json").is_file()
    for path in kept.rglob("*.json"):
        json.loads(path.read_text())
    shutil.rmtree(fresh.out)
    shutil.copytree(kept, fresh.out, symlinks=True)
    fresh.resume_and_compare()
