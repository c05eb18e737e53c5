"""One run directory being filled: its store, its device facts, the model plan and the runner. Grid,
check and bisect all run their probes through a Session."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from .. import jsonio
from ..capabilities import input_support, parallel_support
from ..config import ExecutorConfig, Recipe, recipe_to_dict, refuse_short_probes
from ..env import collect_doctor, get_cpu_count, get_gpu_count_guess
from ..errors import NandoctorError
from ..models import memory_budget, model_type_hint, plan_model, plan_warnings, training_bytes
from ..plan import PlannedProbe
from ..record import ModelPlan, ProbeRecord, ProbeSpec
from .cache import ProbeCache
from .fingerprint import probe_fingerprint
from .remote import RemoteRunner
from .runner import ProbeRunner, ProbeTask, plan_request, threads_per_probe
from .slots import most_jobs, packed_jobs
from .store import RESULTS_FILE, RUN_FILE, ResultsStore, write_atomic

REPORTS_DIR = Path("reports")
HEARTBEAT_S = 15.0  # how often a running probe says it is alive
FACTS_FILE = "hardware.json"  # an executor's device facts per kind of hardware, kept for --resume
RESUME_COMMANDS = {"grid": "nandoctor grid --resume {dir}", "bisect": "nandoctor bisect --resume {dir}"}


def planning_device(devices: dict[str, dict]) -> dict:
    """The facts the model is planned with when probes run on several kinds of hardware: those of the
    kind with the least memory, so that every kind trains the same model and it fits on each."""
    return min(devices.values(), key=memory_budget)


def kept_device(run_dir, executor: ExecutorConfig | None) -> dict | None:
    """The facts a run placed by an executor was planned with (FACTS_FILE), for resuming it with them
    on the same kind of executor; None otherwise."""
    if executor is None or not executor.remote:
        return None
    kept = ResultsStore(run_dir).read_json(FACTS_FILE)
    return planning_device(kept) if kept else None


def resume_command(kind: str, run_dir: str | Path) -> str | None:
    """The command line that finishes an interrupted run of this kind, or None (a check is not resumed)."""
    template = RESUME_COMMANDS.get(kind)
    return template.format(dir=shlex.quote(str(run_dir))) if template else None


def refuse_used_out(path: Path) -> None:
    """--out must be a new or unused directory: appending to a run already there would mix two runs in
    one results.jsonl and judge the old probes against the new reference."""
    if path.exists() and not path.is_dir():
        raise NandoctorError(
            f"--out {str(path)!r} is a file; pass a directory for the run (it is created when missing)"
        )
    if not any((path / name).exists() for name in (RUN_FILE, RESULTS_FILE, "probes")):
        return
    try:
        kind = (ResultsStore(path).read_json(RUN_FILE) or {}).get("kind", "nandoctor")
    except NandoctorError:
        kind = "nandoctor"  # an unreadable run.json is still somebody's run
    command = resume_command(kind, path)
    finish = f"finish it with `{command}` or " if command else ""
    raise NandoctorError(f"--out {str(path)!r} already holds a {kind} run; {finish}pass another --out")


def refuse_unwritable(path: Path, named: str = "--out") -> None:
    """Before any probe runs: the run directory (or the nearest folder above it that exists, where it
    will be created) must be a directory this process can write to."""
    there = path
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise NandoctorError(f"{named} {str(path)!r} cannot be created: {str(there)!r} is a file, not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        why = (
            "is on a read-only file system"
            if os.statvfs(there).f_flag & os.ST_RDONLY
            else "is not writable by this user"
        )
        raise NandoctorError(
            f"{named} {str(path)!r} cannot be written: {str(there)!r} {why}; pass --out a writable directory"
        )


def new_run_dir(out: str | Path | None, kind: str, recipe: Recipe) -> Path:
    if out:
        refuse_used_out(Path(out))
        refuse_unwritable(Path(out))
        return Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = recipe.name.replace("/", "--")
    path = REPORTS_DIR / f"{stamp}-{kind}-{safe}"
    n = 1
    while path.exists():
        n += 1
        path = REPORTS_DIR / f"{stamp}-{kind}-{safe}-{n}"
    refuse_unwritable(path, "the default run directory")
    return path


def probe_spec(
    recipe: Recipe,
    probe: PlannedProbe,
    plan: ModelPlan,
    device: dict,
    steps: int,
    jobs: int,
    threads: int | None = None,
    replay_failed_only: bool = False,
) -> ProbeSpec:
    """threads: the probe's CPU threads (an executor's cores per probe); by default this host's cores over `jobs`.
    replay_failed_only: the forensics replay runs only after a non-finite step (check)."""
    return ProbeSpec(
        probe.probe_id,
        recipe,
        probe.cell,
        plan,
        steps,
        recipe.seed + probe.seed_offset,
        device["device"],
        threads or threads_per_probe(jobs, device["cpu_count"]),
        replay_failed_only,
    )


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C while a Session was filling a run directory: what it recorded is kept there."""

    def __init__(self, kind: str, run_dir: Path):
        super().__init__(kind, str(run_dir))
        self.kind, self.run_dir = kind, run_dir

    @property
    def resume_command(self) -> str | None:
        return resume_command(self.kind, self.run_dir)


