"""`executor: ray` on a real two-node Ray cluster of this machine (a head and a second node,
`ray start`), in a network namespace of its own that has only loopback (`unshare -n`, then
`ip link set lo up`): every node binds 127.0.0.1 and nothing leaves the machine. The driver
(`quantgate run --address`) runs inside the same namespace (`nsenter -n`).

One cluster for the module: the tiny model's two formats run side by side, a worker is killed
while a quantization runs (Ray retries it), and the verdicts, per-item results and ledger
records equal a local run's; a second run reuses every stage, and a local run resumes it; an
`out` the workers cannot see is refused before any work; Ctrl-C cancels the tasks and leaves no
half-written artifact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from quantgate import evalsets, serving
from quantgate.pipeline import runner as pipeline
from quantgate.pipeline.plan import from_mapping
from quantgate.serving import environment
from tests.helpers import TINY_FORMATS, plan_mapping

BIN = Path(sys.executable).parent
PORT = 6379  # the namespace is the cluster's own: no other Ray can hold its ports
TEMPORARY = re.compile(r"^\..+\.(partial|old)-")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Cluster:
    """A head and a second node, one CPU each, in a network namespace that has only loopback; the
    second advertises the schemes its serving engine serves (Ray resources)."""

    def __init__(self, home: Path) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="qg-ray-", dir="/tmp"))  # short: Ray's socket paths
        self.env = {**os.environ, "QUANTGATE_HOME": str(home), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        common = "--node-ip-address=127.0.0.1 --num-cpus=1 --disable-usage-stats"
        engine = serving.find()  # the machine's serving environment (the cluster's QUANTGATE_HOME is a test's own)
        advertise = f"{environment.PYTHON_ENV}={engine.python} {BIN}/quantgate serving resources" if engine else "echo '{}'"
        script = (f"ip link set lo up && {BIN}/ray start --head --port={PORT} --include-dashboard=false "
                  f"--temp-dir={self.temp} {common} >{self.temp}/head.log 2>&1 && "
                  # the second node alone advertises what its serving engine serves (`quantgate serving resources`)
                  f"{BIN}/ray start --address=127.0.0.1:{PORT} {common} --resources \"$({advertise})\" "
                  f">{self.temp}/node.log 2>&1 && "
                  "echo ready && exec sleep infinity")
        self.anchor = subprocess.Popen(["unshare", "-n", "sh", "-c", script], stdout=subprocess.PIPE, text=True, env=self.env)
        assert self.anchor.stdout is not None
        line = self.anchor.stdout.readline()
        if line.strip() != "ready":
            logs = "".join(path.read_text()[-2000:] for path in sorted(self.temp.glob("*.log")))
            self.stop()
            raise RuntimeError(f"the Ray cluster did not start: {logs}")

    def inside(self, *command: str, mount: Path | None = None) -> list[str]:
        """`command` in the cluster's network namespace (with `mount`: behind a tmpfs of its own there)."""
        entered = ["nsenter", "-t", str(self.anchor.pid), "-n", "--"]
        if mount is None:
            return [*entered, *command]
        quoted = " ".join(f"'{part}'" for part in command)
        return [*entered, "unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs '{mount}' && exec {quoted}"]

    def run(self, plan: Path, *args: str, mount: Path | None = None) -> subprocess.CompletedProcess[str]:
        command = self.inside(str(BIN / "quantgate"), "run", str(plan), "--address", f"127.0.0.1:{PORT}", *args, mount=mount)
        return subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=600, cwd=plan.parent)

    def start(self, plan: Path) -> subprocess.Popen[str]:
        """The driver, in the background. SIGINT back to its default in the child: a signal this
        process ignores stays ignored across exec, and Python then installs no KeyboardInterrupt
        (something earlier in a full test session leaves SIGINT ignored)."""
        command = self.inside(str(BIN / "quantgate"), "run", str(plan), "--address", f"127.0.0.1:{PORT}")
        return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env, cwd=plan.parent,
                                preexec_fn=_default_sigint)

    def stop(self) -> None:
        subprocess.run(self.inside(str(BIN / "ray"), "stop", "--force"), capture_output=True, env=self.env, timeout=120)
        self.anchor.kill()
        self.anchor.wait()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    made = Cluster(tmp_path_factory.mktemp("ray-home"))
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture(scope="module")
def local_run(quant_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same plan under the local executor, with torch at one thread as in every Ray task
    here (GPTQ's sums depend on the thread count: docs/scale-out.md)."""
    root = tmp_path_factory.mktemp("local")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("local-home")))
            patch.setenv("HF_HUB_OFFLINE", "1")
            pipeline.run(from_mapping(plan_mapping(quant_model, root)), show_progress=False)
    finally:
        torch.set_num_threads(threads)
    return root / "run"


def write_plan(model: Path, root: Path, **changes: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_mapping(model, root, **changes)))
    return path


