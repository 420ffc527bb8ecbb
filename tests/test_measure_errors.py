"""Every damaged or hostile checkpoint: `quantgate measure` answers one line naming the file
and the problem, exit code 2, writes nothing, and never allocates or hangs on a header."""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from pathlib import Path

import pytest

from quantgate.core.errors import QuantgateError
from quantgate.core.headers import HeaderError, read_safetensors
from quantgate.quantize.measure.accounting import measure
from tests.helpers import assert_refused, write_header_only

GOOD = {"model.norm.weight": ("BF16", [64]), "model.layers.0.mlp.up_proj.weight": ("BF16", [64, 64])}


def raw_file(path: Path, header: bytes | str, data: int = 0, length: int | None = None) -> Path:
    raw = header.encode() if isinstance(header, str) else header
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as stream:
        stream.write((len(raw) if length is None else length).to_bytes(8, "little"))
        stream.write(raw)
        stream.truncate(8 + len(raw) + data)
    return path


def entries(**tensors: tuple[str, list[int], list[int]]) -> str:
    return json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": offsets} for name, (dtype, shape, offsets) in tensors.items()})


def refused(cli, target: Path, fragment: str, tmp_path: Path, names: Path | None = None) -> str:
    result = cli("measure", target)
    assert_refused(result, fragment, tmp_path / "nothing-written")
    assert str(names or target) in result.err  # names the file
    return result.err


