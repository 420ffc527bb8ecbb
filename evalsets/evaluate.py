"""Stage 4's entry: evaluate one model on golden sets into a results directory, with per-item
results, lm-eval's provenance, and (against a baseline's results) the text-set agreement
metrics. Results are cached by what decides them, so a baseline is evaluated once."""

from __future__ import annotations

# torch, transformers and safetensors are imported where used: they take seconds to import,
# and a cache hit (or `quantgate --help`) needs none of them.
import functools
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import JsonValue

from quantgate import serving
from quantgate.core import memory
from quantgate.core.artifacts import (
    MANIFEST,
    Stopwatch,
    atomic_directory,
    file_hashes,
    library_versions,
    provenance,
    read_json,
    sha256_file,
    sha256_json,
    verify_files,
    write_json,
)
from quantgate.core.console import progress_bar, stderr
from quantgate.core.cpu import cpu_flags, native_bf16
from quantgate.core.errors import InputError, IntegrityError, OutputExistsError
from quantgate.core.headers import read_checkpoint
from quantgate.core.ids import SetRef
from quantgate.core.memory import Placement
from quantgate.core.models import (
    TORCH_DTYPES,
    baseline_dtype,
    load_causal_lm,
    max_sequence_length,
    quantgate_home,
    resolve_model,
    scratch_root,
    tokenizer_hash,
    weights_sha256,
)
from quantgate.core.records import Provenance
from quantgate.evalsets import lm_eval_tasks, text_eval
from quantgate.evalsets import sets as golden_sets
from quantgate.evalsets.config import ComputeDtype, EvalBackend, EvaluateConfig, GoldenItem, Kind
from quantgate.evalsets.results import (
    SCHEMA_VERSION,
    BaselineResults,
    GrownLmEval,
    ItemRecord,
    ItemsFile,
    LmEvalDetails,
    LmEvalProvenance,
    ModelIdentity,
    ResultsManifest,
    RunSettings,
    SetRecord,
    SetResults,
    TextDetails,
)
from quantgate.evalsets.sets import GoldenSet
from quantgate.evalsets.text_eval import BaselineSide
from quantgate.serving import device as device_classes

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

# Bump when a change to this package changes a number: every cached result is then recomputed.
EVALUATOR_VERSION = 3  # 3: log-likelihoods from one pass over a shared context (evalsets.loglikelihood), equal within 1e-4
RECORD_FILE = "record.json"
ITEMS_FILE = "items.json"
TOPK_FILE = "topk.safetensors"
TOKENS_FILE = "tokens.safetensors"
ORDER_RULE = "the first N items of the set's seeded order (items.jsonl line order) after its first `offset`"


