"""Every bad calibration input: one line naming the problem, exit code 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import assert_refused


def calibrate(cli, model: Path | str, out: Path, *extra: str, source: str = "demo", samples: int = 4, seq_len: int = 32):
    return cli(
        "calibrate", "--model", model, "--source", source, "--samples", samples,
        "--seq-len", seq_len, "--seed", 0, "--out", out, *extra,
    )


def test_missing_model_directory(cli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tmp_path / "no-such-model", out), "is not a directory, a demo model", out)


def test_model_without_tokenizer(cli, tiny_model: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tiny_model / name).unlink(missing_ok=True)
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out), "has no tokenizer", out)


def test_empty_source(cli, tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "empty.txt"
    source.write_text("\n\n   \n")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source)), "contains no text", out)


def test_field_that_does_not_exist(cli, tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "data.jsonl"
    source.write_text(json.dumps({"body": "some text here"}) + "\n")
    out = tmp_path / "out"
    result = calibrate(cli, tiny_model, out, "--field", "text", source=str(source))
    assert_refused(result, "field 'text' is not in record 1", out)
    assert "body" in result.err


def test_column_that_does_not_exist(cli, tiny_model: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a b c"]}), tmp_path / "data.parquet")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, "--field", "contnt", source=str(tmp_path / "data.parquet")), "did you mean 'content'", out)


def test_fewer_usable_samples_than_asked(cli, tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "short.txt"
    source.write_text("A short paragraph about rivers and valleys and towns.\n")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source), samples=50, seq_len=8), "yields only", out)
    # with --allow-fewer the same run succeeds and says how many it got
    accepted = calibrate(cli, tiny_model, out, "--allow-fewer", source=str(source), samples=50, seq_len=8)
    assert accepted.code == 0, accepted.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert 0 < manifest["samples"] < 50 and manifest["selection"]["samples_requested"] == 50


def test_sequence_length_beyond_the_model_maximum(cli, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, seq_len=257), "exceeds the model's maximum sequence length 256", out)


def test_unsupported_source_file_type(cli, tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "data.csv"
    source.write_text("text\nhello\n")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source)), "unsupported file type .csv", out)


def test_invalid_jsonl_line(cli, tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "data.jsonl"
    source.write_text('{"text": "fine"}\n{not json\n')
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source)), "data.jsonl:2: invalid JSON", out)


def test_chat_messages_without_chat_template(cli, tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps({"text": [{"role": "user", "content": "hi there"}]}) + "\n")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source)), "pass --chat-template", out)


@pytest.mark.parametrize("option, value, fragment", [("--samples", "0", "samples"), ("--seq-len", "-1", "seq-len")])
def test_non_positive_sizes(cli, tiny_model: Path, tmp_path: Path, option: str, value: str, fragment: str) -> None:
    out = tmp_path / "out"
    args = {"--samples": 4, "--seq-len": 32}
    args[option] = value
    result = cli("calibrate", "--model", tiny_model, "--source", "demo", "--samples", args["--samples"],
                 "--seq-len", args["--seq-len"], "--out", out)
    assert_refused(result, f"invalid {fragment}", out)


def test_unknown_packing_lists_the_valid_ones(cli, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, "--packing", "stack"), "'concat' or 'document'", out)


def test_existing_different_output_is_kept_without_overwrite(cli, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert calibrate(cli, tiny_model, out).code == 0
    before = (out / "manifest.json").read_bytes()
    result = calibrate(cli, tiny_model, out, "--seed", "1")
    assert result.code == 2 and "--overwrite" in result.err
    assert (out / "manifest.json").read_bytes() == before
    assert calibrate(cli, tiny_model, out, "--seed", "1", "--overwrite").code == 0
    assert (out / "manifest.json").read_bytes() != before


def test_model_with_only_pickle_weights_is_refused(cli, tiny_model: Path, tmp_path: Path) -> None:
    (tiny_model / "model.safetensors").rename(tiny_model / "pytorch_model.bin")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out), "pass --allow-pickle", out)
    # only the tokenizer is read here, so allowing pickles lets calibration proceed
    assert calibrate(cli, tiny_model, out, "--allow-pickle").code == 0


@pytest.mark.parametrize("suffix, data, fragment", [
    (".txt", "Une rivière traverse la vallée.\n\nLe café".encode("latin-1"), ":1: not UTF-8 text (invalid continuation byte at byte 8)"),
    (".txt", b"first line\nsecond \xff line\n", ":2: not UTF-8 text (invalid start byte at byte 18)"),
    (".jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8 text"),
])
def test_source_that_is_not_utf8(cli, tiny_model: Path, tmp_path: Path, suffix: str, data: bytes, fragment: str) -> None:
    source = tmp_path / f"latin1{suffix}"
    source.write_bytes(data)
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source)), fragment, out)


@pytest.mark.parametrize("line, fragment", [
    ('{"text": "\\ud800 half a surrogate pair"}', "holds an unpaired surrogate"),
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"text": "a", "n": ' + "9" * 5000 + "}", "invalid JSON (Exceeds the limit"),
    ('{"text": [{"role": "user", "content": 7}]}', "not text or a list of chat messages"),
])
def test_jsonl_record_no_tokenizer_can_take(cli, tiny_model: Path, tmp_path: Path, line: str, fragment: str) -> None:
    source = tmp_path / "data.jsonl"
    source.write_text(line + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, "--chat-template", source=str(source)), fragment, out)


def test_damaged_datasets_directory(cli, tiny_model: Path, tmp_path: Path) -> None:
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["a paragraph of text"] * 4}).save_to_disk(str(saved))
    (saved / "state.json").write_bytes(b'{"_data_files": [')
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(saved)), "not a readable datasets directory", out)


def test_overlap_refuses_a_damaged_calibration_set(cli, tiny_model: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib"
    assert calibrate(cli, tiny_model, calib, samples=2, seq_len=16).code == 0
    against = tmp_path / "against.txt"
    against.write_text("some words\n")
    manifest = json.loads((calib / "manifest.json").read_text())
    damaged = {
        "not UTF-8": b"\xff\xfe{}",
        "files is a list": json.dumps({**manifest, "files": ["text.jsonl"]}).encode(),
        "a NUL in a name": json.dumps({**manifest, "files": {"text\u0000.jsonl": "0" * 64}}).encode(),
        "not an object": b"[1, 2]",
    }
    for why, data in damaged.items():
        (calib / "manifest.json").write_bytes(data)
        result = cli("overlap", "--calibration", calib, "--against", against)
        assert result.code == 2, (why, result.err)
        assert result.err.count("\n") == 1 and result.err.startswith("quantgate: error:"), (why, result.err)
    # text.jsonl whose manifest hash was recomputed (a hostile but consistent set): still one line
    (calib / "text.jsonl").write_text('{"index": 0}\n')
    files = {**manifest["files"], "text.jsonl": __import__("hashlib").sha256(b'{"index": 0}\n').hexdigest()}
    (calib / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    result = cli("overlap", "--calibration", calib, "--against", against)
    assert result.code == 2 and "not an object with a `text` string" in result.err, result.err


def test_arrow_file_whose_offsets_point_past_its_end(cli, tiny_model: Path, tmp_path: Path) -> None:
    """A damaged .arrow file: its last string offset points 2 GB past the data. Memory-mapped (as
    `datasets.Dataset.from_file` reads it) that killed the whole process with SIGBUS; it is one line."""
    import struct

    import pyarrow as pa

    texts = ["first paragraph about rivers", "second one about towns", "third about the sea"]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": texts}))
    data = bytearray(sink.getvalue().to_pybytes())
    at = data.index(struct.pack("<4i", 0, len(texts[0]), len(texts[0]) + len(texts[1]), sum(map(len, texts))))
    data[at + 12 : at + 16] = struct.pack("<i", 0x7FFFFF00)
    source = tmp_path / "damaged.arrow"
    source.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert_refused(calibrate(cli, tiny_model, out, source=str(source)), "not a readable arrow file", out)
    # the same file undamaged is read (the stream format datasets writes)
    source.write_bytes(sink.getvalue().to_pybytes())
    accepted = calibrate(cli, tiny_model, out, "--allow-fewer", source=str(source), samples=1, seq_len=4)
    assert accepted.code == 0, accepted.err


def test_datasets_directory_whose_saved_format_hides_the_column(cli, tiny_model: Path, tmp_path: Path) -> None:
    """state.json's `_format_columns: {}` (edited, or saved so) made the text column unreadable
    (KeyError, exit 3); the column is read whatever format was saved."""
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": [" ".join(["word"] * 40)] * 4}).save_to_disk(str(saved))
    state = json.loads((saved / "state.json").read_text())
    (saved / "state.json").write_text(json.dumps({**state, "_format_columns": {}}))
    out = tmp_path / "out"
    result = calibrate(cli, tiny_model, out, source=str(saved), samples=1, seq_len=8)
    assert result.code == 0, result.err


def test_empty_conversation_is_an_empty_document(cli, tiny_model: Path, tmp_path: Path) -> None:
    """`"text": []` is a list of no chat messages: skipped like an empty text (the chat template
    raised ValueError on it, exit 3); the other documents make the set."""
    source = tmp_path / "chats.jsonl"
    rows = [{"text": []}, {"text": [{"role": "user", "content": " ".join(["river"] * 30)}]}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    result = calibrate(cli, tiny_model, out, "--chat-template", "--allow-fewer", source=str(source), samples=2, seq_len=8)
    assert result.code == 0, result.err
    assert json.loads((out / "manifest.json").read_text())["samples"] >= 1
    only_empty = tmp_path / "empty.jsonl"
    only_empty.write_text('{"text": []}\n')
    assert_refused(calibrate(cli, tiny_model, tmp_path / "out2", "--chat-template", source=str(only_empty)), "contains no text",
                   tmp_path / "out2")
