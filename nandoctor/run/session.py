"""One run directory being filled: its store, its device facts, the model plan, and the scheduler that
runs its probes on a placement (this machine's slots, a SLURM cluster or a Ray cluster). Grid, check
and bisect all run their probes through a Session, which only orchestrates: the run-directory policy
is rundir.py, the heartbeat heartbeat.py, the loop scheduler.py, where probes run placement.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .. import jsonio
from ..capabilities import data_masked, emulated_notes, input_support, parallel_support, quant_support
from ..cells import weight_dtype
from ..config import PATH_FIELDS, STORAGE_DTYPES, Recipe, get_field, load_dtype, recipe_to_dict
from ..device import DeviceFacts
from ..env import collect_doctor
from ..errors import NandoctorError
from ..executors import ExecutorConfig
from ..models import model_type_hint, plan_model, plan_warnings, training_bytes
from ..plan import PlannedProbe
from ..record import ModelPlan, ProbeRecord, ProbeSpec
from ..runmeta import RunMeta
from ..thresholds import refuse_short_probes
from .cache import gave_up_threads
from .fingerprint import probe_fingerprint
from .heartbeat import Heartbeat
from .local import LocalPlacement, threads_per_probe
from .on_ray import RayPlacement
from .on_slurm import SlurmPlacement
from .options import RunOptions
from .placement import Placement
from .planner import plan_request
from .rundir import FACTS_FILE, RunInterrupted, new_run_dir, planning_device
from .scheduler import Scheduler
from .store import RUN_FILE, ResultsStore, write_atomic
from .task import SPEC_FILE, ProbeTask, probe_dir

# Where each executor places probes: a placement class per --executor kind (run/placement.py's protocol).
PLACEMENTS = {"local": LocalPlacement, "slurm": SlurmPlacement, "ray": RayPlacement}


def input_files(recipe: Recipe) -> dict[str, str]:
    """The local files the recipe's probes open (config.PATH_FIELDS that name one here): a placement
    whose nodes do not share this filesystem checks that each node has them (on_ray.task_facts)."""
    out = {}
    for key in PATH_FIELDS:
        value = get_field(recipe, key)
        if value and os.path.exists(value):
            out[key] = str(value)
    return out


def probe_spec(
    recipe: Recipe,
    probe: PlannedProbe,
    plan: ModelPlan,
    device: DeviceFacts | dict,
    steps: int,
    jobs: int,
    threads: int | None = None,
    options: RunOptions | None = None,
) -> ProbeSpec:
    """threads: the probe's CPU threads (its placement's share); by default this host's cores over `jobs`.
    options: the run's RunOptions, of which the probe reads replay_failed_only (the forensics replay runs
    only after a non-finite step: check), roundtrip (the probe merges, saves and reloads what it trained:
    check --roundtrip, child/roundtrip.py) and trainer (the user's trainer the probe trains with)."""
    device, options = DeviceFacts.of(device), options or RunOptions()
    return ProbeSpec(
        probe.probe_id,
        recipe,
        probe.cell,
        plan,
        steps,
        recipe.seed + probe.seed_offset,
        device.device,
        threads or threads_per_probe(jobs, device.cpu_count),
        options.replay_failed_only,
        options.roundtrip,
        options.trainer,
    )


def measured_peak(record: ProbeRecord) -> int:
    """A finished probe's GPU memory peak, its forensics replay included; 0 off the GPU."""
    if record.peak_memory_kind != "cuda-allocator-peak":
        return 0
    return max(record.peak_memory_bytes or 0, (record.forensics or {}).get("peak_memory_bytes") or 0)


class Session:
    """A run directory being filled. A context manager: leaving it ends every probe still running (and
    cancels its job) and closes the placement.

    options (a RunOptions) says how: options.warm=False starts a cold Python process per probe, and no
    warm worker to plan on (this process plans); options.cache reuses records with an identical
    fingerprint and keeps the new ones; options.replay_failed_only runs the forensics replay only for a
    probe that hit a non-finite step (a quick check); options.listener's alive hook hears every
    HEARTBEAT_S while a probe runs, its stale hook when a resumed run's records are rerun because their
    inputs changed, its note hook what capabilities.emulated_notes says, its queue hook a scheduler's
    queue, its uncached hook the probes options.cache kept none of since each gave up CPU threads to a busy
    host (cache.gave_up_threads). plan reuses a model plan and resume=True continues the run directory options.out (see
    resume()); otherwise options.out must not hold a run yet. on_record(record) is called for every
    record as it is kept. Constructing one picks the run directory and opens the placement (this
    machine's first warm worker, or a scheduler's start-up jobs and the warm worker that plans start at
    once); prepare() then gathers the device facts (options.device, unless given) and plans the model
    (`plan`, unless given); `warnings` says what the user should know about the model plan. Ctrl-C (or
    SIGTERM) inside the `with` block leaves as RunInterrupted once run.json exists.

    options.jobs=None packs probes on this machine (local.LocalPlacement): on a GPU host by the planned
    model's training memory, corrected by the peaks measured as probes finish; one at a time on a CPU.

    options.executor (an ExecutorConfig) says where probes run (PLACEMENTS); a scheduler's placement runs
    `parallel` of them at once, each with `cpus` threads per rank."""

    def __init__(
        self,
        kind: str,
        recipe: Recipe,
        options: RunOptions | None = None,
        on_record=None,
        plan: ModelPlan | None = None,
        resume: bool = False,
    ):
        options = options or RunOptions()
        hooks = options.hooks()
        self.kind, self.recipe = kind, recipe
        self.options = options
        self.steps = options.steps or recipe.steps
        self.short = refuse_short_probes(kind, self.steps) if kind != "check" and not resume else None
        self.executor = options.executor or ExecutorConfig()
        self.dir = Path(options.out) if resume else new_run_dir(options.out, kind, recipe)
        self.store = ResultsStore(self.dir)
        self.device = DeviceFacts.of(options.device)
        # the device facts per kind of hardware a resumed run was planned with (a scheduler's start-up
        # jobs gathered them on the cluster): its placement gathers none again
        self.kept: dict | None = self.store.read_json(FACTS_FILE) if resume else None
        self.devices: dict[str, DeviceFacts] = {}
        # the placement starts its first warm worker (or a scheduler's start-up jobs) now, while this
        # process gathers the device facts and plans the model (prepare)
        self.placement: Placement = PLACEMENTS[self.executor.kind](
            self.executor, self.dir, jobs=options.jobs, warm=options.warm, kept=self.kept, inputs=input_files(recipe)
        )
        heartbeat = Heartbeat(hooks.alive) if hooks.alive else None
        self.scheduler = Scheduler(self.placement, self.store, self.executor.option("retries"), heartbeat, hooks.queue)
        self.plan = plan
        # models.config_facts of the recipe, when the worker's planning gathered them
        self.model_facts: dict | None = None
        # the data lint of the recipe's rows (api.open_session judges what lint() measured); None: synthetic
        self.data_lint: dict | None = None
        self.cache = options.cache
        self.on_record = on_record or (lambda record: None)
        self.on_stale = hooks.stale or (lambda probe_ids: None)
        self.on_note = hooks.note or (lambda line: None)
        self.emulated_said: set[str] = set()  # the compute dtypes announced as emulated (capabilities.emulated_notes)
        self.on_uncached = hooks.uncached or (lambda threads: None)
        self.planned = 0
        self.recorded: dict[str, ProbeRecord] = {}  # probes already in the store (a resumed run)

    def prepare(self) -> None:
        """Gather the device facts (unless given) and plan the model. A placement whose start-up jobs
        gather each kind of hardware's facts on the cluster gives them (kept in the run directory, so
        that --resume plans with the same facts without asking again). A warm worker of this machine
        plans, in a forked child (child/plan.py, run/planner.py): a local placement's first slot, or a
        cluster placement's own planner, given the facts its start-up jobs gathered; so this process
        imports neither torch nor transformers. Without one (--cold) or without its answer, this
        process plans. Until this returns, only `dir` is known."""
        try:
            hint, adapter = model_type_hint(self.recipe), self.recipe.adapter.type != "none"
            if hint or adapter:
                self.placement.preload(hint, adapter)  # the worker imports its modeling code before it plans
            gathered = self.placement.facts()
            if gathered and not self.kept:
                self.dir.mkdir(parents=True, exist_ok=True)
                write_atomic(self.dir / FACTS_FILE, jsonio.dumps(gathered))
            self.devices = {kind: DeviceFacts.from_dict(facts) for kind, facts in gathered.items()}
            if self.devices:
                self.device = planning_device(self.devices)
            if self.device is None or self.plan is None:
                answer = self._worker_plans([self.recipe], self.device)
                if answer:
                    self.device = self.device or answer[0]
                    self.plan = self.plan or answer[1][0]
                    self.model_facts = answer[2]
            self.device = self.device or collect_doctor()
            self.plan = self.plan or plan_model(self.recipe, self.device, self.steps)
        except BaseException:
            self.close()
            raise
        self.placement.preload(self.plan.model_type, adapter)
        self.warnings = plan_warnings(self.recipe, self.plan, self.device) + ([self.short] if self.short else [])
        self.estimate = training_bytes(self.plan.params, self.plan.trainable_params)
        self.peak = 0  # the largest GPU memory peak a finished probe measured
        self.placement.fit(self.device, self.estimate)
        self.jobs = self.placement.capacity
        self.plans = {self._key(self.recipe): self.plan}

    def device_of(self, hardware: str) -> DeviceFacts:
        """The device facts a probe on this kind of hardware is planned with: that kind's, gathered where
        it runs (an executor), or this run's own."""
        return self.devices.get(hardware) or self.device

    @staticmethod
    def _key(recipe: Recipe) -> str:
        return json.dumps(recipe_to_dict(recipe), sort_keys=True, default=str)

    def plan_for(self, recipe: Recipe) -> ModelPlan:
        """The model plan of a recipe variant (an adapter or model.* override changes it)."""
        key = self._key(recipe)
        if key not in self.plans:
            answer = self._worker_plans([recipe], self.device)
            self.plans[key] = answer[1][0] if answer else plan_model(recipe, self.device, self.steps)
            self.placement.preload(self.plans[key].model_type, recipe.adapter.type != "none")
        return self.plans[key]

    def lint(self) -> dict | None:
        """What the data lint measures on the recipe's rows (measure/lint.lint_rows, unjudged; None for
        the synthetic stream), measured by the placement's planning child where it has one, so that this
        process imports neither torch nor the datasets and tokenizer code for it; else here. The user's
        own error is raised here."""
        if self.recipe.data.source != "file":
            return None
        answer = self.placement.plan({"lint": recipe_to_dict(self.recipe)})
        if not answer:
            from ..measure.lint import lint_rows

            return lint_rows(self.recipe)
        if "error" in answer:
            raise NandoctorError(answer["error"])
        return answer["data"]

    def _worker_plans(
        self, recipes: list[Recipe], device: DeviceFacts | None
    ) -> tuple[DeviceFacts, list[ModelPlan], dict] | None:
        """(device facts, a plan per recipe, the first recipe's models.config_facts) from the placement's
        planning child (a warm worker's fork), or None when it has none or it did not answer: then this
        process plans. The user's own error in a model config or adapter is raised here, as plan_model
        raises it."""
        answer = self.placement.plan(plan_request(device, [recipe_to_dict(r) for r in recipes], self.steps))
        if not answer:
            return None
        if "error" in answer:
            raise NandoctorError(answer["error"])
        plans = [ModelPlan.from_dict(p) for p in answer["plans"]]
        return DeviceFacts.from_dict(answer["device"]), plans, answer["facts"]

    def _spec(self, recipe: Recipe, probe: PlannedProbe, plan: ModelPlan, steps: int) -> ProbeSpec:
        device = self.device_of(probe.cell.hardware)
        ranks = recipe.world_size if probe.cell.parallel_row.wrapper else 1
        threads = self.placement.threads(device, ranks)
        return probe_spec(recipe, probe, plan, device, steps, self.jobs, threads, self.options)

    def close(self) -> None:
        """End every probe still running (cancelling its job) and close the placement."""
        self.scheduler.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and (self.dir / RUN_FILE).exists():
            raise RunInterrupted(self.kind, self.dir, getattr(exc, "signal", 2)) from None

    def start(self, planned: int, extra: dict | None = None) -> None:
        """Write run.json (RunMeta): the run's own facts, and `extra`, the fields of its kind (RunMeta's
        grid, check and bisect fields)."""
        self.planned = planned
        meta = RunMeta.from_dict(
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
        self.store.create(meta.to_dict())

    def resume(self, planned: int) -> list[ProbeRecord]:
        """Continue a run directory: the probes its store holds count as done and are not rerun, unless
        what one was made from changed since (a checkpoint, tokenizer, template or data file, nandoctor's
        version: its fingerprint, recomputed from its spec.json, differs from the recorded one). Those
        are dropped from the store, named through on_stale(probe_ids), and run again. Returns the records
        kept (the caller learns their references)."""
        self.planned = planned
        self.store.drop_partial_line()
        records = self.store.records()
        stale = [r.probe_id for r in records if self._inputs_changed(r)]
        if stale:
            self.store.drop(stale)
            self.on_stale(stale)
            records = [r for r in records if r.probe_id not in stale]
        for record in records:
            self.recorded[record.probe_id] = record
        return records

    def _inputs_changed(self, record: ProbeRecord) -> bool:
        """Whether the probe's fingerprint, computed now from the spec it ran with, differs from the one
        it was recorded with; False for a record without either (a reused or an unsupported one)."""
        spec = probe_dir(self.dir, record.probe_id) / SPEC_FILE
        if not record.fingerprint or not spec.is_file():
            return False
        try:
            data = jsonio.loads(spec.read_text())
        except (OSError, ValueError):
            return False
        return probe_fingerprint(data, record.overrides, self.device_of(record.cell.hardware)) != record.fingerprint

    def run(self, recipe: Recipe, probes: list[PlannedProbe]) -> list[ProbeRecord]:
        """Record the unsupported probes, reuse cached ones, run the others; every record in plan order.
        A probe that carries its own recipe variant runs with it; the others run with `recipe`."""
        records = {p.probe_id: self.recorded[p.probe_id] for p in probes if p.probe_id in self.recorded}
        tasks = []
        for p in probes:
            if p.probe_id in records:
                continue
            own, device = p.recipe or recipe, self.device_of(p.cell.hardware)
            spec = self._spec(own, p, self.plan_for(own), self.steps)
            ranks = own.world_size if p.cell.parallel_row.wrapper else 1
            unsupported = (
                p.unsupported
                or spec.plan.refuses.get(p.cell.attention.implementation)
                or input_support(p.cell, spec.plan.shape, data_masked(own.data, self.data_lint), device)
                or parallel_support(
                    p.cell, own.world_size, own.batch_size, self.placement.probe_device(device, ranks), own.objective
                )
                or quant_support(p.cell, STORAGE_DTYPES[own.quant.storage], weight_dtype(p.cell, load_dtype(own)))
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
        for hardware in dict.fromkeys(t.spec.cell.hardware for t in tasks):
            cells = [t.spec.cell for t in tasks if t.spec.cell.hardware == hardware]
            for line in emulated_notes(self.device_of(hardware), cells, self.emulated_said):
                self.on_note(line)
        busy = {}
        for r in self.scheduler.run(tasks, on_record=self._measured):
            records[r.probe_id] = r
            if self.cache:
                self.cache.add(r, self.dir)
                if gave_up_threads(r):
                    busy[r.probe_id] = gave_up_threads(r)
        if busy:
            self.on_uncached(busy)
        return [records[p.probe_id] for p in probes]

    def time_only(self, recipe: Recipe, probes: list[PlannedProbe], steps: int, on_alive=None) -> list[ProbeRecord]:
        """Run probes for their timing alone, in the given order, one at a time (so that none competes
        with another), `steps` steps each: never cached, never in results.jsonl; the caller keeps what
        it needs. Their folders sit under retime/, apart from the run's probes. on_alive(running, step_of):
        the heartbeat while they run, instead of the run's."""
        tasks = [ProbeTask(self._spec(recipe, p, self.plan, steps), recipe.timeout_s) for p in probes]
        run = self.scheduler.run(tasks, keep=False, under="retime", at_once=1, on_alive=on_alive)
        records = {r.probe_id: r for r in run}
        return [records[t.probe_id] for t in tasks]

    def _measured(self, record: ProbeRecord) -> None:
        """A probe finished: fit the next ones to the largest GPU memory peak measured so far."""
        peak = measured_peak(record)
        if peak > self.peak:
            self.peak = peak
            self.placement.fit(self.device, self.peak)
        self.on_record(record)

    def _keep(self, record: ProbeRecord) -> ProbeRecord:
        self.store.append(record)
        self.on_record(record)
        return record
