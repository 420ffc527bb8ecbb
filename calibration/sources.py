"""Text sources for calibration: local .txt / .jsonl / .parquet / .arrow files, a `datasets`
directory saved to disk, and the built-in demo source (versioned data in this package)."""

from __future__ import annotations

# pyarrow and datasets are imported where used, by the readers of their formats: they take
# seconds to import, and the other sources need neither.
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from pydantic import JsonValue

from quantgate.core.artifacts import json_text, read_json, sha256_file, sha256_tree, verify_files
from quantgate.core.errors import SourceError, did_you_mean
from quantgate.core.validation import is_path

DATA_DIR = Path(__file__).parent / "data"
DEMO_SOURCE = "demo"
DEMO_VERSION = "v1"


class ChatMessage(TypedDict):
    """A chat message of a document (checked by `_is_message`; the chat template renders it)."""

    role: str
    content: str | list[JsonValue]  # text, or a multimodal message's parts


@dataclass(frozen=True)
class Documents:
    """The texts of a source, in the source's own order, and what identifies the source."""

    texts: list[Any]  # str, or a list of ChatMessage
    kind: str
    sha256: str
    description: str


def load_documents(spec: str, field: str = "text", split: str | None = None) -> Documents:
    if spec == DEMO_SOURCE or spec.startswith(DEMO_SOURCE + "@"):
        return _demo(spec.partition("@")[2] or DEMO_VERSION)
    path = Path(spec).expanduser()
    if not is_path(str(path)) or not path.exists():
        shown = spec if len(spec) <= 80 else f"{spec[:80]}... ({len(spec)} characters)"
        raise SourceError(f"calibration source {shown} does not exist (nor is it 'demo')")
    if path.is_dir():
        documents = _datasets_dir(path, field, split)
    else:
        suffix = path.suffix.lower()
        readers = {".txt": _text_file, ".jsonl": _jsonl_file, ".parquet": _parquet_file, ".arrow": _arrow_file}
        if suffix not in readers:
            raise SourceError(
                f"calibration source {path}: unsupported file type {suffix or '(none)'}; "
                f"use one of {', '.join(sorted(readers))} or a datasets directory"
            )
        documents = readers[suffix](path, field)
    if not any(_non_empty(text) for text in documents.texts):
        raise SourceError(f"calibration source {spec} contains no text")
    return documents


def _non_empty(text: Any) -> bool:
    return bool(text.strip()) if isinstance(text, str) else bool(text)


def demo_source_dir(version: str = DEMO_VERSION) -> Path:
    return DATA_DIR / "demo" / version


def _demo(version: str) -> Documents:
    directory = demo_source_dir(version)
    manifest_path = directory / "manifest.json"
    if not re.fullmatch(r"v[0-9]+", version) or not manifest_path.is_file():
        raise SourceError(f"built-in demo source has no version {version!r}")
    manifest = read_json(manifest_path)
    verify_files(directory, manifest["files"], f"demo source {version}")
    texts = [row["text"] for row in _read_jsonl(directory / manifest["data_file"])]
    return Documents(
        texts=texts,
        kind="demo",
        sha256=manifest["files"][manifest["data_file"]],
        description=f"built-in demo source {DEMO_SOURCE}@{version} ({manifest['title']})",
    )


def _text_file(path: Path, field: str) -> Documents:
    # Paragraphs: blocks separated by one or more blank lines.
    raw = _utf8(path.read_bytes(), path)
    paragraphs, current = [], []
    for line in raw.splitlines():
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return Documents(paragraphs, "txt", sha256_file(path), f"{path} (paragraphs)")


def _utf8(data: bytes, path: Path) -> str:
    """`data` decoded as UTF-8, or one SourceError line saying where it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SourceError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {error.start}); "
                          "save the file as UTF-8") from error


def _read_jsonl(path: Path) -> list[dict[str, JsonValue]]:
    """Each line's JSON object, as parsed: its reader checks the fields it takes."""
    rows = []
    for number, line in enumerate(re.split(r"\r\n|\r|\n", _utf8(path.read_bytes(), path)), start=1):
        if not line.strip():
            continue
        try:
            row = json_text(line)
        except ValueError as error:
            raise SourceError(f"{path}:{number}: invalid JSON ({error})") from error
        if not isinstance(row, dict):
            raise SourceError(f"{path}:{number}: expected a JSON object per line")
        rows.append(row)
    return rows


