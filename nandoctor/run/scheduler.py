"""The one loop that runs probes, wherever they run: it writes each probe's spec, hands the probes to a
placement (run/placement.py) as it has room, waits for their endings, turns each into a record kept in
the store, and places again a probe the infrastructure lost.

One retry rule: an ending without the probe's own outcome that says nothing about the probe (a warm
worker that died before it forked it, a node failure, a preemption, a job never started within
queue_wait) is the infrastructure's failure: the probe is placed again, at most `retries` times, then
recorded `lost`, which is no verdict about the configuration. What a scheduler reports that does say
something about the probe is data (SCHEDULER_ENDS): its time limit is a timeout, its memory limit an OOM.

One time budget (task.Budget), enforced by whatever watches the probe process (a local slot, the
node-side wrapper placed.py); for a placement that cannot watch its probes' processes from here
(grace_s set) the loop adds a backstop: a probe alive grace_s past its whole budget is cancelled and
recorded as the timeout it is. A queued probe of a placement with a queue (queue_wait set) is
cancelled, and counts as lost, once it waited queue_wait seconds while none of the run's probes ran,
so that a run larger than the cluster, queued behind its own probes, is not cut short.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..record import ProbeRecord
from .placement import Ending, PlacedProbe, Placement
from .store import ResultsStore
from .task import OUTCOME_FILE, ProbeTask, collect, probe_dir, write_spec

WAIT_S = 1.0  # the longest the loop leaves to a placement's wait: the heartbeat's and the backstop's cadence
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


class Scheduler:
    """Runs probes on one placement and keeps their records in `store`. retries: how many times a probe
    the infrastructure lost is placed again. on_alive(running probes, last_step) is called at least
    every WAIT_S (the heartbeat); on_queue(queued, running, done, job_ids, queue_wait, retries) hears a
    queueing placement's queue whenever it changes (at most every QUEUE_LINE_S). close() cancels
    whatever is still in flight and closes the placement."""

    def __init__(self, placement: Placement, store: ResultsStore, retries: int, on_alive=None, on_queue=None):
        self.placement, self.store, self.retries = placement, store, retries
        self.on_alive, self.on_queue = on_alive, on_queue
        self.in_flight: dict[str, PlacedProbe] = {}
        self.done = 0
        self.said: tuple | None = None
        self.said_at = 0.0
        self.moved_at = 0.0  # when one of this run's probes last ran or ended: its queue was moving

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Cancel every probe still in flight, wait until its job left the queue, close the placement."""
        try:
            if self.in_flight:
                self.placement.cancel(list(self.in_flight.values()), wait_s=CANCEL_WAIT_S)
                self.in_flight.clear()
        finally:
            self.placement.close()

    def run(
        self,
        tasks: list[ProbeTask],
        on_record=None,
        keep: bool = True,
        under: str = "probes",
        at_once: int | None = None,
        on_alive=None,
    ) -> list[ProbeRecord]:
        """Run every task, each in its folder under the store's directory/`under`; each record is appended
        to the store the moment its probe ends (keep=False: only returned, for probes run to time cells
        again) and handed to on_record. at_once: at most this many in flight (re-timing runs one at a
        time); by default as many as the placement has room for (a batching placement gets them all).
        on_alive: this run's heartbeat instead of the scheduler's (the re-timing says its own progress)."""
        on_alive = on_alive or self.on_alive
        pending = [PlacedProbe(t, probe_dir(Path(self.store.dir), t.probe_id, under)) for t in tasks]
        records = []
        while pending or self.in_flight:
            self._place(pending, at_once)
            self._say_queue(len(pending))
            ended = self.placement.wait(list(self.in_flight.values()), WAIT_S)
            if ended or any(p.state == "running" for p in self.in_flight.values()):
                self.moved_at = time.monotonic()
            ended += self._never_started({p.task.probe_id for p, _ in ended})
            for probe, ending in ended:
                del self.in_flight[probe.task.probe_id]
                record = self._record(probe, ending)
                if record is None:
                    probe.placed_again()
                    pending.insert(0, probe)
                    continue
                self.done += 1
                if keep:
                    self.store.append(record)
                records.append(record)
                if on_record:
                    on_record(record)
            self._backstop()
            if on_alive:
                on_alive([p for p in self.in_flight.values() if p.state == "running"], self.placement.last_step)
        return records

    def _place(self, pending: list[PlacedProbe], at_once: int | None) -> None:
        """Hand the placement the pending probes it has room for, their specs written first."""
        if not pending:
            return
        if self.placement.batches and at_once is None:
            offer = pending
        else:
            most = min(at_once or self.placement.capacity, self.placement.capacity)
            offer = pending[: max(0, most - len(self.in_flight))]
        batch = offer[: self.placement.room(offer)] if offer else []
        if not batch:
            return
        now = time.monotonic()
        for probe in batch:
            write_spec(probe.task, probe.folder, (OUTCOME_FILE, "log.txt"))
            probe.queued_at = now
        self.placement.submit(batch)
        self.in_flight.update((p.task.probe_id, p) for p in batch)
        del pending[: len(batch)]

    def _never_started(self, ended: set) -> list[tuple[PlacedProbe, Ending]]:
        """The probes still queued `queue_wait` seconds after they were placed and after this run's last
        probe ran, cancelled: each ends as NOT_STARTED, a loss of the infrastructure."""
        wait = self.placement.queue_wait
        if wait is None:
            return []
        since = [(p, max(p.queued_at, self.moved_at)) for p in self.in_flight.values() if p.task.probe_id not in ended]
        stuck = [p for p, t in since if p.state == "queued" and time.monotonic() - t > wait]
        if stuck:
            self.placement.cancel(stuck, wait_s=0)
        return [
            (
                p,
                Ending(
                    "NOT_STARTED",
                    detail=f"still queued after {wait} s (queue_wait)" + (f": {p.waiting}" if p.waiting else ""),
                ),
            )
            for p in stuck
        ]

    def _backstop(self) -> None:
        """A placement that cannot watch its probes' processes from here relies on its node's watcher;
        a probe that outlives its budget by the placement's grace (a hung node, a wedged task) is
        cancelled here and recorded as the timeout it is."""
        grace = self.placement.grace_s
        if grace is None:
            return
        for probe in self.in_flight.values():
            if probe.state == "running" and not probe.cancelled and probe.elapsed > probe.task.budget_s + grace:
                probe.cancelled = True
                self.placement.cancel([probe], wait_s=0)

    def _record(self, probe: PlacedProbe, ending: Ending) -> ProbeRecord | None:
        """The probe's record, or None when the infrastructure lost it and it is placed again."""
        facts = {"launch": self.placement.launch, **({"job_id": probe.job_id} if probe.job_id else {})}
        for name, text in ending.files.items():  # carried back by a placement without a shared filesystem
            (probe.folder / name).write_text(text)
        if ending.outcome is not None:
            o = ending.outcome
            return collect(
                probe.task,
                probe.folder,
                o.returncode,
                o.timed_out,
                o.wall_s,
                o.worker_died,
                o.replay_overran,
                **facts,
                **o.record_facts(),
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
        if not self.on_queue or self.placement.queue_wait is None:
            return
        states = [p.state for p in self.in_flight.values()]
        now = (pending + states.count("queued"), states.count("running"), self.done)
        if now != self.said and time.monotonic() - self.said_at >= QUEUE_LINE_S:
            self.said, self.said_at = now, time.monotonic()
            jobs = sorted({p.job_id.split("_")[0] for p in self.in_flight.values() if p.job_id})
            self.on_queue(*now, jobs, self.placement.queue_wait, self.retries)
