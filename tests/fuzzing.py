"""Fuzzing every file quantgate reads, shared by `tests/test_fuzz.py` (a bounded run in the suite)
and `benchmarks/fuzz_campaign.py` (the nightly-size run). Not a test module: it defines readers,
mutations and the property, and test modules and the benchmark import it.

A *reader* is one kind of file and the cheap command that reads it (no model is run): a valid
file of that kind, where it lies in a sandbox, the command line, and what a successful run must
have produced. A *mutation* turns the valid file into a hostile one: random bytes, a truncation,
flipped bytes, bytes that are not UTF-8, a very long line, deep nesting, huge numbers, a value of
the wrong type somewhere in the structure, a duplicated key, or the file (or a file its manifest
names) made a symlink to a file outside the directory.

The property (`check`): the command ends in exit 0 (or 1, where that is a verdict) with a correct
result, or exit 2 with exactly one line on stderr; never a traceback (exit 3), never a hang, and
never a file written outside the reader's output paths (the whole sandbox is snapshotted before
and after)."""

from __future__ import annotations

# torch, transformers, pyarrow and datasets are imported inside the readers' setup: only the
# readers that need them pay for them (the plan and policy readers need none).
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from quantgate.cli import main
from tests.factories import build_tiny_llama, demo_paragraphs
from tests.helpers import TINY_POLICY, USER_ITEMS, write_header_only, write_jsonl

HANG_SECONDS = 60  # one command on a tiny input that runs longer than this is a hang


# ---- running the CLI in process -------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


class Hang(BaseException):
    """Raised by the alarm in a command that ran past HANG_SECONDS (a BaseException: `main`'s
    crash handler must not take it for an ordinary bug)."""


