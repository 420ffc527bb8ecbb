"""The exit codes of `quantgate`: part of its interface, so that a CI branches on what happened
without parsing text. One table, read by the CLI, the runner, `verify` and `serving check`."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """What a command's exit status means (docs/usage.md, "Exit codes", says the same).

    Where a run has several outcomes, the most urgent one is its exit code: UNTRUSTED before
    UNIT_FAILED (the run is incomplete: run it again) before BLOCKED before PENDING before APPROVED."""

    APPROVED = 0  # every format approved (verify: approved, signed by a trusted key, these very files)
    BLOCKED = 1  # a format blocked by its gates (verify: blocked, or no verdict on these files)
    BAD_INPUT = 2  # bad input or configuration: one line says what; nothing was written or lost
    CRASHED = 3  # a bug: the traceback is printed above
    PENDING = 4  # quality passed, serving evidence missing: the printed command adds it
    UNIT_FAILED = 5  # a unit of the run (a quantization, an evaluation, a serve...) failed: its record says which and why
    UNTRUSTED = 6  # a record unsigned, signed by an untrusted key, a bad signature, a tampered ledger or changed files
    INTERRUPTED = 130  # Ctrl-C, as a shell's


# The most urgent first: the exit code of a run with several outcomes.
URGENCY = (Exit.UNTRUSTED, Exit.UNIT_FAILED, Exit.BLOCKED, Exit.PENDING, Exit.APPROVED)


def most_urgent(codes: list[Exit]) -> Exit:
    """The exit code of several outcomes: the first of URGENCY among them (APPROVED for none)."""
    return next((code for code in URGENCY if code in codes), Exit.APPROVED)
