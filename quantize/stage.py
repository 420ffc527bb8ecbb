"""Stage 2: quantize a baseline with a calibration set into a complete, servable
compressed-tensors checkpoint, checked on a fixed prompt before it is published."""

from __future__ import annotations

# torch and transformers are imported where used: they take seconds to import, and every
# input check before the quantization itself needs neither.
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate import calibration
from quantgate.core import memory
from quantgate.core.artifacts import (
    Stopwatch,
    atomic_directory,
    read_json,
    sha256_bytes,
)
from quantgate.core.errors import InputError, ModelError, OutputExistsError
from quantgate.core.memory import Placement
from quantgate.core.models import (
    SMOKE_PROMPT,
    TORCH_DTYPES,
    baseline_dtype,
    compute_dtype,
    load_causal_lm,
    release_scratch,
    resolve_model,
    scratch_root,
    tokenizer_hash,
)
from quantgate.quantize import llmcompressor_backend
from quantgate.quantize.autoawq_backend import quantize_with_autoawq
from quantgate.quantize.checkpoint import (
    MIXED,
    RECIPE_FILE,
    GroupSizeFallback,
    GroupSizes,
    Identity,
    LayerFormat,
    MixedLayers,
    QuantizationFailed,
    QuantizedCheckpoint,
    RecipeFile,
    SmokeCheck,
    copy_baseline_files,
    identity,
    write_manifest,
)
from quantgate.quantize.config import UNQUANTIZED, Backend, MixedConfig, QuantizeConfig
from quantgate.quantize.presets import get_preset

SMOKE_NEW_TOKENS = 8
# A checkpoint's largest weight file: transformers gathers a shard in memory before writing it (a
# streamed model's tensors too), so a shard, not the checkpoint, is what saving holds at once. The
# demo model's and the 1.5B model's INT4 and 8-bit checkpoints are one file (under 2 GB).
SHARD_SIZE = "2GB"


@dataclass(frozen=True)
class _Manifest:
    """What `run` and `run_mixed` know of the manifest before the checkpoint is saved (the rest of
    `write_manifest`'s arguments: the recipe and the smoke check come from the saved checkpoint)."""

    what: Identity
    description: str
    group_size: GroupSizes
    calibration_set: calibration.CalibrationSet
    samples_used: int
    model_dir: Path
    dtype: str
    placement: memory.Chosen
    extra: MixedLayers | None = None


def run(
    cfg: QuantizeConfig,
    model: str | Path,
    calibration_dir: str | Path,
    out: str | Path,
    overwrite: bool = False,
    allow_pickle: bool = False,
    placement: Placement = Placement.auto,
) -> QuantizedCheckpoint:
    """Quantize `model` to `cfg.format` with the calibration set at `calibration_dir` into `out`.

    Every input is checked before the (long) quantization starts; the output directory
    appears only when complete and checked. `placement`: the model in memory or streamed from
    disk (auto: streamed where this process's memory does not hold the in-memory estimate);
    the checkpoint is the same either way, its manifest says which was taken.
    """
    stopwatch = Stopwatch()
    preset = get_preset(cfg.format)
    out = Path(out)
    model_dir, calibration_set = _inputs(model, calibration_dir, out, overwrite=overwrite, allow_pickle=allow_pickle)
    if cfg.backend is Backend.autoawq:
        if placement is Placement.streamed:
            raise InputError("placement streamed: AutoAWQ quantizes the model in memory (backend llmcompressor streams)")
        return quantize_with_autoawq(cfg, preset, model_dir=model_dir, calibration_set=calibration_set, out=out,
                                     overwrite=overwrite, stopwatch=stopwatch)

    backend = llmcompressor_backend  # the adapter; its functions are looked up at call time (tests patch them)
    architecture = _architecture(model_dir)
    if architecture is not None:
        backend.check_architecture(preset, architecture)  # before the model loads
    dtype = baseline_dtype(model_dir)
    chosen = choose_placement(model_dir, placement, calibration_set)
    loaded = _load_model(model_dir, compute_dtype(dtype), chosen.placement is Placement.streamed)
    if architecture is None:  # config.json names none: the class transformers chose is what llmcompressor looks up
        backend.check_architecture(preset, type(loaded).__name__)
    plan = backend.plan_for(loaded, preset, cfg)
    recipe = backend.build_recipe(preset, cfg, plan, storage_dtype=TORCH_DTYPES[dtype], model=loaded)
    samples = min(cfg.num_calibration_samples or calibration_set.samples, calibration_set.samples)
    dataset = calibration_set.to_dataset() if backend.needs_calibration(preset, cfg) else None
    _quantize(backend, loaded, recipe, dataset=dataset, samples=samples, seq_len=int(calibration_set.input_ids.shape[1]))
    manifest = _Manifest(
        what=identity(preset, cfg), description=preset.description,
        group_size=GroupSizes(
            requested=cfg.group_size if preset.grouped else None,
            fallbacks=[GroupSizeFallback.model_validate(fallback) for fallback in plan.fallbacks] if plan else [],
            unquantized_layers=plan.unquantized if plan else [],
        ),
        calibration_set=calibration_set, samples_used=samples if dataset is not None else 0,
        model_dir=model_dir, dtype=dtype, placement=chosen,
    )
    held = [loaded]
    del loaded, recipe  # the model's only reference is `held` now (its modifiers may point at its modules)
    return _save(held, out, overwrite=overwrite, stopwatch=stopwatch, manifest=manifest)