def invoke(args: list[str], seconds: int = HANG_SECONDS) -> Outcome:
    """`quantgate ARGS...` through the real entry point, in this process; its exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"quantgate {' '.join(args)} ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    sys.argv = ["quantgate", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.argv = argv
    return Outcome(code, out.getvalue(), err.getvalue())


# ---- the sandbox ------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under `root`: its kind, size and modification time (nanoseconds)."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            info = path.lstat()
            kind = "link" if path.is_symlink() else ("dir" if path.is_dir() else "file")
            found[str(path.relative_to(root))] = (kind, info.st_size if kind != "dir" else 0, info.st_mtime_ns if kind == "file" else 0)
    return found


@dataclass
class Sandbox:
    """A directory every reader works in: `home` is QUANTGATE_HOME, `outside` holds what a symlink
    may point to, `model` the tiny model (made once, only where a reader needs it)."""

    root: Path
    model: Path | None = None

    def __post_init__(self) -> None:
        for folder in ("inputs", "seeds", "home", "outside"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def outside(self) -> Path:
        return self.root / "outside"

    def tiny_model(self) -> Path:
        if self.model is None:
            self.model = build_tiny_llama(self.root / "tiny-llama")
        return self.model


@contextlib.contextmanager
def environment(sandbox: Sandbox) -> Iterator[None]:
    """QUANTGATE_HOME in the sandbox, no hub: set for the duration, restored after."""
    saved = {key: os.environ.get(key) for key in ("QUANTGATE_HOME", "HF_HUB_OFFLINE")}
    os.environ["QUANTGATE_HOME"] = str(sandbox.home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---- readers ----------------------------------------------------------------------------------


@dataclass
class Reader:
    """One kind of file and the command that reads it.

    `format`: json, jsonl, yaml, text or binary (which mutations apply). `setup` makes what the
    reader needs once and returns the valid file's bytes; `target` is where the fuzzed file goes;
    `args` the command; `outputs` the paths the command may write (cleared before each input);
    `accept` checks a run that ended in an allowed code other than 2 (None: it is correct);
    `rehash`, where the file is named by a manifest, rewrites the manifest to match the file, so
    that the content itself gets past the integrity check.
    """

    name: str
    format: str
    setup: Callable[[Sandbox], bytes]
    target: Callable[[Sandbox], Path]
    args: Callable[[Sandbox], list[str]]
    outputs: Callable[[Sandbox], list[Path]] = lambda sandbox: []
    accept: Callable[[Sandbox, Outcome], str | None] = lambda sandbox, outcome: None
    codes: tuple[int, ...] = (0, 2)
    rehash: Callable[[Sandbox, Path], None] | None = None


def _paragraphs(count: int) -> list[str]:
    return demo_paragraphs(count)


def _calibrate_args(sandbox: Sandbox, source: Path, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(sandbox.tiny_model()), "--source", str(source), "--samples", "2", "--seq-len", "8",
            "--allow-fewer", "--out", str(sandbox.root / "calib-out"), *extra]


def _calibrated(sandbox: Sandbox, outcome: Outcome) -> str | None:
    from quantgate import calibration

    built = calibration.load(sandbox.root / "calib-out")
    return None if built.samples >= 1 and built.input_ids.shape[1] == 8 else f"a set of {built.samples} rows"


def _source_reader(name: str, suffix: str, fmt: str, valid: Callable[[Sandbox, Path], None], *extra: str) -> Reader:
    def setup(sandbox: Sandbox) -> bytes:
        sandbox.tiny_model()
        seed = sandbox.root / "seeds" / f"{name}{suffix}"
        seed.parent.mkdir(parents=True, exist_ok=True)
        valid(sandbox, seed)
        return seed.read_bytes()

    return Reader(name, fmt, setup, target=lambda sandbox: sandbox.root / "inputs" / f"source{suffix}",
                  args=lambda sandbox: _calibrate_args(sandbox, sandbox.root / "inputs" / f"source{suffix}", *extra),
                  outputs=lambda sandbox: [sandbox.root / "calib-out"], accept=_calibrated)


def _write_txt(sandbox: Sandbox, path: Path) -> None:
    path.write_text("\n\n".join(_paragraphs(3)) + "\n", encoding="utf-8")


def _write_jsonl(sandbox: Sandbox, path: Path) -> None:
    records: list[dict[str, Any]] = [{"text": text, "id": index} for index, text in enumerate(_paragraphs(2))]
    records.append({"text": [{"role": "user", "content": "What is a river?"}, {"role": "assistant", "content": "Water."}]})
    write_jsonl(path, records)


def _write_parquet(sandbox: Sandbox, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": _paragraphs(3)}), path)


def _write_arrow(sandbox: Sandbox, path: Path) -> None:
    import datasets

    saved = sandbox.root / "seeds" / "arrow-dataset"
    datasets.Dataset.from_dict({"text": _paragraphs(3)}).save_to_disk(str(saved))
    shutil.copyfile(next(saved.glob("*.arrow")), path)


def _datasets_state_reader() -> Reader:
    """A `datasets` directory's state.json (its other files stay valid)."""

    def setup(sandbox: Sandbox) -> bytes:
        import datasets

        sandbox.tiny_model()
        saved = sandbox.root / "inputs" / "saved-dataset"
        datasets.Dataset.from_dict({"text": _paragraphs(3)}).save_to_disk(str(saved))
        return (saved / "state.json").read_bytes()

    return Reader("calibration source: datasets directory state.json", "json", setup,
                  target=lambda sandbox: sandbox.root / "inputs" / "saved-dataset" / "state.json",
                  args=lambda sandbox: _calibrate_args(sandbox, sandbox.root / "inputs" / "saved-dataset"),
                  outputs=lambda sandbox: [sandbox.root / "calib-out"], accept=_calibrated)


def _manifest_rehash(manifest: Callable[[Sandbox], Path], relative: str, after: Callable[[dict[str, Any]], None] | None = None
                     ) -> Callable[[Sandbox, Path], None]:
    """Rewrite `manifest`'s files[relative] to the fuzzed file's sha256 (and run `after` on it)."""

    def rehash(sandbox: Sandbox, path: Path) -> None:
        target = manifest(sandbox)
        value = json.loads(target.read_text(encoding="utf-8"))
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "0" * 64
        value["files"][relative] = digest
        if after is not None:
            after(value)
        target.write_text(json.dumps(value), encoding="utf-8")

    return rehash


def _calibration_set(sandbox: Sandbox) -> Path:
    """A small calibration set of the tiny model, made once; its pristine copy is kept aside."""
    pristine = sandbox.root / "seeds" / "calib"
    if not pristine.exists():
        from quantgate import calibration

        calibration.run(calibration.CalibrationConfig(model=str(sandbox.tiny_model()), source="demo", samples=2, seq_len=16), pristine)
        (sandbox.root / "inputs" / "against.txt").write_text("\n\n".join(_paragraphs(5)), encoding="utf-8")
    return pristine