def kill_a_quantization(driver: subprocess.Popen[str], out: Path) -> tuple[str, list[str]]:
    """Read the driver's stage lines; when a quantization task starts, SIGKILL its worker (once
    its staging directory appears, mid-write, or after two seconds). Returns the format and
    every line the driver printed."""
    assert driver.stderr is not None
    lines: list[str] = []
    killed = ""
    for line in driver.stderr:
        lines.append(line)
        found = re.search(r"quantize (\S+) running on node \d \(127\.0\.0\.1, host \S+, pid (\d+)\)", line)
        if found and not killed:
            killed = found.group(1)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not list((out / "checkpoints").glob(f".{killed}.partial-*")):
                time.sleep(0.02)
            os.kill(int(found.group(2)), signal.SIGKILL)
    driver.wait(timeout=600)
    return killed, lines


def comparable(record: dict[str, Any], out: Path) -> dict[str, Any]:
    """A ledger record without what differs between two runs of the same plan: when it was
    written, the chain's hashes (they cover the time), its signature (a random ECDSA nonce), the
    hashes of the results' manifests and the checkpoint's file manifest (manifests hold their run's
    times), and where its run directory is."""
    dropped = {key: value for key, value in record.items()
               if key not in ("time", "prev_hash", "record_hash", "verdict_sha256", "signature", "results_sha256")}
    checkpoint = dropped.get("checkpoint")
    if isinstance(checkpoint, dict):
        dropped["checkpoint"] = {key: value for key, value in checkpoint.items() if key != "files"}
    return json.loads(json.dumps(dropped).replace(str(out), "<out>"))


def per_item(out: Path, name: str) -> dict[str, list[dict[str, Any]]]:
    """Every set's per-item records of one results directory, without its run's paths."""
    results = evalsets.load_results(out / name)
    return {spec: results.items(spec)["items"] for spec in results.manifest.sets}


def temporaries(root: Path) -> list[Path]:
    return [path for path in root.rglob(".*") if TEMPORARY.match(path.name)]


def test_ray_run_with_a_killed_worker_equals_the_local_run_and_resumes_either_way(
        cluster: Cluster, local_run: Path, quant_model: Path, tmp_path: Path) -> None:
    plan = write_plan(quant_model, tmp_path)
    out = tmp_path / "run"
    driver = cluster.start(plan)
    killed, lines = kill_a_quantization(driver, out)
    text = "".join(lines)
    assert driver.returncode == 0, text[-3000:]
    assert killed in TINY_FORMATS
    # Ray ran the killed quantization again; the driver said where each attempt ran
    assert re.search(rf"quantize {killed} running on node \d .*\(attempt 2: Ray retried it\)", text), text[-3000:]
    assert re.search(r"done quantize \S+ in [\d.]+ s on node \d \(127\.0\.0\.1", text)
    assert {match for match in re.findall(r"running on (node \d)", text)} == {"node 1", "node 2"}  # both nodes worked
    assert temporaries(out) == []  # the killed worker's staging directory was removed
    # the same verdicts, per-item results and ledger records (but for times) as the local run
    for fmt in TINY_FORMATS:
        ours, theirs = (json.loads((root / "verdicts" / f"{fmt}.json").read_text())["value"] for root in (out, local_run))
        assert (ours["verdict"], ours["reasons"]) == (theirs["verdict"], theirs["reasons"])
        for name in (fmt,):
            assert per_item(out / "results", name) == per_item(local_run / "results", name)
            assert per_item(out / "baselines", name) == per_item(local_run / "baselines", name)
    ledgers = [[comparable(json.loads(line), root) for line in (root / "ledger.jsonl").read_text().splitlines()]
               for root in (out, local_run)]
    assert ledgers[0] == ledgers[1] and [record["format"] for record in ledgers[0]] == TINY_FORMATS

    # a second run on the cluster reuses every stage and appends nothing
    ledger = (out / "ledger.jsonl").read_bytes()
    again = cluster.run(plan)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"\(0 of (\d+) stages run, \1 reused\)", again.stdout), again.stdout
    # and the local executor resumes what Ray made: nothing to redo
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", cluster.env["QUANTGATE_HOME"])
        resumed = pipeline.run(from_mapping(plan_mapping(quant_model, tmp_path)), show_progress=False)
    assert resumed.redone == [] and (out / "ledger.jsonl").read_bytes() == ledger


def test_an_out_the_workers_cannot_see_is_refused_before_any_work(cluster: Cluster, quant_model: Path, tmp_path: Path) -> None:
    private = tmp_path / "driver-only"
    private.mkdir()
    plan = write_plan(quant_model, tmp_path, out=str(private / "run"))
    # the driver sees a tmpfs of its own at `private`; the workers see the directory beneath it
    refused = cluster.run(plan, mount=private)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert re.fullmatch(rf"quantgate: error: out {private}/run is not on storage every Ray worker sees: node \d \(127\.0\.0\.1\) "
                        r"has no such directory; put out on a filesystem shared by the driver and every node", lines[-1]), lines
    assert not any(re.match(r"\[\d+/\d+\]", line) for line in lines)  # no stage began
    assert list(private.iterdir()) == []


