"""Build a calibration set: sample documents from a source with a seed, tokenize them with
the model's tokenizer, pack them into rows, and write the token ids with a manifest whose
fingerprint identifies the set byte for byte."""

from __future__ import annotations

# torch, safetensors, transformers and datasets are imported where used: they take seconds
# to import, and `quantgate --help` or a reused set needs none of them.
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

from quantgate.calibration.config import CalibrationConfig, Packing
from quantgate.calibration.manifest import KIND, CalibrationManifest, CalibrationSource, Selection, TokenizerIdentity
from quantgate.calibration.sources import ChatMessage, Documents, load_documents
from quantgate.core.artifacts import (
    MANIFEST,
    Stopwatch,
    UnreadableJSON,
    atomic_directory,
    file_hashes,
    provenance,
    sha256_bytes,
    sha256_json,
    verify_files,
)
from quantgate.core.console import progress_bar
from quantgate.core.errors import InputError, IntegrityError, ModelError, OutputExistsError, SourceError
from quantgate.core.models import max_sequence_length, resolve_model, tokenizer_hash
from quantgate.core.records import Provenance

TOKENS_FILE = "tokens.safetensors"
TEXT_FILE = "text.jsonl"
_ENCODE_BATCH = 64


@dataclass(frozen=True)
class CalibrationSet:
    """A calibration set on disk, loaded and verified against its manifest."""

    path: Path
    manifest: CalibrationManifest
    input_ids: Any  # torch.LongTensor [samples, seq_len]
    attention_mask: Any  # torch.LongTensor [samples, seq_len]
    reused: bool = False

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @property
    def samples(self) -> int:
        return int(self.input_ids.shape[0])

    def texts(self) -> list[str]:
        """Each row decoded (text.jsonl); a file that is not that is an IntegrityError line."""
        where = f"calibration set {self.path}: {TEXT_FILE}"
        try:
            with open(self.path / TEXT_FILE, encoding="utf-8") as stream:
                rows = [json.loads(line) for line in stream if line.strip()]
        except (OSError, ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise IntegrityError(f"{where}: unreadable ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from error
        if not all(isinstance(row, dict) and isinstance(row.get("text"), str) for row in rows):
            raise IntegrityError(f"{where}: a line is not an object with a `text` string")
        return [row["text"] for row in rows]

    def to_dataset(self) -> Any:
        """A `datasets.Dataset` with input_ids and attention_mask, as llmcompressor takes it."""
        import datasets

        return datasets.Dataset.from_dict(
            {"input_ids": self.input_ids.tolist(), "attention_mask": self.attention_mask.tolist()}
        )


class SelectionSettings(TypedDict):
    """What decides which tokens end up in the set (the manifest's Selection, less the documents used)."""

    samples_requested: int
    seq_len: int
    seed: int
    field: str
    split: str | None
    packing: str  # a Packing's value
    chat_template: bool
    allow_fewer: bool
    min_document_tokens: int | None  # document packing only
    shuffle: str


def selection_settings(cfg: CalibrationConfig) -> SelectionSettings:
    """Everything that decides which tokens end up in the set, besides source and tokenizer."""
    return {
        "samples_requested": cfg.samples,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "field": cfg.field,
        "split": cfg.split,
        "packing": cfg.packing.value,
        "chat_template": cfg.chat_template,
        "allow_fewer": cfg.allow_fewer,
        "min_document_tokens": cfg.min_document_tokens if cfg.packing is Packing.document else None,
        "shuffle": "python random.Random(seed).shuffle over document indices",
    }


def run(cfg: CalibrationConfig, out: Path, overwrite: bool = False) -> CalibrationSet:
    """Build the calibration set `cfg` describes into `out`.

    Same inputs give the same fingerprint; if `out` already holds exactly this set, it is
    returned as is (reused). Every check runs before anything is written.
    """
    stopwatch = Stopwatch()
    out = Path(out)
    model_dir = resolve_model(cfg.model, allow_pickle=cfg.allow_pickle)
    limit = max_sequence_length(model_dir)
    if limit is not None and cfg.seq_len > limit:
        raise InputError(f"--seq-len {cfg.seq_len} exceeds the model's maximum sequence length {limit}")
    tokenizer_sha256, tokenizer_files = tokenizer_hash(model_dir)
    documents = load_documents(cfg.source, cfg.field, cfg.split)
    settings = selection_settings(cfg)
    input_key = sha256_json({"source_sha256": documents.sha256, "tokenizer_sha256": tokenizer_sha256, "selection": settings})
    if out.exists():
        existing = _reusable(out, input_key)
        if existing is not None:
            return existing
        if not overwrite:
            raise OutputExistsError(f"{out} already exists and holds something else (pass --overwrite to replace it)")

    tokenizer = _load_tokenizer(model_dir, cfg)
    rows, masks, used = _pack(tokenizer, documents, _shuffled(len(documents.texts), cfg.seed), cfg)
    _check_count(rows, cfg)

    import torch
    from safetensors.torch import save_file

    input_ids = torch.tensor(rows, dtype=torch.int32)
    attention_mask = torch.tensor(masks, dtype=torch.int8)
    tokens_sha256 = sha256_bytes(input_ids.numpy().tobytes() + attention_mask.numpy().tobytes())
    fingerprint = sha256_json({"kind": KIND, "source_sha256": documents.sha256, "tokenizer_sha256": tokenizer_sha256,
                               "selection": settings, "samples": len(rows), "tokens_sha256": tokens_sha256})
    with atomic_directory(out, overwrite=True) as staging:
        save_file({"input_ids": input_ids, "attention_mask": attention_mask}, staging / TOKENS_FILE)
        _write_texts(staging / TEXT_FILE, tokenizer, rows)
        CalibrationManifest(
            fingerprint=fingerprint,
            input_key=input_key,
            model=str(model_dir),
            source=CalibrationSource(spec=cfg.source, kind=documents.kind, description=documents.description,
                                     sha256=documents.sha256, documents=len(documents.texts)),
            # by its written names: `class` is a keyword, and mypy reads the field by its alias
            tokenizer=TokenizerIdentity.model_validate({"sha256": tokenizer_sha256, "files": tokenizer_files,
                                                        "class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
                                                        "eos_token_id": tokenizer.eos_token_id}),
            selection=Selection.model_validate({**settings, "documents_used": used}),
            samples=len(rows),
            seq_len=cfg.seq_len,
            tokens=int(attention_mask.sum()),
            tokens_sha256=tokens_sha256,
            files=file_hashes(staging),
            config=cfg,
            provenance=Provenance.model_validate(provenance(stopwatch)),
        ).write(staging / MANIFEST)
    return load(out)


def _shuffled(count: int, seed: int) -> list[int]:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return order


def _check_count(rows: list[list[int]], cfg: CalibrationConfig) -> None:
    if not rows:
        raise SourceError(f"calibration source {cfg.source} yields no usable sample of {cfg.seq_len} tokens")
    if len(rows) < cfg.samples and not cfg.allow_fewer:
        raise SourceError(
            f"calibration source {cfg.source} yields only {len(rows)} samples of {cfg.seq_len} tokens, "
            f"{cfg.samples} asked (pass --allow-fewer to accept them)"
        )


def _write_texts(path: Path, tokenizer: Any, rows: list[list[int]]) -> None:
    """Each row decoded, one JSON line each: what the overlap check reads (special tokens left out)."""
    with open(path, "w", encoding="utf-8") as stream:
        for index, row in enumerate(rows):
            text = tokenizer.decode(row, skip_special_tokens=True)
            stream.write(json.dumps({"index": index, "text": text}, ensure_ascii=False) + "\n")


def _reusable(out: Path, input_key: str) -> CalibrationSet | None:
    try:
        existing = load(out)
    except (IntegrityError, InputError):
        return None
    if existing.manifest.input_key != input_key:
        return None
    return CalibrationSet(existing.path, existing.manifest, existing.input_ids, existing.attention_mask, reused=True)


def _load_tokenizer(model_dir: Path, cfg: CalibrationConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load the tokenizer of {model_dir}: {str(error).splitlines()[0]}") from error
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"--chat-template: the tokenizer of {model_dir} has no chat template")
    return tokenizer


def _encoded(tokenizer: Any, documents: Documents, order: list[int], cfg: CalibrationConfig) -> Iterator[tuple[int, list[int]]]:
    """(document index, token ids) in shuffled order, encoded in batches."""
    # concat joins documents with eos itself, so no per-document special tokens there;
    # a document row is encoded the way the model sees a prompt (with its bos, if any).
    add_special_tokens = cfg.packing is Packing.document and not cfg.chat_template
    for start in range(0, len(order), _ENCODE_BATCH):
        batch = order[start : start + _ENCODE_BATCH]
        strings = [_as_string(tokenizer, documents.texts[index], cfg, index) for index in batch]
        encoded = tokenizer(strings, add_special_tokens=add_special_tokens)["input_ids"]
        yield from zip(batch, encoded, strict=True)


def _as_string(tokenizer: Any, text: str | list[ChatMessage], cfg: CalibrationConfig, index: int) -> str:
    if isinstance(text, list):
        if not text:  # an empty conversation: an empty document, skipped as an empty text is
            return ""
        if not cfg.chat_template:
            raise SourceError(f"document {index} is a list of chat messages: pass --chat-template")
        return cast(str, tokenizer.apply_chat_template(text, tokenize=False))  # transformers is untyped here
    if cfg.chat_template:
        return cast(str, tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False))
    return text


def _pack(tokenizer: Any, documents: Documents, order: list[int], cfg: CalibrationConfig) -> tuple[list[list[int]], list[list[int]], list[int]]:
    rows: list[list[int]] = []
    used: list[int] = []
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    masks: list[list[int]] = []
    stream: list[int] = []
    with progress_bar() as bar:
        task = bar.add_task("tokenizing calibration samples", total=cfg.samples)
        for index, ids in _encoded(tokenizer, documents, order, cfg):
            if len(rows) == cfg.samples:
                break
            if cfg.packing is Packing.concat:
                if not ids:
                    continue
                used.append(index)
                stream.extend(ids)
                if eos is not None:
                    stream.append(eos)
                while len(stream) >= cfg.seq_len and len(rows) < cfg.samples:
                    rows.append(stream[: cfg.seq_len])
                    masks.append([1] * cfg.seq_len)
                    del stream[: cfg.seq_len]
                    bar.advance(task)
            else:
                if len(ids) < cfg.min_document_tokens:
                    continue
                used.append(index)
                ids = ids[: cfg.seq_len]
                padding = cfg.seq_len - len(ids)
                rows.append(ids + [pad] * padding)
                masks.append([1] * len(ids) + [0] * padding)
                bar.advance(task)
    return rows, masks, used


def load(path: Path) -> CalibrationSet:
    """Load a calibration set, refusing one whose files do not match its manifest, or whose
    manifest or tokens are not a calibration set's (IntegrityError, one line)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise InputError(f"{path} is not a calibration set (no {MANIFEST})")
    try:
        manifest = CalibrationManifest.read(manifest_path)
    except UnreadableJSON as error:  # not JSON at all: a damaged set, not a wrong input
        raise IntegrityError(f"calibration set {path}: {error.msg}") from error
    verify_files(path, manifest.files, "calibration set")
    try:
        tensors = load_file(path / TOKENS_FILE)
        input_ids, attention_mask = tensors["input_ids"].long(), tensors["attention_mask"].long()
    except (OSError, SafetensorError, KeyError, RuntimeError) as error:
        raise IntegrityError(f"calibration set {path}: {TOKENS_FILE} holds no input_ids and attention_mask ({error})") from error
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise IntegrityError(f"calibration set {path}: input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} are not one [samples, seq_len] shape")
    return CalibrationSet(path, manifest, input_ids, attention_mask)
