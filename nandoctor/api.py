"""The Python API the CLI is a thin layer over: run a grid, run a check, re-render a run."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from .analysis import RunAnalysis, analyze, is_reference, reference_key
from .config import REFERENCE_CELL, Cell, NandoctorError, Recipe, recipe_to_dict
from .doctor import doctor_section
from .env import collect_doctor, collect_summary
from .models import ModelPlan, plan_model
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
                     extra={"reference": probe.reference, "overrides": probe.overrides})


def unsupported_record(recipe: Recipe, probe: PlannedProbe, plan: ModelPlan) -> dict:
    return {"probe_id": probe.probe_id, "cell": dataclasses.asdict(probe.cell), "status": "unsupported",
            "reason": probe.unsupported, "steps": [], "seed": recipe.seed + probe.seed_offset,
            "overrides": probe.overrides, "recipe": recipe_to_dict(recipe), "model": dataclasses.asdict(plan)}


class Session:
    """One run directory being filled: its store, its device facts, the model plan, the runner."""

    def __init__(self, kind: str, recipe: Recipe, out=None, jobs: int | None = None, steps: int | None = None,
                 device: dict | None = None, progress=None):
        self.kind, self.recipe = kind, recipe
        self.device = device or collect_summary()
        self.plan = plan_model(recipe, self.device)
        self.steps = steps or recipe.steps
        gpus = len(self.device.get("gpus") or [])
        self.jobs = jobs or max(1, gpus)
        self.dir = new_run_dir(out, kind, recipe)
        self.store = ResultsStore(self.dir)
        self.runner = ProbeRunner(self.dir, self.store, self.jobs, gpus)
        self.progress = progress
        self.done = 0
        self.planned = 0
        self.references: dict[str, list] = {}

    def start(self, planned: int, extra: dict | None = None) -> None:
        self.planned = planned
        self.store.create({"kind": self.kind, "run_id": self.dir.name, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                           "recipe": recipe_to_dict(self.recipe), "model_plan": dataclasses.asdict(self.plan),
                           "steps": self.steps, "seed": self.recipe.seed, "jobs": self.jobs,
                           "env": self.device, "planned": planned, **(extra or {})})

    def run(self, recipe: Recipe, probes: list[PlannedProbe]) -> list[dict]:
        """Record the unsupported probes, run the others, return every record in plan order."""
        records = {}
        for p in probes:
            if p.unsupported:
                records[p.probe_id] = unsupported_record(recipe, p, self.plan)
                self.store.append(records[p.probe_id])
                self._report(records[p.probe_id])
        tasks = [probe_task(recipe, p, self.plan, self.device, self.steps, self.jobs) for p in probes if not p.unsupported]
        for r in self.runner.run(tasks, on_record=self._report):
            records[r["probe_id"]] = r
        return [records[p.probe_id] for p in probes]

    def _report(self, record: dict) -> None:
        self.done += 1
        if is_reference(record) and record["status"] == "ok":
            self.references[reference_key(record)] = record["steps"]
        verdict = classify(record, None if is_reference(record) else self.references.get(reference_key(record)))
        if self.progress:
            self.progress(self.done, self.planned, record, verdict)


def run_grid(recipe: Recipe, axes: dict | None = None, steps: int | None = None, jobs: int | None = None,
             out=None, progress=None, device: dict | None = None) -> RunAnalysis:
    """Probe every cell of the grid; returns the analysis of the finished run (reports written)."""
    session = Session("grid", recipe, out, jobs, steps, device or collect_doctor(), progress)
    probes = plan_grid(recipe, session.device, axes)
    runnable = [p.cell for p in probes if not p.unsupported]
    doctor = doctor_section(session.device, recipe, runnable, setup={"recipe": recipe.name, "cells": [c.id for c in runnable]})
    session.start(len(probes), {"axes": axes or {}, "doctor": doctor})
    session.run(recipe, probes)
    return render_run(session.dir)


def run_check(recipe: Recipe, cell: Cell, steps: int = 1, out=None, device: dict | None = None):
    """One cell for a few steps in a subprocess; returns (analysis, [(check, passed, detail)])."""
    from .capabilities import cell_support
    from .verdicts import check_results
    session = Session("check", recipe, out, 1, steps, device or collect_doctor())
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
