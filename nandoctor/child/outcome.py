"""How a probe process reports: the warnings it emitted, what it raised, and its record written
whole (the runner never reads half a file). Shared by the probe body (probe.py), in one process and in
each rank of a parallel probe."""

from __future__ import annotations

import os
import traceback
import warnings
from pathlib import Path

from .. import jsonio
from ..record import ProbeRecord

MAX_WARNINGS = 20


class WarningLog:
    """The distinct warnings the probe emitted, still printed to log.txt. PyTorch says in UserWarnings
    why it refused an SDPA kernel; a "No available kernel" error alone does not."""

    def __init__(self):
        self.messages: list[str] = []
        self.show = warnings.showwarning
        warnings.showwarning = self._show

    def _show(self, message, category, filename, lineno, file=None, line=None):
        text = f"{category.__name__}: {message}"
        if text not in self.messages and len(self.messages) < MAX_WARNINGS:
            self.messages.append(text)
        self.show(message, category, filename, lineno, file, line)


def error_of(e: BaseException, emitted: WarningLog) -> dict:
    """What the probe raised, as the record's `error`; the traceback also goes to log.txt."""
    import torch

    traceback.print_exc()  # into log.txt, whose tail the record keeps
    return {
        "type": type(e).__name__,
        "message": str(e)[:4000],
        "traceback": traceback.format_exc()[-6000:],
        "oom": isinstance(e, (MemoryError, torch.OutOfMemoryError)),
        "warnings": emitted.messages,
    }


def write(record: ProbeRecord, result_path: Path) -> None:
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(jsonio.dumps(record.to_dict()))
    os.replace(tmp, result_path)  # the runner never reads half a file


def built(path: Path) -> None:
    """Tell the runner the model is built: its timed steps' budget (timeout_s) starts now. A marker the
    runner cannot see only leaves the probe on its build budget, so a failure to write it is ignored."""
    try:
        path.touch()
    except OSError:
        pass