def test_truncated_file_without_a_header_length(cli, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(b"\x10\x00\x00")
    refused(cli, tmp_path / "ckpt", "truncated safetensors file (3 bytes", tmp_path, path)


def test_truncated_file_with_data_cut_off(cli, tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "model.safetensors"
    path.parent.mkdir()
    write_header_only(path, GOOD)
    with open(path, "r+b") as stream:
        stream.truncate(path.stat().st_size - 100)
    refused(cli, tmp_path / "ckpt", "are out of range (data section is 8220 bytes; truncated file?)", tmp_path, path)


def test_header_length_beyond_the_file(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", "{}", length=4096)
    refused(cli, path, "header length 4096 exceeds the file (10 bytes)", tmp_path)


def test_invalid_header_json(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", '{"a": {"dtype": "BF16", ')
    refused(cli, path, "invalid header JSON", tmp_path)


def test_header_that_is_not_json_at_all(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", b"\xff\xfe garbage")
    refused(cli, path, "invalid header JSON (does not start with '{')", tmp_path)


def test_offsets_out_of_range(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(w=("BF16", [64], [0, 128])), data=64)
    refused(cli, path, "tensor 'w' offsets [0, 128] are out of range (data section is 64 bytes", tmp_path)


def test_overlapping_offsets(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(a=("BF16", [32], [0, 64]), b=("BF16", [32], [32, 96])), data=96)
    refused(cli, path, "overlap another tensor", tmp_path)


def test_gap_between_tensors(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(a=("BF16", [16], [0, 32]), b=("BF16", [16], [64, 96])), data=96)
    refused(cli, path, "bytes 32..64 of the data section belong to no tensor", tmp_path)


def test_bytes_after_the_last_tensor(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(a=("BF16", [16], [0, 32])), data=40)
    refused(cli, path, "the data section has 8 bytes after the last tensor", tmp_path)


def test_size_that_does_not_match_the_shape(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(a=("BF16", [16], [0, 16])), data=16)
    refused(cli, path, "tensor 'a' BF16 [16] needs 32 bytes but its offsets span 16", tmp_path)


def test_unknown_dtype(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(a=("Q4_K", [16], [0, 32])), data=32)
    refused(cli, path, "tensor 'a' has unknown dtype 'Q4_K'", tmp_path)


def test_tensor_listed_twice(cli, tmp_path: Path) -> None:
    one = '{"dtype": "BF16", "shape": [16], "data_offsets": [0, 32]}'
    path = raw_file(tmp_path / "model.safetensors", f'{{"a": {one}, "a": {one}}}', data=32)
    refused(cli, path, "key 'a' appears twice", tmp_path)


def test_index_naming_a_missing_shard(cli, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    write_header_only(root / "model-00001-of-00002.safetensors", GOOD)
    weight_map = {name: "model-00001-of-00002.safetensors" for name in GOOD} | {"lm_head.weight": "model-00002-of-00002.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(cli, root, "names shard model-00002-of-00002.safetensors, which is missing", tmp_path, root / "model.safetensors.index.json")


def test_index_naming_a_tensor_its_shard_lacks(cli, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    write_header_only(root / "model-00001-of-00001.safetensors", GOOD)
    weight_map = {name: "model-00001-of-00001.safetensors" for name in [*GOOD, "lm_head.weight"]}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(cli, root, "names tensor 'lm_head.weight' in model-00001-of-00001.safetensors, but", tmp_path)


def test_index_shard_outside_the_checkpoint(cli, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    refused(cli, root, "names an invalid shard '../elsewhere.safetensors'", tmp_path)


def test_same_tensor_in_two_shards(cli, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    write_header_only(root / "a.safetensors", GOOD)
    write_header_only(root / "b.safetensors", GOOD)
    refused(cli, root, "is also in a.safetensors", tmp_path, root / "b.safetensors")


def test_missing_checkpoint(cli, tmp_path: Path) -> None:
    refused(cli, tmp_path / "nope", "no such checkpoint", tmp_path)


def test_directory_without_weights(cli, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    refused(cli, tmp_path / "empty", "no safetensors weights", tmp_path)


def test_invalid_config_json(cli, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    write_header_only(root / "model.safetensors", GOOD)
    (root / "config.json").write_text("{not json")
    refused(cli, root, "invalid config JSON", tmp_path, root / "config.json")


# --- hostile headers -----------------------------------------------------------------------------

def _quick_and_small(action) -> None:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        action()
    finally:
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < 2.0 and peak < 8 * 2**20, (elapsed, peak)


def test_huge_header_length_is_refused_before_any_allocation(tmp_path: Path) -> None:
    # A sparse 200 GB file claiming a 150 GB header: within the file, over the limit.
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as stream:
        stream.write((150 * 10**9).to_bytes(8, "little"))
        stream.truncate(200 * 10**9)

    def read() -> None:
        with pytest.raises(HeaderError, match="over the 104857600 byte limit"):
            read_safetensors(path)

    _quick_and_small(read)
    tiny = raw_file(tmp_path / "tiny.safetensors", "{}", length=2**64 - 1)
    with pytest.raises(HeaderError, match="exceeds the file"):
        read_safetensors(tiny)


def test_deeply_nested_header_neither_hangs_nor_crashes(cli, tmp_path: Path) -> None:
    depth = 200_000
    path = raw_file(tmp_path / "model.safetensors", '{"a":' + "[" * depth + "]" * depth + "}")
    started = time.perf_counter()
    refused(cli, path, "nested too deeply", tmp_path)
    assert time.perf_counter() - started < 5.0


def test_header_of_zeros_claiming_a_large_length_is_refused_cheaply(tmp_path: Path) -> None:
    # A 50 MB header of NUL bytes (within the limit): refused on its first byte, not parsed.
    path = raw_file(tmp_path / "model.safetensors", b"", data=50 * 2**20, length=50 * 2**20)

    def read() -> None:
        with pytest.raises(HeaderError, match="does not start with"):
            read_safetensors(path)

    _quick_and_small(read)


def test_integer_with_a_million_digits_is_refused(cli, tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", '{"a": {"dtype": "BF16", "shape": [' + "9" * 1_000_000 + '], "data_offsets": [0, 2]}}')
    refused(cli, path, "invalid header JSON", tmp_path)


@pytest.mark.parametrize("entry, fragment", [
    ('{"a": 5}', "tensor 'a' is not described by a JSON object"),
    ('{"a": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 0]}}', "tensor 'a' has an invalid shape"),
    ('{"a": {"dtype": "BF16", "shape": [true], "data_offsets": [0, 2]}}', "tensor 'a' has an invalid shape"),
    ('{"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0]}}', "tensor 'a' has invalid data_offsets"),
    ('{"__metadata__": [1, 2]}', "__metadata__ is not a JSON object"),
    ('[1, 2, 3]', "does not start with '{'"),
])
def test_malformed_entries(cli, tmp_path: Path, entry: str, fragment: str) -> None:
    path = raw_file(tmp_path / "model.safetensors", entry, data=2)
    refused(cli, path, fragment, tmp_path)


def test_huge_shape_does_not_allocate(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "model.safetensors", entries(a=("BF16", [10**12, 10**12], [0, 2])), data=2)

    def read() -> None:
        with pytest.raises(HeaderError, match="needs 2e\\+24 bytes"):
            read_safetensors(path)

    _quick_and_small(read)


# A quantization config whose bits are not a number: measure may refuse a checkpoint with it
# (when a tensor makes it read the scheme); every other config below is readable.
UNREADABLE_CONFIG = {"quantization_config": {"quant_method": "gptq", "bits": "four"}}


def test_garbled_headers_never_crash_and_every_byte_is_explained(tmp_path: Path) -> None:
    """Valid safetensors full of nonsense (random roles, dtypes, shapes, configs): measure
    either refuses with one QuantgateError or accounts for every byte; never a traceback.
    Only the unreadable config may be refused, so the count measured has a floor: a measure
    that refused everything would otherwise pass."""
    rng = random.Random(0)
    roles = ["weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "qweight", "qzeros",
             "scales", "g_idx", "weight", "bias", "input_scale", "k_scale", "unknown"]
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head", "model.embed_tokens", "model.norm"]
    configs = [None, {"tie_word_embeddings": True},
               {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
               {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}},
               UNREADABLE_CONFIG,
               {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"],
                "weights": {"num_bits": 4, "strategy": "group", "group_size": 0, "symmetric": False}}}}}]
    trials, readable, measured, refused_unreadable = 300, 0, 0, 0
    for trial in range(trials):
        tensors = {}
        for _ in range(rng.randint(1, 6)):
            shape = [rng.choice([0, 1, 3, 8, 24, 64]) for _ in range(rng.randint(0, 3))]
            tensors[f"{rng.choice(modules)}.{rng.choice(roles)}"] = (rng.choice(["I32", "BF16", "F32", "I8", "F8_E4M3", "I64", "BOOL"]), shape)
        root = tmp_path / f"t{trial}"
        root.mkdir()
        write_header_only(root / "model.safetensors", tensors)
        config = rng.choice(configs)
        if config is not None:
            (root / "config.json").write_text(json.dumps(config))
        readable += config is not UNREADABLE_CONFIG
        try:
            data = measure(root).to_json()
        except QuantgateError as error:
            assert config is UNREADABLE_CONFIG, (error, tensors, config)
            assert "cannot read the quantization scheme" in str(error), error
            refused_unreadable += 1
            continue
        measured += 1
        json.dumps(data)
        assert data["explanation"]["unexplained_bytes"] == 0, (tensors, config)
        assert sum(v["bytes"] for v in data["categories"].values()) + data["totals"]["header_bytes"] == data["totals"]["file_bytes"]
    # Seed 0 draws 258 inputs with a readable config and 42 with the unreadable one, of which
    # 18 hold a tensor that makes measure read the scheme.
    assert readable == 258 and measured >= readable, (readable, measured)
    assert measured + refused_unreadable == trials and 0 < refused_unreadable < trials - readable, refused_unreadable
