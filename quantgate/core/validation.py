"""Pydantic glue every stage shares: the strict base model of configs and data files, and the
one way a validation failure becomes a one-line typed error naming where it is."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from quantgate.core.errors import InputError, QuantgateError

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """A config or data file: unknown fields are errors, values are frozen once read, and a number
    is finite (YAML's .nan and .inf, or 1e999, are errors: a NaN threshold compares false with
    everything, so a gate bounded by it would pass anything)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Problem:
    """The first thing pydantic found wrong: where (dotted), what, and pydantic's error type."""

    location: str
    message: str
    kind: str
    path: tuple[str | int, ...]

    @property
    def field(self) -> str:
        """The outermost named field on the path ('' for the document itself)."""
        return next((str(part) for part in self.path if isinstance(part, str)), "")


def first_problem(error: ValidationError) -> Problem:
    """The first error of a ValidationError, with pydantic's 'Value error, ' prefix taken off our
    own validators' messages (they are written for the user)."""
    first = error.errors()[0]
    path = tuple(first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return Problem(".".join(str(part) for part in path), message, str(first["type"]), path)


def validated(
    model: type[M],
    values: Mapping[str, Any] | object,
    what: str = "",
    *,
    error: type[QuantgateError] = InputError,
    names: Mapping[str, str] | None = None,
    within: str = "",
    message: Callable[[Problem], str] | None = None,
) -> M:
    """`model` built from `values`, or `error('<what>: <where>: <message>')` in one line: the one
    place a pydantic ValidationError becomes a quantgate error.

    `names` maps a field name to what the user typed for it (a command-line option), so the
    message names the option rather than the field. `within` is where `values` sit in a larger
    document (`quantize.gptq-int4` of a plan): `where` is then `quantize.gptq-int4.group_size`.
    `message`, where given, words the whole line from the problem instead (a site whose users
    know another shape, such as `invalid --format: ...`). `values` that are no mapping (a YAML
    list where a mapping belongs) are the error themselves.
    """
    try:
        return model.model_validate(dict(values) if isinstance(values, Mapping) else values)
    except ValidationError as failure:
        problem = first_problem(failure)
        if message is not None:
            raise error(message(problem)) from failure
        where = names.get(problem.field, problem.location) if names is not None else problem.location
        where = ".".join(part for part in (within, where) if part)
        prefix = f"{what}: {where}" if where else what
        raise error(f"{prefix}: {problem.message}") from failure


def is_file_name(name: str) -> bool:
    """Whether `name` can name a file at all, so that asking the filesystem about it is no error:
    not empty, no NUL, valid Unicode (no unpaired surrogate), each part at most 255 bytes and the
    whole at most 4096 (NAME_MAX and PATH_MAX on Linux). Where it points is checked elsewhere."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return bool(name) and b"\x00" not in encoded and len(encoded) <= 4096 and all(len(part) <= 255 for part in encoded.split(b"/"))


def is_path(text: str) -> bool:
    """Whether `text` can name a path at all (`is_file_name`, for a path that may be absolute):
    asking the filesystem about one that cannot is an OSError or ValueError, not an answer."""
    return is_file_name(text.lstrip("/") or ".")
