"""Run probes in isolated OS processes, one per slot at a time, and append each result to the store.

Whatever a probe does — raise, segfault, abort, run out of memory, hang — the runner turns it into a
record and goes on. Each probe gets its own folder under <run>/probes/ with spec.json, steps.jsonl,
result.json and log.txt. By default a probe is forked from a warm worker (slots.WarmSlot); with
warm=False it is a fresh Python process (slots.ColdSlot). Either way the child runs child.entry.main.

A probe has three budgets, one after the other. build_timeout_s covers its imports and model build,
until the child writes BUILT_FILE; timeout_s then covers the timed steps, until the child writes
result.json (before the forensics replay); from then on the replay has forensics_timeout_s of its own,
and a replay that overruns (or dies) is noted in the record's `forensics`: the timed verdict stands.
A slow import on a busy machine or a long checkpoint load thus never eats the steps' budget, and a
hung step is caught after timeout_s, not after the build's allowance too.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import jsonio
from ..record import BUILT_FILE, REPLAY_RUNNING, STALE_FILES, ProbeRecord, ProbeSpec
from .slots import ColdSlot, WarmSlot
from .store import ResultsStore, cannot_write, write_atomic

LOG_TAIL_CHARS = 4000
# faulthandler lists every loaded extension module on one line after a crash's stack; on a GPU host
# that line alone filled the tail (issue 10), so it is left out of it.
NOISE_PREFIXES = ("Extension modules:",)
MAX_WAIT_S = 0.5  # the longest the runner sleeps between timeout checks
PLAN_TIMEOUT_S = 300.0  # a worker's import and the planning child together; past it the parent plans itself


@dataclass
class ProbeTask:
    spec: ProbeSpec  # what the child reads
    timeout_s: float
    run_facts: dict = field(default_factory=dict)  # record fields the parent knows (overrides, fingerprint)

    @property
    def probe_id(self) -> str:
        return self.spec.probe_id


def probe_dir(run_dir: Path, probe_id: str, under: str = "probes") -> Path:
    return run_dir / under / probe_id.replace("/", "__").replace("=", "-").replace(",", "+").replace(" ", "_")


def plan_request(device: dict | None, recipes: list[dict], steps: int) -> dict:
    """What a warm worker's planning child reads (child/plan.py): the device facts (None: gather them),
    the recipes (as dicts) to plan, the steps --scale auto weighs, and the GPUs this process sees."""
    return {"device": device, "recipes": recipes, "steps": steps, "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def threads_per_probe(jobs: int, cpu_count: int) -> int:
    """Divide the cores so that K probes at once do not oversubscribe them."""
    return max(1, cpu_count // max(1, jobs))


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16 * LOG_TAIL_CHARS))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith(NOISE_PREFIXES)]
    return "".join(lines)[-LOG_TAIL_CHARS:]


def _read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(jsonio.loads(line))
        except ValueError:
            break  # the line the child was writing when it died
    return steps


def _read_result(path: Path) -> dict:
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
    result = _read_result(folder / "result.json")
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
        _read_steps(folder / "steps.jsonl"),
        returncode,
        timed_out,
        wall_s,
        task.timeout_s,
        _tail(folder / "log.txt"),
        worker_died,
        ended_by,
        **task.run_facts,
        **run_facts,
    )
    record.exit_code = exit_code
    return record


@dataclass
class RunningProbe:
    task: ProbeTask
    folder: Path
    started: float
    timed_out: bool = False
    pid: int | None = None  # set when the probe process exists
    built_at: float | None = None  # when its model was built: the timed steps' budget starts then
    timed_at: float | None = None  # when its timed result appeared: the replay's budget starts then
    replay_overran: bool = False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left_s(self) -> float:
        """Seconds before this probe is killed: build_timeout_s from its start, then timeout_s from the
        end of its build, then the replay's budget from its timed result."""
        now = time.monotonic()
        if self.timed_at is None and (self.folder / "result.json").exists():
            self.timed_at = now
        if self.timed_at is not None:
            return self.task.spec.recipe.forensics_timeout_s - (now - self.timed_at)
        if self.built_at is None and (self.folder / BUILT_FILE).exists():
            self.built_at = now
        if self.built_at is not None:
            return self.task.timeout_s - (now - self.built_at)
        return self.task.spec.recipe.build_timeout_s - self.elapsed


