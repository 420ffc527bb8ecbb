"""The one error family of quantgate. Library code raises these; only the CLI turns them
into a one-line message and an exit code."""

from __future__ import annotations


class QuantgateError(Exception):
    """Base of every error quantgate raises on purpose. `exit_code` is what the CLI returns."""

    exit_code = 1


class InputError(QuantgateError):
    """The user gave something unusable: a missing path, a bad option, an empty source."""

    exit_code = 2


class ModelError(InputError):
    """A model directory, hub id or demo model that cannot be used."""


class SourceError(InputError):
    """A calibration text source that cannot be read or yields nothing usable."""


class OutputExistsError(InputError):
    """The output path exists and would be replaced without --overwrite."""


class Interrupted(QuantgateError):
    """Ctrl-C: the work stopped, and what was written so far is whole (exit 130, as a shell's)."""

    exit_code = 130


class IntegrityError(QuantgateError):
    """An artifact's files do not match the hashes in its manifest."""

    exit_code = 2


def did_you_mean(name: str, valid: list[str]) -> str:
    """A ' (did you mean X?)' hint for a misspelt name, or '' when nothing is close."""
    import difflib

    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
