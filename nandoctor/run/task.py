"""One probe as the parent hands it over and reads it back, wherever it runs: the task, its folder and
spec.json (written here, atomically, for every placement), its time budget, and its record built from
what the probe process left in its folder.

A probe has three budgets, one after the other (Budget). build_timeout_s covers its imports and model
build, until the child writes BUILT_FILE; timeout_s then covers the timed steps, until the child writes
result.json (before the forensics replay); from then on the replay has forensics_timeout_s of its own,
and a replay that overruns (or dies) is noted in the record's `forensics`: the timed verdict stands.
A slow import on a busy machine or a long checkpoint load thus never eats the steps' budget, and a
hung step is caught after timeout_s, not after the build's allowance too. Whatever watches a probe
process applies it: a local slot (run/local.py) and the node-side wrapper of a placed job (run/placed.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import jsonio
from ..record import BUILT_FILE, REPLAY_RUNNING, STALE_FILES, ProbeRecord, ProbeSpec
from .store import cannot_write, write_atomic

LOG_TAIL_CHARS = 4000
# faulthandler lists every loaded extension module on one line after a crash's stack; on a GPU host
# that line alone filled the tail (issue 10), so it is left out of it.
NOISE_PREFIXES = ("Extension modules:",)
SPEC_FILE = "spec.json"
OUTCOME_FILE = "placed.json"  # how a placed probe ended, written by its node-side watcher (placed.py)


@dataclass
class ProbeTask:
    spec: ProbeSpec  # what the child reads
    timeout_s: float
    run_facts: dict = field(default_factory=dict)  # record fields the parent knows (overrides, fingerprint)

    @property
    def probe_id(self) -> str:
        return self.spec.probe_id

    @property
    def ranks(self) -> int:
        """The processes this probe runs as: world_size for a parallel cell, else 1."""
        return self.spec.recipe.world_size if self.spec.cell.parallel_row.wrapper else 1

    @property
    def budget_s(self) -> float:
        """The whole of its three budgets: the longest a probe may live."""
        recipe = self.spec.recipe
        return recipe.build_timeout_s + self.timeout_s + recipe.forensics_timeout_s


def probe_dir(run_dir: Path, probe_id: str, under: str = "probes") -> Path:
    return run_dir / under / probe_id.replace("/", "__").replace("=", "-").replace(",", "+").replace(" ", "_")


def write_spec(task: ProbeTask, folder: Path, stale: tuple[str, ...] = ()) -> Path:
    """Make the probe's folder, clear what an earlier attempt left there (STALE_FILES and `stale`) and
    write its spec.json atomically; returns the spec's path. A refused write is one NandoctorError."""
    path = folder / SPEC_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name in (*STALE_FILES, *stale):
            (folder / name).unlink(missing_ok=True)
        write_atomic(path, jsonio.dumps(task.spec.to_dict()))
    except OSError as e:
        raise cannot_write(path, e) from None
    return path


@dataclass
class Budget:
    """The time a running probe has left, phase by phase (see the module docstring). `folder` is where
    the probe writes BUILT_FILE and result.json; `started` when its process was started."""

    task: ProbeTask
    folder: Path
    started: float = field(default_factory=time.monotonic)
    built_at: float | None = None  # when its model was built: the timed steps' budget starts then
    timed_at: float | None = None  # when its timed result appeared: the replay's budget starts then
    timed_out: bool = False  # killed in its build or its timed steps
    replay_overran: bool = False  # killed in its forensics replay, after its timed result

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left_s(self) -> float:
        """Seconds before this probe must be killed: build_timeout_s from its start, then timeout_s from
        the end of its build, then the replay's budget from its timed result."""
        now, recipe = time.monotonic(), self.task.spec.recipe
        if self.timed_at is None and (self.folder / "result.json").exists():
            self.timed_at = now
        if self.timed_at is not None:
            return recipe.forensics_timeout_s - (now - self.timed_at)
        if self.built_at is None and (self.folder / BUILT_FILE).exists():
            self.built_at = now
        if self.built_at is not None:
            return self.task.timeout_s - (now - self.built_at)
        return recipe.build_timeout_s - self.elapsed

    @property
    def killed(self) -> bool:
        return self.timed_out or self.replay_overran

    def overran(self) -> bool:
        """True once, when the probe has just run out of time: then it must be killed, and which budget
        it overran is noted (timed_out before its timed result, replay_overran after)."""
        if self.killed or self.left_s() >= 0:
            return False
        self.timed_out, self.replay_overran = self.timed_at is None, self.timed_at is not None
        return True


def log_tail(path: Path) -> str:
    """The last LOG_TAIL_CHARS of a probe's log.txt, faulthandler's module list left out."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16 * LOG_TAIL_CHARS))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith(NOISE_PREFIXES)]
    return "".join(lines)[-LOG_TAIL_CHARS:]


def read_steps(path: Path) -> list[dict]:
    """The steps a probe streamed to its steps.jsonl, up to the line it was writing when it ended."""
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(jsonio.loads(line))
        except ValueError:
            break  # the line the child was writing when it died
    return steps


def read_result(path: Path) -> dict:
    """A probe's result.json, or {} when it wrote none (or half of one)."""
    try:
        return jsonio.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def collect(
    task: ProbeTask,
    folder: Path,
    returncode: int | None,
    timed_out: bool,
    wall_s: float,
    worker_died: int | None = None,
    replay_overran: bool = False,
    ended_by: dict | None = None,
    **run_facts,
) -> ProbeRecord:
    """The probe's record from whatever the child left behind in its folder. A result whose replay
    never finished is the timed steps' result: the replay's end is noted in its forensics."""
    result = read_result(folder / "result.json")
    exit_code = returncode
    replay_cut = result.get("forensics") == REPLAY_RUNNING
    if replay_cut:
        budget = task.spec.recipe.forensics_timeout_s
        if replay_overran:
            why = f"replay overran its {budget:g} s budget"
        elif returncode is not None and returncode < 0:
            why = f"replay died of signal {-returncode}"
        else:
            why = (
                "replay ended without a result "
                f"(exit {returncode if worker_died is None else f'of its worker {worker_died}'})"
            )
        result["forensics"] = {"error": why}
    if replay_cut or (replay_overran and result):
        returncode, worker_died = 0, None  # the timed steps ended with a result: the verdict is theirs
    if timed_out:
        run_facts["timed_out_in"] = "steps" if (folder / BUILT_FILE).exists() else "build"
    record = ProbeRecord.finished(
        task.spec,
        result,
        read_steps(folder / "steps.jsonl"),
        returncode,
        timed_out,
        wall_s,
        task.timeout_s,
        log_tail(folder / "log.txt"),
        worker_died,
        ended_by,
        **task.run_facts,
        **run_facts,
    )
    record.exit_code = exit_code
    return record


def last_step(path: Path) -> dict | None:
    """The last complete step a running probe has streamed to its steps.jsonl, or None."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return jsonio.loads(line)
        except ValueError:
            continue  # the line the child is writing right now
    return None
