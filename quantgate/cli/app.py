"""The `quantgate` Typer app and what every command module shares: config validation and JSON
output. Command groups register themselves on `app` when `quantgate.cli` imports them."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import typer
from pydantic import BaseModel

from quantgate.core.validation import validated

M = TypeVar("M", bound=BaseModel)

app = typer.Typer(
    name="quantgate",
    help="Quantize an LLM and gate every format against its baseline before it ships.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def config(config_class: type[M], **values: Any) -> M:
    """Build a pydantic config from command-line values; a failure is one InputError line naming
    the option (`invalid group-size: ...`)."""
    return validated(config_class, values,
                     message=lambda problem: f"invalid {(problem.location or 'config').replace('_', '-')}: {problem.message}")


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))