@dataclass(frozen=True)
class EvaluationResults:
    """A results directory on disk, verified against its manifest."""

    path: Path
    manifest: ResultsManifest

    def set_dir(self, spec: str) -> Path:
        if spec not in self.manifest.sets:
            raise InputError(f"results in {self.path} hold no {spec}; they hold {', '.join(self.manifest.sets)}")
        return self.path / self.manifest.sets[spec].dir

    def record(self, spec: str) -> SetRecord:
        """One set's record.json (docs/evaluate.md, "Results directory"): its files matched the manifest."""
        record = read_json(self.set_dir(spec) / RECORD_FILE)
        if not isinstance(record, dict):
            raise IntegrityError(f"evaluation results {self.path}: {spec} {RECORD_FILE} is not a JSON object")
        return cast(SetRecord, record)

    def items(self, spec: str) -> ItemsFile:
        """The per-item results of one set (docs/evaluate.md, schema_version 1)."""
        items = read_json(self.set_dir(spec) / ITEMS_FILE)
        if not (isinstance(items, dict) and isinstance(items.get("items"), list) and all(isinstance(item, dict) for item in items["items"])):
            raise IntegrityError(f"evaluation results {self.path}: {spec} {ITEMS_FILE} holds no `items` list of objects")
        for number, item in enumerate(items["items"]):
            wrong = _wrong_item_field(item)
            if wrong:
                raise IntegrityError(f"evaluation results {self.path}: {spec} {ITEMS_FILE} item {number}: {wrong}")
        return cast(ItemsFile, items)  # every item has an id, and the fields the gates compute with their types

    def token_values(self, spec: str) -> dict[str, NDArray[np.float32]]:
        """A text set's per-position values against the baseline ({"kl": float32 array, ...}, item
        order, numpy), split by nothing; {} when the set has none (no baseline, or not a text set)."""
        path = self.set_dir(spec) / TOKENS_FILE
        if not path.is_file():
            return {}
        from safetensors.numpy import load_file

        return dict(load_file(path))

    @property
    def from_cache(self) -> dict[str, bool]:
        return {spec: entry.from_cache for spec, entry in self.manifest.sets.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


# The per-item fields the gates compute with (docs/evaluate.md, items.json), each with its type
# check, where an item has it; every item has an `id`.
_ITEM_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "id": (lambda value: isinstance(value, str), "a string"),
    "index": (lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a count"),
    "tokens": (lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a count"),
    "bytes": (lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a count"),
    "top1_matches": (_is_number, "a number"),
    "nll": (_is_number, "a number"),
    "kl_sum": (_is_number, "a number"),
    "top_prob_change_sum": (_is_number, "a number"),
    "loglikelihood": (_is_number, "a number"),
    "loglikelihoods": (lambda value: isinstance(value, list) and all(map(_is_number, value)), "a list of numbers"),
    "choice_chars": (lambda value: isinstance(value, list) and all(map(_is_number, value)), "a list of numbers"),
    "metrics": (lambda value: isinstance(value, dict) and all(map(_is_number, value.values())), "an object of numbers"),
}


def _wrong_item_field(item: dict[str, JsonValue]) -> str:
    """What is wrong with one per-item record as read, before it is trusted as an ItemRecord ('' when
    nothing): no id, or a field the gates compute with that is not of its type."""
    for field, (valid, what) in _ITEM_FIELDS.items():
        if field in item and not valid(item[field]):
            return f"`{field}` is {type(item[field]).__name__}, not {what}"
        if field == "id" and field not in item:  # the gates pair a baseline's and a candidate's items by id
            return f"no `{field}`"
    return ""


def load_results(path: str | Path) -> EvaluationResults:
    """A results directory, its files verified against its manifest; a manifest that is not a
    results manifest (unreadable, another artifact's, another schema_version, fields of the wrong
    type, a set directory outside `path`) is one line (InputError or IntegrityError)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise InputError(f"{path} is not an evaluation results directory (no {MANIFEST})")
    manifest = ResultsManifest.read(manifest_path)
    what = f"evaluation results {path}"
    verify_files(path, manifest.files, what)
    base = path.resolve()
    for spec, entry in manifest.sets.items():
        folder = base / entry.dir
        if not folder.resolve().is_relative_to(base) or not folder.is_dir():
            raise IntegrityError(f"{what}: the directory of {spec!r}, {entry.dir!r}, is not a directory inside it")
    return EvaluationResults(path, manifest)


# ---- identities and the cache key -----------------------------------------------------------


def as_served(results: EvaluationResults, settings: dict[str, str], wanted: Iterable[str] | None = None) -> EvaluateConfig | None:
    """The settings that evaluate, through the serving engine under `settings`, the items
    `results` hold of its multiple-choice, last-word and generation sets (text sets are scored in
    the reference numerics only: the serve check compares them as served), of those `wanted`
    (NAME or NAME@vN; None: all); None: no such set."""
    refs = None if wanted is None else [SetRef.parse(name) for name in wanted]
    sets = {spec: entry for spec, entry in results.manifest.sets.items() if entry.kind is not Kind.text
            and (refs is None or any(ref.matches(SetRef.parse(spec)) for ref in refs))}
    if not sets:
        return None
    made = results.manifest.config
    return EvaluateConfig(evalsets=tuple(sets), limits={spec: entry.limit for spec, entry in sets.items() if entry.limit},
                          offsets={spec: entry.offset for spec, entry in sets.items() if entry.offset},
                          backend=EvalBackend.vllm, engine_settings=dict(settings), batch_size=made.batch_size,
                          bootstrap_iters=made.bootstrap_iters, use_cache=made.use_cache, allow_pickle=made.allow_pickle)


def model_identity(model_dir: Path) -> ModelIdentity:
    """What decides a model's numbers: its weight bytes, its config (quantization scheme
    included: two checkpoints may share weights and differ in activation quantization), its tokenizer."""
    return ModelIdentity(path=str(model_dir), weights_sha256=weights_sha256(model_dir),
                         config_sha256=sha256_file(model_dir / "config.json"), tokenizer_sha256=tokenizer_hash(model_dir)[0],
                         storage_dtype=baseline_dtype(model_dir))


def run_settings(cfg: EvaluateConfig, golden: GoldenSet, device: str, compute: ComputeChoice) -> RunSettings:
    """The settings that can change one set's numbers (and nothing else, so the cache hits)."""
    kind, dtype = golden.kind, compute.dtype
    limit = cfg.limit_for(golden.name, golden.spec)
    if kind is Kind.text:
        return _with_offset(cfg, golden, {"limit": limit, "batch_size": cfg.batch_size, "device": device, "dtype": dtype,
                                          "dtype_basis": compute.basis, "evaluator_version": EVALUATOR_VERSION, "runner": "transformers",
                                          "max_tokens": cfg.max_tokens, "top_k": cfg.top_k, "exact_positions": cfg.exact_positions})
    settings: RunSettings = {"limit": limit, "batch_size": cfg.batch_size, "device": device, "dtype": dtype,
                             "evaluator_version": EVALUATOR_VERSION, "runner": f"lm-eval/{cfg.backend.value}", "num_fewshot": 0,
                             "bootstrap_iters": cfg.bootstrap_iters}
    if cfg.backend is not EvalBackend.vllm:
        settings["dtype_basis"] = compute.basis
    else:  # vLLM's own dtype (the checkpoint's), and its release: an upgrade recomputes
        settings.update({"dtype": "auto", "engine": serving_env().identity()})
        if cfg.engine_settings:  # absent when none: keys made before settings existed stay valid
            # and the device class, whose kernels decide what a setting computes (W4A8 on AMX only)
            settings["engine_settings"] = dict(sorted(cfg.engine_settings.items()))
            settings["device_class"] = device_classes.local_class("cuda" if device.startswith("cuda") else "cpu")
    grown = [n for n in cfg.grown_from_for(golden.name, golden.spec) if limit is None or n < limit]
    if grown:  # these items extend the cached results of the earlier looks (in the key: other bits)
        settings["grown_from"] = grown
    return _with_offset(cfg, golden, settings)


def serving_env() -> serving.ServingEnv:
    """The serving environment `--backend vllm` runs in, or one line saying how to build it."""
    found = serving.find()
    if found is None:
        raise InputError("--backend vllm needs the serving environment: run `quantgate serving setup`")
    return found


def _with_offset(cfg: EvaluateConfig, golden: GoldenSet, settings: RunSettings) -> RunSettings:
    """`settings` with the set's offset, where it has one (absent at 0: keys made before offsets
    existed stay valid)."""
    offset = cfg.offset_for(golden.name, golden.spec)
    if not offset:
        return settings
    with_offset = settings.copy()
    with_offset["offset"] = offset
    return with_offset


def cache_key(identity: ModelIdentity, golden: GoldenSet, settings: RunSettings, baseline_topk: str | None) -> str:
    return sha256_json(
        {
            "model": identity.numbers(),
            "evalset": {"spec": golden.spec, "sha256": golden.sha256},
            "settings": settings,
            "libraries": library_versions(),
            "baseline_topk_sha256": baseline_topk,
        }
    )


def cache_root(home: Path | None = None) -> Path:
    return (home or quantgate_home()) / "eval-cache"


def _cached(root: Path, key: str) -> Path | None:
    """The cache entry of `key` if it is there and whole: its manifest is this key's and names
    exactly the files it holds, each with its sha256. A torn or changed entry is never trusted:
    None, and it is computed again (and replaced)."""
    entry = root / key
    try:
        _check_entry(entry, key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IntegrityError):
        return None  # absent or damaged: computed again
    return entry


def _check_entry(entry: Path, key: str) -> dict[str, str]:
    """A cache entry's files table (relative path -> sha256, from its manifest), after checking
    the entry against it (IntegrityError if not)."""
    manifest = read_json(entry / MANIFEST)
    files = manifest["files"]
    if manifest.get("key") != key or not isinstance(files, dict):
        raise IntegrityError(f"cached evaluation {key[:12]}: its manifest is not this entry's")
    present = {path.relative_to(entry).as_posix() for path in entry.rglob("*") if path.is_file() and path.name != MANIFEST}
    if present != set(files):
        raise IntegrityError(f"cached evaluation {key[:12]}: holds other files than its manifest names")
    verify_files(entry, files, f"cached evaluation {key[:12]}")
    return dict(files)


def _entry_good(key: str) -> Callable[[Path], bool]:
    """Whether a cache entry another process published is whole (atomic_directory's `keep`)."""
    return lambda entry: _cached(entry.parent, key) is not None


# ---- the stage ------------------------------------------------------------------------------


@dataclass
class _SetJob:
    """One golden set to evaluate: what decides its numbers, its cache key, and (once found or
    computed) the cache entry that holds its result."""

    golden: GoldenSet
    settings: RunSettings
    key: str
    baseline_topk: str | None
    entry: Path | None = None
    from_cache: bool = False


class Evaluator:
    """One model, evaluated on as many golden-set runs as asked, loaded once (on the first run
    that misses the cache) and kept: sequential evaluation asks for the same model again at
    every look."""

    def __init__(self, model: str | Path, *, allow_pickle: bool = False, home: Path | None = None,
                 identity: ModelIdentity | None = None) -> None:
        self.model_dir = resolve_model(model, allow_pickle=allow_pickle)
        # `identity`: the model's, hashed already by the caller (a run hashes its baseline once)
        self.identity = identity if identity is not None else model_identity(self.model_dir)
        self.home = home
        # (device, dtype, streamed) -> the model loaded there
        self._loaded: dict[tuple[str, str, bool], _LoadedModel] = {}

    def loaded(self, device: str, dtype: str, streamed: bool = False) -> _LoadedModel:
        if (device, dtype, streamed) not in self._loaded:
            self._loaded[(device, dtype, streamed)] = _LoadedModel(self.model_dir, device, dtype, streamed,
                                                                   scratch_root(self.home))
        return self._loaded[(device, dtype, streamed)]

    def placement(self, cfg: EvaluateConfig, device: str) -> memory.Chosen:
        """The path this model's evaluation takes (memory.choose): streamed only on the CPU (the
        offload reads each module's tensors into the device it runs on: a GPU's memory is not
        what is checked here)."""
        if device != "cpu":
            if cfg.placement is Placement.streamed:
                raise InputError(f"placement: streamed evaluation runs on the CPU, not on {device}")
            return memory.Chosen(Placement.memory, f"evaluate: in memory on {device}")
        if cfg.placement is Placement.auto:
            work = memory.Work(batch=cfg.batch_size, tokens=cfg.max_tokens)
            chosen = memory.choose(cfg.placement, memory.stage_needs(memory.shape(self.model_dir), "evaluate", work),
                                   memory.allowance(), "evaluate")
        else:
            chosen = memory.choose(cfg.placement, memory.StageNeeds(0, 0), None, "evaluate")
        if chosen.placement is Placement.streamed:
            found = read_checkpoint(self.model_dir)
            if "quantization_config" in (found.config or {}):  # a checkpoint's weights are decompressed to the scratch directory
                memory.check_scratch_disk(memory.shape(self.model_dir, found), scratch_root(), "evaluate")
        return chosen

    def cache_keys(self, cfg: EvaluateConfig) -> dict[str, str]:
        """Set spec -> the cache key this model's results on it would have under `cfg`, without a
        baseline (what a results directory made with these settings, evaluator and libraries records)."""
        device = cfg.device or default_device()
        choice = compute_dtype_name(device, self.identity.storage_dtype, cfg.dtype)
        keys = {}
        for spec in cfg.evalsets:
            golden = golden_sets.load(spec, self.home)
            keys[golden.spec] = cache_key(self.identity, golden, run_settings(cfg, golden, device, choice), None)
        return keys

    def run(self, cfg: EvaluateConfig, out: str | Path, baseline_results: str | Path | None = None,
            overwrite: bool = False) -> EvaluationResults:
        """Evaluate this model on `cfg.evalsets` into `out` (written atomically); see `run`."""
        stopwatch = Stopwatch()
        out = Path(out)
        if out.exists() and not overwrite:
            raise OutputExistsError(f"{out} already exists (pass --overwrite to replace it)")
        if cfg.backend is EvalBackend.vllm:
            serving_env()  # refused here, in one line, when the serving environment is not built
        home, identity = self.home, self.identity
        goldens = [golden_sets.load(spec, home) for spec in cfg.evalsets]
        baseline = load_results(baseline_results) if baseline_results is not None else None
        device = cfg.device or default_device()
        choice = compute_dtype_name(device, identity.storage_dtype, cfg.dtype)
        root = cache_root(home)

        jobs = []
        for golden in goldens:
            settings = run_settings(cfg, golden, device, choice)
            if baseline is not None and golden.spec in baseline.manifest.sets:
                refuse_other_numerics(baseline.record(golden.spec)["settings"], settings, golden.spec)
            topk = _baseline_topk_sha256(baseline, golden, settings) if golden.kind is Kind.text and baseline else None
            job = _SetJob(golden, settings, cache_key(identity, golden, settings, topk), topk)
            if cfg.use_cache and (entry := _cached(root, job.key)) is not None:
                job.entry, job.from_cache = entry, True
            jobs.append(job)

        missing = [job for job in jobs if job.entry is None]
        load_seconds = placement = None
        if missing:
            chosen = self.placement(cfg, device)
            placement = chosen.taken
            if chosen.placement is Placement.streamed and cfg.backend is EvalBackend.hf:
                stderr.print(f"{self.model_dir}: {chosen.reason}", soft_wrap=True, highlight=False, markup=False)
            load_seconds = _compute(cfg, self.loaded(device, choice.dtype, chosen.placement is Placement.streamed), missing,
                                    identity=identity, baseline=baseline, root=root)

        with atomic_directory(out, overwrite=overwrite) as staging:
            entries = {job.golden.spec: _publish(job, staging) for job in jobs}
            manifest = ResultsManifest(
                model=identity,
                baseline=None if baseline is None else BaselineResults(results=str(baseline.path.resolve()), model=baseline.manifest.model),
                config=cfg,
                sets=entries,
                model_load_seconds=load_seconds,
                placement=placement,
                files=file_hashes(staging),
                provenance=Provenance.model_validate(provenance(stopwatch)),
            )
            manifest.write(staging / MANIFEST)
        return EvaluationResults(out, manifest)


def run(
    cfg: EvaluateConfig,
    model: str | Path,
    out: str | Path,
    baseline_results: str | Path | None = None,
    overwrite: bool = False,
    home: Path | None = None,
) -> EvaluationResults:
    """Evaluate `model` on `cfg.evalsets` into `out` (written atomically).

    Text sets need `baseline_results` (a results directory of the baseline on the same sets and
    limits) for KL divergence and top-1 agreement; without it they report perplexity and bits
    per byte. Either way the results keep this model's own text-set cache (final hidden states,
    output head, top-k), so it can serve as a baseline itself without being run again.
    """
    return Evaluator(model, allow_pickle=cfg.allow_pickle, home=home).run(cfg, out, baseline_results, overwrite)


def _publish(job: _SetJob, staging: Path) -> SetResults:
    """Copy one set's cache entry into the results being written; its line of their manifest.
    The copy is checked against the entry's manifest: bytes that changed after the entry was
    found good are refused, never published."""
    assert job.entry is not None  # found in the cache or computed by now
    directory = job.golden.spec
    files = _check_entry(job.entry, job.key)
    for relative in files:  # file by file (not copytree, which folds errors into one without an errno: a full disk)
        target = staging / directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(str(job.entry / relative), str(target))
    verify_files(staging / directory, files, f"cached evaluation {job.key[:12]} (as copied)")
    record: SetRecord = read_json(staging / directory / RECORD_FILE)
    return SetResults(dir=directory, kind=job.golden.kind, sha256=job.golden.sha256, primary=record["primary"],
                      metrics=record["metrics"], items=record["items"], limit=job.settings["limit"],
                      offset=job.settings.get("offset", 0), cache_key=job.key, from_cache=job.from_cache,
                      seconds=record["timing"]["seconds"])


def _link_or_copy(source: str, target: str) -> None:
    """Results share the cache's bytes where the filesystem allows (a text set's cache is tens of MB);
    both sides stay verifiable by their manifests' hashes."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def default_device() -> str:
    # No GPU device node, no CUDA (or ROCm) device: answer without importing torch (~1.5 s),
    # so that a cache hit from the command line stays quick.
    if sys.platform == "linux" and not any(os.path.exists(node) for node in ("/dev/nvidiactl", "/dev/kfd")):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ComputeChoice:
    """The dtype a model is evaluated in on this machine, and why (both in every set's settings)."""

    dtype: str  # a torch dtype's name
    basis: str


def compute_dtype_name(device: str, storage_dtype: str, requested: ComputeDtype = ComputeDtype.auto,
                       flags: frozenset[str] | None = None) -> ComputeChoice:
    """The dtype to evaluate in: what the config asks for, else (auto) the storage dtype on an
    accelerator and FP32 on every CPU. BF16 on a CPU with BF16 arithmetic (avx512_bf16, AMX) is
    2.1x to 2.5x faster, but it is not the default: measured on the 1.5B model (AVX-512 with
    avx512_bf16), evaluating both sides in BF16 moved fp8-e4m3's perplexity change from +5.77% to
    +3.26% (bound 3%) and its top-1 agreement from 0.951 to 0.939 (bound 0.95), eight and three
    times the tenth of a bound issue 36 allows (docs/evaluate.md, "Compute dtype"). Asked for
    (`bfloat16`), it is what a run computes in, recorded as such; on a CPU without BF16
    arithmetic (`flags`) its products are emulated and far slower."""
    if requested is not ComputeDtype.auto:
        flag = native_bf16(cpu_flags() if flags is None else flags) if device == "cpu" and requested is ComputeDtype.bfloat16 else None
        emulated = " (emulated: this CPU has no BF16 arithmetic)" if device == "cpu" and requested is ComputeDtype.bfloat16 and flag is None else ""
        return ComputeChoice(requested.value, f"{requested.value}, as the evaluation asks{emulated}")
    if device != "cpu":
        return ComputeChoice(TORCH_DTYPES.get(storage_dtype, "float32"), f"{device}: the weights' storage dtype")
    return ComputeChoice("float32", "cpu: FP32 (BF16 moves gate estimates: docs/evaluate.md, Compute dtype)")


def refuse_other_numerics(baseline: RunSettings, candidate: RunSettings, spec: str) -> None:
    """A candidate's results on `spec` are compared with the baseline's only where both were
    computed by the same runner in the same dtype: BF16 rounding on one side alone moves every
    gate's estimate (docs/evaluate.md, "Compute dtype")."""
    if baseline.get("runner") == candidate.get("runner") and baseline.get("dtype") != candidate.get("dtype"):
        raise InputError(f"{spec}: the baseline was evaluated in {baseline.get('dtype')}, the candidate in {candidate.get('dtype')}; "
                         "evaluate both in the same dtype (evaluation.dtype, --dtype)")


def _baseline_topk_sha256(baseline: EvaluationResults, golden: GoldenSet, settings: RunSettings) -> str:
    """The baseline's cached top-k for a text set, checked to line up with this evaluation."""
    if golden.spec not in baseline.manifest.sets:
        raise InputError(f"the baseline results in {baseline.path} hold no {golden.spec}; evaluate the baseline on it first")
    entry = baseline.manifest.sets[golden.spec]
    if entry.sha256 != golden.sha256:
        raise IntegrityError(f"the baseline results for {golden.spec} were made on a different set (sha256 differs)")
    base_settings = baseline.record(golden.spec)["settings"]
    for name in ("limit", "max_tokens", "offset", "dtype"):
        if base_settings.get(name) != settings.get(name):
            raise InputError(
                f"{golden.spec}: the baseline was evaluated with {name}={base_settings.get(name)}, this run uses "
                f"{settings.get(name)}; evaluate both on the same items (limit, offset), max tokens and compute dtype"
            )
    return baseline.manifest.files[f"{entry.dir}/{TOPK_FILE}"]


def _compute(
    cfg: EvaluateConfig,
    loaded: _LoadedModel,
    jobs: list[_SetJob],
    *,
    identity: ModelIdentity,
    baseline: EvaluationResults | None,
    root: Path,
) -> float:
    """Evaluate every set not in the cache (the model loaded once, on first use), store each
    result in the cache; returns the seconds the model took to load (kept out of every set's own
    timing; 0 when it was loaded already)."""
    loading = Stopwatch()
    if cfg.backend is EvalBackend.hf or any(job.golden.kind is Kind.text for job in jobs):
        loaded.transformers()
    load_seconds = loading.seconds
    # the earlier looks that grown results extend, made first where the cache lost them (each
    # with its own progress bar, before this one starts)
    earlier = {job.key: _earlier_look(cfg, loaded, job, identity=identity, root=root) for job in jobs if job.settings.get("grown_from")}
    with progress_bar(items_per_second=True) as bar:
        for job in jobs:
            golden = job.golden
            items = _items(golden, job.settings)
            task = bar.add_task(f"{golden.spec} ({golden.kind.value})", total=len(items))
            if job.key in earlier:
                bar.update(task, completed=len(earlier[job.key].items))
            stopwatch = Stopwatch()
            # shared by runs: an entry another process published meanwhile (the same inputs) is kept
            with atomic_directory(root / job.key, keep=_entry_good(job.key)) as staging:
                if golden.kind is Kind.text:
                    result = _run_text(cfg, loaded, job, items, baseline=baseline, advance=functools.partial(bar.advance, task))
                else:
                    result = _run_lm_eval(cfg, loaded, job, items, staging=staging, advance=functools.partial(bar.advance, task),
                                          earlier=earlier.get(job.key))
                bar.update(task, completed=len(items))
                _write_entry(staging, cfg, job, identity=identity, baseline=baseline, items=items, result=result,
                             stopwatch=stopwatch)
                write_json(staging / MANIFEST, {"artifact": "evaluation-cache-entry", "key": job.key, "files": file_hashes(staging)})
            job.entry = root / job.key
            record: SetRecord = read_json(job.entry / RECORD_FILE)
            shown = ", ".join(f"{name} {value:.4g}" for name, value in record["metrics"].items() if "stderr" not in name)
            grown = f" ({len(earlier[job.key].items)} from the earlier look)" if job.key in earlier else ""
            stderr.print(
                f"{golden.spec}: {len(items)} items{grown} in {record['timing']['seconds']:.1f} s "
                f"({record['timing']['items_per_second']:.2f} items/s): {shown}",
                soft_wrap=True, highlight=False,
            )
    return load_seconds


class _LoadedModel:
    """The model under evaluation, loaded on first use in its compute dtype (compute_dtype_name) and
    decompressed up front: whole in memory, or `streamed` from disk (memory.Placement; its scratch
    directory, for decompressed weights, under `scratch`)."""

    def __init__(self, model_dir: Path, device: str, dtype: str, streamed: bool = False, scratch: Path | None = None) -> None:
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.streamed, self.scratch = streamed, scratch
        self._model: Any = None
        self._tokenizer: Any = None
        self._lms: dict[EvalBackend, Any] = {}

    def transformers(self) -> tuple[Any, Any]:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            with stderr.status(f"loading {self.model_dir}"):
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                dtype = getattr(torch, self.dtype)
                if self.streamed:
                    model = load_causal_lm(self.model_dir, dtype, True, self.scratch).eval()
                else:
                    model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
                # compressed-tensors checkpoints decompress on the first full forward pass;
                # do it here, before lm-eval or anything else touches a submodule
                with torch.no_grad():
                    model(input_ids=torch.tensor([[self._tokenizer.eos_token_id or 0]], device=self.device))
            self._model = model
        return self._model, self._tokenizer

    def lm(self, cfg: EvaluateConfig) -> Any:
        """lm-eval's model for `cfg.backend`, one per backend (a process keeps an evaluator per model,
        and a run may evaluate one checkpoint both ways: in the reference numerics, and as vLLM serves it)."""
        if cfg.backend not in self._lms:
            if cfg.backend is EvalBackend.vllm:
                self._lms[cfg.backend] = lm_eval_tasks.served_model(self.model_dir, serving_env(), cfg.batch_size)
            else:
                model, tokenizer = self.transformers()
                self._lms[cfg.backend] = lm_eval_tasks.hf_model(model, tokenizer, cfg.batch_size)
        lm = self._lms[cfg.backend]
        if cfg.backend is EvalBackend.vllm:  # this run's own settings (the engine starts per lm-eval call)
            lm.settings = dict(cfg.engine_settings)
        return lm


@dataclass(frozen=True)
class _EarlierLook:
    """The cached results of the look before a set's (evaluation grown over looks)."""

    items: list[ItemRecord]
    key: str
    lm_eval: LmEvalProvenance | GrownLmEval  # its record's: an lm-eval set's


@dataclass(frozen=True)
class _SetResult:
    """One set evaluated: what its record.json, items.json and tensor files are written from."""

    metrics: dict[str, float]
    details: TextDetails | LmEvalDetails
    items: list[ItemRecord]
    lm_eval: LmEvalProvenance | GrownLmEval | None  # None: a text set (transformers, not lm-eval)
    tensors: dict[str, Any] = dataclass_field(default_factory=dict)  # torch tensors: topk.safetensors
    token_values: dict[str, Any] = dataclass_field(default_factory=dict)  # torch tensors: tokens.safetensors


def _earlier_look(cfg: EvaluateConfig, loaded: _LoadedModel, job: _SetJob, *, identity: ModelIdentity,
                  root: Path) -> _EarlierLook:
    """The cached entry of the look before `job`'s (made first if the cache lost it): its
    per-item records and its key, which `job`'s results extend."""
    grown = list(job.settings["grown_from"])
    settings = job.settings.copy()
    settings["limit"] = grown[-1]
    del settings["grown_from"]
    if grown[:-1]:
        settings["grown_from"] = grown[:-1]
    earlier = _SetJob(job.golden, settings, cache_key(identity, job.golden, settings, None), None)
    entry = _cached(root, earlier.key)
    if entry is None:
        _compute(cfg, loaded, [earlier], identity=identity, baseline=None, root=root)
        entry = root / earlier.key
    return _EarlierLook(items=read_json(entry / ITEMS_FILE)["items"], key=earlier.key, lm_eval=read_json(entry / RECORD_FILE)["lm_eval"])


def _items(golden: GoldenSet, settings: RunSettings) -> list[GoldenItem]:
    """The items one evaluation covers: past the set's offset, its first `limit`."""
    offset, limit = settings.get("offset", 0), settings["limit"]
    return golden.items(None if limit is None else offset + limit)[offset:]


def _run_lm_eval(cfg: EvaluateConfig, loaded: _LoadedModel, job: _SetJob, items: list[GoldenItem], *, staging: Path,
                 advance: Callable[[float], None], earlier: _EarlierLook | None = None) -> _SetResult:
    """One set through lm-eval: its first `limit` items, or, growing an earlier look's cached
    results, only the items past them (`samples`), with the set's metrics over all of them."""
    golden = job.golden
    lm = loaded.lm(cfg)
    start, offset = 0 if earlier is None else len(earlier.items), job.settings.get("offset", 0)
    fresh = items[start:]
    per_request = lm_eval_tasks.requests_per_item(golden, fresh)
    lm.on_rows = lambda rows: advance(rows / per_request)
    if earlier is None and not offset:
        results = lm_eval_tasks.run_task(lm, golden, staging, job.settings["limit"], cfg.bootstrap_iters)
    else:  # the items past the earlier look, or past the offset: lm-eval's doc indices
        results = lm_eval_tasks.run_task(lm, golden, staging, None, cfg.bootstrap_iters,
                                         samples=list(range(offset + start, offset + len(items))))
    records = lm_eval_tasks.per_item(golden, results["samples"][lm_eval_tasks.task_name(golden)])
    if earlier is None:
        return _SetResult(
            metrics=lm_eval_tasks.summary(golden, results),
            details={"samples": results["n-samples"][lm_eval_tasks.task_name(golden)]},
            items=records,
            lm_eval=lm_eval_tasks.provenance(golden, results),
        )
    records = earlier.items + records
    return _SetResult(
        metrics=lm_eval_tasks.summary_of_items(golden, records),
        details={"samples": {"original": len(items), "effective": len(records)},
                 "grown_from": {"items": start, "cache_key": earlier.key}, "evaluated_here": len(fresh)},
        items=records,
        lm_eval={"grown_from": earlier.lm_eval, "items_past_it": lm_eval_tasks.provenance(golden, results)},
    )


def _run_text(cfg: EvaluateConfig, loaded: _LoadedModel, job: _SetJob, items: list[GoldenItem], *,
              baseline: EvaluationResults | None, advance: Callable[[int], None]) -> _SetResult:
    model, tokenizer = loaded.transformers()
    side = None
    if job.baseline_topk is not None and baseline is not None:
        side = load_side(baseline, job.golden.spec, job.baseline_topk)
    positions = max_sequence_length(loaded.model_dir)
    max_tokens = min(cfg.max_tokens, positions) if positions else cfg.max_tokens
    run = text_eval.evaluate_text(
        model, tokenizer, items, max_tokens=max_tokens, top_k=cfg.top_k, exact_positions=cfg.exact_positions,
        batch_size=cfg.batch_size, baseline=side, advance=advance,
    )
    return _SetResult(metrics=run.metrics, details=run.details, items=run.items, lm_eval=None, tensors=run.tensors,
                      token_values=getattr(run, "token_values", None) or {})


def load_side(baseline: EvaluationResults, spec: str, sha256: str) -> BaselineSide:
    """A text set's cached side of `baseline` (its tokens, top-k and, where kept, its output-layer inputs):
    what a candidate is compared with, and what the serve check rebuilds the gated distributions from."""
    from safetensors.torch import load_file

    tensors = load_file(baseline.set_dir(spec) / TOPK_FILE)
    weight = tensors.get("head_weight")
    return BaselineSide(
        token_ids=tensors["token_ids"],
        item_tokens=tensors["item_tokens"].tolist(),
        topk_ids=tensors["topk_ids"],
        topk_logprobs=tensors["topk_logprobs"],
        topk_residual=tensors["topk_residual"],
        head_inputs=tensors.get("head_inputs"),
        head_weight=None if weight is None else weight.float(),  # once, not per item
        head_bias=tensors.get("head_bias"),
        exact_positions=tensors["exact_positions"].tolist() if "exact_positions" in tensors else [],
        exact_logprobs=tensors.get("exact_logprobs"),
        sha256=sha256,
    )


def _write_entry(
    staging: Path,
    cfg: EvaluateConfig,
    job: _SetJob,
    *,
    identity: ModelIdentity,
    baseline: EvaluationResults | None,
    items: list[GoldenItem],
    result: _SetResult,
    stopwatch: Stopwatch,
) -> None:
    seconds = stopwatch.seconds
    golden, metrics = job.golden, dict(result.metrics)
    evaluated = result.details["evaluated_here"] if "evaluated_here" in result.details else len(items)
    # a text set without a baseline to agree with: perplexity is what this run measured
    unagreed = golden.kind is Kind.text and "kl_divergence" not in metrics
    primary = "perplexity" if unagreed else golden.manifest["scoring"]["primary"]
    baseline_model = None if baseline is None else baseline.manifest.model.numbers()
    model = identity.numbers()
    items_file: ItemsFile = {
            "schema_version": SCHEMA_VERSION,
            "evalset": golden.spec,
            "sha256": golden.sha256,
            "kind": golden.kind.value,
            "primary": primary,
            "limit": job.settings["limit"],
            "offset": job.settings.get("offset", 0),
            "items_total": golden.size,
            "order": ORDER_RULE,
            "model": model,
            "baseline": baseline_model if golden.kind is Kind.text else None,
            "items": result.items,
    }
    write_json(staging / ITEMS_FILE, items_file)
    if result.tensors:
        from safetensors.torch import save_file

        save_file(result.tensors, staging / TOPK_FILE, metadata={"evalset": golden.spec, "top_k": str(cfg.top_k)})
    if result.token_values:
        from safetensors.torch import save_file

        # per scored position, in item order: the candidate's KL and top-token probability change
        # against the baseline (docs/evaluate.md, tokens.safetensors); the tails are gated from it
        save_file({name: values.float().contiguous() for name, values in result.token_values.items()},
                  staging / TOKENS_FILE, metadata={"evalset": golden.spec})
    record: SetRecord = {
            "schema_version": SCHEMA_VERSION,
            "evalset": golden.spec,
            "sha256": golden.sha256,
            "kind": golden.kind.value,
            "primary": primary,
            "metrics": metrics,
            "details": result.details,
            "items": len(items),
            "items_total": golden.size,
            "limit": job.settings["limit"],
            "settings": job.settings,
            "cache_key": job.key,
            "model": model,
            "baseline": baseline_model,
            "lm_eval": result.lm_eval,
            # the items evaluated here: grown results count only those past the earlier look
            "timing": {"seconds": round(seconds, 3), "items_per_second": round(evaluated / seconds, 3) if seconds else None},
            "provenance": provenance(stopwatch),
    }
    write_json(staging / RECORD_FILE, record)
