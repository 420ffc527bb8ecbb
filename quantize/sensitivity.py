"""Per-layer-group sensitivity: what quantizing one fused layer group to one format costs the
model's next-token distribution, in nats per token, from a diagonal Fisher (second-order) proxy,
and the check of its ranking against the KL measured by quantizing each decoder block alone."""

from __future__ import annotations

# torch, transformers, compressed_tensors and scipy are imported where used: they take seconds to
# import, and the config, the input key or `quantgate --help` need none of them.
import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from pydantic import Field, field_validator

from quantgate import calibration
from quantgate.core.artifacts import (
    MANIFEST,
    Stopwatch,
    atomic_directory,
    file_hashes,
    provenance,
    read_json,
    sha256_json,
    verify_files,
    write_json,
)
from quantgate.core.console import progress_bar
from quantgate.core.errors import InputError, IntegrityError, ModelError, OutputExistsError
from quantgate.core.hf_config import QuantizationArgs
from quantgate.core.models import baseline_dtype, compute_dtype, resolve_model, tokenizer_hash, weights_sha256
from quantgate.core.validation import Strict
from quantgate.quantize.config import QuantizeConfig
from quantgate.quantize.fusion import layer_groups
from quantgate.quantize.groups import effective_group_size
from quantgate.quantize.llmcompressor_backend import linear_layers, prepare_model
from quantgate.quantize.presets import get_preset

if TYPE_CHECKING:
    from torch import Tensor

KIND = "sensitivity"
SCHEMA_VERSION = 1
REPORT_FILE = "sensitivity.json"
METHOD = "diagonal-fisher"
FORMULA = "score(group, format) = 1/2 * sum_i F_ii * (RTN_format(W)_i - W_i)^2"
QUANTIZER = "round-to-nearest: min-max scales (compressed-tensors calculate_qparams), compressed-tensors fake_quantize"
# Rows a validation forward takes at once: the log-probabilities of a batch of 4 x 256 tokens over
# a 49,152-token vocabulary are 200 MB in FP32, and are kept for every batch.
VALIDATION_BATCH = 4
_BLOCK_MODULE = re.compile(r"^(?P<module>.*?\.(?P<index>\d+))\.")


class FisherVariant(str, Enum):
    # labels drawn from the model's own next-token distribution: the true Fisher, the Hessian
    # of the KL at zero change (Martens, "New insights and perspectives on the natural gradient
    # method", JMLR 2020)
    sampled = "sampled"
    # the calibration text's real next tokens: the empirical Fisher, which is not in general
    # the same matrix (Kunstner, Hennig and Balles, "Limitations of the empirical Fisher
    # approximation for natural gradient descent", NeurIPS 2019)
    empirical = "empirical"