def _calibration_set_reader(file: str, fmt: str) -> Reader:
    """`quantgate overlap` on a calibration set whose `file` is fuzzed (text.jsonl with its manifest
    hash recomputed, so that its content is what is tested)."""
    where = lambda sandbox: sandbox.root / "inputs" / "calib"  # noqa: E731 - a short path helper

    def setup(sandbox: Sandbox) -> bytes:
        pristine = _calibration_set(sandbox)
        shutil.copytree(pristine, where(sandbox), dirs_exist_ok=True)
        return (pristine / file).read_bytes()

    def restore(sandbox: Sandbox) -> list[Path]:
        shutil.rmtree(where(sandbox), ignore_errors=True)
        shutil.copytree(sandbox.root / "seeds" / "calib", where(sandbox))
        return []

    rehash = None if file == "manifest.json" else _manifest_rehash(lambda sandbox: where(sandbox) / "manifest.json", file)
    return Reader(f"calibration set {file}", fmt, setup, target=lambda sandbox: where(sandbox) / file,
                  args=lambda sandbox: ["overlap", "--calibration", str(where(sandbox)), "--against",
                                        str(sandbox.root / "inputs" / "against.txt"), "--json"],
                  outputs=restore, accept=_overlap_printed, rehash=rehash)


def _overlap_printed(sandbox: Sandbox, outcome: Outcome) -> str | None:
    summary = json.loads(outcome.out)
    return None if 0 <= summary["share"] <= 1 and summary["shared_ngrams"] <= summary["candidate_ngrams"] else outcome.out


# golden sets


def _evalset_add_reader() -> Reader:
    def setup(sandbox: Sandbox) -> bytes:
        seed = sandbox.root / "seeds" / "items.jsonl"
        seed.parent.mkdir(parents=True, exist_ok=True)
        (sandbox.home / "evalsets").mkdir(parents=True, exist_ok=True)
        write_jsonl(seed, USER_ITEMS[next(iter(USER_ITEMS))] * 1)
        return seed.read_bytes()

    def added(sandbox: Sandbox, outcome: Outcome) -> str | None:
        from quantgate.evalsets.sets import check_items, load

        golden = load("fuzzed", sandbox.home)
        check_items(golden)
        return None if golden.size >= 1 else "an empty set"

    return Reader("golden set source JSONL (evalsets add)", "jsonl", setup,
                  target=lambda sandbox: sandbox.root / "inputs" / "items.jsonl",
                  args=lambda sandbox: ["evalsets", "add", "--name", "fuzzed", "--kind", "multiple-choice",
                                        "--from", str(sandbox.root / "inputs" / "items.jsonl")],
                  outputs=lambda sandbox: [sandbox.home / "evalsets" / "fuzzed"], accept=added)


def _user_set(sandbox: Sandbox) -> Path:
    """A user's text golden set `mine@v1` in the sandbox's home; its pristine copy kept aside."""
    pristine = sandbox.root / "seeds" / "user-set"
    if not pristine.exists():
        from quantgate import evalsets

        source = write_jsonl(sandbox.root / "seeds" / "texts.jsonl", [{"text": text} for text in _paragraphs(4)])
        with environment(sandbox):
            added = evalsets.add(evalsets.AddConfig(name="mine", kind=evalsets.Kind.text), source, sandbox.home)
        shutil.copytree(added.golden.path, pristine)
    return pristine


