"""Pydantic glue every stage shares: the strict base model of configs and data files, and the
one way a validation failure becomes a one-line typed error naming where it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from quantgate.core.errors import InputError, QuantgateError

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """A config or data file: unknown fields are errors, values are frozen once read."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Problem:
    """The first thing pydantic found wrong: where (dotted), what, and pydantic's error type."""

    location: str
    message: str
    kind: str
    path: tuple[str | int, ...]


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
    what: str,
    *,
    error: type[QuantgateError] = InputError,
    names: Mapping[str, str] | None = None,
    within: str = "",
) -> M:
    """`model` built from `values`, or `error('<what>: <where>: <message>')` in one line.

    `names` maps a field name to what the user typed for it (a command-line option), so the
    message names the option rather than the field. `within` is where `values` sit in a larger
    document (`quantize.gptq-int4` of a plan): `where` is then `quantize.gptq-int4.group_size`.
    `values` that are no mapping (a YAML list where a mapping belongs) are the error themselves.
    """
    try:
        return model.model_validate(dict(values) if isinstance(values, Mapping) else values)
    except ValidationError as failure:
        problem = first_problem(failure)
        field = next((str(part) for part in problem.path if isinstance(part, str)), "")
        where = names.get(field, problem.location) if names is not None else problem.location
        where = ".".join(part for part in (within, where) if part)
        prefix = f"{what}: {where}" if where else what
        raise error(f"{prefix}: {problem.message}") from failure
