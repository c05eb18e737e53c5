"""Probes placed by a scheduler (SLURM, Ray) instead of this machine's slots.

RemoteRunner has ProbeRunner's interface (run, limit, open, preload, close), so a Session runs grid,
check and bisect probes through it unchanged. A placement (on_slurm.SlurmPlacement, on_ray.RayPlacement)
only submits, polls and cancels; every probe is still its own process running the child code
(placed.run_placed on the node), and its record is built by runner.collect from the same files and
exit facts as a local probe's, so a segfault, a hang or an OOM gets the same verdict wherever it ran.

What the scheduler reports is data (SCHEDULER_ENDS): its time limit is a timeout, its memory limit an
OOM. Anything else that ended a job without the probe's own outcome (a lost node, a preemption, a job
never started) is the infrastructure's failure: the probe is placed again, at most `retries` times, then
recorded as `lost`, which is no verdict about the configuration. A job the scheduler does not start
within the `queue_wait` option (held, pending on resources no node has, a partition that never frees)
is cancelled and counts as such a loss; the wait counts only while none of this run's probes runs, so
a run larger than the cluster, queued behind its own probes, is not cut short.
"""

from __future__ import annotations

import time
from pathlib import Path

from .. import jsonio
from ..config import ExecutorConfig
from ..errors import NandoctorError
from ..record import STALE_FILES, ProbeRecord
from .placement import Ending, PlacedProbe
from .runner import ProbeTask, collect, probe_dir
from .store import ResultsStore

POLL_S = 0.25  # how often the scheduler is asked about the probes in flight
QUEUE_LINE_S = 5.0  # the queue line is said when it changes, at most this often
CANCEL_WAIT_S = 20.0  # how long close() waits for the cancelled jobs to leave the queue

# A scheduler's own end states that say something about the probe, as the verdict a local probe gets:
# the job's time limit is the probe's timeout, its memory limit the probe's OOM (SLURM's names;
# slurm.schedmd.com/squeue.html#SECTION_JOB-STATE-CODES).
SCHEDULER_ENDS = {
    "TIMEOUT": {"timed_out": True},
    "DEADLINE": {"timed_out": True},
    "OUT_OF_MEMORY": {
        "ended_by": {
            "type": "OutOfMemory",
            "oom": True,
            "traceback": "",
            "message": "the scheduler ended the job OUT_OF_MEMORY: the probe exceeded the job's memory limit",
        }
    },
}


def open_placement(executor: ExecutorConfig, run_dir: Path, gather: bool = True):
    if executor.kind == "slurm":
        from .on_slurm import SlurmPlacement

        return SlurmPlacement(executor, run_dir, gather)
    if executor.kind == "ray":
        from .on_ray import RayPlacement

        return RayPlacement(executor, gather)
    raise NandoctorError(f"--executor {executor.kind!r} does not place probes remotely")


