"""Place probes on a Ray cluster: each probe one task with the CPUs / GPUs / custom resources the
options give it, and a share of its hardware kind's custom resource (--axis node_type=, Cell.hardware).
The task runs the probe in a scratch folder of its node and returns its files (placed.run_carried), so
no shared filesystem is needed. It is a streaming generator task: it first yields its node's name (until
then the probe is queued, waiting for resources, and its time budget has not begun), then the probe's
last step every few seconds (the parent's heartbeat says it), then the probe's outcome and files.

A probe failure is a verdict, not a transient: tasks have max_retries=0 (Ray would retry a dead
worker three times). Ray's `get(timeout=...)` leaves a hung task running, so the parent's backstop
cancels with force=True. Without an `address` a local Ray is started on the loopback address only.

Before the first probe, one task per kind of hardware gathers that kind's device facts (task_facts),
which the run plans its cells with: on a warm worker of this machine (planner.Planner), started with the
placement, so that its import overlaps Ray's start and those tasks.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from ..errors import NandoctorError
from ..executors import ExecutorConfig
from .cluster import ClusterPlacement
from .placed import inputs_not_on_node, missing_inputs, node_facts, run_carried
from .placement import EXITED, Ending, Outcome, PlacedProbe, missing_extra

# How much of a node_type resource one probe asks for: any node that has the resource at all can take
# it, and the probe's CPUs and GPUs decide how many fit there (a cluster declares node_type_a100: 1 or
# 100 alike).
HARDWARE_SHARE = 0.001
FACTS_TIMEOUT_S = 300.0  # a started facts task's import of torch and its facts


def parse_resources(text: str | None) -> dict:
    """'node_type_a100:1,fast_disk:0.5' -> {'node_type_a100': 1.0, 'fast_disk': 0.5}."""
    resources = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, amount = item.partition(":")
        try:
            resources[name.strip()] = float(amount) if sep else 1.0
        except ValueError:
            raise NandoctorError(f"bad --executor-opt resources={text!r}: expected NAME:AMOUNT[,NAME:AMOUNT]") from None
    return resources


def task_size(executor: ExecutorConfig, ranks: int) -> dict:
    """Ray's num_cpus / num_gpus for one probe task: the per-probe options times its ranks (a parallel
    probe's launcher forks its W ranks inside the one task)."""
    cpus, gpus = executor.size(ranks)
    return {"num_cpus": cpus, "num_gpus": gpus}


def task_facts(inputs: dict[str, str] | None = None):
    """The task that gathers a kind of hardware's device facts: yields its node's name as it starts,
    then placed.node_facts with, in `gathered`, the Ray node it ran on, the resources Ray gave it (its
    node_type share among them) and the run's input files (inputs) this node lacks."""
    import ray

    yield socket.gethostname()
    facts = node_facts()
    context = ray.get_runtime_context()
    facts["gathered"].update(
        ray_node=context.get_node_id(),
        resources=context.get_assigned_resources(),
        missing_inputs=missing_inputs(inputs or {}),
    )
    yield facts


def run_announced(spec: dict, timeout_s: float, run: str):
    """The task: yields this node's name as it starts, then run_carried's items ({"step"} while the
    probe runs, then {"placed", "files"})."""
    yield socket.gethostname()
    yield from run_carried(spec, timeout_s, run)


