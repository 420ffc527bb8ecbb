"""The JSON documents quantgate writes have the schemas docs/ gives them: each test reads the
schema out of the document (a fenced block, a table) and compares it with real output, so a
field added, renamed or dropped on one side without the other fails here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from quantgate import evalsets
from quantgate.quantize.measure.causes import Cause
from tests.helpers import USER_ITEMS, write_header_only, write_jsonl

DOCS = Path(__file__).resolve().parent.parent / "docs"


# --- reading the docs ---------------------------------------------------------------------------


def section(doc: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of the same or a higher level."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    assert match, f"{doc} has no heading {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]


def fenced_block(doc: str, heading: str) -> str:
    """The first fenced code block under a heading."""
    match = re.search(r"^```[^\n]*\n(.*?)^```", section(doc, heading), re.MULTILINE | re.DOTALL)
    assert match, f"{doc} {heading!r} has no fenced block"
    return match.group(1)


@dataclass
class Field:
    optional: bool = False  # written `name?`: only with some option
    nested: Schema | None = None  # the fields of a {...} value, or of each element of a [{...}] list


@dataclass
class Schema:
    fields: dict[str, Field] = field(default_factory=dict)

    @property
    def is_map(self) -> bool:
        """`{<category>: ...}` or `{"4-bit group g64": ...}`: the keys are data, not field names."""
        return len(self.fields) == 1 and next(iter(self.fields))[0] in '<"'


class SchemaParser:
    """The docs' compact schema notation: `name: type` fields separated by `;` or newlines at
    the top and by `,` inside `{...}`; a type is `{fields}`, `[type]`, a literal or a word, with
    alternatives `a|b`; `name?` is an optional field; `(...)` is a remark."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def peek(self) -> str:
        while self.at < len(self.text) and self.text[self.at] in " \t\n":
            self.at += 1
        return self.text[self.at] if self.at < len(self.text) else ""

    def fields(self, closing: str) -> Schema:
        schema = Schema()
        while self.peek() not in (closing, ""):
            name, value = self.field(closing)
            schema.fields[name] = value
            if self.peek() in ",;":
                self.at += 1
        if closing:
            self.at += 1
        return schema

    def field(self, closing: str) -> tuple[str, Field]:
        if self.peek() in '<"':
            end = self.text.index('>' if self.text[self.at] == "<" else '"', self.at + 1)
            name, self.at = self.text[self.at:end + 1], end + 1
        else:
            match = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(self.text, self.at)
            assert match, f"no field name at {self.text[self.at:self.at + 40]!r}"
            name, self.at = match.group(), match.end()
        value = Field()
        if self.peek() == "?":
            value.optional, self.at = True, self.at + 1
        if self.peek() == ":":
            self.at += 1
            value.nested = self.type()
        elif self.peek() == "|":  # `plain_step_ms|null`: a type of its own after the name
            self.at += 1
            self.type()
        self.skip_remarks(closing)
        return name, value

    def type(self) -> Schema | None:
        found = None
        while True:
            char = self.peek()
            if char == "{":
                self.at += 1
                found = self.fields("}")
            elif char == "[":
                self.at += 1
                if self.peek() == "{":
                    self.at += 1
                    found = self.fields("}")
                self.skip_to("]")
            elif char == '"':
                self.at = self.text.index('"', self.at + 1) + 1
            else:
                self.at = re.compile(r"[^,;|{}\[\]()\s]*").match(self.text, self.at).end()
            if self.peek() != "|":
                return found
            self.at += 1

    def skip_to(self, closing: str) -> None:
        depth = 0
        while self.at < len(self.text):
            char, self.at = self.text[self.at], self.at + 1
            if char in "([{":
                depth += 1
            elif char in ")]}":
                if depth == 0:
                    assert char == closing, f"expected {closing!r} at {self.text[self.at - 20:self.at]!r}"
                    return
                depth -= 1

    def skip_remarks(self, closing: str) -> None:
        """Whatever follows a field up to its separator: `against (the first format)`."""
        while self.peek() == "(":
            self.at += 1
            self.skip_to(")")
        assert self.peek() in (",", ";", closing, ""), f"unexpected {self.text[self.at:self.at + 40]!r}"


