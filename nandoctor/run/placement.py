"""Where probes run, as the one scheduling loop (run/scheduler.py) sees it: the Placement protocol, the
probe it places (PlacedProbe) and how that probe ended (Ending, carrying the watcher's Outcome).

Three placements implement it: this machine's slots (run/local.py: warm workers or a cold process per
probe), SLURM (run/on_slurm.py: job arrays) and Ray (run/on_ray.py: a task per probe). Whatever runs a
probe process watches its time budget (task.Budget): the local slots, or the node-side wrapper
(run/placed.py) of a job or task, which also writes the Outcome the parent reads back.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

from ..device import DeviceFacts
from ..errors import NandoctorError
from ..executors import ExecutorConfig
from .task import ProbeTask

EXITED = "EXITED"  # an Ending whose probe process was watched to its end: its Outcome says how


@dataclass
class Outcome:
    """How a watched probe process ended, as its watcher saw it: its exit (returncode: n < 0 killed by
    signal -n; None when it never exited on its own), whether its budget ran out, its wall time, and
    where it ran. Written by a local slot (in memory) or by placed.run_placed on a node (placed.json);
    read by the scheduler, which turns it into the probe's record with task.collect."""

    returncode: int | None
    timed_out: bool = False
    replay_overran: bool = False
    wall_s: float = 0.0
    worker_died: int | None = None  # the exit status of the warm worker that died under this probe
    worker_pid: int | None = None  # the warm worker that forked it
    node: str | None = None  # the host an executor placed it on
    gpus: str | None = None  # the GPUs it was given, as CUDA_VISIBLE_DEVICES names them
    gpu: str | None = None  # what those GPUs are (NVML's names), read where it ran

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Outcome:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def record_facts(self) -> dict:
        """The record fields it fills (ProbeRecord: worker_pid, node, gpu), those it knows."""
        return {k: v for k, v in (("worker_pid", self.worker_pid), ("node", self.node), ("gpu", self.gpu)) if v}


@dataclass
class Ending:
    """How a placed probe ended. state EXITED: its watcher saw it end, and `outcome` says how. Any other
    state is what the placement or its scheduler said instead (SLURM's end states, Ray's error type,
    NOT_STARTED past queue_wait, NOT_READY for a warm worker that never finished importing, WORKER_LOST
    for one that died before it forked the probe): the probe's own outcome is unknown."""

    state: str
    outcome: Outcome | None = None
    files: dict = field(default_factory=dict)  # what a placement without a shared filesystem carried back
    detail: str = ""  # what the scheduler said, for a lost probe's reason


@dataclass
class PlacedProbe:
    """A probe from the moment the scheduler hands it to a placement until it ends, attempt by attempt."""

    task: ProbeTask
    folder: Path
    attempt: int = 1
    handle: Any = None  # the placement's own handle (a local slot, a submitit job, a Ray generator)
    job_id: str | None = None
    state: str = "queued"  # queued | running
    queued_at: float = 0.0  # when it was placed, or when its own array's throttle last held it back
    waiting: str = ""  # why the scheduler has not started it (SLURM's pending reason, Ray's resources)
    started: float | None = None  # when it was first seen running
    cancelled: bool = False  # by the scheduler's backstop, past its budget
    seen_done: float | None = None  # when the scheduler first said it ended (its files may lag on a shared filesystem)
    step: dict | None = None  # its last step, for a placement whose probes' files are not here (Ray)
    lost: list[str] = field(default_factory=list)  # why earlier attempts failed

    @property
    def ranks(self) -> int:
        return self.task.ranks

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started if self.started else 0.0

    def placed_again(self) -> None:
        """Forget the last attempt's placement: it goes out again as a fresh one."""
        self.attempt += 1
        self.handle = self.job_id = self.started = self.seen_done = self.step = None
        self.state, self.cancelled, self.waiting = "queued", False, ""


class Placement(Protocol):
    """What the scheduling loop needs of a place where probes run.

    A placement is handed PlacedProbes whose folder already holds spec.json (the scheduler writes it);
    it starts each one's probe process there (`python -m nandoctor.child SPEC RESULT`, or a warm
    worker's fork of it), reports when each ended, and cancels on request. Every method but `wait`
    returns promptly."""

    launch: str  # the records' `launch`: warm, cold, slurm, ray
    capacity: int  # the most probes it runs at once
    batches: bool  # True: hand it every pending probe at once (a SLURM array throttles itself)
    grace_s: float | None  # None: it kills a probe past its budget itself; else how long past it the loop cancels
    queue_wait: float | None  # seconds a probe may stay queued while none of the run runs; None: it never queues

    def facts(self) -> dict[str, dict]:
        """{hardware kind ("" without a hardware axis): the device facts a job sized like one probe
        gathered there, as it wrote them (DeviceFacts.to_dict)}, once the start-up jobs ended; {} where
        the run plans with this host's facts."""

    def fit(self, device: DeviceFacts, probe_bytes: int) -> None:
        """The facts the run's probes are planned with and the GPU memory one probe takes (the plan's
        estimate, then the largest peak measured): a placement that packs probes sizes its slots by them."""

    def room(self, probes: list[PlacedProbe]) -> int:
        """How many of these probes, from the first, it can start now (a free slot, free GPUs)."""

    def submit(self, probes: list[PlacedProbe]) -> None:
        """Start (or queue) these probes."""

    def wait(self, probes: list[PlacedProbe], timeout_s: float) -> list[tuple[PlacedProbe, Ending]]:
        """Block up to timeout_s for endings of these in-flight probes; returns those that ended. A
        polling placement polls at its own polite cadence inside. It marks a probe that started (state
        "running", started) and notes its last step where its files are not here (PlacedProbe.step)."""

    def last_step(self, probe: PlacedProbe) -> dict | None:
        """A running probe's last step, or None before its first."""

    def cancel(self, probes: list[PlacedProbe], wait_s: float) -> None:
        """End these probes (kill, scancel, ray.cancel) and wait up to wait_s for them to be gone."""

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        """What the run's probes, and its planning, will import (a warm worker imports it ahead)."""

    def plan(self, request: dict) -> dict | None:
        """Plan the run where torch is already imported (child/plan.py in the fork of a warm worker of this
        machine: planner.py), or None: the caller plans itself."""

    def threads(self, device: DeviceFacts, ranks: int) -> int:
        """The CPU threads of a probe of `ranks` ranks: the cores its job asks for, or this host's share."""

    def probe_device(self, device: DeviceFacts, ranks: int) -> DeviceFacts:
        """What a probe of `ranks` ranks sees of the device facts (its job's GPUs, on a scheduler)."""

    def close(self) -> None:
        """End every probe and job still running, and what the placement started (workers, canaries)."""


def job_device(executor: ExecutorConfig, device: DeviceFacts | dict, ranks: int) -> DeviceFacts:
    """What a placed probe of `ranks` ranks will see: its job asks for the per-probe GPUs times its
    ranks (ExecutorConfig.size) of the kind the facts job saw one probe's share of."""
    device = DeviceFacts.of(device)
    if not device.gpus:
        return device
    return replace(device, gpus=device.gpus[:1] * executor.size(ranks)[1])


def missing_extra(kind: str, module: str) -> NandoctorError:
    return NandoctorError(f"--executor {kind} needs the {module} package: pip install 'nandoctor[{kind}]'")