def _golden_set_reader(file: str, fmt: str) -> Reader:
    """`quantgate evalsets show mine --items 3` on a user set whose `file` is fuzzed (items.jsonl with
    its manifest's file hash and set sha256 recomputed)."""
    where = lambda sandbox: sandbox.home / "evalsets" / "mine" / "v1"  # noqa: E731 - a short path helper

    def setup(sandbox: Sandbox) -> bytes:
        pristine = _user_set(sandbox)
        return (pristine / file).read_bytes()

    def restore(sandbox: Sandbox) -> list[Path]:
        shutil.rmtree(where(sandbox), ignore_errors=True)
        shutil.copytree(sandbox.root / "seeds" / "user-set", where(sandbox))
        return []

    def resign(manifest: dict[str, Any]) -> None:
        from quantgate.evalsets.sets import set_sha256

        manifest["sha256"] = set_sha256(manifest)

    rehash = None if file == "manifest.json" else _manifest_rehash(lambda sandbox: where(sandbox) / "manifest.json", file, resign)
    return Reader(f"golden set {file}", fmt, setup, target=lambda sandbox: where(sandbox) / file,
                  args=lambda sandbox: ["evalsets", "show", "mine", "--items", "3"], outputs=restore,
                  accept=lambda sandbox, outcome: None if outcome.out.startswith("mine@v1 (user)") else outcome.out, rehash=rehash)


# policies, hardware profiles, plans


def _policy_reader() -> Reader:
    return Reader("policy YAML (evalsets plan)", "yaml", lambda sandbox: TINY_POLICY.encode(),
                  target=lambda sandbox: sandbox.root / "inputs" / "policy.yaml",
                  args=lambda sandbox: ["evalsets", "plan", "--policy", str(sandbox.root / "inputs" / "policy.yaml"), "--json"],
                  accept=lambda sandbox, outcome: None if isinstance(json.loads(outcome.out), dict) else outcome.out)


HARDWARE = """\
name: fuzzed-accelerator
kind: spec sheet
description: a profile of the fuzz tests
hbm_bytes_per_second: 4.8e12
peak_dense_flops: 989.0e12
flops_dtype: bf16
source: the fuzz tests
"""


def _hardware_reader() -> Reader:
    return Reader("hardware profile YAML (bounds)", "yaml", lambda sandbox: HARDWARE.encode(),
                  target=lambda sandbox: sandbox.root / "inputs" / "hardware.yaml",
                  args=lambda sandbox: ["bounds", "--hardware", str(sandbox.root / "inputs" / "hardware.yaml"), "--reference-case", "--json"],
                  accept=lambda sandbox, outcome: None if isinstance(json.loads(outcome.out), dict) else outcome.out)


def _plan_text(sandbox: Sandbox) -> str:
    (sandbox.root / "inputs").mkdir(parents=True, exist_ok=True)
    (sandbox.root / "inputs" / "plan-policy.yaml").write_text(TINY_POLICY, encoding="utf-8")
    plan = {
        "model": str(sandbox.tiny_model()), "formats": ["fp8-e4m3", "gptq-int4"],
        "quantize": {"gptq-int4": {"group_size": 64}},
        "calibration": {"samples": 8, "seq_len": 64, "seed": 1},
        "evaluation": {"sets": ["wiki-text", "lambada"], "items": 4, "batch_size": 2},
        "policy": str(sandbox.root / "inputs" / "plan-policy.yaml"), "hardware": ["reference", "h200"],
        "out": str(sandbox.root / "run-out"), "report": {"plot_metric": None},
    }
    return yaml.safe_dump(plan, sort_keys=False)


def _plan_reader() -> Reader:
    """`quantgate run PLAN` up to the end of its preflight: `preflight_only` (used by the test and
    the campaign) makes the run stop there, after every file the plan names was read."""
    return Reader("run plan YAML (run, preflight)", "yaml", lambda sandbox: _plan_text(sandbox).encode(),
                  target=lambda sandbox: sandbox.root / "inputs" / "plan.yaml",
                  args=lambda sandbox: ["run", str(sandbox.root / "inputs" / "plan.yaml"), "--quiet"],
                  outputs=lambda sandbox: [sandbox.root / "run-out"],
                  accept=lambda sandbox, outcome: None if "preflight passed" in outcome.out else outcome.out)


@contextlib.contextmanager
def preflight_only() -> Iterator[None]:
    """`quantgate run` checks its plan (every file it names read and validated) and stops there:
    `Pipeline.run` replaced by its preflight, then exit 0 with 'preflight passed'."""
    import typer

    from quantgate.pipeline.runner import Pipeline

    def preflight(self: Pipeline) -> Any:
        self.preflight()
        typer.echo("preflight passed")
        raise typer.Exit(0)

    original = Pipeline.run
    Pipeline.run = preflight  # type: ignore[method-assign]  # restored below
    try:
        yield
    finally:
        Pipeline.run = original  # type: ignore[method-assign]  # the original