@dataclass
class Documented:
    schema: Schema
    notes: dict[str, list[str]]  # indented lines under a top-level field, which list its keys


def parse_schema_block(block: str) -> Documented:
    """A fenced schema block: top-level entries start at column 0 (a `{` or `[` may carry one
    over several lines); indented lines outside brackets are notes on the entry above."""
    entries: list[str] = []
    notes: dict[str, list[str]] = {}
    depth = 0
    for raw in block.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if depth == 0 and line[0] in " \t":
            notes.setdefault(entries[-1].split(":")[0].strip(), []).append(line.strip())
            continue
        entries[-1:] = [entries[-1] + "\n" + line] if depth else [*entries[-1:], line]
        depth += sum(line.count(c) for c in "{[") - sum(line.count(c) for c in "}]")
    schema = Schema()
    for entry in entries:
        schema.fields |= SchemaParser(entry.replace("\n", " ")).fields("").fields
    return Documented(schema, notes)


def listed(note: str) -> set[str]:
    """The names a note lists: `roles: a, b, c` or `a, b, c  (remark)`."""
    return {name.strip() for name in re.sub(r"\(.*?\)", "", note.split(":", 1)[-1]).split(",") if name.strip()}


def mismatches(schema: Schema, data: Any, path: str = "", maps: frozenset[str] = frozenset()) -> list[str]:
    """Where `data` departs from `schema`: missing or undocumented keys, at any depth."""
    if data is None:  # a nullable value (`{...}|null`)
        return []
    if isinstance(data, list):
        return [problem for element in data for problem in mismatches(schema, element, path + "[]", maps)]
    assert isinstance(data, dict), (path, data)
    if schema.is_map or path in maps:
        value = next(iter(schema.fields.values())).nested
        return [problem for key, item in data.items() if value for problem in mismatches(value, item, f"{path}.<{key}>", maps)]
    required = {name for name, spec in schema.fields.items() if not spec.optional}
    problems = [f"{path}.{name}: documented, not written" for name in sorted(required - set(data))]
    problems += [f"{path}.{name}: written, not documented" for name in sorted(set(data) - set(schema.fields))]
    for name, spec in schema.fields.items():
        if spec.nested is not None and name in data:
            problems += mismatches(spec.nested, data[name], f"{path}.{name}", maps)
    return problems


def test_the_schema_reader_sees_what_a_document_departs_in() -> None:
    """The reader itself, on a small block: a missing field, an extra one, a nested one, a map."""
    documented = parse_schema_block(
        'kind: "x"; version: 1; gone_too; extra?: int\n'
        "inner: {a, b: {c: int|null}, against (a remark), d|null}\n"
        "rows: [{name, bytes: {<category>: {n}}}]\n"
        "    (a note on rows)\n")
    assert set(documented.schema.fields) == {"kind", "version", "gone_too", "extra", "inner", "rows"}
    assert documented.notes == {"rows": ["(a note on rows)"]}
    data = {"kind": "x", "version": 1, "inner": {"a": 1, "b": {"c": None, "e": 2}, "against": 0, "d": None, "f": 3},
            "rows": [{"name": "r", "bytes": {"one": {"n": 1}, "two": {"m": 2}}}], "new": 1}
    assert mismatches(documented.schema, data) == [
        ".gone_too: documented, not written", ".new: written, not documented", ".inner.f: written, not documented",
        ".inner.b.e: written, not documented", ".rows[].bytes.<two>.n: documented, not written",
        ".rows[].bytes.<two>.m: written, not documented",
    ]


# --- measure and bounds: docs/measure-and-bounds.md -----------------------------------------------------


