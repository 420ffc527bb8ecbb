"""Records: the artifacts that cross a layer (a measurement, a calibration set's manifest, an
evaluation's results manifest), each written and read through one pydantic class, as
compressed-tensors does its QuantizationConfig. The class names every field with its type; the
reader checks the record's kind and schema_version before anything else, so a record another
quantgate wrote in a shape this one does not know is refused in one line, never half read.

A record's JSON is `to_json()`, which is what `write` puts on disk through the atomic writer
(sorted keys, so the bytes do not depend on the order the fields are declared in)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from quantgate.core.artifacts import read_json, write_json
from quantgate.core.errors import InputError, IntegrityError
from quantgate.core.validation import first_problem, is_file_name

R = TypeVar("R", bound="Record")


class RecordPart(BaseModel):
    """A part of a record, as written: strict types (a count written as text, or as a float, is
    damage, not something to coerce), no field the class does not name, frozen once read.
    NaN and infinities are kept: a record reports what was measured (an evaluation's perplexity
    can overflow), and a gate judges it; refusing to read it would hide it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=True)


class Record(RecordPart):
    """A whole record: a JSON object whose `KIND_FIELD` holds `KIND` and whose `schema_version`
    is one of `READS`. Subclasses declare both as Literal fields, so a record they build carries
    them, and set the class variables the reader checks before validating anything else."""

    KIND: ClassVar[str]
    KIND_FIELD: ClassVar[str] = "kind"
    READS: ClassVar[tuple[int, ...]] = (1,)
    WHAT: ClassVar[str]  # how a message names the record: "measurement", "calibration set manifest"

    @classmethod
    def from_json(cls: type[R], value: object, where: str) -> R:
        """The record in `value` (parsed JSON), read from `where` (a file, or a file and a place
        in it): InputError when it is no JSON object, another artifact or a schema_version this
        quantgate does not read; IntegrityError (one line naming the field) when a field is
        missing, unknown or of the wrong type: the record is damaged."""
        what = f"{'an' if cls.WHAT[0] in 'aeiou' else 'a'} {cls.WHAT}"
        if not isinstance(value, dict):
            raise InputError(f"{where}: not {what} (a JSON {_json_type(value)}, not an object)")
        kind = value.get(cls.KIND_FIELD)
        if kind != cls.KIND:
            found = f"{cls.KIND_FIELD} {_shown(kind)}" if kind is not None else f"no {cls.KIND_FIELD}"
            raise InputError(f"{where}: {found}, not {what} ({cls.KIND_FIELD} {cls.KIND!r})")
        version = value.get("schema_version")
        if not (isinstance(version, int) and not isinstance(version, bool) and version in cls.READS):
            found = "no schema_version" if version is None else f"schema_version {_shown(version)}"
            raise InputError(f"{where}: {found}; this quantgate reads {' or '.join(map(str, cls.READS))}")
        try:
            return cls.model_validate(value)
        except ValidationError as error:
            problem = first_problem(error)
            raise IntegrityError(f"{where}: {cls.WHAT} field {_location(problem.path)}: {problem.message}") from error

    @classmethod
    def read(cls: type[R], path: Path) -> R:
        """The record in the JSON file `path` (see `from_json`); a file that is not JSON is one
        line too (quantgate.core.artifacts.read_json)."""
        return cls.from_json(read_json(Path(path)), str(path))

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values, in the field names it is written with."""
        return self.model_dump(mode="json", by_alias=True)

    def write(self, path: Path) -> None:
        """Write the record to `path` atomically."""
        write_json(Path(path), self.to_json())


def _json_type(value: object) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _shown(value: object) -> str:
    """A value a message quotes: short, on one line."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


def _location(path: tuple[str | int, ...]) -> str:
    """Where a field is, dotted (`sets.arc-easy@v1.items`); a key that could break the line or
    be mistaken for a dot is quoted, and a long one cut."""
    parts = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
            continue
        plain = part.isprintable() and "." not in part and 0 < len(part) <= 60
        parts.append(("." if parts else "") + (part if plain else _shown(part)))
    return "".join(parts) or "(the record)"


def _file_names(files: dict[str, str]) -> dict[str, str]:
    for name in files:
        if not is_file_name(name):
            raise ValueError(f"{_shown(name)} cannot name a file (empty, too long, a NUL or an unpaired surrogate)")
    return files


# An artifact's `files` table: relative path -> sha256 of the file; what each names is checked
# against the bytes by quantgate.core.artifacts.verify_files.
FileTable = Annotated[dict[str, str], AfterValidator(_file_names)]


class Machine(RecordPart):
    python: str
    platform: str
    cpu_count: int | None


class Provenance(RecordPart):
    """What made an artifact and what it cost (quantgate.core.artifacts.provenance)."""

    created_at: str
    libraries: dict[str, str | None]
    machine: Machine
    wall_seconds: float
    peak_memory_bytes: int
