"""Runs at once, and bytes that changed: two runs on the same `out` (one is refused in one line;
taking a stale lock is race-free), two runs on two `out`s sharing $QUANTGATE_HOME (both finish
with an uninterrupted run's results, no cache entry corrupt), and a cache entry whose bytes
changed (the evaluation cache's, a stage artifact of the run directory): detected and made
again, never trusted."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from quantgate.core.artifacts import MANIFEST, read_json, verify_files, write_json
from quantgate.core.stagecache import VALUE_SHA256
from quantgate.evalsets import evaluate
from quantgate.evalsets.config import EvaluateConfig
from quantgate.gates import ledger as ledger_module
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from tests.helpers import plan_mapping

TEMPORARY = re.compile(r"^\..+\.(partial|old)-[A-Za-z0-9_-]+$")


def small_plan(model: Path, root: Path, out: str = "run") -> dict[str, Any]:
    """The cheapest plan with every stage: one format, one set, a small calibration set."""
    return plan_mapping(model, root, formats=["fp8-e4m3"], narrow_policy=["wiki-text"], evaluation={"sets": ["wiki-text"], "items": 4},
                        calibration={"samples": 4, "seq_len": 32}, out=str(root / out))


def comparable(out: Path) -> dict[str, Any]:
    """Verdicts, per-item results and ledger records, with the run directory's own path and
    what differs between two runs (times, the hashes that chain them or hash a path, the
    signature: each home's own key and a random ECDSA nonce, the checkpoint's file manifest: its
    manifest.json holds the run's times) left out."""
    def same_files(record: dict[str, Any]) -> dict[str, Any]:
        checkpoint = record.get("checkpoint")
        return {**record, "checkpoint": {key: value for key, value in checkpoint.items() if key != "files"}} \
            if isinstance(checkpoint, dict) else record

    text = json.dumps({
        "verdicts": {path.stem: same_files(read_json(path)["value"]) for path in sorted((out / "verdicts").glob("*.json"))},
        "items": {str(path.relative_to(out)): read_json(path)["items"]
                  for folder in ("results", "baselines") for path in sorted((out / folder).glob("*/*/items.json"))},
        "ledger": [same_files({key: value for key, value in json.loads(line).items()
                               if key not in ("time", "record_hash", "prev_hash", "verdict_sha256", "signature", "results_sha256")})
                   for line in (out / "ledger.jsonl").read_text().splitlines()],
    }, sort_keys=True)
    return json.loads(text.replace(str(out), "<out>"))


@pytest.fixture(scope="module")
def reference(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """One uninterrupted run of the small plan (its root, its home, what it left)."""
    root = tmp_path_factory.mktemp("concurrency")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(root / "home"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        result = pipeline.run(from_mapping(small_plan(quant_model, root)), show_progress=False)
    assert result.exit_code == 0
    return root, root / "home", comparable(root / "run")


# ---- the same out ------------------------------------------------------------------------------

LOCKER = """
import importlib.util, os, sys, time
from pathlib import Path
from quantgate.core.errors import InputError
spec = importlib.util.spec_from_file_location("lock", sys.argv[3])  # the module alone: no stage is imported
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)
path, start = Path(sys.argv[1]), float(sys.argv[2])
inside = path.with_name("inside")
took = overlaps = refused = 0
time.sleep(max(0.0, start - time.time()))
while time.time() < start + 1.5:
    try:
        with lock.RunLock(path):
            took += 1
            try:
                os.close(os.open(inside, os.O_CREAT | os.O_EXCL))  # no other holder is inside now
            except FileExistsError:
                overlaps += 1
                continue
            time.sleep(0.001)
            os.unlink(inside)
    except InputError as error:
        refused += 1
        assert str(error).startswith("another quantgate run"), error
print(took, overlaps, refused)
"""


def test_runs_that_find_a_stale_lock_at_once_and_race_for_it_never_both_hold_it(tmp_path: Path) -> None:
    """A lock left by a killed run, found stale by six runs at once, each then taking and
    releasing it as fast as it can for 1.5 s: never two holders at a time (the pid-file lock
    this replaced let two in on most tries: one removed the file the other had just made)."""
    from quantgate.pipeline import lock as lock_module

    lock = tmp_path / ".lock"
    lock.write_text(str(2**22 + 4321))  # a pid above any pid_max: its run was killed
    start = time.time() + 1.0  # every process is waiting by then
    processes = [subprocess.Popen([sys.executable, "-c", LOCKER, str(lock), str(start), lock_module.__file__], stdout=subprocess.PIPE,
                                  text=True) for _ in range(6)]
    counts = [tuple(map(int, process.communicate()[0].split())) for process in processes]
    assert all(process.returncode == 0 for process in processes)
    assert sum(took for took, _, _ in counts) > 6 and sum(overlaps for _, overlaps, _ in counts) == 0, counts
    assert not lock.exists()


def test_a_second_run_on_the_same_out_is_refused_in_one_line(cli, reference, quant_model: Path) -> None:
    root, home, _ = reference
    plan = root / "plan.yaml"
    plan.write_text(yaml.safe_dump(small_plan(quant_model, root)))
    lock = root / "run" / ".lock"
    with open(lock, "w") as held:  # the first run, still running
        held.write("31337")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        ledger = (root / "run" / "ledger.jsonl").read_bytes()
        result = cli("run", plan)
    assert result.code == 2 and result.err.count("\n") == 1
    assert result.err.startswith(f"quantgate: error: another quantgate run (pid 31337) is using {root / 'run'}; wait for it")
    assert (root / "run" / "ledger.jsonl").read_bytes() == ledger


APPENDER = """
import sys, time
from pathlib import Path
from quantgate.gates.stage import record_verdict
from quantgate.gates.verdict_record import VerdictRecord
ledger, start, name = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(max(0.0, start - time.time()))
for number in range(8):
    record = VerdictRecord.from_json({"kind": "verdict", "format": f"{name}-{number}", "precision": "8bit", "checkpoint": None,
                                      "baseline": {"model": "/m", "weights_sha256": "0" * 64},
                                      "policy": {"name": "p", "version": "v1", "sha256": "1" * 64}, "evalsets": [], "metrics": {},
                                      "gates": [], "verdict": "blocked", "reasons": ["a test"]}, "a test's verdict")
    record_verdict(ledger, record)  # takes the ledger's lock (quantgate.core.artifacts.sibling_lock)
"""


def append_at_once(ledger: Path) -> list[ledger_module.LedgerRecord]:
    start = time.time() + 1.5
    processes = [subprocess.Popen([sys.executable, "-c", APPENDER, str(ledger), str(start), f"run{index}"]) for index in range(4)]
    try:
        assert [process.wait(timeout=120) for process in processes] == [0] * 4
    finally:
        for process in processes:
            process.kill()
    return ledger_module.read(ledger)


def test_runs_sharing_a_ledger_append_to_it_one_at_a_time_and_lose_no_record(tmp_path: Path) -> None:
    """Two runs with different run directories (or `quantgate gate` in CI) may name one ledger; an
    append rewrites the whole file, so record_verdict appends under the ledger's lock."""
    records = append_at_once(tmp_path / "ledger.jsonl")
    assert sorted(str(record.format) for record in records) == sorted(f"run{i}-{n}" for i in range(4) for n in range(8))


# ---- two outs, one home --------------------------------------------------------------------------


def test_two_runs_sharing_a_home_at_once_both_finish_with_the_same_results(reference, quant_model: Path,
                                                                          tmp_path: Path) -> None:
    root, _, expected = reference
    home = Path(os.environ["QUANTGATE_HOME"])  # this test's own, empty: both runs fill it at once
    plan = root / "plan-second.yaml"
    plan.write_text(yaml.safe_dump(small_plan(quant_model, root, out="second")))
    first = subprocess.Popen([sys.executable, "-c", "from quantgate.cli import main; main()", "run", str(plan)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert first.stderr is not None
    for line in first.stderr:  # the other run starts when this one has begun its stages
        if line.startswith("[1/"):
            break
    result = pipeline.run(from_mapping(small_plan(quant_model, root, out="third")), show_progress=False)
    first.stderr.read()
    assert first.wait() == 0 and result.exit_code == 0
    for out in (root / "second", root / "third"):
        assert comparable(out) == expected
        ledger_module.read(out / "ledger.jsonl")
    cache = evaluate.cache_root(home)
    entries = [entry for entry in cache.iterdir() if re.fullmatch(r"[0-9a-f]{64}", entry.name)]
    assert entries and all(evaluate._cached(cache, entry.name) == entry for entry in entries)
    assert [path for path in home.rglob(".*") if TEMPORARY.match(path.name)] == []


PULLER = """
import sys, time
from pathlib import Path
from quantgate.core import models
home, publish_at = Path(sys.argv[1]), float(sys.argv[2])

def convert(gguf, out):  # the conversion's output, quickly
    (out / "model.safetensors").write_bytes(b"the same weights" * 4096)
    (out / "config.json").write_text("{}")
    return {}

def provenance(stopwatch):  # the last step before its manifest is written: it publishes at `publish_at`
    time.sleep(max(0.0, publish_at - time.time()))
    return {}

models._convert_gguf, models.provenance = convert, provenance
pulled = models.pull(home=home)
print(pulled.manifest["weights_sha256"], pulled.path.stat().st_ino)  # the model it left in place
"""


def test_pulls_of_the_same_demo_model_at_once_all_succeed_and_keep_the_first_model_published(tmp_path: Path) -> None:
    """Runs sharing a home may convert the demo model at once: two publish at the same moment,
    a third a second later, when the model is in place; each keeps the model the first one
    published (replacing it would pull it from under a run reading it)."""
    from quantgate.core.models import DEMO_MODELS, demo_model_dir, locate_gguf

    try:
        locate_gguf(DEMO_MODELS["smollm2-135m"])
    except Exception as error:  # noqa: BLE001 - any reason the package is missing skips, with it
        pytest.skip(f"the demo model's package is not installed: {error}")
    start = time.time() + 2.0  # every puller has found no model and converted by then
    processes = [subprocess.Popen([sys.executable, "-c", PULLER, str(tmp_path), str(at)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for at in (start, start, start + 1.0)]
    said = [process.communicate() for process in processes]
    assert [process.returncode for process in processes] == [0] * 3, [err[-800:] for _, err in said]
    target = demo_model_dir("smollm2-135m", tmp_path)
    manifest = read_json(target / MANIFEST)
    verify_files(target, manifest["files"], "model")
    assert {out.strip() for out, _ in said} == {f"{manifest['weights_sha256']} {target.stat().st_ino}"}, said
    assert [path for path in target.parent.iterdir() if path.name.startswith(".")] == []


# ---- bytes that changed ---------------------------------------------------------------------------


def _tampered_copies(entry: Path, into: Path) -> dict[str, Path]:
    """Copies of a whole cache entry (under its own key), each damaged one way."""
    damages = {
        "a changed byte": lambda copy: (copy / "items.json").write_bytes((copy / "items.json").read_bytes().replace(b"0", b"1", 1)),
        "a torn manifest": lambda copy: (copy / MANIFEST).write_bytes((copy / MANIFEST).read_bytes()[:-40]),
        "a file its manifest does not name": lambda copy: (copy / "extra.json").write_text("{}"),
        "another key's manifest": lambda copy: write_json(copy / MANIFEST, {**read_json(copy / MANIFEST), "key": "0" * 64}),
        "a missing file": lambda copy: (copy / "record.json").unlink(),
    }
    copies = {}
    for index, (what, damage) in enumerate(damages.items()):
        copy = into / str(index) / entry.name
        shutil.copytree(entry, copy)  # copies, not links: the original stays whole
        damage(copy)
        copies[what] = copy
    return copies


def test_a_damaged_evaluation_cache_entry_is_never_trusted_and_is_computed_again(reference, quant_model: Path,
                                                                                 tmp_path: Path) -> None:
    _, home, _ = reference
    cache = evaluate.cache_root(home)
    entry = next(entry for entry in cache.iterdir() if (entry / "items.json").is_file())
    assert evaluate._cached(cache, entry.name) == entry
    for what, copy in _tampered_copies(entry, tmp_path).items():
        assert evaluate._cached(copy.parent, copy.name) is None, what
    # end to end: an entry whose bytes changed is computed again, and replaced by a whole one
    cfg = EvaluateConfig(evalsets=("wiki-text",), limit=2)
    first = evaluate.run(cfg, quant_model, tmp_path / "first", home=home)
    key = first.manifest.sets["wiki-text@v1"].cache_key
    items = cache / key / "items.json"
    original = items.read_bytes()
    items.unlink()  # a new file, not the bytes the first results share
    items.write_bytes(original.replace(b"0", b"1", 1))
    again = evaluate.run(cfg, quant_model, tmp_path / "again", home=home)
    assert again.from_cache == {"wiki-text@v1": False}
    assert items.read_bytes() == original and evaluate._cached(cache, key) == cache / key
    assert again.items("wiki-text@v1") == first.items("wiki-text@v1")


def test_a_changed_stage_artifact_is_made_again_never_trusted(reference, quant_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, home, expected = reference
    out = root / "run"
    monkeypatch.setenv("QUANTGATE_HOME", str(home))  # the run's own cache
    measured = out / "measure" / "fp8-e4m3.json"
    stored = read_json(measured)
    stored["value"]["measurement"]["totals"]["file_bytes"] += 1  # its key still matches
    write_json(measured, stored)
    verdict = out / "verdicts" / "fp8-e4m3.json"
    stored = read_json(verdict)
    stored["value"]["verdict"] = "blocked"
    write_json(verdict, stored)
    record = out / "stages" / "evaluate-baseline.json"
    record.write_bytes(record.read_bytes()[:-30])  # torn
    paired = out / "baselines" / "fp8-e4m3" / "wiki-text@v1" / "items.json"  # the baseline's side of the format's gate
    changed = paired.read_bytes().replace(b"0", b"1", 1)
    paired.unlink()  # a file of its own (not the bytes it shares with the evaluation cache)
    paired.write_bytes(changed)
    ledger = (out / "ledger.jsonl").read_bytes()
    rerun = pipeline.run(from_mapping(small_plan(quant_model, root)), show_progress=False)
    assert rerun.redone == ["evaluate baseline", "measure fp8-e4m3", "evaluate fp8-e4m3", "gate fp8-e4m3"]
    assert rerun.verdicts["fp8-e4m3"].verdict == "approved" and comparable(out) == expected
    assert read_json(verdict)[VALUE_SHA256] and (out / "ledger.jsonl").read_bytes() == ledger  # the same verdict: not appended again