def last_step(path: Path) -> dict | None:
    """The last complete step a running probe has streamed to its steps.jsonl, or None."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return jsonio.loads(line)
        except ValueError:
            continue  # the line the child is writing right now
    return None


class Heartbeat:
    """Given to the runner, which calls it with the running probes at least every 0.5 s; calls
    on_alive(probe_id, elapsed_s, last step or None) for each probe every `every` seconds it runs."""

    def __init__(self, on_alive, every: float = HEARTBEAT_S):
        self.on_alive, self.every = on_alive, every
        self.beats: dict[tuple, int] = {}  # (probe id, start time) -> heartbeats given

    def __call__(self, running) -> None:
        for probe in running:
            key = (probe.task.probe_id, probe.started)
            due = int(probe.elapsed // self.every)
            if due > self.beats.get(key, 0):
                self.beats[key] = due
                self.on_alive(probe.task.probe_id, probe.elapsed, last_step(probe.folder / "steps.jsonl"))


def measured_peak(record: ProbeRecord) -> int:
    """A finished probe's GPU memory peak, its forensics replay included; 0 off the GPU."""
    if record.peak_memory_kind != "cuda-allocator-peak":
        return 0
    return max(record.peak_memory_bytes or 0, (record.forensics or {}).get("peak_memory_bytes") or 0)