def run_mixed(
    cfg: MixedConfig,
    model: str | Path,
    calibration_dir: str | Path,
    out: str | Path,
    overwrite: bool = False,
    allow_pickle: bool = False,
    placement: Placement = Placement.auto,
) -> QuantizedCheckpoint:
    """Quantize `model` into one mixed-precision checkpoint: each linear layer in the format
    `cfg.layers` gives it (or left 16-bit), in one llmcompressor run. Its config.json's
    `config_groups` name every layer (exact-name targets), and its manifest's `layers` table says
    which layer has which scheme."""
    stopwatch = Stopwatch()
    out = Path(out)
    model_dir, calibration_set = _inputs(model, calibration_dir, out, overwrite=overwrite, allow_pickle=allow_pickle)
    backend = llmcompressor_backend
    dtype = baseline_dtype(model_dir)
    chosen = choose_placement(model_dir, placement, calibration_set)
    loaded = _load_model(model_dir, compute_dtype(dtype), chosen.placement is Placement.streamed)
    plan = backend.build_mixed_recipe(loaded, cfg, storage_dtype=TORCH_DTYPES[dtype])
    samples = min(cfg.num_calibration_samples or calibration_set.samples, calibration_set.samples)
    _quantize(backend, loaded, plan.recipe, dataset=calibration_set.to_dataset(), samples=samples,
              seq_len=int(calibration_set.input_ids.shape[1]))
    counts = {name: sum(1 for entry in plan.layers.values() if entry.format == name) for name in cfg.formats}
    left = len(cfg.layers) - len(plan.layers)
    manifest = _Manifest(
        what=Identity(format=MIXED, backend=Backend.llmcompressor.value, config=cfg.model_dump(mode="json")),
        description="mixed precision: " + ", ".join(f"{count} layers {name}" for name, count in counts.items())
                    + f", {left} layers {UNQUANTIZED}",
        group_size=GroupSizes(requested=cfg.group_size, fallbacks=[], unquantized_layers=plan.unquantized),
        calibration_set=calibration_set, samples_used=samples, model_dir=model_dir, dtype=dtype, placement=chosen,
        extra=MixedLayers(layers={name: plan.layers.get(name, LayerFormat(format=UNQUANTIZED, group_size=None))
                                  for name in sorted(cfg.layers)},
                          smoothed=plan.smoothed),
    )
    held = [loaded]
    del loaded, plan  # the model's only reference is `held` now (the recipe's modifiers may point at its modules)
    return _save(held, out, overwrite=overwrite, stopwatch=stopwatch, manifest=manifest)


def _inputs(model: str | Path, calibration_dir: str | Path, out: Path, *, overwrite: bool, allow_pickle: bool
            ) -> tuple[Path, calibration.CalibrationSet]:
    """The baseline's directory and the calibration set, checked (made with the baseline's tokenizer)."""
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists (pass --overwrite to replace it)")
    model_dir = resolve_model(model, allow_pickle=allow_pickle)
    calibration_set = calibration.load(Path(calibration_dir))
    model_tokenizer, _ = tokenizer_hash(model_dir)
    if calibration_set.manifest.tokenizer.sha256 != model_tokenizer:
        raise InputError(
            f"calibration set {calibration_dir} was made with another tokenizer than {model_dir}'s "
            f"(tokenizer sha256 {calibration_set.manifest.tokenizer.sha256[:12]} vs {model_tokenizer[:12]})"
        )
    return model_dir, calibration_set


