"""One run at a time in a run directory: its lock file holds the running process's pid, and a
lock left by a process that no longer exists (a killed run) is taken over."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from quantgate.core.errors import InputError


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(path: Path) -> int:
    """The pid a lock file names; 0 when it names none."""
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


class RunLock:
    """`with RunLock(run_dir.lock):` holds the run directory for this process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> RunLock:
        for _ in range(2):
            try:
                handle = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _holder(self.path)
                if holder and holder != os.getpid() and alive(holder):
                    raise InputError(f"another quantgate run (pid {holder}) is using {self.path.parent}; wait for it, or choose another out") from None
                self.path.unlink(missing_ok=True)  # stale: its run was killed
                continue
            with os.fdopen(handle, "w") as stream:
                stream.write(str(os.getpid()))
            return self
        raise InputError(f"cannot take the lock {self.path}")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.path.unlink(missing_ok=True)