class SensitivityConfig(Strict):
    """Which formats to score, on how much of the calibration set, with which Fisher."""

    formats: tuple[str, ...] = Field(min_length=1, description="preset names, e.g. gptq-int4, smoothquant-w8a8")
    rows: int | None = Field(default=None, gt=0, description="calibration rows to use (default: all)")
    # chosen on the demo model: docs/sensitivity.md, "Which Fisher"
    fisher: FisherVariant = FisherVariant.sampled
    seed: int = Field(default=0, ge=0, description="seed of the sampled Fisher's labels")
    ignore: tuple[str, ...] = Field(default=("lm_head",), description="module names or 're:' regexes left unscored")
    group_size: int = Field(default=128, description="INT4 formats: weights per scale (fallback as quantize.groups)")
    validation: bool = Field(default=False, description="also measure each block's KL and the rank correlation")

    @field_validator("formats")
    @classmethod
    def _known_formats(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            get_preset(name)  # InputError naming the valid formats
        if len(set(value)) != len(value):
            raise ValueError(f"a format is named twice: {', '.join(value)}")
        return value

    @field_validator("group_size")
    @classmethod
    def _multiple_of_32(cls, value: int) -> int:
        return QuantizeConfig._multiple_of_32(value)  # the quantize stage's rule, one place


# --- sensitivity.json (docs/sensitivity.md): written and read as dicts, named field by field ------


class GroupScore(TypedDict):
    """One fused layer group and its predicted KL (nats per token) per format."""

    name: str
    block: int | None
    role: str
    layers: list[str]
    parameters: int
    group_sizes: list[int | None]
    scores: dict[str, float]


class BlockCheck(TypedDict):
    block: int
    proxy: float
    measured_kl: float


class FormatCheck(TypedDict):
    spearman: float | None
    p_value: float | None
    blocks: list[BlockCheck]


class Validation(TypedDict):
    """The proxy's ranking of decoder blocks against the KL measured by quantizing each alone."""

    method: str
    rows: int
    tokens: int
    formats: dict[str, FormatCheck]
    seconds: float


class Seconds(TypedDict):
    fisher: float
    scores: float


class SensitivityReport(TypedDict):
    """sensitivity.json: every layer group's score per format, and the validation (None unless asked)."""

    method: str
    formula: str
    unit: str
    fisher: str
    seed: int
    quantizer: str
    group_size: int
    formats: list[str]
    rows: int
    tokens: int
    totals: dict[str, float]
    groups: list[GroupScore]
    seconds: Seconds
    validation: Validation | None


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity artifact on disk: its manifest and `sensitivity.json` (the report)."""

    path: Path
    manifest: dict[str, Any]
    report: SensitivityReport
    reused: bool = False

    def scores(self, fmt: str) -> dict[str, float]:
        """Group name -> predicted KL (nats per token) of quantizing that group alone to `fmt`."""
        return {group["name"]: group["scores"][fmt] for group in self.report["groups"]}

    def ranked(self, fmt: str) -> list[tuple[str, float]]:
        """(group, score), most sensitive first."""
        return sorted(self.scores(fmt).items(), key=lambda pair: pair[1], reverse=True)

    def total(self, fmt: str) -> float:
        return float(self.report["totals"][fmt])


def input_key(cfg: SensitivityConfig, baseline_weights_sha256: str, calibration_fingerprint: str) -> str:
    """What decides an artifact's content: an existing one with this key is reused as it is."""
    return sha256_json({"kind": KIND, "schema_version": SCHEMA_VERSION, "config": cfg.model_dump(mode="json"),
                        "baseline_weights_sha256": baseline_weights_sha256, "calibration_fingerprint": calibration_fingerprint})


def run(cfg: SensitivityConfig, model: str | Path, calibration_dir: str | Path, out: str | Path,
        overwrite: bool = False, allow_pickle: bool = False) -> Sensitivity:
    """Score every layer group of `model` for every format of `cfg` on the calibration set, and
    (with `cfg.validation`) check the ranking against measured per-block KL; write it to `out`.

    An `out` that already holds this very result is returned as is (reused); one that holds
    anything else is refused unless `overwrite`. Every input is checked before the model loads.
    """
    stopwatch = Stopwatch()
    out = Path(out)
    model_dir = resolve_model(model, allow_pickle=allow_pickle)
    calibration_set = _checked_calibration(Path(calibration_dir), model_dir)
    rows = _rows(cfg, calibration_set.samples)
    baseline_sha256 = weights_sha256(model_dir)
    key = input_key(cfg, baseline_sha256, calibration_set.fingerprint)
    if out.exists():
        existing = _reusable(out, key)
        if existing is not None:
            return existing
        if not overwrite:
            raise OutputExistsError(f"{out} already exists and holds something else (pass --overwrite to replace it)")
    loaded = load_model(model_dir, compute_dtype(baseline_dtype(model_dir)))
    input_ids, attention_mask = calibration_set.input_ids[:rows], calibration_set.attention_mask[:rows]
    report = score(loaded, input_ids, attention_mask, cfg)
    if cfg.validation:
        report["validation"] = validate(loaded, input_ids, attention_mask, report)
    with atomic_directory(out, overwrite=True) as staging:
        write_json(staging / REPORT_FILE, report)
        manifest = {
            "kind": KIND, "schema_version": SCHEMA_VERSION, "input_key": key, "config": cfg.model_dump(mode="json"),
            "baseline": {"path": str(model_dir), "weights_sha256": baseline_sha256},
            "calibration": {"path": str(calibration_set.path), "fingerprint": calibration_set.fingerprint,
                            "rows_used": rows, "seq_len": int(input_ids.shape[1])},
            "files": file_hashes(staging), "provenance": provenance(stopwatch),
        }
        write_json(staging / MANIFEST, manifest)
    return Sensitivity(out, manifest, report)


def load(path: str | Path) -> Sensitivity:
    """Read a sensitivity artifact, refusing one that is missing, of another kind or damaged."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise InputError(f"{path} is not a sensitivity artifact (no {MANIFEST})")
    try:
        manifest = read_json(path / MANIFEST)
        if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
            kind = manifest.get("kind", "unknown") if isinstance(manifest, dict) else "unknown"
            raise InputError(f"{path} is a {kind!r} artifact, not a sensitivity artifact")
        verify_files(path, manifest["files"], "sensitivity artifact")
        report = read_json(path / REPORT_FILE)
        if not {"formats", "groups", "totals"} <= set(report):
            raise InputError(f"{path / REPORT_FILE} lacks formats, groups or totals")
    except (json.JSONDecodeError, KeyError, TypeError, OSError, IntegrityError) as error:
        raise InputError(f"{path}: damaged sensitivity artifact ({type(error).__name__}: {error})") from error
    return Sensitivity(path, manifest, report)


def _reusable(out: Path, key: str) -> Sensitivity | None:
    try:
        existing = load(out)
    except InputError:
        return None
    if existing.manifest.get("input_key") != key:
        return None
    return Sensitivity(existing.path, existing.manifest, existing.report, reused=True)


def _checked_calibration(calibration_dir: Path, model_dir: Path) -> calibration.CalibrationSet:
    if not calibration_dir.exists():
        raise InputError(f"calibration set {calibration_dir} does not exist")
    calibration_set = calibration.load(calibration_dir)
    model_tokenizer, _ = tokenizer_hash(model_dir)
    if calibration_set.manifest.tokenizer.sha256 != model_tokenizer:
        raise InputError(f"calibration set {calibration_dir} was made with another tokenizer than {model_dir}'s")
    return calibration_set


def _rows(cfg: SensitivityConfig, available: int) -> int:
    if cfg.rows is not None and cfg.rows > available:
        raise InputError(f"rows: {cfg.rows} asked, the calibration set has {available}")
    return cfg.rows or available


def load_model(model_dir: Path, dtype: Any) -> Any:
    """The baseline as a transformers causal LM in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError, KeyError) as error:
        raise ModelError(f"cannot load {model_dir} as a causal LM: {str(error).splitlines()[0]}") from error
    return prepare_model(loaded).eval()  # experts as the Linear layers the quantize stage plans


