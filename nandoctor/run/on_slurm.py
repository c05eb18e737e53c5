"""Place probes on a SLURM cluster through submitit: the probes of one submission (a grid's cells, a
bisection round's candidates) go out as one job array, throttled to the `parallel` option.

The nodes write into the run directory, so it must be on a filesystem they share: a canary job checks
that at start, one per partition the probes go to, with one core and a probe's GPUs; it also gathers
that partition's device facts (placed.node_facts), which the run plans its cells with. State comes
from squeue (`--states=all`, which also lists jobs that ended within the cluster's MinJobAge), so no
accounting database is needed.
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
from ..config import ExecutorConfig
from ..errors import NandoctorError
from .placed import PLACED_FILE, node_facts, run_placed
from .placement import Ending, PlacedProbe, missing_extra

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
    """The canary job: writes this node's device facts (gather) or its name into the run directory."""
    if gather:
        Path(path).write_text(jsonio.dumps(node_facts()))
    else:
        import socket

        Path(path).write_text(jsonio.dumps({"gathered": {"host": socket.gethostname()}}))
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


def scancel_and_wait(jobs: list[str], wait_s: float) -> None:
    """Cancel these jobs, then wait up to wait_s for each to leave the active states (COMPLETING included)."""
    try:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        states = squeue([j.split("_")[0] for j in jobs])
        if states is not None and not any(states.get(j, ("GONE",))[0] in ACTIVE for j in jobs):
            return
        time.sleep(0.2)


