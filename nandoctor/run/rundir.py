"""Run-directory policy: where a run goes (a new or unused --out, or a stamped folder under reports/),
what an interrupted run says to resume it, and what a resumed run reads back from its directory."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from ..config import Recipe
from ..device import DeviceFacts
from ..errors import NandoctorError
from ..executors import ExecutorConfig
from ..models import memory_budget
from ..runmeta import RunMeta
from .store import RESULTS_FILE, RUN_FILE, ResultsStore

REPORTS_DIR = Path("reports")
FACTS_FILE = "hardware.json"  # an executor's device facts per kind of hardware, kept for --resume
RESUME_COMMANDS = {"grid": "nandoctor grid --resume {dir}", "bisect": "nandoctor bisect --resume {dir}"}


def planning_device(devices: dict[str, DeviceFacts]) -> DeviceFacts:
    """The facts the model is planned with when probes run on several kinds of hardware: those of the
    kind with the least memory, so that every kind trains the same model and it fits on each."""
    return min(devices.values(), key=memory_budget)


def kept_device(run_dir, executor: ExecutorConfig | None) -> DeviceFacts | None:
    """The facts a run placed by an executor was planned with (FACTS_FILE), for resuming it with them
    on the same kind of executor; None otherwise."""
    if executor is None or not executor.remote:
        return None
    kept = ResultsStore(run_dir).read_json(FACTS_FILE)
    return planning_device({kind: DeviceFacts.from_dict(f) for kind, f in kept.items()}) if kept else None


def resume_command(kind: str, run_dir: str | Path) -> str | None:
    """The command line that finishes an interrupted run of this kind, or None (a check is not resumed)."""
    template = RESUME_COMMANDS.get(kind)
    return template.format(dir=shlex.quote(str(run_dir))) if template else None


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM: `signal`) while a Session was filling a run directory: what it recorded is
    kept there."""

    def __init__(self, kind: str, run_dir: Path, signal: int):
        super().__init__(kind, str(run_dir))
        self.kind, self.run_dir, self.signal = kind, run_dir, signal

    @property
    def resume_command(self) -> str | None:
        return resume_command(self.kind, self.run_dir)


def refuse_used_out(path: Path) -> None:
    """--out must be a new or unused directory: appending to a run already there would mix two runs in
    one results.jsonl and judge the old probes against the new reference."""
    if path.exists() and not path.is_dir():
        raise NandoctorError(
            f"--out {str(path)!r} is a file; pass a directory for the run (it is created when missing)"
        )
    if not any((path / name).exists() for name in (RUN_FILE, RESULTS_FILE, "probes")):
        return
    try:
        kind = RunMeta.from_dict(ResultsStore(path).read_json(RUN_FILE) or {}).kind or "nandoctor"
    except NandoctorError:
        kind = "nandoctor"  # an unreadable run.json is still somebody's run
    command = resume_command(kind, path)
    finish = f"finish it with `{command}` or " if command else ""
    raise NandoctorError(f"--out {str(path)!r} already holds a {kind} run; {finish}pass another --out")


def refuse_unwritable(path: Path, named: str = "--out") -> None:
    """Before any probe runs: the run directory (or the nearest folder above it that exists, where it
    will be created) must be a directory this process can write to."""
    there = path
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise NandoctorError(f"{named} {str(path)!r} cannot be created: {str(there)!r} is a file, not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        why = (
            "is on a read-only file system"
            if os.statvfs(there).f_flag & os.ST_RDONLY
            else "is not writable by this user"
        )
        raise NandoctorError(
            f"{named} {str(path)!r} cannot be written: {str(there)!r} {why}; pass --out a writable directory"
        )


def new_run_dir(out: str | Path | None, kind: str, recipe: Recipe) -> Path:
    if out:
        refuse_used_out(Path(out))
        refuse_unwritable(Path(out))
        return Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = recipe.name.replace("/", "--")
    path = REPORTS_DIR / f"{stamp}-{kind}-{safe}"
    n = 1
    while path.exists():
        n += 1
        path = REPORTS_DIR / f"{stamp}-{kind}-{safe}-{n}"
    refuse_unwritable(path, "the default run directory")
    return path