class RemoteRunner:
    """Runs tasks through a scheduler. `limit` probes are in flight at most (the `parallel` option; a
    SLURM submission is one job array throttled to it). on_queue(queued, running, done, job_ids,
    queue_wait) hears the queue whenever it changes (at most every QUEUE_LINE_S). gather: have the
    start-up jobs gather each hardware kind's device facts (hardware_facts)."""

    def __init__(
        self, run_dir: Path, store: ResultsStore, executor: ExecutorConfig, on_queue=None, gather: bool = True
    ):
        self.run_dir, self.store, self.executor = Path(run_dir), store, executor
        self.placement = open_placement(executor, self.run_dir, gather)
        self.jobs = self.limit = min(executor.option("parallel"), self.placement.capacity)
        self.retries, self.queue_wait = executor.option("retries"), executor.option("queue_wait")
        self.on_queue = on_queue
        self.in_flight: dict[str, PlacedProbe] = {}
        self.done = 0
        self.said: tuple | None = None
        self.said_at = 0.0
        self.moved_at = 0.0  # when one of this run's probes last ran or ended: its queue was moving

    def open(self, slots: int = 1) -> RemoteRunner:
        return self

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        pass  # each placed probe is a fresh process: nothing is imported ahead

    def __enter__(self) -> RemoteRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel every job this runner placed that has not ended, and wait until they left the queue."""
        if self.in_flight:
            self.placement.cancel(list(self.in_flight.values()), wait_s=CANCEL_WAIT_S)
            self.in_flight.clear()
        self.placement.close()

    def hardware_facts(self) -> dict[str, dict]:
        """{hardware kind ("" without a hardware axis): the device facts a job sized like one probe
        gathered there}, once the start-up jobs ended ({} when they were not asked to gather)."""
        return self.placement.ready()

    def _prepare(self, probe: PlacedProbe) -> None:
        probe.folder.mkdir(parents=True, exist_ok=True)
        for stale in (*STALE_FILES, "placed.json"):
            (probe.folder / stale).unlink(missing_ok=True)
        (probe.folder / "spec.json").write_text(jsonio.dumps(probe.task.spec.to_dict()))
        probe.handle, probe.job_id, probe.state, probe.started, probe.cancelled, probe.seen_done = (
            None,
            None,
            "queued",
            None,
            False,
            None,
        )
        probe.queued_at, probe.waiting = time.monotonic(), ""

    def run(
        self, tasks: list[ProbeTask], on_record=None, on_wait=None, keep: bool = True, under: str = "probes"
    ) -> list[ProbeRecord]:
        """Place every task, each in its folder under run_dir/`under`; each record is appended to the store
        the moment its probe ends (keep=False: only returned). on_wait(running probes) is called every
        POLL_S (a heartbeat hangs off it). A placement that batches sends all pending probes at once
        unless the session lowered `limit` (re-timing runs one probe at a time)."""
        self.placement.ready()
        pending = [PlacedProbe(t, probe_dir(self.run_dir, t.probe_id, under)) for t in tasks]
        records = []
        while pending or self.in_flight:
            batches = self.placement.batches and self.limit >= self.jobs
            room = len(pending) if batches else self.limit - len(self.in_flight)
            if pending and room > 0:
                batch, pending = pending[:room], pending[room:]
                for probe in batch:
                    self._prepare(probe)
                self.placement.submit(batch)
                self.in_flight.update((p.task.probe_id, p) for p in batch)
            ended = self.placement.poll(list(self.in_flight.values()))
            if ended or any(p.state == "running" for p in self.in_flight.values()):
                self.moved_at = time.monotonic()
            ended += self._never_started({p.task.probe_id for p, _ in ended})
            for probe, ending in ended:
                del self.in_flight[probe.task.probe_id]
                record = self._record(probe, ending)
                if record is None:
                    probe.attempt += 1
                    pending.insert(0, probe)
                    continue
                self.done += 1
                if keep:
                    self.store.append(record)
                records.append(record)
                if on_record:
                    on_record(record)
            self._backstop()
            running = [p for p in self.in_flight.values() if p.state == "running"]
            if on_wait:
                on_wait(running)
            self._say_queue(len(pending))
            time.sleep(POLL_S)
        return records

    def _never_started(self, ended: set) -> list[tuple[PlacedProbe, Ending]]:
        """The probes still queued `queue_wait` seconds after they were placed and after this run's last
        probe ran, cancelled: each ends as NOT_STARTED, a loss of the infrastructure (placed again, at
        most `retries` times)."""
        since = [(p, max(p.queued_at, self.moved_at)) for p in self.in_flight.values() if p.task.probe_id not in ended]
        stuck = [p for p, t in since if p.state == "queued" and time.monotonic() - t > self.queue_wait]
        if stuck:
            self.placement.cancel(stuck, wait_s=0)
        return [
            (
                p,
                Ending(
                    "NOT_STARTED",
                    detail=f"still queued after {self.queue_wait} s (queue_wait)"
                    + (f": {p.waiting}" if p.waiting else ""),
                ),
            )
            for p in stuck
        ]

    def _backstop(self) -> None:
        """The node kills a probe past its budget; a job that outlives it by the placement's grace (a
        hung node, a wedged task) is cancelled here and recorded as the timeout it is."""
        for probe in self.in_flight.values():
            recipe = probe.task.spec.recipe
            budget = recipe.build_timeout_s + probe.task.timeout_s + recipe.forensics_timeout_s + self.placement.grace_s
            if probe.state == "running" and not probe.cancelled and probe.elapsed > budget:
                probe.cancelled = True
                self.placement.cancel([probe], wait_s=0)

    def _record(self, probe: PlacedProbe, ending: Ending) -> ProbeRecord | None:
        """The probe's record, or None when the infrastructure lost it and it is placed again."""
        facts = {"launch": self.executor.kind, "job_id": probe.job_id}
        for name, text in ending.files.items():  # carried back by a placement without a shared filesystem
            (probe.folder / name).write_text(text)
        if ending.placed is not None:
            p = ending.placed
            return collect(
                probe.task,
                probe.folder,
                p["returncode"],
                p["timed_out"],
                p["wall_s"],
                replay_overran=p["replay_overran"],
                node=p["node"],
                gpu=p.get("gpu"),
                **facts,
            )
        if probe.cancelled or ending.state in SCHEDULER_ENDS:
            end = {"timed_out": True} if probe.cancelled else SCHEDULER_ENDS[ending.state]
            return collect(
                probe.task,
                probe.folder,
                None,
                end.get("timed_out", False),
                probe.elapsed,
                ended_by=end.get("ended_by"),
                **facts,
            )
        probe.lost.append(f"{ending.state}{': ' + ending.detail if ending.detail else ''}")
        if probe.attempt <= self.retries:
            return None
        attempts = f"all {probe.attempt} attempts" if probe.attempt > 1 else "its one attempt (retries=0)"
        why = f"the scheduler lost this probe on {attempts} ({'; '.join(probe.lost)[:600]})"
        return ProbeRecord.lost(
            probe.task.spec, why, probe.elapsed, probe.task.timeout_s, **probe.task.run_facts, **facts
        )

    def _say_queue(self, pending: int) -> None:
        if not self.on_queue:
            return
        states = [p.state for p in self.in_flight.values()]
        now = (pending + states.count("queued"), states.count("running"), self.done)
        if now != self.said and time.monotonic() - self.said_at >= QUEUE_LINE_S:
            self.said, self.said_at = now, time.monotonic()
            self.on_queue(
                *now, sorted({p.job_id.split("_")[0] for p in self.in_flight.values() if p.job_id}), self.queue_wait
            )
