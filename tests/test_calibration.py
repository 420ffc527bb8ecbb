"""Stage 1: calibration sets are reproducible, read every source kind, and refuse bad input
with one line, exit code 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantgate import calibration
from quantgate.calibration import CalibrationConfig, Packing
from quantgate.core.errors import IntegrityError

SMALL = {"source": "demo", "samples": 8, "seq_len": 64, "seed": 0}


def build(model: Path, out: Path, **overrides) -> calibration.CalibrationSet:
    cfg = CalibrationConfig(model=str(model), **{**SMALL, **overrides})
    return calibration.run(cfg, out)


# --- determinism ---------------------------------------------------------------------------


def test_same_inputs_give_the_same_fingerprint_and_bytes(tiny_model: Path, tmp_path: Path) -> None:
    first = build(tiny_model, tmp_path / "a")
    second = build(tiny_model, tmp_path / "b")
    assert first.fingerprint == second.fingerprint
    assert (tmp_path / "a/tokens.safetensors").read_bytes() == (tmp_path / "b/tokens.safetensors").read_bytes()
    assert (tmp_path / "a/text.jsonl").read_bytes() == (tmp_path / "b/text.jsonl").read_bytes()
    assert first.input_ids.shape == (8, 64)
    assert first.attention_mask.sum() == 8 * 64  # concat packing: no padding


def test_another_seed_gives_another_set(tiny_model: Path, tmp_path: Path) -> None:
    seed0 = build(tiny_model, tmp_path / "s0", seed=0)
    seed1 = build(tiny_model, tmp_path / "s1", seed=1)
    assert seed0.fingerprint != seed1.fingerprint
    assert not (seed0.input_ids == seed1.input_ids).all()
    assert seed0.manifest.selection.documents_used != seed1.manifest.selection.documents_used


def test_other_settings_change_the_fingerprint(tiny_model: Path, tmp_path: Path) -> None:
    base = build(tiny_model, tmp_path / "base").fingerprint
    assert build(tiny_model, tmp_path / "len", seq_len=32).fingerprint != base
    assert build(tiny_model, tmp_path / "n", samples=4).fingerprint != base


def test_rerun_into_the_same_directory_reuses_the_set(tiny_model: Path, tmp_path: Path) -> None:
    first = build(tiny_model, tmp_path / "set")
    mtime = (tmp_path / "set/manifest.json").stat().st_mtime_ns
    again = build(tiny_model, tmp_path / "set")
    assert again.reused and again.fingerprint == first.fingerprint
    assert (tmp_path / "set/manifest.json").stat().st_mtime_ns == mtime


def test_manifest_records_how_the_set_was_made(tiny_model: Path, tmp_path: Path) -> None:
    built = build(tiny_model, tmp_path / "set")
    manifest = json.loads((tmp_path / "set/manifest.json").read_text())
    assert manifest["source"]["sha256"] == json.loads(
        (Path(calibration.__file__).parent / "data/demo/v1/manifest.json").read_text()
    )["files"]["paragraphs.jsonl"]
    assert len(manifest["tokenizer"]["sha256"]) == 64
    assert manifest["selection"]["seed"] == 0 and manifest["seq_len"] == 64
    assert manifest["provenance"]["libraries"]["transformers"]
    assert manifest["fingerprint"] == built.fingerprint
    # the decoded text sits beside the ids, for inspection and the overlap check
    assert len(built.texts()) == 8 and all(built.texts())


def test_tampered_calibration_set_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    build(tiny_model, tmp_path / "set")
    with open(tmp_path / "set/text.jsonl", "a", encoding="utf-8") as stream:
        stream.write('{"index": 99, "text": "injected"}\n')
    with pytest.raises(IntegrityError, match="text.jsonl does not match"):
        calibration.load(tmp_path / "set")


def test_calibration_set_feeds_a_datasets_dataset(tiny_model: Path, tmp_path: Path) -> None:
    dataset = build(tiny_model, tmp_path / "set").to_dataset()
    assert dataset.column_names == ["input_ids", "attention_mask"]
    assert len(dataset) == 8 and len(dataset[0]["input_ids"]) == 64


# --- sources -------------------------------------------------------------------------------

PARAGRAPHS = [
    "The river rises in the mountains and flows north through a wide valley of farms and towns. " * 3,
    "A lighthouse keeper kept a log of every ship that passed the rocky point in winter storms. " * 3,
    "The old library held maps of the coast drawn by hand, some of them centuries old and faded. " * 3,
]


def test_text_file_is_split_into_paragraphs(tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "notes.txt"
    source.write_text("\n\n".join(PARAGRAPHS) + "\n")
    built = build(tiny_model, tmp_path / "set", source=str(source), samples=2, seq_len=32)
    assert built.manifest.source.documents == 3
    assert built.manifest.source.kind == "txt"


def test_jsonl_field_is_read(tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps({"id": i, "body": text}) + "\n" for i, text in enumerate(PARAGRAPHS)))
    built = build(tiny_model, tmp_path / "set", source=str(source), field="body", samples=2, seq_len=32)
    assert built.manifest.source.kind == "jsonl" and built.manifest.source.documents == 3
    # the first row is the start of the first shuffled document, token for token
    first = PARAGRAPHS[built.manifest.selection.documents_used[0]]
    assert first.startswith(built.texts()[0])


def test_parquet_arrow_and_datasets_directory_sources(tiny_model: Path, tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": PARAGRAPHS}), tmp_path / "data.parquet")
    dataset = datasets.Dataset.from_dict({"text": PARAGRAPHS})
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "dsdir"))
    arrow_file = next((tmp_path / "dsdir" / "train").glob("*.arrow"))
    fingerprints = {}
    for name, spec in {"parquet": tmp_path / "data.parquet", "arrow": arrow_file, "datasets": tmp_path / "dsdir"}.items():
        built = build(tiny_model, tmp_path / f"set-{name}", source=str(spec), samples=2, seq_len=32)
        assert built.manifest.source.kind == name
        fingerprints[name] = built.fingerprint
    # same texts in the same order: same tokens, but the sources' hashes differ
    first = calibration.load(tmp_path / "set-parquet").input_ids
    assert (calibration.load(tmp_path / "set-datasets").input_ids == first).all()
    assert len(set(fingerprints.values())) == 3


def test_chat_template_wraps_each_text_as_a_user_turn(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    built = build(tiny_model, tmp_path / "set", chat_template=True, packing=Packing.document, samples=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert (built.input_ids[:, 0] == start).all()
    plain = build(tiny_model, tmp_path / "plain", packing=Packing.document, samples=4)
    assert plain.fingerprint != built.fingerprint


def test_chat_messages_in_jsonl_are_templated(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    source = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Noted."}]} for i in range(3)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    built = build(tiny_model, tmp_path / "set", source=str(source), field="messages", chat_template=True,
                  packing=Packing.document, samples=3, seq_len=64, min_document_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for row, mask, index in zip(built.input_ids, built.attention_mask, built.manifest.selection.documents_used, strict=True):
        expected = tokenizer.apply_chat_template(rows[index]["messages"], tokenize=False)
        assert tokenizer.decode(row[mask.bool()]) == expected  # both turns, in the template's markup


def test_document_packing_pads_and_masks(tiny_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "short.jsonl"
    source.write_text("".join(json.dumps({"text": text[:120]}) + "\n" for text in PARAGRAPHS))
    built = build(tiny_model, tmp_path / "set", source=str(source), packing=Packing.document, samples=3, seq_len=128)
    mask = built.attention_mask
    assert mask.shape == (3, 128)
    assert (mask[:, 0] == 1).all() and (mask[:, -1] == 0).all()  # real tokens first, padding after