def _save(held: list[Any], out: Path, *, overwrite: bool, stopwatch: Stopwatch, manifest: _Manifest) -> QuantizedCheckpoint:
    """Cast back to the baseline's dtype, save compressed with the baseline's tokenizer files,
    reload and check on the smoke prompt, write the manifest: all in a staging directory that
    becomes `out` only when complete. `held`: the quantized model, taken out of it here, so that
    once saved nothing keeps it while the smoke check loads the checkpoint again."""
    loaded = held.pop()
    dtype = manifest.dtype
    llmcompressor_backend.restore_storage_dtype(loaded, TORCH_DTYPES[dtype])
    with atomic_directory(out, overwrite=overwrite) as staging:
        # shards of at most 2 GB: a streamed model's are onloaded a shard at a time, never the whole checkpoint
        loaded.save_pretrained(staging, save_compressed=True, max_shard_size=SHARD_SIZE)  # its recipe.yaml from llmcompressor's session
        llmcompressor_backend.release()  # which holds the model until reset: freed before the smoke check loads it again
        release_scratch(loaded)
        del loaded
        gc.collect()
        copy_baseline_files(manifest.model_dir, staging)
        smoke = smoke_check(staging, dtype, manifest.placement.placement is Placement.streamed)
        recipe_text = (staging / RECIPE_FILE).read_text(encoding="utf-8")
        written = write_manifest(
            staging, stopwatch, what=manifest.what, description=manifest.description, group_size=manifest.group_size,
            calibration_set=manifest.calibration_set, samples_used=manifest.samples_used, model_dir=manifest.model_dir,
            dtype=manifest.dtype, extra=manifest.extra, smoke=smoke, placement=manifest.placement.taken,
            recipe=RecipeFile(file=RECIPE_FILE, sha256=sha256_bytes(recipe_text.encode("utf-8")), text=recipe_text),
        )
    return QuantizedCheckpoint(out, written)


def _architecture(model_dir: Path) -> str | None:
    """config.json's `architectures[0]` (e.g. "Qwen2ForCausalLM"), None where it names none."""
    try:
        names = read_json(model_dir / "config.json").get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def choose_placement(model_dir: Path, requested: Placement, calibration_set: calibration.CalibrationSet) -> memory.Chosen:
    """The path this quantization takes (memory.choose), from the model's headers, its calibration
    rows and this process's allowance; InputError where streamed and the scratch disk is short."""
    found = memory.shape(model_dir) if requested is not Placement.memory else None
    if requested is Placement.auto:
        rows, tokens = (int(size) for size in calibration_set.input_ids.shape)
        work = memory.Work(rows=rows, row_tokens=tokens)
        chosen = memory.choose(requested, memory.stage_needs(found or memory.shape(model_dir), "quantize", work), memory.allowance(), "quantize")
    else:
        chosen = memory.choose(requested, memory.StageNeeds(0, 0), None, "quantize")
    if chosen.placement is Placement.streamed:  # it writes the weights it quantizes to the scratch directory
        memory.check_scratch_disk(found or memory.shape(model_dir), scratch_root(), "quantize")
    return chosen


def _load_model(model_dir: Path, dtype: Any, streamed: bool = False, scratch: Path | None = None) -> Any:
    try:
        loaded = load_causal_lm(model_dir, dtype, streamed, scratch)
    except (OSError, ValueError, KeyError) as error:
        raise ModelError(f"cannot load {model_dir} as a causal LM: {str(error).splitlines()[0]}") from error
    return llmcompressor_backend.prepare_model(loaded)


def _quantize(backend: Any, model: Any, recipe: list[Any], *, dataset: Any, samples: int, seq_len: int) -> None:
    from torch.fx.proxy import TraceError

    try:
        backend.quantize_in_place(model, recipe, dataset, samples, seq_len)
    except TraceError as error:
        architecture = type(model).__name__
        raise ModelError(
            f"llmcompressor cannot trace {architecture} for sequential calibration: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else 'TraceError'}"
        ) from error


def smoke_check(checkpoint: Path, dtype: str, streamed: bool = False, scratch: Path | None = None) -> SmokeCheck:
    """Reload the checkpoint (streamed where the quantization was), run the fixed prompt, refuse
    NaN/Inf logits, record a greedy completion."""
    import torch
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        reloaded = load_causal_lm(checkpoint, compute_dtype(dtype), streamed, scratch)
    except Exception as error:  # any load failure means the checkpoint is not publishable
        raise QuantizationFailed(f"the quantized checkpoint does not load: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    ids = tokenizer(SMOKE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        try:
            try:
                # A whole forward first: transformers decompresses compressed-tensors weights on it.
                logits = reloaded(ids).logits
            except Exception as error:  # a checkpoint that loads but cannot run is no more publishable
                raise QuantizationFailed(f"the quantized checkpoint loads but does not run: {type(error).__name__}: "
                                         f"{str(error).splitlines()[0] if str(error) else ''}") from error
            if not torch.isfinite(logits).all():
                bad = int((~torch.isfinite(logits)).sum())
                raise QuantizationFailed(f"the quantized checkpoint produces NaN or Inf logits on the smoke prompt ({bad} values); not published")
            generated = reloaded.generate(ids, max_new_tokens=SMOKE_NEW_TOKENS, do_sample=False)
        finally:
            release_scratch(reloaded)
    completion = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
    return SmokeCheck(prompt=SMOKE_PROMPT, completion=completion, logits_finite=True)
