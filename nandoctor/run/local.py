"""This machine as a placement: slots (run/slots.py: warm workers that fork a probe each, or a cold
process per probe) and the GPUs this process was given.

Each probe gets a GPU set for its whole life. The GPUs are those this process was given: the entries
of the inherited CUDA_VISIBLE_DEVICES, in their own spelling (indices, GPU-UUIDs, MIG ids), or every
GPU the device facts list when it is unset; never one outside them. A W-rank probe (DDP, FSDP2) takes
W GPUs no other probe uses and holds them alone until it ends; one-GPU probes pack by memory
(slots.gpu_fit), each on the least loaded GPU. The probe process gets its set as its
CUDA_VISIBLE_DEVICES; a parallel probe's launcher gives rank r the r-th of them.

Whatever a probe does — raise, segfault, abort, run out of memory, hang — it ends as an Ending with
the Outcome of its process; its time budget (task.Budget) is watched here, and a probe past it is killed.
"""

from __future__ import annotations

import math
import os
import queue
import time
from pathlib import Path

from ..device import DeviceFacts, GpuFacts
from ..env import VISIBLE_DEVICES_ENV, get_cpu_count, get_gpu_count_guess, parse_visible_devices
from ..errors import NandoctorError
from ..executors import ExecutorConfig
from ..record import Exited, Ready, Started
from .placement import EXITED, Ending, Outcome, PlacedProbe
from .planner import plan_with
from .slots import ColdSlot, Died, WarmSlot, gpu_fit, most_jobs, packed_jobs
from .task import Budget, last_step

WAIT_SLICE_S = 0.5  # the longest the placement waits on its events between budget checks
# A warm worker's import of torch and transformers, however loaded the host: past it the worker is
# replaced, and the probe waiting on it counts as lost to the infrastructure (placed again, `retries`).
READY_TIMEOUT_S = 600.0


def visible_gpus(count: int, given: str | None) -> list[str]:
    """The GPUs this process was given, as it was given them: the entries of CUDA_VISIBLE_DEVICES
    (`given`; indices, GPU-UUIDs and MIG ids kept as written, env.parse_visible_devices), or
    0..count-1 when it is unset; at most `count` (the GPUs the device facts list)."""
    entries = parse_visible_devices(given)
    return [str(i) for i in range(count)] if entries is None else entries[:count]


def threads_per_probe(jobs: int, cpu_count: int) -> int:
    """A probe's torch threads on this host: the user's OMP_NUM_THREADS when it is set (its first
    level, a positive integer: the count torch itself would take), else the cores divided so that
    `jobs` probes at once do not oversubscribe them."""
    given = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, cpu_count // max(1, jobs))


class GpuSets:
    """Which of the visible GPUs each running probe holds: `load[i]` probes on GPU i, `owned[i]` when a
    W-rank probe holds it alone."""

    def __init__(self, visible: list[str]):
        self.visible = visible
        self.load = [0] * len(visible)
        self.owned = [False] * len(visible)

    def take(self, ranks: int, per_gpu: list[int]) -> list[int] | None:
        """A set for a probe of `ranks` ranks (indices into `visible`), or None when none is free now:
        W GPUs nothing runs on for a parallel probe, else the least loaded GPU with room (per_gpu)."""
        if not self.visible:
            return []
        if ranks > 1:
            free = [i for i, n in enumerate(self.load) if n == 0]
            if len(free) < ranks:
                return None
            for i in free[:ranks]:
                self.load[i], self.owned[i] = 1, True
            return free[:ranks]
        room = [i for i, n in enumerate(self.load) if not self.owned[i] and n < per_gpu[i]]
        if not room:
            return None
        best = min(room, key=lambda i: self.load[i])
        self.load[best] += 1
        return [best]

    def give_back(self, gpus: list[int]) -> None:
        for i in gpus:
            self.load[i] -= 1
            self.owned[i] = False

    def env(self, gpus: list[int]) -> dict:
        """The probe's CUDA_VISIBLE_DEVICES: its set, in the spelling this process was given."""
        return {VISIBLE_DEVICES_ENV: ",".join(self.visible[i] for i in gpus)} if self.visible else {}


class Running:
    """What a slot holds: the probe handed to it, its GPUs, and (once launched) its budget."""

    def __init__(self, probe: PlacedProbe, gpus: list[int]):
        self.probe, self.gpus = probe, gpus
        self.budget: Budget | None = None


