"""A probe process's lifetime tied to its parent's: a warm worker's forked children and a parallel
probe's ranks die with the process that started them."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so that killing the CLI (or a worker)
    leaves no orphan probe training on. Elsewhere this is a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def parent_gone(expected: str | None, ppid: int) -> bool:
    """Whether the process that started this one (its pid `expected`, from PARENT_ENV) died before
    die_with_parent could tie this process to it: then this process's parent is already someone else."""
    return expected is not None and expected != str(ppid)
