"""What the placements on a cluster scheduler (run/on_slurm.py, run/on_ray.py) share. Each probe is a job
or task that asks for its own resources (ExecutorConfig.size times its ranks) and runs as a fresh
process, and the run plans on a warm worker of this machine (planner.Planner), started with the
placement so that its import overlaps the cluster's start-up: a resumed run has its plan, so its worker
starts only if a recipe variant needs one. A subclass starts or joins its cluster, gathers each hardware
kind's device facts (`facts`), and submits, waits for and cancels its jobs.
"""

from __future__ import annotations

from pathlib import Path

from ..device import DeviceFacts
from ..executors import ExecutorConfig
from .placement import PlacedProbe, job_device
from .planner import Planner


class ClusterPlacement:
    """The Placement members a cluster scheduler's placement shares; the subclass sets `launch`,
    `batches`, `grace_s` and `capacity`, and implements facts, submit, wait, last_step and cancel."""

    def __init__(self, executor: ExecutorConfig, run_dir: Path, kept: dict | None, warm: bool):
        self.options = executor
        self.queue_wait = executor.option("queue_wait")
        self.gather, self.gathered = not kept, dict(kept or {})  # a resumed run keeps the facts it gathered
        self.planner = Planner(run_dir, warm, start=not kept)

    def fit(self, device: DeviceFacts, probe_bytes: int) -> None:
        pass  # a job asks for its own resources

    def room(self, probes: list[PlacedProbe]) -> int:
        return len(probes)  # what cannot run yet waits in the cluster's queue (SLURM) or in the loop (capacity)

    def threads(self, device: DeviceFacts, ranks: int) -> int:
        return self.options.size(ranks)[0]

    def probe_device(self, device: DeviceFacts, ranks: int) -> DeviceFacts:
        return job_device(self.options, device, ranks)

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        self.planner.preload(model_type, adapter)  # each placed probe is a fresh process: only the planner preloads

    def plan(self, request: dict) -> dict | None:
        return self.planner.plan(request)  # with the facts gathered at start, in the request

    def close(self) -> None:
        self.planner.close()