class LocalPlacement:
    """This machine's slots. jobs: probes at once (None: packed by GPU memory, see fit; one at a time
    on a CPU); warm=False starts a cold process per probe. `device` is what the host is known to be so
    far (the facts that need no torch): fit() gives the planned facts later. The first slot's worker
    starts at once, so that its import overlaps with what the caller does next."""

    batches = False
    grace_s = None  # it kills a probe past its budget itself
    queue_wait = None  # a probe handed to it starts as soon as its slot is ready

    def __init__(self, executor: ExecutorConfig, run_dir: Path, jobs: int | None = None, warm: bool = True, **_):
        self.run_dir, self.asked, self.warm = Path(run_dir), jobs, warm
        self.launch = "warm" if warm else "cold"
        self.events: queue.Queue = queue.Queue()
        self.slots: list = []
        self.held: dict[int, Running] = {}  # slot index -> what it runs
        self.preloads: list[tuple] = []
        guess = DeviceFacts(gpus=(GpuFacts(),) * get_gpu_count_guess(), cpu_count=get_cpu_count())
        self._size(guess, None)
        self._slot(0)

    def _size(self, device: DeviceFacts, probe_bytes: int | None) -> None:
        """Capacity and per-GPU room from the device facts and one probe's GPU memory (None: not yet known)."""
        self.gpus = GpuSets(visible_gpus(len(device.gpus), os.environ.get(VISIBLE_DEVICES_ENV)))
        gpus = len(self.gpus.visible)
        self.slot_count = self.asked or most_jobs(device)
        if self.asked:
            self.capacity = self.asked
            self.per_gpu = [math.ceil(self.asked / gpus)] * gpus if gpus else []
        elif probe_bytes is None:
            self.capacity, self.per_gpu = self.slot_count, [self.slot_count] * gpus
        else:
            self.capacity = min(self.slot_count, packed_jobs(device, probe_bytes))
            self.per_gpu = gpu_fit(device, probe_bytes)

    def _slot(self, index: int):
        while len(self.slots) <= index:
            slot = (WarmSlot if self.warm else ColdSlot)(len(self.slots), self.events, str(self.run_dir.resolve()))
            for preload in self.preloads:
                slot.preload(*preload)
            slot.open()
            self.slots.append(slot)
        return self.slots[index]

    # --- the Placement protocol -------------------------------------------------------------------

    def facts(self) -> dict[str, dict]:
        return {}  # the run plans with this host's own facts

    def fit(self, device: DeviceFacts | dict, probe_bytes: int) -> None:
        busy = {i: r.gpus for i, r in self.held.items()}
        self._size(DeviceFacts.of(device), probe_bytes)
        for gpus in busy.values():  # what runs keeps its GPUs
            for i in gpus:
                self.gpus.load[i] += 1
                self.gpus.owned[i] = len(gpus) > 1

    def threads(self, device: DeviceFacts, ranks: int) -> int:
        return threads_per_probe(self.slot_count, device.cpu_count)

    def probe_device(self, device: DeviceFacts, ranks: int) -> DeviceFacts:
        return device

    def room(self, probes: list[PlacedProbe]) -> int:
        load, owned = list(self.gpus.load), list(self.gpus.owned)
        free = self.capacity - len(self.held)
        n = 0
        for probe in probes[: max(0, free)]:
            if self.gpus.take(probe.ranks, self.per_gpu) is None:
                break
            n += 1
        self.gpus.load, self.gpus.owned = load, owned  # only counted
        return n

    def submit(self, probes: list[PlacedProbe]) -> None:
        for probe in probes:
            free = [i for i in range(len(self.slots)) if i not in self.held]
            ready = [i for i in free if self.slots[i].ready]
            slot = self._slot((ready or free or [len(self.slots)])[0])
            index = slot.index
            held = Running(probe, self.gpus.take(probe.ranks, self.per_gpu) or [])
            self.held[index] = held
            probe.handle, probe.queued_at = slot, time.monotonic()
            if slot.ready:
                self._launch(slot, held)

    def _launch(self, slot, held: Running) -> None:
        folder = held.probe.folder
        slot.launch(folder / "spec.json", folder / "result.json", folder / "log.txt", self.gpus.env(held.gpus))
        held.budget = Budget(held.probe.task, folder)
        held.probe.state, held.probe.started = "running", time.monotonic()

    def wait(self, probes: list[PlacedProbe], timeout_s: float) -> list[tuple[PlacedProbe, Ending]]:
        deadline = time.monotonic() + timeout_s
        ended: list[tuple[PlacedProbe, Ending]] = []
        while True:
            ended += self._watch()
            left = deadline - time.monotonic()
            if ended or left <= 0:
                return ended
            try:
                event = self.events.get(timeout=min(left, WAIT_SLICE_S, *self._budgets_left()))
            except queue.Empty:
                continue
            while event is not None:
                ended += self._handle(*event)
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    event = None

    def _budgets_left(self) -> list[float]:
        return [max(0.01, r.budget.left_s()) for r in self.held.values() if r.budget and not r.budget.killed]

    def _watch(self) -> list[tuple[PlacedProbe, Ending]]:
        """Kill the probes past their budget (their exits come as events), and give up on workers that
        never finished importing."""
        ended = []
        for index, held in list(self.held.items()):
            slot = self.slots[index]
            if held.budget is not None:
                if slot.pid and held.budget.overran():
                    slot.kill_probe()  # its exit comes as an event
            elif time.monotonic() - slot.opened_at > READY_TIMEOUT_S:
                slot.kill_worker()
                slot.open()  # a fresh worker takes the slot; the old one's death is of an old generation
                ended.append(self._free(index, Ending("NOT_READY", detail=self._not_ready())))
        return ended

    @staticmethod
    def _not_ready() -> str:
        return f"its warm worker did not finish importing within {READY_TIMEOUT_S:g} s"

    def _free(self, index: int, ending: Ending) -> tuple[PlacedProbe, Ending]:
        held = self.held.pop(index)
        self.gpus.give_back(held.gpus)
        held.probe.handle = None
        return held.probe, ending

    def _handle(self, index: int, generation: int, message) -> list[tuple[PlacedProbe, Ending]]:
        """Act on one slot event; returns the probe it ended, if it ended one."""
        slot = self.slots[index]
        if generation != slot.generation:
            return []
        held = self.held.get(index)
        if isinstance(message, Ready):
            slot.ready, slot.threads = True, message.threads
            if held is not None and held.budget is None:
                self._launch(slot, held)
        elif isinstance(message, Started):
            slot.pid, slot.threads = message.pid, message.threads
        elif isinstance(message, Exited):
            if slot.pid is not None and message.pid != slot.pid:
                return []  # a probe killed before this slot took another: its end is no news
            slot.pid = None
            if held is not None:
                return [self._free(index, Ending(EXITED, self._outcome(slot, held, message.returncode)))]
        elif isinstance(message, Died):
            return self._died(slot, held, message.returncode)
        return []

    def _outcome(self, slot, held: Running, returncode: int | None, worker_died: int | None = None) -> Outcome:
        budget = held.budget
        return Outcome(
            returncode,
            budget.timed_out,
            budget.replay_overran,
            budget.elapsed,
            worker_died=worker_died,
            worker_pid=slot.worker_pid,
            gpus=self.gpus.env(held.gpus).get(VISIBLE_DEVICES_ENV),
        )

    def _died(self, slot, held: Running | None, returncode: int) -> list[tuple[PlacedProbe, Ending]]:
        if not slot.ready:
            raise NandoctorError(
                f"a warm worker exited {returncode} before it finished importing "
                "(its error is printed above); `--cold` runs probes without warm workers"
            )
        forked, worker = slot.pid is not None, slot.worker_pid
        slot.kill_probe()
        slot.pid = None
        outcome = self._outcome(slot, held, None, returncode) if held is not None and forked else None
        slot.open()  # a fresh worker takes the slot
        if held is None:
            return []
        if outcome is None:  # the worker died before it forked the probe: not the probe's doing
            return [
                self._free(slot.index, Ending("WORKER_LOST", detail=f"its warm worker {worker} exited {returncode}"))
            ]
        outcome.worker_pid = worker
        return [self._free(slot.index, Ending(EXITED, outcome))]

    def last_step(self, probe: PlacedProbe) -> dict | None:
        return last_step(probe.folder / "steps.jsonl")

    def cancel(self, probes: list[PlacedProbe], wait_s: float) -> None:
        for index, held in list(self.held.items()):
            if held.probe in probes:
                self.slots[index].kill_probe()
                self._free(index, Ending("CANCELLED"))

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        if (model_type, adapter) not in self.preloads:
            self.preloads.append((model_type, adapter))
        for slot in self.slots:
            slot.preload(model_type, adapter)

    def plan(self, request: dict, timeout_s: float | None = None) -> dict | None:
        """Have the first warm worker plan the run, or lint its data (planner.plan_with), once it has
        imported torch and transformers; None when there is no warm worker or it gave no answer (then
        the caller does it itself). Events of the other slots wait their turn."""
        slot = self.slots[0]
        if slot.kind != "warm" or 0 in self.held:
            return None
        return plan_with(slot, self.events, request, timeout_s)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.held.clear()
