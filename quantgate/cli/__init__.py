"""The `quantgate` command line: a thin layer over the library, one module per command group
(`quantgate.cli.app` names them). Each command calls one library function; only `main` turns a
QuantgateError into one line on stderr and an exit code."""

from __future__ import annotations

import sys
import traceback

from quantgate.cli.app import app
from quantgate.core.errors import QuantgateError
from quantgate.core.exitcodes import Exit

# The exit codes are quantgate.core.exitcodes.Exit (docs/usage.md, "Exit codes"); a crash is
# never 1 (= "blocked"): a CI must not read a bug as a verdict.
CRASH_EXIT_CODE = Exit.CRASHED


def main() -> None:
    try:
        app()
    except QuantgateError as error:
        message = " ".join(str(error).split())
        print(f"quantgate: error: {message}", file=sys.stderr)
        sys.exit(error.exit_code)
    except Exception:  # noqa: BLE001 - anything else is a bug: say so, never exit 1 (= "blocked")
        traceback.print_exc()
        print(f"quantgate: crashed (a bug, please report it with the traceback above); exit code {int(CRASH_EXIT_CODE)}", file=sys.stderr)
        sys.exit(CRASH_EXIT_CODE)

