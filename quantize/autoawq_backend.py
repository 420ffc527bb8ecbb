"""The reference AWQ backend: AutoAWQ (deprecated upstream, optional extra `autoawq`) on the
same model and calibration set, written as an AutoAWQ GEMM checkpoint. A second, independent
AWQ implementation to gate llmcompressor's against.

AutoAWQ takes one group size for the whole model, so the group-size fallback here picks the
largest size (no larger than requested) that divides every quantized layer's width.
"""

from __future__ import annotations

# awq, torch and transformers are imported where used: they take seconds to import, and the
# reference backend is an optional extra that `quantgate --help` must not need.
import importlib.util
from pathlib import Path
from typing import Any

from pydantic import JsonValue

from quantgate.core.artifacts import Stopwatch, atomic_directory
from quantgate.core.errors import InputError
from quantgate.core.models import SMOKE_PROMPT, baseline_dtype, compute_dtype
from quantgate.quantize.checkpoint import (
    AutoAWQRecipe,
    CommonGroupSize,
    GroupSizes,
    QuantizationFailed,
    QuantizedCheckpoint,
    SmokeCheck,
    copy_baseline_files,
    identity,
    write_manifest,
)
from quantgate.quantize.compat import autoawq_plain_torch_on_cpu
from quantgate.quantize.config import QuantizeConfig
from quantgate.quantize.groups import effective_group_size
from quantgate.quantize.presets import Preset

INSTALL_HINT = "--backend autoawq needs the optional extra: pip install 'quantgate[autoawq]'"


def require_autoawq() -> None:
    if importlib.util.find_spec("awq") is None:
        raise InputError(INSTALL_HINT)


def common_group_size(widths: list[int], requested: int) -> int:
    sizes = {effective_group_size(width, requested) for width in widths}
    if None in sizes:
        raise InputError("--backend autoawq: some layer width is not a multiple of 32; AutoAWQ cannot quantize it")
    # sizes (None ruled out above) are powers of two times 32 here, so the smallest divides every width
    return min(size for size in sizes if size is not None)


def quantize_with_autoawq(cfg: QuantizeConfig, preset: Preset, *, model_dir: Path, calibration_set: Any,
                          out: Path, overwrite: bool, stopwatch: Stopwatch) -> QuantizedCheckpoint:
    if preset.name != "awq-int4":
        raise InputError(f"--backend autoawq makes awq-int4 checkpoints only, not {preset.name}")
    require_autoawq()
    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    dtype = baseline_dtype(model_dir)
    # trust_remote_code defaults to True in AutoAWQ; quantgate never turns it on implicitly.
    model = AutoAWQForCausalLM.from_pretrained(str(model_dir), torch_dtype=compute_dtype(dtype), trust_remote_code=False, safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ignore = [pattern for pattern in cfg.ignore if pattern != "lm_head"]
    widths = [module.in_features for name, module in model.model.named_modules()
              if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")]
    group_size = common_group_size(widths, cfg.group_size)
    quant_config: dict[str, JsonValue] = {"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": "GEMM",
                    "modules_to_not_convert": [*ignore] or None}
    samples = min(cfg.num_calibration_samples or calibration_set.samples, calibration_set.samples)
    rows = [row.tolist() for row in calibration_set.input_ids[:samples]]
    seq_len = int(calibration_set.input_ids.shape[1])
    model.quantize(
        tokenizer,
        quant_config=quant_config,
        calib_data=rows,
        max_calib_samples=samples,
        max_calib_seq_len=seq_len,
        duo_scaling=bool(cfg.awq_duo_scaling),
    )
    with atomic_directory(out, overwrite=overwrite) as staging:
        model.save_quantized(str(staging), safetensors=True)
        del model
        copy_baseline_files(model_dir, staging)
        smoke = _smoke(staging, dtype, tokenizer, QuantizationFailed)
        fallbacks = [] if group_size == cfg.group_size else [
            CommonGroupSize(layer="(all)", requested=cfg.group_size, group_size=group_size, quantized=True,
                            reason="AutoAWQ takes one group size; this is the largest that divides every layer width")
        ]
        manifest = write_manifest(
            staging, stopwatch, what=identity(preset, cfg),
            description="AWQ INT4 (AutoAWQ reference implementation, GEMM layout)",
            recipe=AutoAWQRecipe(autoawq_quant_config=quant_config),
            group_size=GroupSizes(requested=cfg.group_size, fallbacks=list(fallbacks), unquantized_layers=[]),
            calibration_set=calibration_set, samples_used=samples, model_dir=model_dir, dtype=dtype, smoke=smoke,
        )
    return QuantizedCheckpoint(out, manifest)


def _smoke(checkpoint: Path, dtype: str, tokenizer: Any, failure: type[Exception]) -> SmokeCheck:
    """AutoAWQ's own loader (its GEMM layer dequantizes in plain torch on a CPU)."""
    import torch
    from awq import AutoAWQForCausalLM

    try:
        with autoawq_plain_torch_on_cpu():
            reloaded = AutoAWQForCausalLM.from_quantized(str(checkpoint), fuse_layers=False, trust_remote_code=False,
                                                         torch_dtype=torch.float16, device_map={"": "cpu"})
    except Exception as error:  # any load failure means the checkpoint is not publishable
        raise failure(f"the AutoAWQ checkpoint does not load: {type(error).__name__}: {error}") from error
    ids = tokenizer(SMOKE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad(), autoawq_plain_torch_on_cpu():
        logits = reloaded.model(ids).logits
        if not torch.isfinite(logits).all():
            raise failure("the AutoAWQ checkpoint produces NaN or Inf logits on the smoke prompt; not published")
        generated = reloaded.model.generate(ids, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
    return SmokeCheck(prompt=SMOKE_PROMPT, completion=completion, logits_finite=True)
