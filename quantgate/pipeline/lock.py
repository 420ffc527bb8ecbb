"""One run at a time in a run directory: the running process holds an exclusive `flock` on its
lock file (which names its pid, for the message), so a second run is refused in one line.

The kernel drops the lock when its process ends, however it ends, so a lock left by a killed
run needs no take-over: there is no window in which two processes that both found it stale
could both take it. A lock file is removed by its holder while still locked, and a process
that locked a file just removed (its inode no longer the path's) tries again on the new one."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from quantgate.core.errors import InputError


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
        self.handle: int | None = None

    def __enter__(self) -> RunLock:
        for _ in range(16):
            handle = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(handle)
                holder = _holder(self.path)
                running = f" (pid {holder})" if holder else ""
                raise InputError(f"another quantgate run{running} is using {self.path.parent}; wait for it, or choose another out") from None
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(handle).st_ino:  # its holder removed it as we opened it: lock the new one
                os.close(handle)
                continue
            os.ftruncate(handle, 0)
            os.write(handle, str(os.getpid()).encode())
            self.handle = handle
            return self
        raise InputError(f"cannot take the lock {self.path}")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if self.handle is None:
            return
        self.path.unlink(missing_ok=True)  # still locked: whoever opened it meanwhile sees it was removed
        os.close(self.handle)
        self.handle = None