# --- the proxy ------------------------------------------------------------------------------------


def score(model: Any, input_ids: Any, attention_mask: Any, cfg: SensitivityConfig) -> SensitivityReport:
    """The report (`sensitivity.json` without validation): every layer group's score per format."""
    stopwatch = Stopwatch()
    layers = linear_layers(model, list(cfg.ignore))
    if not layers:
        raise ModelError("the model has no Linear layer left to score once ignore is applied")
    names = [name for name, _ in layers]
    fisher, tokens = fisher_diagonal(model, input_ids, attention_mask, names, variant=cfg.fisher, seed=cfg.seed)
    fisher_seconds = stopwatch.seconds
    weights = {name: model.get_submodule(name).weight.detach() for name in names}
    groups: list[GroupScore] = []
    for group in layer_groups(names):
        scores = {fmt: sum(layer_score(weights[name], fisher[name], fmt, cfg.group_size) for name in group.layers)
                  for fmt in cfg.formats}
        groups.append({
            "name": group.name, "block": group.block, "role": group.role, "layers": list(group.layers),
            "parameters": sum(int(weights[name].numel()) for name in group.layers),
            "group_sizes": [effective_group_size(int(weights[name].shape[1]), cfg.group_size) for name in group.layers],
            "scores": scores,
        })
    return {
        "method": METHOD, "formula": FORMULA, "unit": "nats per token (predicted KL increase)",
        "fisher": cfg.fisher.value, "seed": cfg.seed, "quantizer": QUANTIZER, "group_size": cfg.group_size,
        "formats": list(cfg.formats), "rows": int(input_ids.shape[0]), "tokens": tokens,
        "totals": {fmt: sum(group["scores"][fmt] for group in groups) for fmt in cfg.formats},
        "groups": groups,
        "seconds": {"fisher": round(fisher_seconds, 3), "scores": round(stopwatch.seconds - fisher_seconds, 3)},
        "validation": None,
    }