class Session:
    """A run directory being filled. A context manager: leaving it stops the warm workers and kills any
    probe still running.

    warm=False starts a cold Python process per probe; cache (a ProbeCache) reuses records with an
    identical fingerprint and keeps the new ones; replay_failed_only runs the forensics replay only for
    a probe that hit a non-finite step (a quick check); plan reuses a model plan and resume=True continues
    the run directory `out` (see resume()); otherwise `out` must not hold a run yet.
    on_record(record) is called for every record as it is kept; on_alive(probe_id, elapsed_s, step)
    every HEARTBEAT_S while a probe runs. Constructing one only picks the run directory and starts the
    first warm worker; prepare() then gathers the device facts (`device`, unless given) and plans the
    model (`plan`, unless given); `warnings` says what the user should know about the model plan.
    Ctrl-C inside the `with` block leaves as RunInterrupted once run.json exists.

    jobs=None packs probes (slots.packed_jobs): on a GPU host by the planned model's training memory,
    corrected by the peaks measured as probes finish; one at a time on a CPU.

    executor (an ExecutorConfig other than local) places the probes with a scheduler (remote.RemoteRunner):
    `parallel` of them at once, each with `cpus` threads per rank; on_queue(queued, running, done, job_ids, queue_wait)
    hears its queue."""

    def __init__(
        self,
        kind: str,
        recipe: Recipe,
        out=None,
        jobs: int | None = None,
        steps: int | None = None,
        device: dict | None = None,
        on_record=None,
        warm: bool = True,
        cache: ProbeCache | None = None,
        plan: ModelPlan | None = None,
        on_alive=None,
        resume: bool = False,
        executor: ExecutorConfig | None = None,
        on_queue=None,
        replay_failed_only: bool = False,
    ):
        self.kind, self.recipe = kind, recipe
        self.replay_failed_only = replay_failed_only
        self.steps = steps or recipe.steps
        self.short = refuse_short_probes(kind, self.steps) if kind != "check" and not resume else None
        self.asked_jobs, self.warm, self.on_queue = jobs, warm, on_queue
        self.executor = executor or ExecutorConfig()
        self.dir = Path(out) if resume else new_run_dir(out, kind, recipe)
        self.store = ResultsStore(self.dir)
        self.device = device
        # an executor's facts per kind of hardware: gathered on the cluster by the start-up jobs, or read
        # back from the run directory when resuming
        self.devices: dict[str, dict] = (
            (self.store.read_json(FACTS_FILE) or {}) if resume and self.executor.remote else {}
        )
        # the first warm worker (or a scheduler's canary) starts now, while this process gathers the
        # device facts and plans the model (prepare), which import torch / transformers too; until then
        # the slots go by the facts that need no torch
        guess = {"gpus": [{}] * get_gpu_count_guess(), "cpu_count": get_cpu_count()}
        self.runner = self._open_runner(device or guess)
        self.plan = plan
        # models.config_facts of the recipe, when the worker's planning gathered them
        self.model_facts: dict | None = None
        self.cache = cache
        self.on_record = on_record or (lambda record: None)
        self.heartbeat = Heartbeat(on_alive) if on_alive else None
        self.planned = 0
        self.recorded: dict[str, ProbeRecord] = {}  # probes already in the store (a resumed run)

    def _open_runner(self, device: dict):
        """A scheduler's runner (--executor slurm / ray), or slots for the most probes this device may run
        at once (packing keeps some idle), pinned to its GPUs."""
        self.gpus = len(device.get("gpus") or [])
        if self.executor.remote:
            runner = RemoteRunner(self.dir, self.store, self.executor, self.on_queue, gather=not self.devices)
            self.most = runner.jobs
            return runner
        self.most = self.asked_jobs or most_jobs(device)
        return ProbeRunner(self.dir, self.store, self.most, self.gpus, self.warm).open()

    def prepare(self) -> None:
        """Gather the device facts (unless given) and plan the model. With a warm local worker, its
        forked child does both once the worker has imported torch and transformers (child/plan.py), so
        that this process imports neither; otherwise this process does. Until this returns, only `dir`
        is known."""
        try:
            hint, adapter = model_type_hint(self.recipe), self.recipe.adapter.type != "none"
            if hint or adapter:
                self.runner.preload(hint, adapter)  # the worker imports its modeling code before it plans
            if self.executor.remote:
                self.devices = self.devices or self._cluster_facts()
                self.device = planning_device(self.devices)
            if self.device is None or self.plan is None:
                answer = self._worker_plans([self.recipe], self.device)
                if answer:
                    self.device = self.device or answer[0]
                    self.plan = self.plan or answer[1][0]
                    self.model_facts = answer[2]
            self.device = self.device or collect_doctor()
            if not self.executor.remote and len(self.device.get("gpus") or []) != self.gpus:
                self.runner.close()  # the guess was wrong: slots are pinned to GPUs
                self.runner = self._open_runner(self.device)
                if hint or adapter:
                    self.runner.preload(hint, adapter)
            self.plan = self.plan or plan_model(self.recipe, self.device, self.steps)
        except BaseException:
            self.runner.close()
            raise
        self.runner.preload(self.plan.model_type, adapter)
        self.packed = self.asked_jobs is None and not self.executor.remote
        self.warnings = plan_warnings(self.recipe, self.plan, self.device) + ([self.short] if self.short else [])
        self.estimate = training_bytes(self.plan.params, self.plan.trainable_params)
        self.peak = 0  # the largest GPU memory peak a finished probe measured
        self.jobs = (
            self.runner.jobs if self.executor.remote else self.asked_jobs or packed_jobs(self.device, self.estimate)
        )
        self.runner.limit = self.jobs
        self.plans = {self._key(self.recipe): self.plan}

    def _cluster_facts(self) -> dict[str, dict]:
        """Each hardware kind's device facts, from a job that ran there (the runner's start-up jobs),
        kept in the run directory so that --resume plans with the same facts without asking again."""
        facts = self.runner.hardware_facts()
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir / FACTS_FILE, jsonio.dumps(facts))
        return facts

    def device_of(self, hardware: str) -> dict:
        """The device facts a probe on this kind of hardware is planned with: that kind's, gathered where
        it runs (an executor), or this run's own."""
        return self.devices.get(hardware) or self.device

    def _job_device(self, device: dict, ranks: int) -> dict:
        """What a placed probe of `ranks` ranks will see: its job asks for the per-probe GPUs times its
        ranks (ExecutorConfig.size) of the kind the facts job saw one probe's share of."""
        if not self.executor.remote or not device.get("gpus"):
            return device
        return {**device, "gpus": device["gpus"][:1] * self.executor.size(ranks)[1]}

    @staticmethod
    def _key(recipe: Recipe) -> str:
        return json.dumps(recipe_to_dict(recipe), sort_keys=True, default=str)

    def plan_for(self, recipe: Recipe) -> ModelPlan:
        """The model plan of a recipe variant (an adapter or model.* override changes it)."""
        key = self._key(recipe)
        if key not in self.plans:
            answer = self._worker_plans([recipe], self.device)
            self.plans[key] = answer[1][0] if answer else plan_model(recipe, self.device, self.steps)
            self.runner.preload(self.plans[key].model_type, recipe.adapter.type != "none")
        return self.plans[key]

    def _worker_plans(self, recipes: list[Recipe], device: dict | None) -> tuple[dict, list[ModelPlan], dict] | None:
        """(device facts, a plan per recipe, the first recipe's models.config_facts) from the first warm
        worker's planning child, or None when there is none (--cold, an executor) or it did not answer:
        then this process plans. The user's own error in a model config or adapter is raised here, as
        plan_model raises it."""
        if self.executor.remote or not self.warm:
            return None
        answer = self.runner.plan(plan_request(device, [recipe_to_dict(r) for r in recipes], self.steps))
        if not answer:
            return None
        if "error" in answer:
            raise NandoctorError(answer["error"])
        return answer["device"], [ModelPlan.from_dict(p) for p in answer["plans"]], answer["facts"]

    def threads(self, recipe: Recipe, probe: PlannedProbe) -> int | None:
        """A placed probe's CPU threads: the cores its job or task asks for (all its ranks' cores for a
        parallel probe, which splits them over its ranks); None on this machine (its slots decide)."""
        if not self.executor.remote:
            return None
        return self.executor.size(recipe.world_size if probe.cell.parallel_row.wrapper else 1)[0]

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.runner.close()
        if exc_type is KeyboardInterrupt and (self.dir / RUN_FILE).exists():
            raise RunInterrupted(self.kind, self.dir) from None

    def start(self, planned: int, extra: dict | None = None) -> None:
        self.planned = planned
        self.store.create(
            {
                "kind": self.kind,
                "run_id": self.dir.name,
                "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                "recipe": recipe_to_dict(self.recipe),
                "model_plan": self.plan.to_dict(),
                "steps": self.steps,
                "seed": self.recipe.seed,
                "jobs": self.jobs,
                "env": self.device,
                "planned": planned,
                "executor": self.executor.kind,
                **({"env_by_hardware": self.devices} if self.devices else {}),
                **(extra or {}),
            }
        )

    def resume(self, planned: int) -> list[ProbeRecord]:
        """Continue a run directory: the probes its store holds count as done and are not rerun.
        Returns them (the caller learns their references)."""
        self.planned = planned
        self.store.drop_partial_line()
        records = self.store.records()
        for record in records:
            self.recorded[record.probe_id] = record
        return records

    def run(self, recipe: Recipe, probes: list[PlannedProbe]) -> list[ProbeRecord]:
        """Record the unsupported probes, reuse cached ones, run the others; every record in plan order.
        A probe that carries its own recipe variant runs with it; the others run with `recipe`."""
        records = {p.probe_id: self.recorded[p.probe_id] for p in probes if p.probe_id in self.recorded}
        tasks = []
        for p in probes:
            if p.probe_id in records:
                continue
            own, device = p.recipe or recipe, self.device_of(p.cell.hardware)
            spec = probe_spec(
                own, p, self.plan_for(own), device, self.steps, self.most, self.threads(own, p), self.replay_failed_only
            )
            ranks = own.world_size if p.cell.parallel_row.wrapper else 1
            unsupported = (
                p.unsupported
                or spec.plan.refuses.get(p.cell.attention.implementation)
                or input_support(p.cell, spec.plan.shape, own.data.pad_fraction > 0, device)
                or parallel_support(p.cell, own.world_size, own.batch_size, self._job_device(device, ranks))
            )
            if unsupported:
                records[p.probe_id] = self._keep(ProbeRecord.unsupported(spec, unsupported, p.overrides))
                continue
            fingerprint = probe_fingerprint(spec.to_dict(), p.overrides, device)
            hit = self.cache.lookup(fingerprint) if self.cache else None
            if hit:
                cached, run_dir = hit
                records[p.probe_id] = self._keep(
                    cached.reused(p.probe_id, run_dir, overrides=p.overrides, fingerprint=fingerprint)
                )
            else:
                tasks.append(ProbeTask(spec, own.timeout_s, {"overrides": p.overrides, "fingerprint": fingerprint}))
        if (
            not self.executor.remote
            and self.device.get("device") == "cuda"
            and any(t.spec.cell.parallel_row.wrapper for t in tasks)
        ):
            self.runner.limit = 1  # a parallel probe takes GPUs 0..W-1 (child/launch.py): one at a time
        for r in self.runner.run(tasks, on_record=self._measured, on_wait=self.heartbeat):
            records[r.probe_id] = r
            if self.cache:
                self.cache.add(r, self.dir)
        return [records[p.probe_id] for p in probes]

    def time_only(self, recipe: Recipe, probes: list[PlannedProbe], steps: int) -> list[ProbeRecord]:
        """Run probes for their timing alone, in the given order, one at a time on the first slot (so that
        none competes with another), `steps` steps each: never cached, never in results.jsonl; the
        caller keeps what it needs. Their folders sit under retime/, apart from the run's probes."""
        tasks = [
            ProbeTask(
                probe_spec(
                    recipe, p, self.plan, self.device_of(p.cell.hardware), steps, self.most, self.threads(recipe, p)
                ),
                recipe.timeout_s,
            )
            for p in probes
        ]
        limit, self.runner.limit = self.runner.limit, 1
        try:
            records = {
                r.probe_id: r for r in self.runner.run(tasks, on_wait=self.heartbeat, keep=False, under="retime")
            }
        finally:
            self.runner.limit = limit
        return [records[t.probe_id] for t in tasks]

    def _measured(self, record: ProbeRecord) -> None:
        """A probe finished: with packing on, fit the next ones to the largest peak measured so far."""
        peak = measured_peak(record)
        if self.packed and peak > self.peak:
            self.peak = peak
            self.runner.limit = min(self.most, packed_jobs(self.device, self.estimate, self.peak))
        self.on_record(record)

    def _keep(self, record: ProbeRecord) -> ProbeRecord:
        self.store.append(record)
        self.on_record(record)
        return record