class ProbeRunner:
    """Runs tasks on up to `jobs` slots (warm workers, or cold processes with warm=False); slot i is
    pinned to GPU i % gpus when there are GPUs. `limit` (at most `jobs`) is how many slots take probes
    now: the session lowers or raises it as measured memory peaks come in. Use as a context manager,
    or call close(): it stops the workers and kills any probe still running."""

    def __init__(self, run_dir: Path, store: ResultsStore, jobs: int = 1, gpus: int = 0, warm: bool = True):
        self.run_dir = Path(run_dir)
        self.store = store
        self.jobs = max(1, jobs)
        self.events: queue.Queue = queue.Queue()
        slot_class = WarmSlot if warm else ColdSlot
        self.slots = [slot_class(i, self.events, i % gpus if gpus else None) for i in range(self.jobs)]
        self.opened = 0  # slots whose worker has been started
        self.limit = self.jobs
        self.retried: set[str] = set()

    def open(self, slots: int = 1) -> ProbeRunner:
        """Start the first `slots` workers now, so that their imports overlap with what the caller does
        next; run() starts as many more as it has probes for, up to `jobs`."""
        most = min(slots, self.limit)
        for slot in self.slots[self.opened : most]:
            slot.open()
        self.opened = max(self.opened, most)
        return self

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        """Have the workers import this model type's modeling code (and peft, for an adapter) before their
        first probe."""
        for slot in self.slots:
            slot.preload(model_type, adapter)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()

    def plan(self, request: dict, timeout_s: float = PLAN_TIMEOUT_S) -> dict | None:
        """Have the first warm worker fork a child that plans the run (child/plan.py) once it has
        imported torch and transformers; returns that child's answer, or None when there is no warm
        worker or it gave none (then the caller plans itself). Events of the other slots wait their turn."""
        slot = self.slots[0]
        if slot.kind != "warm" or not self.opened:
            return None
        folder = Path(tempfile.mkdtemp(prefix="nandoctor-plan-"))
        request_path, result_path = folder / "request.json", folder / "result.json"
        request_path.write_text(jsonio.dumps(request, default=str))
        others, launched, killed, deadline = [], False, False, time.monotonic() + timeout_s
        try:
            while True:
                if not killed and time.monotonic() > deadline:
                    if not launched:
                        return None
                    killed = True  # then wait for its exit, so that run() does not hear of it
                    slot.kill_probe()
                if slot.ready and not launched:
                    slot.launch(request_path, result_path, folder / "log.txt", kind="plan")
                    launched = True
                try:
                    event = self.events.get(timeout=MAX_WAIT_S)
                except queue.Empty:
                    continue
                index, generation, message = event
                if index != slot.index or generation != slot.generation:
                    others.append(event)
                elif "ready" in message:
                    slot.ready, slot.threads = True, message.get("threads")
                elif "started" in message:
                    slot.pid = message["started"]
                    if killed:
                        slot.kill_probe()
                elif "exited" in message:
                    slot.pid = None
                    return None if killed else _read_result(result_path) or None
                elif "died" in message:
                    others.append(event)  # run() reports a worker that could not import, or replaces it
                    return None
        finally:
            for event in others:
                self.events.put(event)
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> ProbeRunner:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _launch(self, slot, task: ProbeTask, under: str) -> RunningProbe:
        folder = probe_dir(self.run_dir, task.probe_id, under)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for stale in STALE_FILES:
                (folder / stale).unlink(missing_ok=True)
            write_atomic(folder / "spec.json", jsonio.dumps(task.spec.to_dict()))
        except OSError as e:
            raise cannot_write(folder / "spec.json", e) from None
        slot.launch(folder / "spec.json", folder / "result.json", folder / "log.txt")
        return RunningProbe(task, folder, time.monotonic())

    def run(
        self, tasks: list[ProbeTask], on_record=None, on_wait=None, keep: bool = True, under: str = "probes"
    ) -> list[ProbeRecord]:
        """Run every task, each in its folder under run_dir/`under`; each record is appended to the store
        the moment its probe ends (keep=False: only returned, for probes run to time cells again).
        on_wait(running probes) is called at least every MAX_WAIT_S (a heartbeat hangs off it)."""
        pending = list(tasks)
        running: dict[int, RunningProbe] = {}
        records = []
        while pending or running:
            self.open(len(running) + len(pending))
            for slot in self.slots[: min(self.opened, self.limit)]:
                if slot.ready and slot.index not in running and pending:
                    running[slot.index] = self._launch(slot, pending.pop(0), under)
            try:
                index, generation, message = self.events.get(timeout=self._wait_s(running))
            except queue.Empty:
                index = None
            if index is not None and generation == self.slots[index].generation:
                record = self._handle(self.slots[index], message, running, pending)
                if record is not None:
                    if keep:
                        self.store.append(record)
                    records.append(record)
                    if on_record:
                        on_record(record)
            for index, probe in running.items():
                killed = probe.timed_out or probe.replay_overran
                if not killed and probe.left_s() < 0 and self.slots[index].pid:
                    if probe.timed_at is None:
                        probe.timed_out = True
                    else:
                        probe.replay_overran = True
                    self.slots[index].kill_probe()  # its exit arrives as an event
            if on_wait:
                on_wait(list(running.values()))
        return records

    @staticmethod
    def _wait_s(running: dict[int, RunningProbe]) -> float:
        left = [p.left_s() for p in running.values() if not (p.timed_out or p.replay_overran)]
        return max(0.01, min([MAX_WAIT_S] + left))

    def _handle(
        self, slot, message: dict, running: dict[int, RunningProbe], pending: list[ProbeTask]
    ) -> ProbeRecord | None:
        """Act on one slot event; returns a finished probe's record, if this event finished one."""
        if "ready" in message:
            slot.ready = True
            slot.threads = message.get("threads")
        elif "started" in message:
            slot.pid = running[slot.index].pid = message["started"]
            slot.threads = message.get("threads", slot.threads)
        elif "exited" in message:
            slot.pid = None
            probe = running.pop(slot.index)
            return self._record(slot, probe, message["returncode"])
        elif "died" in message:
            if not slot.ready:
                raise RuntimeError(
                    f"a warm worker exited {message['died']} before it finished importing "
                    "(its error is printed above); `--cold` runs probes without warm workers"
                )
            slot.kill_probe()
            slot.pid = None
            worker = slot.worker.pid
            slot.open()  # a fresh worker takes the slot
            probe = running.pop(slot.index, None)
            if probe is not None and probe.pid is None and probe.task.probe_id not in self.retried:
                self.retried.add(probe.task.probe_id)  # the worker died before forking it: not the probe's doing
                pending.insert(0, probe.task)
            elif probe is not None:
                return collect(
                    probe.task,
                    probe.folder,
                    None,
                    probe.timed_out,
                    probe.elapsed,
                    message["died"],
                    probe.replay_overran,
                    launch=slot.kind,
                    worker_pid=worker,
                )
        return None

    def _record(self, slot, probe: RunningProbe, returncode) -> ProbeRecord:
        worker = slot.worker.pid if slot.kind == "warm" else None
        return collect(
            probe.task,
            probe.folder,
            returncode,
            probe.timed_out,
            probe.elapsed,
            replay_overran=probe.replay_overran,
            launch=slot.kind,
            worker_pid=worker,
        )