class SlurmPlacement:
    batches = True  # all pending probes of a submission go out as one array
    grace_s = 120.0  # beyond the probe's budget before the parent cancels a job (the node enforces it first)

    def __init__(self, executor: ExecutorConfig, run_dir: Path, gather: bool = True):
        try:
            import submitit
        except ImportError:
            raise missing_extra("slurm", "submitit") from None
        self.options, self.run_dir, self.gather = executor, Path(run_dir).resolve(), gather
        self.capacity = executor.option("parallel")  # the array's throttle: SLURM holds the rest in its queue
        self.executor = self._executor(submitit, executor, PARAMETERS)
        # one canary per partition the probes go to (the hardware axis, else the executor's partition),
        # with that partition and account, one core and a probe's GPUs (the device facts it gathers are
        # what a probe there sees; its cores are the executor's option, not a fact): sbatch refuses a
        # partition it does not know at once, and each canary checks the shared filesystem
        self.canaries = {}  # canary file -> (hardware kind, its job)
        self.facts: dict[str, dict] = {}
        canary = self._executor(submitit, executor, CANARY_PARAMETERS)
        canary.update_parameters(time=CANARY_MINUTES, **{**job_size(executor, 1), "cpus_per_task": 1})
        for partition in executor.hardware or (None,):
            self._submit_canary(canary, partition)

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
                self.canaries[canary_file] = (
                    partition or "",
                    slurm.submit(write_canary, str(canary_file), self.gather),
                )
                return
            except Exception as e:  # submitit raises a bare Exception when sbatch fails
                why = str(e).strip().splitlines()[-1]
        self.close()
        first = f"a job on partition {partition!r} (--axis partition)" if partition else "the first job"
        raise NandoctorError(f"--executor slurm: sbatch refused {first}: {why[:300]}")

    def ready(self) -> dict[str, dict]:
        """Wait for the canary jobs submitted at start; refuse the run if one was not started within
        queue_wait or its file did not appear here. Returns the device facts each gathered, by hardware
        kind ("" without a hardware axis), or {} when they were not asked for."""
        while self.canaries:
            canary_file, (kind, canary) = next(iter(self.canaries.items()))
            facts = self._await_canary(canary_file, kind, canary.job_id, Path(canary.paths.stdout))
            if self.gather:
                self.facts[kind] = facts
            del self.canaries[canary_file]  # it ended: nothing left to cancel
        return self.facts

    def _await_canary(self, canary_file: Path, kind: str, job: str, log: Path) -> dict:
        # queue_wait bounds the wait for the canary to start, as for a probe; once it runs, its own
        # time limit (CANARY_MINUTES) bounds it
        wait = self.options.option("queue_wait")
        deadline, reason = time.monotonic() + wait, ""
        while time.monotonic() < deadline:
            states = squeue([job])
            state, reason = (states or {}).get(job, ("GONE", ""))
            if states is not None and state not in ACTIVE:
                break
            if state != "PENDING" and states is not None:
                deadline = time.monotonic() + 60 * (CANARY_MINUTES + 1)
            time.sleep(0.2)
        else:
            where = f" on partition {kind!r}" if kind else ""
            pending = f", pending: {reason}" if reason not in ("", "None") else ""
            raise NandoctorError(
                f"--executor slurm: the cluster did not start the canary job {job}{where} within "
                f"{wait} s (queue_wait{pending}); is the partition up (sinfo)?"
            )
        ended = states.get(job, ("GONE",))[0]
        # a canary that wrote its file may show it here late (NFS attribute caching); one that failed never
        # will: on a node that does not see the run directory it cannot even read its own job
        seen = time.monotonic() + (SHARED_FS_WAIT_S if ended in ("COMPLETED", "GONE") else 0)
        while not canary_file.exists() and time.monotonic() < seen:
            time.sleep(0.2)
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
        budget = max(
            p.task.spec.recipe.build_timeout_s + p.task.timeout_s + p.task.spec.recipe.forensics_timeout_s
            for p in probes
        )
        self.executor.update_parameters(time=self.options.option("time") or math.ceil((budget + self.grace_s) / 60) + 1)
        arrays: dict[tuple, list[PlacedProbe]] = {}
        for probe in probes:  # one array per kind of hardware the cells ask for (Cell.hardware) and size
            arrays.setdefault((probe.task.spec.cell.hardware, probe.ranks), []).append(probe)
        for (partition, ranks), batch in arrays.items():
            self.executor.update_parameters(
                **job_size(self.options, ranks), **({"partition": partition} if partition else {})
            )
            with self.executor.batch():
                jobs = [self.executor.submit(run_placed, str(p.folder.resolve()), p.task.timeout_s) for p in batch]
            for probe, job in zip(batch, jobs):
                probe.handle, probe.job_id = job, job.job_id

    def poll(self, probes: list[PlacedProbe]) -> list[tuple[PlacedProbe, Ending]]:
        states = squeue([p.job_id.split("_")[0] for p in probes])
        if states is None:
            return []  # slurmctld did not answer this time: ask again at the next poll
        ended = []
        for probe in probes:
            state, reason = states.get(probe.job_id, ("GONE", "no longer in squeue"))
            if state in ACTIVE:
                probe.waiting = reason if state == "PENDING" and reason not in ("None", "") else ""
                if state == "RUNNING" and probe.state != "running":
                    probe.state, probe.started = "running", time.monotonic()
                continue
            placed = probe.folder / PLACED_FILE
            if state == "COMPLETED" and not placed.exists():
                probe.seen_done = probe.seen_done or time.monotonic()
                if time.monotonic() - probe.seen_done < SHARED_FS_WAIT_S:
                    continue
            outcome = jsonio.loads(placed.read_text()) if placed.exists() else None
            if probe.started is None:
                probe.started = time.monotonic()
            ended.append((probe, Ending(state, outcome, detail=reason if reason not in ("None", "") else "")))
        return ended

    def cancel(self, probes: list[PlacedProbe], wait_s: float) -> None:
        jobs = [p.job_id for p in probes if p.job_id]
        if not jobs:
            return
        scancel_and_wait(jobs, wait_s)

    def close(self) -> None:
        if self.canaries:
            # a canary still queued or running when the run ends early (a refused partition, Ctrl-C):
            # cancelled, and waited for past COMPLETING so that nothing of this run is left in the queue
            scancel_and_wait([c.job_id for _, c in self.canaries.values()], CANARY_CANCEL_WAIT_S)
            self.canaries.clear()
