"""The Python API the CLI is a thin layer over: run a grid, resume one, run a check, re-render a run."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from .analysis import RunAnalysis, analyze, is_reference, reference_key, reference_steps
from .cache import ProbeCache
from .config import REFERENCE_CELL, Cell, NandoctorError, Recipe, recipe_from_dict, recipe_to_dict
from .doctor import doctor_section
from .env import collect_doctor, collect_summary
from .fingerprint import environment_key, probe_fingerprint
from .models import ModelPlan, plan_from_dict, plan_model
from .plan import PlannedProbe, plan_grid
from .runner import ProbeRunner, ProbeTask, threads_per_probe
from .store import ResultsStore
from .verdicts import classify

REPORTS_DIR = Path("reports")


def new_run_dir(out: str | Path | None, kind: str, recipe: Recipe) -> Path:
    if out:
        return Path(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = recipe.name.replace("/", "--")
    path = REPORTS_DIR / f"{stamp}-{kind}-{safe}"
    n = 1
    while path.exists():
        n += 1
        path = REPORTS_DIR / f"{stamp}-{kind}-{safe}-{n}"
    return path


def probe_task(recipe: Recipe, probe: PlannedProbe, plan: ModelPlan, device: dict, steps: int, jobs: int) -> ProbeTask:
    spec = {"probe_id": probe.probe_id, "recipe": recipe_to_dict(recipe), "cell": dataclasses.asdict(probe.cell),
            "model_plan": dataclasses.asdict(plan), "steps": steps, "seed": recipe.seed + probe.seed_offset,
            "device": device["device"], "threads": threads_per_probe(jobs, device["cpu_count"]),
            "stop_on_nonfinite": True}
    return ProbeTask(probe.probe_id, spec, recipe.timeout_s,
                     extra={"reference": probe.reference, "overrides": probe.overrides,
                            "fingerprint": probe_fingerprint(spec, probe.overrides, device)})


def unsupported_record(recipe: Recipe, probe: PlannedProbe, plan: ModelPlan) -> dict:
    return {"probe_id": probe.probe_id, "cell": dataclasses.asdict(probe.cell), "status": "unsupported",
            "reason": probe.unsupported, "steps": [], "seed": recipe.seed + probe.seed_offset,
            "overrides": probe.overrides, "recipe": recipe_to_dict(recipe), "model": dataclasses.asdict(plan)}


class Session:
    """One run directory being filled: its store, its device facts, the model plan, the runner.
    A context manager: leaving it stops the warm workers and kills any probe still running.

    warm=False starts a cold Python process per probe; cache (a ProbeCache) reuses records with an
    identical fingerprint and keeps the new ones; plan reuses a model plan (when resuming)."""

    def __init__(self, kind: str, recipe: Recipe, out=None, jobs: int | None = None, steps: int | None = None,
                 device: dict | None = None, progress=None, warm: bool = True, cache: ProbeCache | None = None,
                 plan: ModelPlan | None = None):
        self.kind, self.recipe = kind, recipe
        self.device = device or collect_summary()
        self.steps = steps or recipe.steps
        gpus = len(self.device.get("gpus") or [])
        self.jobs = jobs or max(1, gpus)
        self.dir = new_run_dir(out, kind, recipe)
        self.store = ResultsStore(self.dir)
        self.runner = ProbeRunner(self.dir, self.store, self.jobs, gpus, warm).open()  # workers import while we plan
        try:
            self.plan = plan or plan_model(recipe, self.device)
        except BaseException:
            self.runner.close()
            raise
        self.runner.preload(self.plan.model_type)
        self.cache = cache
        self.progress = progress
        self.done = 0
        self.planned = 0
        self.references: dict[str, list] = {}
        self.recorded: dict[str, dict] = {}  # probes already in the store (a resumed run)
        self.plans = {self._key(recipe): self.plan}

    @staticmethod
    def _key(recipe: Recipe) -> str:
        return json.dumps(recipe_to_dict(recipe), sort_keys=True, default=str)

    def plan_for(self, recipe: Recipe) -> ModelPlan:
        """The model plan of a recipe variant (an adapter or model.* override changes it)."""
        key = self._key(recipe)
        if key not in self.plans:
            self.plans[key] = plan_model(recipe, self.device)
        return self.plans[key]

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.runner.close()

    def start(self, planned: int, extra: dict | None = None) -> None:
        self.planned = planned
        self.store.create({"kind": self.kind, "run_id": self.dir.name, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                           "recipe": recipe_to_dict(self.recipe), "model_plan": dataclasses.asdict(self.plan),
                           "steps": self.steps, "seed": self.recipe.seed, "jobs": self.jobs,
                           "env": self.device, "planned": planned, **(extra or {})})

    def resume(self, planned: int) -> None:
        """Continue a run directory: the probes its store holds count as done and are not rerun."""
        self.planned = planned
        self.store.drop_partial_line()
        for record in self.store.records():
            self.recorded[record["probe_id"]] = record
            self._report(record, quiet=True)

    def run(self, recipe: Recipe, probes: list[PlannedProbe]) -> list[dict]:
        """Record the unsupported probes, reuse cached ones, run the others; every record in plan order.
        A probe that carries its own recipe variant runs with it; the others run with `recipe`."""
        records = {p.probe_id: self.recorded[p.probe_id] for p in probes if p.probe_id in self.recorded}
        todo = [p for p in probes if p.probe_id not in records]
        for p in todo:
            if p.unsupported:
                own = p.recipe or recipe
                records[p.probe_id] = unsupported_record(own, p, self.plan_for(own))
                self._keep(records[p.probe_id])
        tasks = []
        for p in todo:
            if p.unsupported:
                continue
            own = p.recipe or recipe
            task = probe_task(own, p, self.plan_for(own), self.device, self.steps, self.jobs)
            hit = self.cache.lookup(task.extra["fingerprint"]) if self.cache else None
            if hit:
                records[p.probe_id] = {**hit, "probe_id": p.probe_id, **task.extra, "cached_from": hit["run_dir"]}
                del records[p.probe_id]["run_dir"]
                self._keep(records[p.probe_id])
            else:
                tasks.append(task)
        for r in self.runner.run(tasks, on_record=self._report):
            records[r["probe_id"]] = r
            if self.cache:
                self.cache.add(r, self.dir)
        return [records[p.probe_id] for p in probes]

    def _keep(self, record: dict) -> None:
        self.store.append(record)
        self._report(record)

    def _report(self, record: dict, quiet: bool = False) -> None:
        self.done += 1
        steps = reference_steps(record)
        if steps is not None:
            self.references[reference_key(record)] = steps
        verdict = classify(record, None if is_reference(record) else self.references.get(reference_key(record)))
        if self.progress and not quiet:
            self.progress(self.done, self.planned, record, verdict)


def run_grid(recipe: Recipe, axes: dict | None = None, steps: int | None = None, jobs: int | None = None,
             out=None, progress=None, device: dict | None = None, warm: bool = True,
             cache: ProbeCache | None = None) -> RunAnalysis:
    """Probe every cell of the grid; returns the analysis of the finished run (reports written)."""
    with Session("grid", recipe, out, jobs, steps, device or collect_doctor(), progress, warm, cache) as session:
        probes = plan_grid(recipe, session.device, axes)
        runnable = [p.cell for p in probes if not p.unsupported]
        doctor = doctor_section(session.device, recipe, runnable, setup={"recipe": recipe.name, "cells": [c.id for c in runnable]})
        session.start(len(probes), {"axes": axes or {}, "doctor": doctor})
        session.run(recipe, probes)
    return render_run(session.dir)


def resume_grid(run_dir, jobs: int | None = None, progress=None, warm: bool = True,
                cache: ProbeCache | None = None, device: dict | None = None) -> RunAnalysis:
    """Finish an interrupted grid: the recipe, axes, steps and model plan come from DIR/run.json;
    only the cells missing from DIR/results.jsonl are probed."""
    store = ResultsStore(run_dir)
    meta = store.meta()
    if meta.get("kind") != "grid":
        raise NandoctorError(f"{run_dir} is a {meta.get('kind')!r} run; only grid runs can be resumed")
    device = device or collect_doctor()
    then, now = environment_key(meta["env"]), environment_key(device)
    changed = [f"{k} {then[k]} -> {now[k]}" for k in then if then[k] != now.get(k)]
    if changed:
        raise NandoctorError(f"{run_dir} was run in another environment ({'; '.join(changed)}); start a new run instead")
    recipe = recipe_from_dict({k: v for k, v in meta["recipe"].items() if k != "name"}, meta["recipe"]["name"])
    with Session("grid", recipe, run_dir, jobs or meta["jobs"], meta["steps"], device, progress, warm, cache,
                 plan_from_dict(meta["model_plan"])) as session:
        probes = plan_grid(recipe, device, meta.get("axes") or None)
        session.resume(len(probes))
        session.run(recipe, probes)
    return render_run(run_dir)


def run_check(recipe: Recipe, cell: Cell, steps: int = 1, out=None, device: dict | None = None, warm: bool = True):
    """One cell for a few steps in a subprocess; returns (analysis, [(check, passed, detail)])."""
    from .capabilities import cell_support
    from .verdicts import check_results
    with Session("check", recipe, out, 1, steps, device or collect_doctor(), warm=warm) as session:
        probe = PlannedProbe(cell.id, cell, cell_support(cell, session.device), cell == REFERENCE_CELL)
        doctor = doctor_section(session.device, recipe, [] if probe.unsupported else [cell], setup={"recipe": recipe.name, "cells": [cell.id]})
        session.start(1, {"cell": cell.id, "doctor": doctor})
        record = session.run(recipe, [probe])[0]
    analysis = render_run(session.dir)
    checks = check_results(record, session.plan.shape["vocab"], session.plan.source == "architecture-twin")
    return analysis, checks


def render_run(run_dir) -> RunAnalysis:
    """Analyse a run directory (finished or interrupted) and write its reports next to the results."""
    from .report import write_reports
    analysis = analyze(run_dir)
    write_reports(analysis, Path(run_dir))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        from .report.markdown import render_markdown
        try:
            with open(summary, "a") as f:
                f.write(render_markdown(analysis) + "\n")
        except OSError as e:
            raise NandoctorError(f"cannot append to GITHUB_STEP_SUMMARY={summary!r}: {e.strerror}") from None
    return analysis