def fisher_diagonal(model: Any, input_ids: Any, attention_mask: Any, layers: list[str], *,
                    variant: FisherVariant, seed: int) -> tuple[dict[str, Tensor], int]:
    """The diagonal Fisher of each layer's weight, per scored token, and the tokens scored.

    One backward a row: the squared gradient of the row's summed log-likelihood. With sampled
    labels the cross-token terms of that square have expectation zero (each token's score has
    mean zero given its context), so the sum over rows, divided by the tokens, estimates the
    per-token Fisher, whose quadratic form 1/2 d^T F d is the KL a small change d costs.
    """
    import torch

    weights = [model.get_submodule(name).weight for name in layers]
    for parameter in model.parameters():
        parameter.requires_grad_(False)  # no gradient for embeddings, norms, lm_head: not scored
    for weight in weights:
        weight.requires_grad_(True)
    squares = [torch.zeros_like(weight) for weight in weights]
    generator = torch.Generator().manual_seed(seed)
    tokens = 0
    try:
        with progress_bar() as bar:
            task = bar.add_task(f"sensitivity: {variant.value} Fisher, one backward a row", total=int(input_ids.shape[0]))
            for row in range(int(input_ids.shape[0])):
                log_likelihood, counted = _row_log_likelihood(
                    model, input_ids[row:row + 1], attention_mask[row:row + 1], variant=variant, generator=generator)
                if counted:
                    for square, gradient in zip(squares, torch.autograd.grad(log_likelihood, weights), strict=True):
                        square.add_(gradient.square())
                    tokens += counted
                bar.advance(task)
    finally:
        for weight in weights:
            weight.requires_grad_(False)
    if tokens == 0:
        raise InputError("the calibration rows hold no token with a next token to score")
    return {name: square / tokens for name, square in zip(layers, squares, strict=True)}, tokens


def _row_log_likelihood(model: Any, ids: Any, mask: Any, *, variant: FisherVariant, generator: Any) -> tuple[Any, int]:
    """Summed log-probability of one row's labels (sampled or real next tokens), and their count."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    scored = (mask[0, :-1] * mask[0, 1:]).bool()  # a position and its next token are both real
    if variant is FisherVariant.sampled:
        # inverse-CDF sampling: a quarter of torch.multinomial's time over a 49,152-token vocabulary
        cumulative = log_probs.detach().exp().cumsum(dim=-1)
        uniform = torch.rand(cumulative.shape[0], 1, generator=generator, dtype=cumulative.dtype) * cumulative[:, -1:]
        labels = torch.searchsorted(cumulative, uniform).squeeze(1).clamp_(max=cumulative.shape[1] - 1)
    else:
        labels = ids[0, 1:]
    picked = log_probs.gather(1, labels.unsqueeze(1)).squeeze(1)
    return picked[scored].sum(), int(scored.sum())


def weight_args(fmt: str, in_features: int, group_size: int) -> QuantizationArgs | None:
    """The compressed-tensors QuantizationArgs (as a dict) `fmt` gives a weight of this input width,
    with the group-size fallback of quantize.groups; None where the layer stays unquantized."""
    args = QuantizationArgs(**get_preset(fmt).weights)
    if args.get("strategy") == "group":
        size = effective_group_size(in_features, group_size)
        if size is None:
            return None
        args["group_size"] = size
    return args


def fake_quantize_weight(weight: Any, args: QuantizationArgs) -> Any:
    """Round-to-nearest quantize-dequantize of a [out, in] weight as llmcompressor's RTN does it.

    The min/max reduction is written here (the statistics of llmcompressor's `memoryless_minmax`
    weight observer, its default for weights): its Observer class needs a module to attach to
    and a fusion handler; the scales, zero points and rounding are compressed-tensors' own.
    """
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    quantization_args = QuantizationArgs(**args)
    strategy = str(args.get("strategy", "tensor"))
    value = weight.detach().float()
    if strategy == "group":
        grouped = value.unflatten(-1, (-1, int(args["group_size"])))
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [out, groups]
    elif strategy == "channel":
        low, high = value.amin(dim=1, keepdim=True), value.amax(dim=1, keepdim=True)  # [out, 1]
    elif strategy == "tensor":
        low, high = value.amin().reshape(1), value.amax().reshape(1)
    else:
        raise InputError(f"weight strategy {strategy!r} is not scored (tensor, channel or group only)")
    with torch.no_grad():
        scale, zero_point = calculate_qparams(low, high, quantization_args)
        return fake_quantize(value, scale, zero_point, quantization_args)


def layer_score(weight: Any, fisher: Any, fmt: str, group_size: int) -> float:
    """1/2 * sum F_ii (Q(W)_i - W_i)^2: the predicted KL (nats per token) of quantizing this layer."""
    args = weight_args(fmt, int(weight.shape[1]), group_size)
    if args is None:
        return 0.0
    error = fake_quantize_weight(weight, args) - weight.detach().float()
    return 0.5 * float((fisher * error.square()).sum())


# --- the validation -------------------------------------------------------------------------------


def block_totals(report: SensitivityReport, fmt: str) -> dict[int, float]:
    """The proxy summed over each decoder block's groups (groups outside a block left out)."""
    totals: dict[int, float] = {}
    for group in report["groups"]:
        if group["block"] is not None:
            totals[group["block"]] = totals.get(group["block"], 0.0) + float(group["scores"][fmt])
    return dict(sorted(totals.items()))