# checkpoints


def _header_checkpoint(sandbox: Sandbox) -> Path:
    """A header-only checkpoint shaped like a one-layer Llama (no tensor data written)."""
    pristine = sandbox.root / "seeds" / "checkpoint"
    if not pristine.exists():
        pristine.mkdir(parents=True)
        hidden, inter, vocab = 64, 128, 512
        tensors = {"model.embed_tokens.weight": ("BF16", [vocab, hidden]), "model.norm.weight": ("BF16", [hidden]),
                   "model.layers.0.input_layernorm.weight": ("BF16", [hidden])}
        for proj, shape in {"self_attn.q_proj": [hidden, hidden], "self_attn.k_proj": [hidden // 2, hidden],
                            "self_attn.v_proj": [hidden // 2, hidden], "self_attn.o_proj": [hidden, hidden],
                            "mlp.gate_proj": [inter, hidden], "mlp.up_proj": [inter, hidden], "mlp.down_proj": [hidden, inter]}.items():
            tensors[f"model.layers.0.{proj}.weight"] = ("BF16", shape)
        write_header_only(pristine / "model.safetensors", tensors, {"format": "pt"})
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab,
                  "max_position_embeddings": 256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
        (pristine / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return pristine


def _checkpoint_reader(file: str, fmt: str) -> Reader:
    where = lambda sandbox: sandbox.root / "inputs" / "checkpoint"  # noqa: E731 - a short path helper

    def setup(sandbox: Sandbox) -> bytes:
        pristine = _header_checkpoint(sandbox)
        return (pristine / file).read_bytes()

    def restore(sandbox: Sandbox) -> list[Path]:
        shutil.rmtree(where(sandbox), ignore_errors=True)
        shutil.copytree(sandbox.root / "seeds" / "checkpoint", where(sandbox))
        return []

    def measured(sandbox: Sandbox, outcome: Outcome) -> str | None:
        data = json.loads(outcome.out)
        return None if data["totals"]["file_bytes"] > 0 and data["totals"]["parameters"] > 0 else outcome.out

    return Reader(f"checkpoint {file} (measure)", fmt, setup, target=lambda sandbox: where(sandbox) / file,
                  args=lambda sandbox: ["measure", str(where(sandbox)), "--json"], outputs=restore, accept=measured)


# evaluation results (evalsets/evaluate.py load_results, then the gates)

RESULTS_POLICY = """\
name: fuzzed
version: v1
metrics:
  mine:
    kl_divergence: {max_value: {8bit: 0.01, 4bit: 0.05}, undecided_margin: 0.01}
    top1_agreement: {min_value: {8bit: 0.90, 4bit: 0.80}, undecided_margin: 0.05}
"""


def _results(sandbox: Sandbox) -> Path:
    """The tiny model evaluated on the user set `mine` as a baseline and again as its own candidate
    (text sets are scored on transformers: about a second each); pristine copies kept aside."""
    pristine = sandbox.root / "seeds" / "results"
    if not pristine.exists():
        from quantgate import evalsets

        _user_set(sandbox)
        restore = sandbox.home / "evalsets" / "mine" / "v1"
        shutil.rmtree(restore, ignore_errors=True)
        shutil.copytree(sandbox.root / "seeds" / "user-set", restore)
        cfg = evalsets.EvaluateConfig(evalsets=("mine@v1",), limit=4)
        with environment(sandbox):
            evalsets.run(cfg, sandbox.tiny_model(), pristine / "baseline", home=sandbox.home)
            evalsets.run(cfg, sandbox.tiny_model(), pristine / "candidate", baseline_results=pristine / "baseline", home=sandbox.home)
        (sandbox.root / "inputs" / "results-policy.yaml").write_text(RESULTS_POLICY, encoding="utf-8")
    return pristine


def _results_reader(file: str, fmt: str) -> Reader:
    """`quantgate gate` on the candidate's results whose `file` is fuzzed (a set's items.json or
    record.json with its manifest hash recomputed)."""
    where = lambda sandbox: sandbox.root / "inputs" / "results"  # noqa: E731 - a short path helper

    def setup(sandbox: Sandbox) -> bytes:
        pristine = _results(sandbox)
        return (pristine / "candidate" / file).read_bytes()

    def restore(sandbox: Sandbox) -> list[Path]:
        shutil.rmtree(where(sandbox), ignore_errors=True)
        shutil.copytree(sandbox.root / "seeds" / "results", where(sandbox))
        return []

    def verdict(sandbox: Sandbox, outcome: Outcome) -> str | None:
        record = json.loads(outcome.out)
        expected = "approved" if outcome.code == 0 else "blocked"
        return None if record["verdict"] == expected else f"exit {outcome.code} with verdict {record['verdict']}"

    rehash = None if file == "manifest.json" else _manifest_rehash(lambda sandbox: where(sandbox) / "candidate" / "manifest.json", file)
    return Reader(f"evaluation results {file} (gate)", fmt, setup, target=lambda sandbox: where(sandbox) / "candidate" / file,
                  args=lambda sandbox: ["gate", "--baseline", str(where(sandbox) / "baseline"), "--candidate", str(where(sandbox) / "candidate"),
                                        "--policy", str(sandbox.root / "inputs" / "results-policy.yaml"), "--precision", "8bit", "--json"],
                  outputs=restore, accept=verdict, codes=(0, 1, 2), rehash=rehash)


# the ledger (gates/ledger.py reads it)


def _ledger_reader() -> Reader:
    """`quantgate verify` of the tiny model against a ledger holding its approval (written by
    `quantgate gate --ledger` on the results above, signed by the sandbox's own key). Exit 0 is
    correct only for a ledger whose records are still the approval's own; any other change must
    not approve (exit 1 blocked or unknown, 6 untrusted or tampered, 2 bad input)."""

    def setup(sandbox: Sandbox) -> bytes:
        pristine = _results(sandbox)
        ledger = sandbox.root / "seeds" / "ledger.jsonl"
        if not ledger.exists():
            with environment(sandbox):
                outcome = invoke(["gate", "--baseline", str(pristine / "baseline"), "--candidate", str(pristine / "candidate"),
                                  "--policy", str(sandbox.root / "inputs" / "results-policy.yaml"), "--precision", "8bit",
                                  "--ledger", str(ledger)])
            assert outcome.code == 0, outcome
        return ledger.read_bytes()

    def unchanged(sandbox: Sandbox, outcome: Outcome) -> str | None:
        if outcome.code in (1, 6):
            return None
        records = lambda data: [json.loads(line) for line in data.splitlines() if line.strip()]  # noqa: E731 - two uses
        now = (sandbox.root / "inputs" / "ledger.jsonl").read_bytes()
        try:
            same = records(now) == records((sandbox.root / "seeds" / "ledger.jsonl").read_bytes())
        except ValueError:
            same = False
        return None if same else "a changed ledger approved the checkpoint"

    return Reader("ledger JSONL (verify)", "jsonl", setup, target=lambda sandbox: sandbox.root / "inputs" / "ledger.jsonl",
                  args=lambda sandbox: ["verify", str(sandbox.tiny_model()), "--ledger", str(sandbox.root / "inputs" / "ledger.jsonl")],
                  codes=(0, 1, 2, 6), accept=unchanged)


def readers() -> list[Reader]:
    """Every reader, in the order the test and the campaign run them."""
    return [
        _source_reader("calibration source .txt", ".txt", "text", _write_txt),
        _source_reader("calibration source .jsonl", ".jsonl", "jsonl", _write_jsonl, "--chat-template"),
        _source_reader("calibration source .parquet", ".parquet", "binary", _write_parquet),
        _source_reader("calibration source .arrow", ".arrow", "binary", _write_arrow),
        _datasets_state_reader(),
        _calibration_set_reader("manifest.json", "json"),
        _calibration_set_reader("text.jsonl", "jsonl"),
        _evalset_add_reader(),
        _golden_set_reader("manifest.json", "json"),
        _golden_set_reader("items.jsonl", "jsonl"),
        _policy_reader(),
        _hardware_reader(),
        _plan_reader(),
        _checkpoint_reader("config.json", "json"),
        _checkpoint_reader("model.safetensors", "binary"),
        _results_reader("manifest.json", "json"),
        _results_reader("mine@v1/items.json", "json"),
        _results_reader("mine@v1/record.json", "json"),
        _ledger_reader(),
    ]


# ---- mutations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """What to do to the valid file: its new bytes, and whether it becomes a symlink to a copy
    outside the directory (`outside`)."""

    how: str
    data: bytes
    outside: bool = False

    def describe(self) -> str:
        shown = self.data if len(self.data) <= 300 else self.data[:150] + b"..." + self.data[-150:]
        return f"{self.how}{' (as a symlink outside)' if self.outside else ''}: {len(self.data)} bytes {shown!r}"


JSON_LEAVES = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
               | st.text(max_size=20) | st.sampled_from(["", "..", "../../outside/secret", "/etc/passwd", "\x00", "\ud800", "v0"]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                           max_leaves=6)


def _parse(data: bytes, fmt: str) -> Any:
    if fmt == "yaml":
        return yaml.safe_load(data.decode("utf-8"))
    if fmt == "jsonl":
        return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return json.loads(data.decode("utf-8"))


def _dump(value: Any, fmt: str) -> bytes:
    if fmt == "jsonl":
        rows = value if isinstance(value, list) else [value]  # the whole file replaced by one value: one line
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8", "surrogatepass")
    if fmt == "yaml":  # JSON is YAML; yaml.safe_dump refuses some of what JSON_VALUES holds
        return json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a parsed document: keys of mappings, indices of lists."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replaced(value[head], rest, new)
    return copy


SPECIAL_TEXT = {  # placeholders a structured mutation puts in, swapped for raw text after dumping
    "__DEEP__": "[" * 50_000 + "]" * 50_000,
    "__HUGE__": "9" * 5000,
    "__FLOAT__": "1e999",
    "__LONG__": '"' + "x" * 1_000_000 + '"',
}


@st.composite
def mutations(draw: st.DrawFn, valid: bytes, fmt: str) -> Mutation:
    """One hostile version of `valid` (a file of format `fmt`)."""
    kinds = ["random bytes", "truncation", "flipped bytes", "not UTF-8", "very long line", "symlink outside"]
    structured = fmt in ("json", "jsonl", "yaml") and valid.strip()
    if structured:
        kinds += ["wrong type", "wrong type", "deep nesting", "huge number", "duplicate key"]
    kind = draw(st.sampled_from(kinds))
    if kind == "random bytes":
        return Mutation(kind, draw(st.binary(max_size=512)))
    if kind == "truncation":
        return Mutation(kind, valid[: draw(st.integers(0, max(len(valid) - 1, 0)))])
    if kind == "flipped bytes":
        data = bytearray(valid or b"\x00")
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return Mutation(kind, bytes(data))
    if kind == "not UTF-8":
        at = draw(st.integers(0, len(valid)))
        return Mutation(kind, valid[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xe9", b"\xed\xa0\x80", b"\x80\x80"])) + valid[at:])
    if kind == "very long line":
        at = draw(st.integers(0, len(valid)))
        return Mutation(kind, valid[:at] + draw(st.sampled_from([b"a", b"\n", b" ", b"#"])) * 1_000_000 + valid[at:])
    if kind == "symlink outside":
        return Mutation(kind, draw(st.sampled_from([valid, b"", draw(st.binary(max_size=64))])), outside=True)
    parsed = _parse(valid, fmt)
    places = _paths(parsed)
    path = places[draw(st.integers(0, len(places) - 1))]
    if kind == "duplicate key":
        mappings = [place for place in places if isinstance(_get(parsed, place), dict) and _get(parsed, place)]
        if not mappings:
            return Mutation(kind, valid)
        place = mappings[draw(st.integers(0, len(mappings) - 1))]
        return Mutation(kind, _duplicated(parsed, place, fmt, draw(JSON_VALUES)))
    new = {"wrong type": None, "deep nesting": "__DEEP__",
           "huge number": draw(st.sampled_from(["__HUGE__", "__FLOAT__", "__LONG__", 10**300, -(10**18), 2**63]))}[kind]
    if kind == "wrong type":
        new = draw(JSON_VALUES)
    data = _dump(_replaced(parsed, path, new), fmt)
    for marker, text in SPECIAL_TEXT.items():
        data = data.replace(json.dumps(marker).encode(), text.encode())
    return Mutation(f"{kind} at {'/'.join(map(str, path)) or '(root)'}", data)


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


def _duplicated(parsed: Any, place: tuple[Any, ...], fmt: str, value: Any) -> bytes:
    """The document with the mapping at `place` holding its first key twice: first with `value`,
    then with its own (as text, since no parser keeps both)."""
    mapping = _get(parsed, place)
    key = next(iter(mapping))
    marker = {"__DUP__": value, **mapping}
    data = _dump(_replaced(parsed, place, marker), fmt)
    return data.replace(json.dumps("__DUP__").encode(), json.dumps(key, ensure_ascii=False).encode("utf-8", "surrogatepass"))


# ---- the property -----------------------------------------------------------------------------


def apply(reader: Reader, sandbox: Sandbox, mutation: Mutation) -> None:
    """Write the mutated file where the reader reads it (a symlink to a copy outside, if asked)."""
    target = reader.target(sandbox)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.is_file():
        target.unlink()
    if mutation.outside:
        sandbox.outside.mkdir(parents=True, exist_ok=True)
        away = sandbox.outside / f"{target.name}.outside"
        away.write_bytes(mutation.data)
        target.symlink_to(away)
    else:
        target.write_bytes(mutation.data)
    if reader.rehash is not None:
        reader.rehash(sandbox, target)


def check(reader: Reader, sandbox: Sandbox, mutation: Mutation) -> str | None:
    """Run the reader's command on the mutated file; None if the property holds, else why not."""
    return run_one(reader, sandbox, mutation)[1]


def run_one(reader: Reader, sandbox: Sandbox, mutation: Mutation) -> tuple[Outcome | None, str | None]:
    """The command's outcome on the mutated file (None: it hung) and why the property fails (None: it holds)."""
    paths = reader.outputs(sandbox)  # a reader of a directory puts its pristine copy back here
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    apply(reader, sandbox, mutation)
    outputs = [str(path.relative_to(sandbox.root)) for path in paths]
    before = snapshot(sandbox.root)
    with environment(sandbox):
        try:
            outcome = invoke(reader.args(sandbox))
        except Hang as error:
            return None, f"hang: {error}"
    failure = _judge(reader, sandbox, outcome)
    changed = sorted(name for name, entry in {**before, **snapshot(sandbox.root)}.items()
                     if before.get(name) != _entry(sandbox.root / name) and not any(name == out or name.startswith(out + "/") for out in outputs)
                     and name != str(reader.target(sandbox).relative_to(sandbox.root)))
    if failure is None and changed:
        failure = f"wrote outside its output: {', '.join(changed[:5])}"
    return outcome, failure


def _entry(path: Path) -> tuple[str, int, int] | None:
    if not path.exists() and not path.is_symlink():
        return None
    info = path.lstat()
    kind = "link" if path.is_symlink() else ("dir" if path.is_dir() else "file")
    return (kind, info.st_size if kind != "dir" else 0, info.st_mtime_ns if kind == "file" else 0)


def _judge(reader: Reader, sandbox: Sandbox, outcome: Outcome) -> str | None:
    lines = outcome.err.strip().splitlines()
    if outcome.code not in reader.codes:
        # a crash: the exception's own line (the one above 'quantgate: crashed ...'), then the traceback
        said = lines[-2] if outcome.code == 3 and len(lines) >= 2 else (lines[-1] if lines else "")
        return f"exit {outcome.code}: {said[:300]}" + (f"\n{outcome.err}" if outcome.code == 3 else "")
    if outcome.code == 2:
        # blank lines aside: a transient progress bar, stopped by the error, leaves one on a
        # stderr that is not a terminal (quantgate/core/console.py)
        lines = [line for line in outcome.err.splitlines() if line.strip()]
        if len(lines) != 1 or not lines[0].startswith("quantgate: error: "):
            return f"exit 2 without exactly one error line: {outcome.err!r}"
        return None
    try:
        return reader.accept(sandbox, outcome)
    except Exception as error:  # noqa: BLE001 - a result the checker cannot read is a wrong result
        return f"exit {outcome.code} with a wrong result ({type(error).__name__}: {error}); stdout {outcome.out[:300]!r}"