def gptq_checkpoint(root: Path, quantized: bool) -> Path:
    """One decoder block in GPTQ INT4 g128 (or its BF16 baseline), header-only."""
    root.mkdir(parents=True)
    tensors: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [512, 256]), "model.norm.weight": ("BF16", [256])}
    for name in ("self_attn.q_proj", "mlp.up_proj"):
        prefix = f"model.layers.0.{name}"
        if quantized:
            tensors |= {f"{prefix}.qweight": ("I32", [256 * 4 // 32, 256]), f"{prefix}.qzeros": ("I32", [2, 256 * 4 // 32]),
                        f"{prefix}.scales": ("F16", [2, 256]), f"{prefix}.g_idx": ("I32", [256])}
        else:
            tensors[f"{prefix}.weight"] = ("BF16", [256, 256])
    write_header_only(root / "model.safetensors", tensors, {"format": "pt"})
    config: dict[str, Any] = {"torch_dtype": "bfloat16", "tie_word_embeddings": True, "num_hidden_layers": 1,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    if quantized:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}
    (root / "config.json").write_text(json.dumps(config))
    return root


def documented_causes() -> set[str]:
    table = section("measure-and-bounds.md", "measure")
    causes = set(re.findall(r"^\| `([a-z_<>]+)` \|", table, re.MULTILINE))
    categories = listed(" ".join(parse_schema_block(fenced_block("measure-and-bounds.md", "measure JSON, schema_version 1")).notes["categories"]))
    expanded = {f"unquantized_{category}" for category in categories}
    return (causes - {"unquantized_<category>"}) | expanded


def test_measure_json_is_the_documented_schema(cli, tmp_path: Path) -> None:
    documented = parse_schema_block(fenced_block("measure-and-bounds.md", "measure JSON, schema_version 1"))
    base = gptq_checkpoint(tmp_path / "base", quantized=False)
    result = cli("measure", gptq_checkpoint(tmp_path / "ckpt", quantized=True), "--baseline", base, "--json")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["kind"] == "measurement" and data["baseline"] is not None and data["format"]["weights"] is not None
    maps = frozenset({".linear_layers[].bytes_by_role"})
    assert mismatches(documented.schema, data, maps=maps) == []
    # The keys the notes list: all 11 categories always; the roles a layer's bytes may have.
    categories = listed(" ".join(documented.notes["categories"]))
    assert len(categories) == 11 and set(data["categories"]) == categories
    assert all(set(block["bytes"]) <= categories for block in [*data["blocks"], data["outside_blocks"]])
    roles = listed(next(note for note in documented.notes["linear_layers"] if note.startswith("roles:")))
    assert {role for layer in data["linear_layers"] for role in layer["bytes_by_role"]} <= roles
    # Every cause the explanation names is in the table of causes.
    causes = {line["cause"] for line in data["explanation"]["lines"]} | {gap["cause"] for layer in data["linear_layers"] for gap in layer["gaps"]}
    assert "header" in causes and causes <= documented_causes()
    # ... and the table is exactly the Cause enum: a new cause must be documented, a documented
    # one must exist (`unquantized_<category>` stands for one cause per documented category).
    table = set(re.findall(r"^\| `([a-z_<>]+)` \|", section("measure-and-bounds.md", "measure"), re.MULTILINE))
    values = {cause.value for cause in Cause}
    assert table == {value for value in values if not value.startswith("unquantized_")} | {"unquantized_<category>"}
    assert {value for value in values if value.startswith("unquantized_")} <= documented_causes()


def test_bounds_json_is_the_documented_schema(cli, tmp_path: Path) -> None:
    documented = parse_schema_block(fenced_block("measure-and-bounds.md", "bounds JSON, schema_version 1"))
    result = cli("bounds", "--checkpoint", gptq_checkpoint(tmp_path / "ckpt", quantized=True), "--json",
                 "--alphas", "0.7", "--gamma-range", "1:4", "--compare-kv-bytes", "1")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["kind"] == "bounds" and data["kv_alternatives"]
    assert mismatches(documented.schema, data) == []
    # kv_alternatives' formats are "as above, without sweeps"
    formats = documented.schema.fields["formats"].nested
    assert formats is not None and {"alpha_sweep", "best_gamma"} <= set(data["formats"][0])
    without_sweeps = Schema({name: spec for name, spec in formats.fields.items() if not spec.optional})
    assert mismatches(without_sweeps, [entry for alternative in data["kv_alternatives"] for entry in alternative["formats"]]) == []


# --- per-item results: docs/evaluate.md ----------------------------------------------------------------


def item_fields_by_kind() -> dict[str, tuple[set[str], set[str]]]:
    """Per kind, from the table under items.json: (fields always there, fields only with a baseline)."""
    text = section("evaluate.md", "Per-item results: `items.json`, schema_version 1")
    rows = re.findall(r"^\| (multiple-choice|last-word|generation|text) \| (.*?) \|", text, re.MULTILINE)
    assert len(rows) == 4, rows
    found = {}
    for kind, cell in rows:
        always, _, with_baseline = cell.partition("with a baseline")
        names = [{name.split(":")[0] for name in re.findall(r"`([a-z_][a-z0-9_]*(?:: \{[a-z0-9_, ]+\})?)`", part)} for part in (always, with_baseline)]
        found[kind] = (names[0], names[1])
    return found


def metrics_documented(kind: str) -> set[str]:
    text = section("evaluate.md", "Per-item results: `items.json`, schema_version 1")
    row = re.search(rf"^\| {kind} \| (.*?) \|", text, re.MULTILINE)
    assert row
    return {name.strip() for name in re.search(r"`metrics: \{([a-z_, ]+)\}`", row.group(1)).group(1).split(",")}


@pytest.fixture(scope="module")
def evaluated(tiny_model_template: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[evalsets.EvaluationResults, evalsets.EvaluationResults]:
    """A baseline and a candidate (the same model) on a set of each kind, two items each."""
    root = tmp_path_factory.mktemp("documented-items")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QUANTGATE_HOME", str(tmp_path_factory.mktemp("documented-items-home")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        evalsets.add(evalsets.AddConfig(name="answers", kind="generation", generation={"max_new_tokens": 4}),
                     write_jsonl(root / "answers.jsonl", USER_ITEMS[evalsets.Kind.generation]))
        config = evalsets.EvaluateConfig(evalsets=("arc-easy", "lambada", "wiki-text", "answers"), limit=2)
        baseline = evalsets.run(config, tiny_model_template, root / "baseline")
        candidate = evalsets.run(config, tiny_model_template, root / "candidate", baseline_results=baseline.path)
    return baseline, candidate


def test_items_json_is_the_documented_schema(evaluated) -> None:
    example = json.loads(fenced_block("evaluate.md", "Per-item results: `items.json`, schema_version 1"))
    by_kind = item_fields_by_kind()
    assert set(by_kind) == {kind.value for kind in evalsets.Kind}
    assert {evaluated[0].items(spec)["kind"] for spec in evaluated[0].manifest.sets} == set(by_kind)
    shared = set(example["items"][0]) - {"..."}
    assert shared == {"index", "id"}
    for results in evaluated:
        for spec in results.manifest.sets:
            items = results.items(spec)
            assert set(items) == set(example) and set(items["model"]) == set(example["model"]), spec
            always, with_baseline = by_kind[items["kind"]]
            expected = shared | always | (with_baseline if items["baseline"] else set())
            for item in items["items"]:
                assert set(item) == expected, (spec, sorted(set(item) ^ expected))
                if "metrics" in item:
                    assert set(item["metrics"]) == metrics_documented(items["kind"]), spec
    assert any(evaluated[1].items(spec)["baseline"] for spec in evaluated[1].manifest.sets)  # the baseline-only fields were seen
