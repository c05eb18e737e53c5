"""The run's planning on a warm worker of this machine: the worker forks a child that gathers the device
facts and plans the models (child/plan.py), so that the process that runs the session never imports
torch, transformers or modeling code for it.

`plan_with` is the one way to ask: a local placement asks the worker of its first slot (which then runs
probes); a placement whose probes run elsewhere (a SLURM or Ray cluster) owns a `Planner`, a worker of
its own that only plans, started with the placement so that its import overlaps the cluster's start-up
jobs, and closed with it."""

from __future__ import annotations

import queue
import shutil
import tempfile
import time
from pathlib import Path

from .. import jsonio
from ..device import DeviceFacts
from ..record import Exited, Ready, Started
from .slots import Died, WarmSlot
from .task import read_result

WAIT_SLICE_S = 0.5  # the longest the planning waits on the slot's events between deadline checks
PLAN_TIMEOUT_S = 300.0  # a worker's import and the planning child together; past it the caller plans itself
# ... and with the data lint ({"lint": recipe}), which reads, tokenizes and measures every row of the file
LINT_TIMEOUT_S = 3600.0


def plan_request(device: DeviceFacts | dict | None, recipes: list[dict], steps: int) -> dict:
    """What a warm worker's planning child reads (child/plan.py), as JSON data: the device facts (None:
    gather them; a cluster's start-up jobs gathered them there), the recipes (as dicts) to plan, and
    the steps --scale auto weighs."""
    device = DeviceFacts.of(device)
    return {"device": device.to_dict() if device else None, "recipes": recipes, "steps": steps}


def plan_with(slot: WarmSlot, events: queue.Queue, request: dict, timeout_s: float | None = None) -> dict | None:
    """Have `slot`'s warm worker fork a child that answers `request` (a plan, or the data lint) once the
    worker has imported torch and transformers; returns that child's answer, or None when it gave none
    within timeout_s (PLAN_TIMEOUT_S, or LINT_TIMEOUT_S for the lint; then the caller does it itself).
    `events` is the queue the slot reports to: the events of other slots, and a worker's death, are put
    back for whoever waits on them."""
    timeout_s = timeout_s or (LINT_TIMEOUT_S if "lint" in request else PLAN_TIMEOUT_S)
    folder = Path(tempfile.mkdtemp(prefix="nandoctor-plan-"))
    request_path, result_path = folder / "request.json", folder / "result.json"
    request_path.write_text(jsonio.dumps(request, default=str))
    others, launched, killed, deadline = [], False, False, time.monotonic() + timeout_s
    try:
        while True:
            if not killed and time.monotonic() > deadline:
                if not launched:
                    return None
                killed = True  # then wait for its exit, so that the probes' events do not hear of it
                slot.kill_probe()
            if slot.ready and not launched:
                slot.launch(request_path, result_path, folder / "log.txt", {}, kind="plan")
                launched = True
            try:
                event = events.get(timeout=WAIT_SLICE_S)
            except queue.Empty:
                continue
            index, generation, message = event
            if index != slot.index or generation != slot.generation:
                others.append(event)
            elif isinstance(message, Ready):
                slot.ready, slot.threads = True, message.threads
            elif isinstance(message, Started):
                slot.pid = message.pid
                if killed:
                    slot.kill_probe()
            elif isinstance(message, Exited):
                slot.pid = None
                return None if killed else read_result(result_path) or None
            elif isinstance(message, Died):
                others.append(event)  # the probes' wait reports a worker that could not import, or replaces it
                return None
    finally:
        for event in others:
            events.put(event)
        shutil.rmtree(folder, ignore_errors=True)


class Planner:
    """A warm worker that only plans, for a placement whose probes run elsewhere: started at once, or
    (start=False: a resumed run, planned already) when a recipe variant first needs a plan. warm=False
    (--cold) starts none: the caller plans itself, as it does when the worker could not import."""

    def __init__(self, run_dir: Path, warm: bool = True, start: bool = True):
        self.events: queue.Queue = queue.Queue()
        self.slot = WarmSlot(0, self.events, str(Path(run_dir).resolve())) if warm else None
        if self.slot and start:
            self.slot.open()

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        if self.slot:
            self.slot.preload(model_type, adapter)  # sent when its worker starts, if it has not yet

    def plan(self, request: dict, timeout_s: float | None = None) -> dict | None:
        if self.slot is None:
            return None
        if self.slot.worker is None:
            self.slot.open()
        elif self.slot.worker.poll() is not None:
            return None  # it could not import (its error is printed above)
        return plan_with(self.slot, self.events, request, timeout_s)

    def close(self) -> None:
        if self.slot:
            self.slot.close()