def said(error: Exception) -> str:
    """The first line of what a failed task said: the exception it raised (Ray's `cause`) where it
    raised one, else Ray's own words (a worker or node that died, a task that never ran)."""
    cause = getattr(error, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(error)
    return text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__


# How long a run's end waits for cancelled tasks to end their probes themselves before killing their workers
GRACEFUL_CANCEL_S = 10.0


class RayPlacement(ClusterPlacement):
    launch = "ray"
    batches = False  # one task per probe, `parallel` in flight
    grace_s = 60.0  # beyond the probe's budget before a task is cancelled with force

    def __init__(
        self,
        executor: ExecutorConfig,
        run_dir: Path,
        kept: dict | None = None,
        inputs: dict | None = None,
        warm: bool = True,
        **_,
    ):
        self.inputs = inputs or {}  # the run's input files (config.PATH_FIELDS): each node must have them
        address = executor.option("address")
        if address is None:
            # a Ray of our own, for this run: every server and every connection on 127.0.0.1 (by default
            # Ray resolves its node address to the host's outward-facing IP); read when ray is imported
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise missing_extra("ray", "ray") from None
        self.ray = ray
        self.started_ray = False
        super().__init__(executor, run_dir, kept, warm)  # its planner imports while Ray starts and gathers facts
        try:
            self._connect(executor, address)
        except BaseException:
            self.close()
            raise
        self.resources = parse_resources(executor.option("resources"))
        self.remote = ray.remote(run_announced)
        self.task_options = {"max_retries": 0, "num_returns": "streaming", "name": "nandoctor-probe"}
        self.run = str(Path(run_dir).resolve())  # what its probes carry as RUN_DIR_ENV, on whatever node

    def _connect(self, executor: ExecutorConfig, address: str | None) -> None:
        """Join the Ray at `address` (or start one of our own), and size `capacity` to it; a hardware
        kind no node offers is the user's error."""
        ray = self.ray
        if not ray.is_initialized():
            if address is None:
                ray.init(
                    address="local",
                    _node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    log_to_driver=False,
                    num_cpus=os.cpu_count(),
                    configure_logging=False,
                )
                self.started_ray = True
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
        # tasks beyond what the cluster runs at once would wait in Ray's queue, against their queue_wait:
        # the loop keeps at most `capacity` out
        have = ray.cluster_resources()
        fits = [have.get("CPU", 1) // executor.option("cpus")]
        if executor.option("gpus"):
            fits.append(have.get("GPU", 0) // executor.option("gpus"))
        self.capacity = max(1, min(int(min(fits)), executor.option("parallel")))
        missing = [name for name in executor.hardware if have.get(name, 0) <= 0]
        if missing:
            known = sorted(
                k
                for k in have
                if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")
            )
            raise NandoctorError(
                f"--axis node_type={','.join(missing)}: no node of this Ray cluster has the custom resource"
                f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}; "
                f"its custom resources: {', '.join(known) or 'none'}"
            )

    def _resources(self, kind: str) -> dict:
        """The custom resources a task on this kind of hardware asks for (a share of its node_type)."""
        return {**self.resources, kind: HARDWARE_SHARE} if kind else self.resources

    def facts(self) -> dict[str, dict]:
        """The device facts of each kind of hardware ("" without a hardware axis), gathered by one task
        per kind with a probe's GPUs and custom resources and one CPU (task_facts), or those a resumed
        run kept. A task the cluster does not start within queue_wait, or one that fails, stops the run
        with one line."""
        if not self.gather or self.gathered:
            return self.gathered
        gather = self.ray.remote(task_facts)
        wait = self.queue_wait
        for kind in self.options.hardware or ("",):
            where = f" on node_type {kind!r}" if kind else ""
            task = gather.options(
                max_retries=0,
                num_returns="streaming",
                name="nandoctor-facts",
                resources=self._resources(kind),
                **{**task_size(self.options, 1), "num_cpus": 1},
            ).remote(self.inputs)
            started, _ = self.ray.wait([task], timeout=wait)  # its first item: it started (queue_wait bounds only that)
            if not started:
                self.ray.cancel(task, force=True)
                raise NandoctorError(
                    f"--executor ray: the cluster did not start the task that gathers the device facts{where} "
                    f"within {wait} s (queue_wait); does a node have its resources (ray status)?"
                )
            try:
                self.ray.get(next(task))
                self.gathered[kind] = self.ray.get(next(task), timeout=FACTS_TIMEOUT_S)
            except (self.ray.exceptions.RayError, StopIteration) as e:
                self.ray.cancel(task, force=True)
                raise NandoctorError(
                    f"--executor ray: the task that gathers the device facts{where} failed: {said(e)}"
                ) from None
            gathered = self.gathered[kind].get("gathered", {})
            if gathered.get("missing_inputs"):
                raise NandoctorError(
                    inputs_not_on_node(gathered["missing_inputs"], gathered.get("host", "?"), "ray", where)
                )
        return self.gathered

    def submit(self, probes: list[PlacedProbe]) -> None:
        self.facts()
        for probe in probes:
            resources = self._resources(probe.task.spec.cell.hardware)  # the hardware axis: a node that has it
            size = task_size(self.options, probe.ranks)
            probe.handle = self.remote.options(**self.task_options, **size, resources=resources).remote(
                probe.task.spec.to_dict(), probe.task.timeout_s, self.run
            )
            probe.job_id = probe.handle.completed().task_id().hex()  # its head is shared by a driver's first tasks
            asked = {"CPU": size["num_cpus"], **({"GPU": size["num_gpus"]} if size["num_gpus"] else {}), **resources}
            probe.waiting = "no node has started it; it asks for " + ", ".join(f"{k}: {v:g}" for k, v in asked.items())

    def wait(self, probes: list[PlacedProbe], timeout_s: float) -> list[tuple[PlacedProbe, Ending]]:
        """Block up to timeout_s for the next item of any task; then read every item that is ready: its
        node's name (it started), its last step, or its outcome."""
        if not probes:
            return []
        self.ray.wait([p.handle for p in probes], num_returns=1, timeout=timeout_s)
        ended = []
        for probe in probes:
            while self.ray.wait([probe.handle], timeout=0)[0]:
                ending = self._item(probe)
                if ending is not None:
                    ended.append((probe, ending))
                    break
        return ended

    def _item(self, probe: PlacedProbe) -> Ending | None:
        """Read the task's next item; its Ending when that item (or its failure) ends it."""
        try:
            item = self.ray.get(next(probe.handle))
        except StopIteration:
            return Ending("ENDED", detail="the task ended without the probe's outcome")
        except self.ray.exceptions.TaskCancelledError:
            return Ending("CANCELLED")
        except self.ray.exceptions.RayError as e:  # the worker or its node died, or the task never ran
            return Ending(type(e).__name__, detail=said(e))
        if isinstance(item, str):  # its node's name: it started
            probe.state, probe.started, probe.waiting = "running", time.monotonic(), ""
            return None
        if "step" in item:
            probe.step = item["step"]
            return None
        return Ending(EXITED, Outcome.from_dict(item["placed"]), item["files"])

    def last_step(self, probe: PlacedProbe) -> dict | None:
        return probe.step

    def cancel(self, probes: list[PlacedProbe], wait_s: float) -> None:
        """End the probes' tasks. With time to wait (a run ending), each task is first asked to end (a
        KeyboardInterrupt in it: its probe's group is killed and reaped before the task ends), and only
        the ones still running after GRACEFUL_CANCEL_S are killed with their worker (then the probe dies
        with its parent, PR_SET_PDEATHSIG, on its own time). Waits on each task's completed(), not on the
        generator itself, which is "ready" as soon as an item waits unread (its node's name)."""
        refs = [p.handle for p in probes if p.handle is not None]
        if not refs:
            return
        deadline = time.monotonic() + wait_s
        pending = refs
        try:
            if wait_s > 0:
                self._cancel(refs, force=False)
                pending = self._wait_ended(refs, min(wait_s, GRACEFUL_CANCEL_S))
        finally:  # a second Ctrl-C during the graceful wait still kills what is left
            self._cancel(pending, force=True)
        if pending and wait_s > 0:
            self._wait_ended(pending, max(0.0, deadline - time.monotonic()))

    def _cancel(self, refs: list, force: bool) -> None:
        for ref in refs:
            try:
                self.ray.cancel(ref, force=force)
            except self.ray.exceptions.RayError:
                pass  # it ended meanwhile

    def _wait_ended(self, refs: list, timeout_s: float) -> list:
        """The tasks of `refs` still running after waiting up to timeout_s for all of them to end."""
        ended = {ref.completed(): ref for ref in refs}
        done, _ = self.ray.wait(list(ended), num_returns=len(ended), timeout=timeout_s)
        done = set(done)
        return [ref for completed, ref in ended.items() if completed not in done]

    def close(self) -> None:
        super().close()
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