def rank_correlation(proxy: list[float], measured: list[float]) -> tuple[float | None, float | None]:
    """Spearman's rho and its p-value; None where undefined (fewer than two blocks, a constant side)."""
    from scipy.stats import spearmanr

    if len(proxy) < 2:
        return None, None
    result = spearmanr(proxy, measured)
    rho, p_value = float(result.statistic), float(result.pvalue)
    return (rho if math.isfinite(rho) else None), (p_value if math.isfinite(p_value) else None)


def kl_per_token(base_log_probs: Any, log_probs: Any) -> Any:
    """KL(base || other) at each position of [positions, vocabulary] log-probabilities, in nats."""
    return (base_log_probs.exp() * (base_log_probs - log_probs)).sum(dim=-1)


def validate(model: Any, input_ids: Any, attention_mask: Any, report: SensitivityReport) -> Validation:
    """Measure, for each decoder block and format, the mean per-token KL(baseline || quantized) of
    round-to-nearest quantizing that block's scored layers alone on the given rows, and Spearman's
    rank correlation between it and the proxy summed over the block."""
    stopwatch = Stopwatch()
    blocks = _block_layers(report)
    baseline = _baseline_pass(model, input_ids, attention_mask, {index: module for index, (module, _) in blocks.items()})
    formats: dict[str, FormatCheck] = {}
    with progress_bar() as bar:
        task = bar.add_task("sensitivity: KL of each block quantized alone", total=len(report["formats"]) * len(blocks))
        measured_by_format = {fmt: {index: _block_kl(model, baseline=baseline, block=index, layers=blocks[index][1], fmt=fmt,
                                                     group_size=int(report["group_size"]), advance=lambda: bar.advance(task))
                                    for index in blocks}
                              for fmt in report["formats"]}
    for fmt, measured in measured_by_format.items():
        proxy = block_totals(report, fmt)
        order = sorted(measured)
        rho, p_value = rank_correlation([proxy.get(index, 0.0) for index in order], [measured[index] for index in order])
        formats[fmt] = {"spearman": rho, "p_value": p_value,
                        "blocks": [{"block": index, "proxy": proxy.get(index, 0.0), "measured_kl": measured[index]}
                                   for index in order]}
    return {"method": "RTN-quantize one block's scored layers, mean per-token KL(baseline || quantized) on the rows",
            "rows": int(input_ids.shape[0]), "tokens": int(attention_mask.sum()), "formats": formats,
            "seconds": round(stopwatch.seconds, 3)}


