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
