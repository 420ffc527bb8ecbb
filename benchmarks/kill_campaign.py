"""Crash anywhere, resume: SIGKILL `quantgate run` on the tiny model at many points, resume it,
and check that nothing of the crash shows in what the resumed run leaves.

    .venv/bin/python benchmarks/kill_campaign.py [--points 50] [--time-share 0.3] [--root DIR]
                                                [--no-disk-full] [--no-concurrency]

An uninterrupted run first (its atomic writes numbered through the testing hook
`QUANTGATE_FAULT_WRITE_LOG`, quantgate.core.artifacts), then, each from an empty run directory
and an empty $QUANTGATE_HOME at the same paths:

- kills inside writes: `QUANTGATE_FAULT_KILL_AT_WRITE=N` for N spread evenly over every atomic
  write of the run (every stage's artifacts, its stage records, the evaluation cache, the
  ledger, the report): the process is SIGKILLed with half of that write's bytes staged;
- kills in time: SIGKILL at evenly spread fractions of the uninterrupted run's wall time;

then the same command again, to the end. Each resumed run must give the uninterrupted run's
exit code, verdicts, per-item results and ledger records (all but `time` and the hashes that
chain it), a ledger that verifies with no duplicate and no torn record, and no temporary
(`.NAME.partial-*`, `.NAME.old-*`) in the run directory or the cache home, and no lock.

Then the disk filling up: a tmpfs too small for the run as `out` (`unshare -m`, as root); the run
must stop with one line (`quantgate: error: no space left ...`, exit 2: a full disk is the
environment's state, not a bug, and the same command resumes once there is space), no
traceback, no temporary, every JSON and the ledger whole; the same command with space then
completes with the uninterrupted run's results. And two runs at once: on the same `out` (one is
refused in one line), and on two `out`s sharing $QUANTGATE_HOME (both finish with the
uninterrupted run's results, and every evaluation-cache entry verifies).

Prints the count of kill points tried and survived, and each failure. Exits 1 on any failure.
About a minute per kill point on a busy 2-core machine (an uninterrupted run of the tiny plan: 30 to 80 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEMPORARY = re.compile(r"^\..+\.(partial|old)-[A-Za-z0-9_-]+$")
UNCHAINED = ("time", "record_hash", "prev_hash", "signature")  # what differs between two runs' ledger records (an ECDSA signature is randomized)


def quantgate() -> list[str]:
    script = Path(sys.executable).with_name("quantgate")
    return [str(script)] if script.is_file() else [sys.executable, "-c", "from quantgate.cli import main; main()"]


class Campaign:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = root / "model"
        self.out = root / "run"
        self.home = root / "home"
        self.plan = root / "plan.yaml"
        self.failures: list[str] = []
        self.seconds = 0.0  # an uninterrupted run's wall time, the latest measured
        self.public_key: Path | None = None  # --sign: every approval is signed, and must verify after a resume

    def setup(self, sign: bool = False) -> None:
        import yaml

        from tests.factories import build_tiny_llama
        from tests.helpers import plan_mapping

        if not (self.model / "config.json").is_file():
            build_tiny_llama(self.model, hidden_size=192, intermediate_size=512, heads=3, kv_heads=1, layers=2)
        mapping = plan_mapping(self.model, self.root)
        if sign:  # an ECDSA P-256 key pair, as `openssl ecparam -name prime256v1 -genkey` makes
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import ec

            key = ec.generate_private_key(ec.SECP256R1())
            private, self.public_key = self.root / "signing-key.pem", self.root / "signing-key.pub"
            private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
            private.chmod(0o600)  # a private key others can read is refused
            self.public_key.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
            mapping["signing_key"] = str(private)
        self.plan.write_text(yaml.safe_dump(mapping))

    def check_signed(self, out: Path, what: str) -> list[str]:
        """With --sign: every approved checkpoint verifies with the public key (its model.sig and
        its ledger record), as `quantgate verify --public-key` checks it."""
        if self.public_key is None:
            return []
        from quantgate.gates.ledger import verify_checkpoint

        run = json.loads((out / "run.json").read_text())
        approved = [fmt for fmt, entry in (run.get("verdicts") or {}).items() if entry.get("verdict") == "approved"]
        problems = []
        for fmt in approved:
            checkpoint = out / "checkpoints" / fmt
            if not checkpoint.is_dir():
                continue  # a search trial's held-out approval lives elsewhere; the uniform formats are what is checked here
            result = verify_checkpoint(checkpoint, out / "ledger.jsonl", self.public_key)
            if not result.deployable:
                problems.append(f"{what}: {fmt} does not verify with the public key: {result.status.value}: {result.reason}")
        return problems

    def env(self, home: Path | None = None, **extra: str) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("QUANTGATE_FAULT")}
        return env | {"QUANTGATE_HOME": str(home or self.home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"} | extra

    def fresh(self) -> None:
        for path in (self.out, self.home):
            shutil.rmtree(path, ignore_errors=True)

    def run(self, out: Path | None = None, home: Path | None = None, **extra: str) -> subprocess.CompletedProcess[str]:
        command = [*quantgate(), "run", str(self.plan), "--quiet", *(["--out", str(out)] if out else [])]
        return subprocess.run(command, env=self.env(home, **extra), capture_output=True, text=True, check=False, cwd=self.root)

    # ---- what a run leaves ------------------------------------------------------------------

    def snapshot(self, out: Path | None = None) -> dict[str, Any]:
        """Verdicts, per-item results and ledger records (without what differs between runs)."""
        out = out or self.out
        verdicts = {path.stem: json.loads(path.read_text())["value"] for path in sorted((out / "verdicts").glob("*.json"))}
        items = {str(path.relative_to(out)): json.loads(path.read_text())["items"]
                 for folder in ("results", "baselines") for path in sorted((out / folder).glob("*/*/items.json"))}
        ledger = [{key: value for key, value in json.loads(line).items() if key not in UNCHAINED}
                  for line in (out / "ledger.jsonl").read_text().splitlines()]
        run = json.loads((out / "run.json").read_text())
        return {"verdicts": verdicts, "items": items, "ledger": ledger, "run_verdicts": run["verdicts"], "status": run["status"]}

    def check_whole(self, out: Path, home: Path, what: str) -> list[str]:
        """No temporary, no lock, every JSON whole, a ledger that verifies without duplicates."""
        from quantgate.gates import ledger as ledger_module

        problems = [f"{what}: temporary left: {path}" for base in (out, home) if base.exists()
                    for path in base.rglob(".*") if TEMPORARY.match(path.name)]
        problems += [f"{what}: lock left: {out / '.lock'}"] if (out / ".lock").exists() else []
        for path in out.rglob("*.json"):
            try:
                json.loads(path.read_text())
            except ValueError:
                problems.append(f"{what}: torn JSON {path}")
        ledger = out / "ledger.jsonl"
        if ledger.exists():
            try:
                records = ledger_module.read(ledger)
            except ledger_module.LedgerTampered as error:
                return [*problems, f"{what}: ledger does not verify: {error}"]
            hashes = [record.verdict_sha256 for record in records]
            if len(set(hashes)) != len(hashes):
                problems.append(f"{what}: duplicate ledger records")
        if (out / "run.json").is_file() and json.loads((out / "run.json").read_text()).get("status") == "finished":
            problems += self.check_signed(out, what)
        return problems

    def compare(self, reference: dict[str, Any], out: Path, what: str) -> list[str]:
        try:
            got = self.snapshot(out)
        except (OSError, ValueError, KeyError) as error:
            return [f"{what}: cannot read the resumed run: {error!r}"]
        differ = [part for part in reference if got[part] != reference[part]]
        if differ:  # kept for a look: what the uninterrupted and the resumed run left
            name = re.sub(r"[^A-Za-z0-9]+", "-", what).strip("-")
            (self.root / f"differs-{name}.json").write_text(json.dumps({"reference": reference, "resumed": got}, indent=1, sort_keys=True))
        return [f"{what}: {part} differ from the uninterrupted run's" for part in differ]

    # ---- the kill points --------------------------------------------------------------------

    def reference(self) -> tuple[dict[str, Any], int, list[str], float]:
        self.fresh()
        log = self.root / "writes.log"
        log.unlink(missing_ok=True)
        started = time.perf_counter()
        done = self.run(QUANTGATE_FAULT_WRITE_LOG=str(log))
        seconds = self.seconds = time.perf_counter() - started
        if done.returncode not in (0, 1):
            raise SystemExit(f"the uninterrupted run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        writes = [line.split("\t", 1)[1] for line in log.read_text().splitlines()]
        problems = self.check_whole(self.out, self.home, "uninterrupted run")
        if problems:
            raise SystemExit("\n".join(problems))
        return self.snapshot(), done.returncode, writes, seconds

    def resume_and_check(self, reference: dict[str, Any], code: int, what: str) -> bool:
        resumed = self.run()
        problems = [f"{what}: resumed run exit {resumed.returncode}, not {code}: {resumed.stderr.strip()[-600:]}"] \
            if resumed.returncode != code else []
        problems += self.compare(reference, self.out, what) if not problems else []
        problems += self.check_whole(self.out, self.home, what)
        self.failures += problems
        for problem in problems:
            print(f"  FAILED {problem}", flush=True)
        return not problems

    def kill_at_write(self, number: int, target: str, reference: dict[str, Any], code: int) -> bool:
        self.fresh()
        killed = self.run(QUANTGATE_FAULT_KILL_AT_WRITE=str(number))
        what = f"write {number} ({os.path.relpath(target, self.root)})"
        if killed.returncode != -signal.SIGKILL:
            self.failures.append(f"{what}: not killed (exit {killed.returncode}): {killed.stderr.strip()[-600:]}")
            print(f"  FAILED {self.failures[-1]}", flush=True)
            return False
        return self.resume_and_check(reference, code, what)

    def kill_at_time(self, fraction: float, reference: dict[str, Any], code: int) -> tuple[float, bool]:
        """SIGKILL at `fraction` of an uninterrupted run's wall time, resume, check. The machine is
        shared, so a run's time changes: a run that ends before its kill is an uninterrupted run
        timed again, and the kill is tried again at that fraction of its time. Returns when it was
        killed and whether it survived."""
        command = [*quantgate(), "run", str(self.plan), "--quiet"]
        for _ in range(6):
            self.fresh()
            seconds = fraction * self.seconds
            started = time.perf_counter()
            log = self.root / "timed.err"
            with open(log, "w") as err:
                process = subprocess.Popen(command, env=self.env(), stdout=subprocess.DEVNULL, stderr=err, cwd=self.root,
                                           start_new_session=True)
                try:
                    process.wait(timeout=seconds)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    return seconds, self.resume_and_check(reference, code, f"at {seconds:.1f} s")
            if process.returncode != code:  # not a quicker run: a failed one
                raise SystemExit(f"a run to be killed at {seconds:.1f} s ended first with exit {process.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")
            self.seconds = time.perf_counter() - started  # it ended first: this machine is quicker now
        raise SystemExit("runs keep ending before the kill: time the uninterrupted run again")

    # ---- the disk filling up, and two runs at once ------------------------------------------

    def disk_full(self, reference: dict[str, Any], code: int, size: str) -> bool:
        """A tmpfs of `size` as `out`; checked inside the mount namespace, its content kept, then
        the same run with space, at the same path."""
        self.fresh()
        self.out.mkdir(parents=True)
        stash = self.root / "disk-full-stash"
        shutil.rmtree(stash, ignore_errors=True)
        stash.mkdir()
        report = self.root / "disk-full.json"
        inner = (f"mount -t tmpfs -o size={size} tmpfs {self.out} && "
                 f"{' '.join(quantgate())} run {self.plan} --quiet > {self.root}/disk-full.out 2> {self.root}/disk-full.err; "
                 f"echo $? > {self.root}/disk-full.code; cp -a {self.out}/. {stash}/")
        subprocess.run(["unshare", "-m", "sh", "-c", inner], env=self.env(), check=True, cwd=self.root)
        exit_code = int((self.root / "disk-full.code").read_text())
        err = (self.root / "disk-full.err").read_text()
        lines = [line for line in err.splitlines() if line.startswith("quantgate: error:")]
        problems = [] if exit_code == 2 else [f"disk full: exit {exit_code}, not 2"]
        problems += [] if len(lines) == 1 and "no space left" in lines[0] and "Traceback" not in err else [f"disk full: stderr {err[-800:]!r}"]
        problems += self.check_whole(stash, self.home, "disk full")
        shutil.rmtree(self.out)
        shutil.copytree(stash, self.out, symlinks=True)
        later = self.run()
        problems += [] if later.returncode == code else [f"disk full, then space: exit {later.returncode}: {later.stderr[-600:]}"]
        problems += self.compare(reference, self.out, "disk full, then space") if not problems else []
        problems += self.check_whole(self.out, self.home, "disk full, then space")
        report.write_text(json.dumps({"exit": exit_code, "error": lines, "problems": problems}, indent=2))
        print(f"disk full ({size} tmpfs as out): exit {exit_code}, {lines[0] if lines else err[-300:]!r}; "
              f"then with space: exit {later.returncode}; {'ok' if not problems else problems}", flush=True)
        self.failures += problems
        return not problems

    def concurrent(self, reference: dict[str, Any], code: int) -> bool:
        """Two runs on the same out (one refused in one line, the other finishes), then two on
        two outs sharing one home (both finish with the reference's results)."""
        command = [*quantgate(), "run", str(self.plan), "--quiet"]
        self.fresh()
        pair = [subprocess.Popen(command, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.root)
                for _ in range(2)]
        said = [process.communicate()[1] for process in pair]  # read to the end first: a full pipe would stall a run
        outcomes = sorted(zip([process.returncode for process in pair], said, strict=True))
        problems = [] if [c for c, _ in outcomes] == sorted([code, 2]) else [f"same out: exits {[c for c, _ in outcomes]}"]
        refused = next((err for c, err in outcomes if c == 2), "")
        problems += [] if refused.count("\n") == 1 and "another quantgate run" in refused else [f"same out: refusal {refused!r}"]
        problems += self.compare(reference, self.out, "same out") + self.check_whole(self.out, self.home, "same out")
        second = self.root / "run-2"
        self.fresh()
        shutil.rmtree(second, ignore_errors=True)
        pair = [subprocess.Popen([*command, "--out", str(out)], env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=self.root) for out in (self.out, second)]
        errors = [process.communicate()[1] for process in pair]
        codes = [process.returncode for process in pair]
        problems += [] if codes == [code, code] else [f"shared home: exits {codes}: {errors[0][-400:]} {errors[1][-400:]}"]
        problems += self.compare(reference, self.out, "shared home, first") + self.check_whole(self.out, self.home, "shared home")
        theirs = self.snapshot(second) if not problems else {}
        mine = {part: value for part, value in reference.items() if part in ("status", "run_verdicts")}
        problems += [] if {part: theirs.get(part) for part in mine} == mine else ["shared home, second: verdicts differ"]
        problems += self.check_cache("shared home")
        print(f"concurrency: same out: exits {[c for c, _ in outcomes]} ({refused.strip()!r}); shared home: exits {codes}; "
              f"{'ok' if not problems else problems}", flush=True)
        self.failures += problems
        return not problems

    def check_cache(self, what: str) -> list[str]:
        from quantgate.evalsets.evaluate import _cached, cache_root

        root = cache_root(self.home)
        entries = [entry for entry in root.iterdir() if entry.is_dir() and len(entry.name) == 64]
        return [f"{what}: cache entry {entry.name[:12]} does not verify" for entry in entries if _cached(root, entry.name) is None]


def spread(count: int, total: int) -> list[int]:
    """`count` numbers from 1 to `total`, evenly spread (all of them when there are fewer)."""
    if count >= total:
        return list(range(1, total + 1))
    return sorted({1 + round(index * (total - 1) / max(count - 1, 1)) for index in range(count)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=50, help="kill points in all (inside writes and in time)")
    parser.add_argument("--time-share", type=float, default=0.3, help="the share of kill points that are time-based")
    parser.add_argument("--root", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--disk-size", default="3m", help="the tmpfs size of the disk-full case (the run needs about 6 MB)")
    parser.add_argument("--no-disk-full", action="store_true")
    parser.add_argument("--no-concurrency", action="store_true")
    parser.add_argument("--sign", action="store_true", help="sign every approval (a fresh ECDSA key); each resumed run's "
                        "approvals must verify with its public key")
    args = parser.parse_args()
    root = (args.root or Path(tempfile.mkdtemp(prefix="quantgate-kill-"))).absolute()
    root.mkdir(parents=True, exist_ok=True)
    campaign = Campaign(root)
    campaign.setup(sign=args.sign)
    reference, code, writes, seconds = campaign.reference()
    print(f"uninterrupted run: exit {code}, {seconds:.1f} s, {len(writes)} atomic writes, verdicts "
          f"{ {fmt: entry['verdict'] for fmt, entry in reference['run_verdicts'].items()} }", flush=True)
    extra = []  # first (they take minutes): the disk filling up, two runs at once
    if not args.no_disk_full:
        extra.append(f"disk full: {'survived' if campaign.disk_full(reference, code, args.disk_size) else 'FAILED'}")
    if not args.no_concurrency:
        extra.append(f"concurrent runs: {'ok' if campaign.concurrent(reference, code) else 'FAILED'}")
    timed = round(args.points * args.time_share)
    tried = survived = 0
    for number in spread(args.points - timed, len(writes)):
        tried += 1
        survived += campaign.kill_at_write(number, writes[number - 1], reference, code)
        print(f"[{tried}] kill inside write {number}/{len(writes)} ({os.path.relpath(writes[number - 1], root)}): "
              f"{survived}/{tried} survived", flush=True)
    for index in range(timed):
        at, alive = campaign.kill_at_time((index + 0.5) / timed, reference, code)
        tried += 1
        survived += alive
        print(f"[{tried}] kill at {at:.1f} s, {(index + 0.5) / timed:.0%} of an uninterrupted run ({campaign.seconds:.1f} s): "
              f"{survived}/{tried} survived", flush=True)
    print(f"kill points tried: {tried}, survived: {survived} ({tried - timed} inside writes of {len(writes)}, {timed} in time); "
          + "; ".join(extra), flush=True)
    for failure in campaign.failures:
        print(f"failure: {failure}")
    raise SystemExit(1 if campaign.failures else 0)


if __name__ == "__main__":
    main()
