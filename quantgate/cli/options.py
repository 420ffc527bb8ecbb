"""What every command module shares: a pydantic config from command-line values, with a failure
worded for the option the user typed, and JSON on stdout."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import typer
from pydantic import BaseModel

from quantgate.core.errors import InputError
from quantgate.core.memory import Placement
from quantgate.core.validation import validated

M = TypeVar("M", bound=BaseModel)


def config(config_class: type[M], **values: Any) -> M:
    """Build a pydantic config from command-line values; a failure is one InputError line naming
    the option (`invalid group-size: ...`)."""
    return validated(config_class, values,
                     message=lambda problem: f"invalid {(problem.location or 'config').replace('_', '-')}: {problem.message}")


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


def placement_option(value: str) -> Placement:
    """--placement's value as a Placement; anything else one InputError line naming the choices."""
    try:
        return Placement(value)
    except ValueError:
        raise InputError(f"invalid placement: {value!r} (auto, memory or streamed)") from None