def _jsonl_file(path: Path, field: str) -> Documents:
    rows = _read_jsonl(path)
    texts = []
    for number, row in enumerate(rows, start=1):
        if field not in row:
            raise SourceError(
                f"{path}: field {field!r} is not in record {number}{did_you_mean(field, list(row))}; "
                f"its fields: {', '.join(row) or '(none)'}"
            )
        texts.append(_text_value(row[field], f"{path}: record {number} field {field!r}"))
    return Documents(texts, "jsonl", sha256_file(path), f"{path} field {field!r}")


def _text_value(value: Any, where: str) -> Any:
    if isinstance(value, str):
        return _encodable(value, where)
    if isinstance(value, list) and all(_is_message(m) for m in value):
        for message in value:
            _encodable(json.dumps(message, ensure_ascii=False, default=str), where)
        return value  # chat messages
    raise SourceError(f"{where} is {type(value).__name__}, not text or a list of chat messages "
                      "(objects with a role and a content)")


def _is_message(value: Any) -> bool:
    return (isinstance(value, dict) and {"role", "content"} <= set(value)
            and isinstance(value["role"], str) and isinstance(value["content"], (str, list)))


def _encodable(text: str, where: str) -> str:
    """`text`, if it is valid Unicode: a JSON escape can name half of a surrogate pair
    ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SourceError(f"{where} holds an unpaired surrogate ({text[error.start]!r} at character {error.start})") from error
    return text


def _column_texts(column: list[Any], where: str) -> list[Any]:
    return [_text_value(value, f"{where} row {index}") for index, value in enumerate(column)]


def _require_column(columns: list[str], field: str, where: str) -> None:
    if field not in columns:
        raise SourceError(
            f"{where}: column {field!r} does not exist{did_you_mean(field, columns)}; columns: {', '.join(columns)}"
        )


def _parquet_file(path: Path, field: str) -> Documents:
    import pyarrow.parquet as parquet

    try:
        table = _checked(parquet.read_table(path))
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise SourceError(f"{path}: not a readable parquet file ({_first_line(error)})") from error
    _require_column(table.column_names, field, str(path))
    texts = _column_texts(table.column(field).to_pylist(), str(path))
    return Documents(texts, "parquet", sha256_file(path), f"{path} column {field!r}")


def _arrow_file(path: Path, field: str) -> Documents:
    """An Arrow IPC file, as `datasets` writes it (the stream format; the file format is read too).
    Read into memory, never memory-mapped: a damaged file whose buffers point past its end would
    kill a process that maps it with SIGBUS; here it is checked whole (`validate(full=True)`)
    before a value is read."""
    import pyarrow as pa

    data = pa.py_buffer(path.read_bytes())
    try:
        try:
            table = pa.ipc.open_stream(data).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(data).read_all()
        table = _checked(table)
    except Exception as error:  # pyarrow errors for a file that is not arrow, or a damaged one
        raise SourceError(f"{path}: not a readable arrow file ({_first_line(error)})") from error
    _require_column(table.column_names, field, str(path))
    texts = _column_texts(table.column(field).to_pylist(), str(path))
    return Documents(texts, "arrow", sha256_file(path), f"{path} column {field!r}")


def _checked(table: Any) -> Any:
    """A pyarrow table whose every offset and length is checked (ArrowInvalid when one is not):
    reading a value of a damaged table could read past its buffers."""
    table.validate(full=True)
    return table


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _datasets_dir(path: Path, field: str, split: str | None) -> Documents:
    import datasets

    try:
        # in memory, not memory-mapped: a damaged arrow file would kill a process mapping it (SIGBUS)
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
        for table in ([loaded.data] if isinstance(loaded, datasets.Dataset) else [part.data for part in loaded.values()]):
            _checked(table.table)
    except FileNotFoundError as error:
        raise SourceError(f"{path} is not a datasets directory saved with save_to_disk") from error
    except Exception as error:  # damaged state.json, dataset_info.json or arrow files: json, pyarrow, datasets errors
        raise SourceError(f"{path}: not a readable datasets directory ({_first_line(error)})") from error
    description = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            if len(splits) != 1:
                raise SourceError(f"{path} has splits {', '.join(splits)}: choose one with --split")
            split = splits[0]
        if split not in loaded:
            raise SourceError(f"{path} has no split {split!r}{did_you_mean(split, splits)}; splits: {', '.join(splits)}")
        loaded = loaded[split]
        description += f" split {split!r}"
    elif split is not None:
        raise SourceError(f"{path} is a single dataset without splits; drop --split")
    loaded = loaded.with_format(None)  # the saved format (its state.json) may hide columns; every column, as Python values
    _require_column(loaded.column_names, field, str(path))
    texts = _column_texts(list(loaded[field]), str(path))
    return Documents(texts, "datasets", sha256_tree(path), f"{description} column {field!r}")

