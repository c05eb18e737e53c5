"""Place probes on a SLURM cluster through submitit: the probes of one submission (a grid's cells, a
bisection round's candidates) go out as one job array, throttled to the `parallel` option.

The nodes write into the run directory, so it must be on a filesystem they share: a canary job checks
that at start, one per partition the probes go to, with one core and a probe's GPUs; it also gathers
that partition's device facts (placed.node_facts), which the run plans its cells with: on a warm worker of
this machine (planner.Planner), started with the placement, so that its import overlaps the canaries.

A polite client: the run's files say most of what happens (a job's log.txt appears when it starts, its
placed.json when it ends), read every FILE_POLL_S; squeue, which every user of the cluster shares, is
asked only for what the files cannot say (a job the scheduler ended, a pending reason), once for all
of this run's jobs (canaries, probes, cancelled jobs) and at a cadence that backs off (SlurmQueue):
FLOOR_S after it told what the files could not (a job the scheduler ended), growing to CEILING_S
otherwise (a submission or a start the files will show is no such news), its answer shared by every
caller for FLOOR_S. State comes from `squeue --states=all` (which also lists jobs that ended within
the cluster's MinJobAge), so no accounting database is needed.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from .. import jsonio
from ..errors import NandoctorError
from ..executors import ExecutorConfig
from .cluster import ClusterPlacement
from .placed import node_facts, run_placed
from .placement import EXITED, Ending, Outcome, PlacedProbe, missing_extra
from .store import write_atomic
from .task import OUTCOME_FILE, last_step

CANARY_MINUTES = 3  # the canary's time limit: its import of torch to gather the device facts
SHARED_FS_WAIT_S = 10.0  # how long a finished job's files may take to appear here (NFS attribute caching)
ACTIVE = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
)
CANARY_CANCEL_WAIT_S = 15  # at most this long on close for cancelled canaries to leave the queue
FILE_POLL_S = 0.5  # how often the run directory is looked at for a job's start (log.txt) and end (placed.json)
FLOOR_S = 2.0  # squeue at most this often, and this soon after something changed
CEILING_S = 20.0  # ... backing off to this while nothing changes
GROWTH = 1.5
# submitit's parameter for each --executor-opt of the slurm kind
PARAMETERS = {
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "constraint": "constraint",
    "gpus": "gpus_per_node",
    "cpus": "cpus_per_task",
    "mem": "mem",
    "parallel": "array_parallelism",
}
CANARY_PARAMETERS = {k: PARAMETERS[k] for k in ("partition", "account", "qos", "constraint")}


def job_size(executor: ExecutorConfig, ranks: int) -> dict:
    """submitit's parameters for the size of one probe's job: one task (a parallel probe's launcher forks
    its W ranks itself) with cpus x W cores, and gpus x W GPUs on its node where GPUs are asked for."""
    cpus, gpus = executor.size(ranks)
    return {"cpus_per_task": cpus, **({"gpus_per_node": gpus} if gpus else {})}


def write_canary(path: str, gather: bool) -> str:
    """The canary job: writes this node's device facts (gather) or its name into the run directory,
    whole or not at all (store.write_atomic): the client parses the file the moment it exists."""
    if gather:
        facts = node_facts()
    else:
        import socket

        facts = {"gathered": {"host": socket.gethostname()}}
    write_atomic(Path(path), jsonio.dumps(facts))
    return path


@contextlib.contextmanager
def redirected_stderr(into):
    """Send this process's file descriptor 2 (where sbatch, started by submitit, writes) into a file."""
    saved = os.dup(2)
    os.dup2(into.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def squeue(job_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """{job id (array elements as 12_3): (state, reason)} of these jobs, or None when squeue did not answer."""
    if not job_ids:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "--states=all", "-j", ",".join(sorted(set(job_ids))), "-o", "%i|%T|%r"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        return None
    states = {}
    for line in out.stdout.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        states[job] = (state, reason)
    return states


class SlurmQueue:
    """The states of this run's jobs, from one squeue for all of them. `poll()` asks at the polite
    cadence (FLOOR_S after a change, backing off by GROWTH to CEILING_S while the answers bring nothing
    new: `news()`); `states(max_age)` gives any caller the last answer while it is younger than max_age."""

    def __init__(self):
        self.jobs: set[str] = set()  # the jobs (array elements as 12_3) still asked about
        self.answer: dict[str, tuple[str, str]] | None = None
        self.asked_at = -math.inf
        self.interval = FLOOR_S

    def track(self, job_ids: list[str]) -> None:
        """Ask about these jobs too. At the cadence already reached: sbatch said the submission, and the
        job's log.txt will say its start (issue 34: a grid that submitted one job at a time, its
        re-timing, asked squeue every FLOOR_S throughout)."""
        self.jobs.update(job_ids)

    def forget(self, job_ids: list[str]) -> None:
        """Stop asking about these jobs (an array stays asked about while another of its elements is)."""
        self.jobs.difference_update(job_ids)

    def news(self, changed: bool) -> None:
        """Whether the last answer told something the run's files had not: then ask again soon."""
        self.interval = FLOOR_S if changed else min(CEILING_S, self.interval * GROWTH)

    def states(self, max_age: float = FLOOR_S) -> dict[str, tuple[str, str]] | None:
        """The run's jobs' states, asked now unless the last answer is younger than max_age (None when
        squeue did not answer)."""
        if self.answer is not None and time.monotonic() - self.asked_at < max_age:
            return self.answer
        self.asked_at = time.monotonic()
        answer = squeue(sorted({j.split("_")[0] for j in self.jobs}))
        if answer is not None:
            self.answer = answer
        return answer

    def poll(self) -> dict[str, tuple[str, str]] | None:
        """A fresh answer when one is due at the polite cadence, else None."""
        if time.monotonic() - self.asked_at < self.interval:
            return None
        return self.states(max_age=0)

    def wait_gone(self, jobs: list[str], wait_s: float) -> None:
        """Wait up to wait_s for these jobs to leave the active states (COMPLETING included)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            states = self.states()
            if states is not None and not any(states.get(j, ("GONE",))[0] in ACTIVE for j in jobs):
                return
            time.sleep(min(FLOOR_S, max(0.0, deadline - time.monotonic())))


def scancel(jobs: list[str]) -> None:
    try:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        pass


class SlurmPlacement(ClusterPlacement):
    launch = "slurm"
    batches = True  # all pending probes of a submission go out as one array
    grace_s = 120.0  # beyond the probe's budget before the parent cancels a job (the node enforces it first)

    def __init__(self, executor: ExecutorConfig, run_dir: Path, kept: dict | None = None, warm: bool = True, **_):
        try:
            import submitit
        except ImportError:
            raise missing_extra("slurm", "submitit") from None
        super().__init__(executor, run_dir, kept, warm)  # its planner imports while the canaries run
        self.run_dir = Path(run_dir).resolve()
        self.capacity = executor.option("parallel")  # the array's throttle: SLURM holds the rest in its queue
        self.queue = SlurmQueue()
        self.canaries = {}  # canary file -> (hardware kind, its job)
        try:
            self.executor = self._executor(submitit, executor, PARAMETERS)
            # one canary per partition the probes go to (the hardware axis, else the executor's partition),
            # with that partition and account, one core and a probe's GPUs (the device facts it gathers are
            # what a probe there sees; its cores are the executor's option, not a fact): sbatch refuses a
            # partition it does not know at once, and each canary checks the shared filesystem
            canary = self._executor(submitit, executor, CANARY_PARAMETERS)
            canary.update_parameters(time=CANARY_MINUTES, **{**job_size(executor, 1), "cpus_per_task": 1})
            for partition in executor.hardware or (None,):
                self._submit_canary(canary, partition)
        except BaseException:
            self.close()
            raise

    def _executor(self, submitit, executor: ExecutorConfig, names: dict):
        slurm = submitit.SlurmExecutor(folder=self.run_dir / "slurm" / "%j")
        params = {names[k]: executor.option(k) for k in names if executor.option(k) is not None}
        slurm.update_parameters(job_name="nandoctor", use_srun=False, stderr_to_stdout=True, **params)
        return slurm

    def _submit_canary(self, slurm, partition: str | None) -> None:
        canary_file = self.run_dir / "slurm" / f"canary-{uuid.uuid4().hex[:8]}"
        canary_file.parent.mkdir(parents=True, exist_ok=True)
        if partition:
            slurm.update_parameters(partition=partition)
        with tempfile.TemporaryFile() as said, redirected_stderr(said):  # sbatch's own complaint goes into our one line
            try:
                job = slurm.submit(write_canary, str(canary_file), self.gather)
                self.canaries[canary_file] = (partition or "", job)
                self.queue.track([job.job_id])
                return
            except Exception as e:  # submitit raises a bare Exception when sbatch fails
                why = str(e).strip().splitlines()[-1]
        first = f"a job on partition {partition!r} (--axis partition)" if partition else "the first job"
        raise NandoctorError(f"--executor slurm: sbatch refused {first}: {why[:300]}")

    def facts(self) -> dict[str, dict]:
        """Wait for the canary jobs submitted at start; refuse the run if one was not started within
        queue_wait or its file did not appear here. Returns the device facts each gathered (or those a
        resumed run kept), by hardware kind ("" without a hardware axis)."""
        while self.canaries:
            canary_file, (kind, canary) = next(iter(self.canaries.items()))
            facts = self._await_canary(canary_file, kind, canary.job_id, Path(canary.paths.stdout))
            if self.gather:
                self.gathered[kind] = facts
            del self.canaries[canary_file]  # it ended: nothing left to cancel
            self.queue.forget([canary.job_id])
        return self.gathered

    def _await_canary(self, canary_file: Path, kind: str, job: str, log: Path) -> dict:
        # queue_wait bounds the wait for the canary to start, as for a probe; once it runs, its own
        # time limit (CANARY_MINUTES) bounds it
        wait = self.queue_wait
        deadline, state, reason, ended = time.monotonic() + wait, "PENDING", "", None
        while not canary_file.exists():
            states = self.queue.poll()
            if states is not None:
                now, reason = states.get(job, ("GONE", ""))
                self.queue.news(now != state)
                if now not in ACTIVE:
                    ended = now
                    break
                if now != "PENDING" and state == "PENDING":
                    deadline = time.monotonic() + 60 * (CANARY_MINUTES + 1)
                state = now
            if time.monotonic() > deadline:
                where = f" on partition {kind!r}" if kind else ""
                pending = f", pending: {reason}" if reason not in ("", "None") else ""
                raise NandoctorError(
                    f"--executor slurm: the cluster did not start the canary job {job}{where} within "
                    f"{wait} s (queue_wait{pending}); is the partition up (sinfo)?"
                )
            time.sleep(FILE_POLL_S)
        if ended is not None:
            # a canary that wrote its file may show it here late (NFS attribute caching); one that failed
            # never will: on a node that does not see the run directory it cannot even read its own job
            seen = time.monotonic() + (SHARED_FS_WAIT_S if ended in ("COMPLETED", "GONE") else 0)
            while not canary_file.exists() and time.monotonic() < seen:
                time.sleep(FILE_POLL_S)
        if not canary_file.exists() and log.exists():  # the node wrote here: the filesystem is shared, the job failed
            said = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            raise NandoctorError(
                f"--executor slurm: the canary job {job} ended {ended} without writing its file "
                f"(its log, {log}: {said[-1][:300] if said else 'empty'})"
            )
        if not canary_file.exists():
            raise NandoctorError(
                f"--executor slurm: the run directory {self.run_dir} is not on a filesystem the nodes share "
                f"(canary job {job} ended {ended} and its file never appeared); "
                "pass --out on a shared filesystem"
            )
        facts = jsonio.loads(canary_file.read_text())
        canary_file.unlink()
        return facts

    def submit(self, probes: list[PlacedProbe]) -> None:
        self.facts()  # the shared filesystem is checked before any probe goes out
        budget = max(p.task.budget_s for p in probes)
        self.executor.update_parameters(time=self.options.option("time") or math.ceil((budget + self.grace_s) / 60) + 1)
        arrays: dict[tuple, list[PlacedProbe]] = {}
        for probe in probes:  # one array per kind of hardware the cells ask for (Cell.hardware) and size
            arrays.setdefault((probe.task.spec.cell.hardware, probe.ranks), []).append(probe)
        for (partition, ranks), batch in arrays.items():
            self.executor.update_parameters(
                **job_size(self.options, ranks), **({"partition": partition} if partition else {})
            )
            with self.executor.batch():
                jobs = [
                    self.executor.submit(run_placed, str(p.folder.resolve()), p.task.timeout_s, str(self.run_dir))
                    for p in batch
                ]
            for probe, job in zip(batch, jobs):
                probe.handle, probe.job_id = job, job.job_id
            self.queue.track([job.job_id for job in jobs])

    def wait(self, probes: list[PlacedProbe], timeout_s: float) -> list[tuple[PlacedProbe, Ending]]:
        deadline = time.monotonic() + timeout_s
        while True:
            ended = self._ended(probes)
            left = deadline - time.monotonic()
            if ended or left <= 0:
                return ended
            time.sleep(min(FILE_POLL_S, left))

    def _ended(self, probes: list[PlacedProbe]) -> list[tuple[PlacedProbe, Ending]]:
        """What the run's files say (a job started, a probe ended), then squeue when it is due."""
        now, ended, unsaid = time.monotonic(), [], []
        for probe in probes:
            outcome = probe.folder / OUTCOME_FILE
            if outcome.exists():
                ended.append((probe, Ending(EXITED, Outcome.from_dict(jsonio.loads(outcome.read_text())))))
            elif probe.seen_done is not None and now - probe.seen_done >= SHARED_FS_WAIT_S:
                ended.append((probe, Ending("COMPLETED", detail="its placed.json never appeared here")))
            else:
                if probe.state == "queued" and (probe.folder / "log.txt").exists():
                    probe.state, probe.started, probe.waiting = "running", now, ""
                unsaid.append(probe)
        states = self.queue.poll() if unsaid else None
        if states is not None:
            changed = False
            for probe in unsaid:
                state, reason = states.get(probe.job_id, ("GONE", "no longer in squeue"))
                said = reason if reason not in ("None", "") else ""
                if state in ACTIVE:
                    probe.waiting = said if state == "PENDING" else ""
                    if state == "RUNNING" and probe.state != "running":
                        # squeue said it first, but its log.txt would have: no reason to ask again soon
                        probe.state, probe.started = "running", now
                elif state == "COMPLETED":
                    probe.seen_done = probe.seen_done or now  # its placed.json may lag on a shared filesystem
                else:
                    probe.started = probe.started or now
                    ended.append((probe, Ending(state, detail=said)))
                    changed = True
            self.queue.news(changed)
        self.queue.forget([p.job_id for p, _ in ended])
        return ended

    def last_step(self, probe: PlacedProbe) -> dict | None:
        return last_step(probe.folder / "steps.jsonl")

    def cancel(self, probes: list[PlacedProbe], wait_s: float) -> None:
        jobs = [p.job_id for p in probes if p.job_id]
        if not jobs:
            return
        scancel(jobs)
        self.queue.track(jobs)  # asked about until they left the queue
        self.queue.wait_gone(jobs, wait_s)
        self.queue.forget(jobs)

    def close(self) -> None:
        super().close()
        if self.canaries:
            # a canary still queued or running when the run ends early (a refused partition, Ctrl-C):
            # cancelled, and waited for past COMPLETING so that nothing of this run is left in the queue
            jobs = [c.job_id for _, c in self.canaries.values()]
            self.canaries.clear()
            scancel(jobs)
            self.queue.track(jobs)
            self.queue.wait_gone(jobs, CANARY_CANCEL_WAIT_S)