def _block_layers(report: SensitivityReport) -> dict[int, tuple[str, list[str]]]:
    """Block index -> (the block's module name, its scored layers), from the report's groups."""
    blocks: dict[int, tuple[str, list[str]]] = {}
    for group in report["groups"]:
        for layer in group["layers"] if group["block"] is not None else []:
            match = _BLOCK_MODULE.match(layer)
            if match is None or int(match["index"]) != group["block"]:
                raise ModelError(f"cannot tell the decoder block of layer {layer}")
            blocks.setdefault(group["block"], (match["module"], []))[1].append(layer)
    if not blocks:
        raise ModelError("no scored layer sits in a numbered decoder block: nothing to validate")
    return dict(sorted(blocks.items()))


@dataclass
class _Baseline:
    batches: list[tuple[Any, Any]]  # (input ids, attention mask) of each micro-batch of rows
    log_probs: list[Any]  # per batch: [rows, positions, vocabulary]
    outputs: dict[int, list[Any]]  # per block: per batch, what the block returned
    modules: dict[int, Any]


def _baseline_pass(model: Any, input_ids: Any, attention_mask: Any, modules: dict[int, str]) -> _Baseline:
    """The unquantized model's log-probabilities per batch of rows, and every block's output per
    batch (so a quantized block's run can replay the blocks before it instead of computing them)."""
    import torch

    blocks = {index: model.get_submodule(name) for index, name in modules.items()}
    batches = [(input_ids[start:start + VALIDATION_BATCH], attention_mask[start:start + VALIDATION_BATCH])
               for start in range(0, int(input_ids.shape[0]), VALIDATION_BATCH)]
    baseline = _Baseline(batches, [], {index: [] for index in blocks}, blocks)
    hooks = [module.register_forward_hook(lambda _module, _inputs, output, index=index: baseline.outputs[index].append(output))
             for index, module in blocks.items()]
    try:
        with torch.no_grad():
            for ids, mask in batches:
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                baseline.log_probs.append(torch.log_softmax(logits.float(), dim=-1))
    finally:
        for hook in hooks:
            hook.remove()
    return baseline


def _block_kl(model: Any, *, baseline: _Baseline, block: int, layers: list[str], fmt: str, group_size: int,
              advance: Callable[[], None]) -> float:
    """Mean per-token KL with block `block`'s layers quantized and every earlier block replayed."""
    import torch

    # Replaying is exact only when every block before this one is known and replaced.
    replay = [baseline.modules[index] for index in range(block)] if all(index in baseline.modules for index in range(block)) else []
    total, count = 0.0, 0
    with _quantized(model, layers, fmt, group_size), torch.no_grad():
        for batch, (ids, mask) in enumerate(baseline.batches):
            with _replaying(replay, baseline.outputs[block - 1][batch] if replay else None):
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            kl = kl_per_token(baseline.log_probs[batch], torch.log_softmax(logits.float(), dim=-1))
            real = mask.bool()
            total += float(kl[real].sum())
            count += int(real.sum())
    advance()
    return total / max(count, 1)


@contextlib.contextmanager
def _quantized(model: Any, layers: list[str], fmt: str, group_size: int) -> Iterator[None]:
    """The layers' weights round-to-nearest quantized to `fmt` for the block; restored after."""
    originals = {}
    try:
        for name in layers:
            weight = model.get_submodule(name).weight
            args = weight_args(fmt, int(weight.shape[1]), group_size)
            if args is not None:
                originals[name] = weight.detach().clone()
                weight.data.copy_(fake_quantize_weight(weight, args).to(weight.dtype))
        yield
    finally:
        for name, original in originals.items():
            model.get_submodule(name).weight.data.copy_(original)


@contextlib.contextmanager
def _replaying(modules: list[Any], output: Any) -> Iterator[None]:
    """Each of `modules` returns `output` (the baseline output of the last of them) without
    computing: an instance `forward` shadows the class's for the duration."""
    for module in modules:
        module.forward = lambda *_args, **_kwargs: output
    try:
        yield
    finally:
        for module in modules:
            del module.forward