def test_ctrl_c_cancels_the_tasks_and_leaves_no_half_written_artifact(cluster: Cluster, quant_model: Path, tmp_path: Path) -> None:
    plan = write_plan(quant_model, tmp_path)
    out = tmp_path / "run"
    driver = cluster.start(plan)
    assert driver.stderr is not None
    lines = []
    for line in driver.stderr:
        lines.append(line)
        if re.search(r"quantize \S+ running on", line):
            driver.send_signal(signal.SIGINT)
            break
    rest = driver.stderr.read()
    driver.wait(timeout=120)
    assert driver.returncode == 130, "".join(lines) + rest
    assert rest.strip().splitlines()[-1].startswith("quantgate: error: interrupted: the run's tasks were cancelled")
    assert temporaries(out) == []
    assert not (out / ".lock").exists()
    # nothing of the interrupted run is half there: a run (here the local executor's) resumes it
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", cluster.env["QUANTGATE_HOME"])
        resumed = pipeline.run(from_mapping(plan_mapping(quant_model, tmp_path)), show_progress=False)
    assert resumed.exit_code == 0 and "calibration" not in resumed.redone


PROBE_ERRORS = """
import functools, os, sys
from quantgate.core.errors import ModelError
from quantgate.core.models import resolve_model
from quantgate.pipeline.executor import RayExecutor, TaskLost
from quantgate.pipeline.plan import ExecutorPlan

executor = RayExecutor(ExecutorPlan(kind="ray", address=sys.argv[1], max_retries=1), {}, show=print)
try:
    executor.call("measure", "a missing model", functools.partial(resolve_model, "/nonexistent/model"))
except ModelError as error:  # the task's own error, as a local run raises it: not retried
    print(f"own error: {error}", flush=True)
try:
    executor.call("quantize", "quantize dying", functools.partial(os._exit, 9))
except TaskLost as lost:  # its worker died every time: lost for good
    print(f"lost: {lost.kind} | {lost}", flush=True)
value = executor.call("overlap", "a value", functools.partial(sum, [1, 2, 3]))
print(f"value: {value} {executor.where('a value')}", flush=True)
executor.close()
"""


def test_a_tasks_own_error_comes_back_as_itself_and_a_dying_worker_is_retried_then_lost(cluster: Cluster) -> None:
    done = subprocess.run(cluster.inside(sys.executable, "-c", PROBE_ERRORS, f"127.0.0.1:{PORT}"), capture_output=True, text=True,
                          env=cluster.env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # (Ray's own raylet lines may share a line with ours: searched, not matched whole; each of ours is
    # one string written at once, since print() writes its arguments one by one and Ray's forwarded
    # log lines landed between them in CI)
    assert re.search(r"own error: model '/nonexistent/model' is not a directory", done.stdout), done.stdout
    assert len([line for line in lines if "quantize dying running on node" in line]) == 2, done.stdout  # the first try and one retry
    assert re.search(r"lost: quantize \| quantize dying was lost on the Ray cluster after 2 attempts: \S", done.stdout), done.stdout
    assert re.search(r"value: 6 node \d \(127\.0\.0\.1, host \S+, pid \d+\)", done.stdout), done.stdout


PLACEMENT = """
import functools, json, sys
import ray
from quantgate.pipeline.executor import RayExecutor
from quantgate.pipeline.plan import ExecutorPlan
from quantgate.serving import device

executor = RayExecutor(ExecutorPlan(kind="ray", address=sys.argv[1]), {}, show=lambda line: None)
needed = device.serve_resource("W8A8")  # a scheme every CPU class serves usably
advertising = sorted(executor.nodes[node["NodeID"]][0] for node in ray.nodes() if node["Alive"] and needed in node["Resources"])
placed = []
for index in range(4):
    executor.call("serve", f"serve {index}", functools.partial(sum, [index]), needs=[needed])
    placed.append(executor.where(f"serve {index}").split(" (")[0])
executor.call("serve", "serve nowhere", functools.partial(sum, [9]), needs=[device.serve_resource("NO-SUCH-SCHEME")])
print(json.dumps({"advertising": advertising, "placed": placed, "anywhere": executor.where("serve nowhere")}))
executor.close()
"""


def test_a_serve_goes_to_the_node_whose_engine_advertises_the_scheme(cluster: Cluster) -> None:
    done = subprocess.run(cluster.inside(sys.executable, "-c", PLACEMENT, f"127.0.0.1:{PORT}"), capture_output=True, text=True,
                          env=cluster.env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    (node,) = found["advertising"]  # one node of the two advertises it
    assert found["placed"] == [node] * 4
    assert found["anywhere"]  # a resource no node advertises is not asked for: the task still runs
