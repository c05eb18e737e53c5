"""The Python API the CLI is a thin layer over: run a grid, resume one, run a check, re-render a run."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .analysis.run import RunAnalysis, analyze
from .analysis.verdicts import References, check_results
from .capabilities import cell_support
from .cells import Cell
from .config import ExecutorConfig, Recipe, recipe_from_dict
from .doctor import doctor_section
from .env import collect_doctor
from .errors import NandoctorError
from .plan import PlannedProbe, plan_grid
from .record import ModelPlan, ProbeRecord
from .retime import retime_leaders
from .run.cache import ProbeCache
from .run.fingerprint import environment_key
from .run.session import Session
from .run.store import ResultsStore


@dataclass
class Listener:
    """What a run tells its caller while it goes; every hook is optional.

    started(run_dir, plan, warnings): once the model is planned, before any probe runs;
    probe(done, planned, record, verdict): each record as it is kept, judged against the references so far;
    alive(probe_id, elapsed_s, step): every HEARTBEAT_S while a probe runs (step: its last step as a dict, or None);
    queue(queued, running, done, job_ids): a scheduler's queue as it changes (--executor slurm / ray);
    retiming(cells, rounds, steps): a grid is about to re-time its leading cells (retime.py).
    """
    started: Callable | None = None
    probe: Callable | None = None
    alive: Callable | None = None
    queue: Callable | None = None
    retiming: Callable | None = None


class Progress:
    """Judges each record as it is kept, against the references seen so far, and hands the verdict to
    the caller's progress(done, planned, record, verdict)."""

    def __init__(self, progress=None):
        self.progress = progress
        self.references = References()
        self.done = 0
        self.planned = 0

    def __call__(self, record: ProbeRecord, quiet: bool = False) -> None:
        self.done += 1
        self.references.learn(record)
        if self.progress and not quiet:
            self.progress(self.done, self.planned, record, self.references.judge(record))


def open_session(kind: str, recipe: Recipe, listener: Listener | None, **session_args) -> tuple[Session, Progress]:
    """A Session whose records and heartbeats go to the listener, which hears about the model plan."""
    listener = listener or Listener()
    judge = Progress(listener.probe)
    session = Session(kind, recipe, on_record=judge, on_alive=listener.alive, on_queue=listener.queue, **session_args)
    try:
        if listener.started:
            listener.started(session.dir, session.plan, session.warnings)
    except BaseException:
        session.runner.close()
        raise
    return session, judge


def resumable(run_dir, kind: str, device: dict) -> tuple[dict, Recipe, ModelPlan]:
    """What continuing DIR takes from its run.json: the run's meta, recipe and model plan. Refuses a
    run of another kind, and one made in another environment (its probes would not be comparable)."""
    meta = ResultsStore(run_dir).meta()
    if meta.get("kind") != kind:
        raise NandoctorError(f"{run_dir} is a {meta.get('kind')!r} run; `nandoctor {kind} --resume` continues {kind} runs only")
    then, now = environment_key(meta["env"]), environment_key(device)
    changed = [f"{k} {then[k]} -> {now[k]}" for k in then if then[k] != now.get(k)]
    if changed:
        raise NandoctorError(f"{run_dir} was run in another environment ({'; '.join(changed)}); start a new run instead")
    recipe = recipe_from_dict({k: v for k, v in meta["recipe"].items() if k != "name"}, meta["recipe"]["name"])
    return meta, recipe, ModelPlan.from_dict(meta["model_plan"])


def run_grid(recipe: Recipe, axes: dict | None = None, steps: int | None = None, jobs: int | None = None,
             out=None, listener: Listener | None = None, device: dict | None = None, warm: bool = True,
             cache: ProbeCache | None = None, executor: ExecutorConfig | None = None) -> RunAnalysis:
    """Probe every cell of the grid; returns the analysis of the finished run (reports written).
    executor: where the probes run (this machine's slots by default, or a SLURM / Ray cluster)."""
    session, judge = open_session("grid", recipe, listener, out=out, jobs=jobs, steps=steps,
                                  device=device or collect_doctor(), warm=warm, cache=cache, executor=executor)
    with session:
        probes = plan_grid(recipe, session.device, axes)
        runnable = [p.cell for p in probes if not p.unsupported]
        doctor = doctor_section(session.device, recipe, runnable, setup={"recipe": recipe.name, "cells": [c.id for c in runnable]})
        session.start(len(probes), {"axes": axes or {}, "doctor": doctor})
        judge.planned = len(probes)
        session.run(recipe, probes)
        retime_leaders(session, recipe, (listener or Listener()).retiming)
    return render_run(session.dir)


def resume_grid(run_dir, jobs: int | None = None, listener: Listener | None = None, warm: bool = True,
                cache: ProbeCache | None = None, device: dict | None = None,
                executor: ExecutorConfig | None = None) -> RunAnalysis:
    """Finish an interrupted grid: the recipe, axes, steps and model plan come from DIR/run.json;
    only the cells missing from DIR/results.jsonl are probed, on any executor."""
    device = device or collect_doctor()
    meta, recipe, plan = resumable(run_dir, "grid", device)
    session, judge = open_session("grid", recipe, listener, out=run_dir, jobs=jobs or meta["jobs"], steps=meta["steps"],
                                  device=device, warm=warm, cache=cache, plan=plan, resume=True, executor=executor)
    with session:
        probes = plan_grid(recipe, device, meta.get("axes") or None)
        judge.planned = len(probes)
        for record in session.resume(len(probes)):
            judge(record, quiet=True)
        session.run(recipe, probes)
        retime_leaders(session, recipe, (listener or Listener()).retiming)
    return render_run(run_dir)


def run_check(recipe: Recipe, cell: Cell, steps: int = 1, out=None, device: dict | None = None, warm: bool = True,
              listener: Listener | None = None):
    """One cell for a few steps in a subprocess; returns (analysis, [(check, passed, detail)])."""
    session, _ = open_session("check", recipe, listener, out=out, jobs=1, steps=steps, device=device or collect_doctor(), warm=warm)
    with session:
        probe = PlannedProbe(cell.id, cell, cell_support(cell, session.device))
        doctor = doctor_section(session.device, recipe, [] if probe.unsupported else [cell], setup={"recipe": recipe.name, "cells": [cell.id]})
        session.start(1, {"cell": cell.id, "doctor": doctor})
        record = session.run(recipe, [probe])[0]
    analysis = render_run(session.dir)
    checks = check_results(record, session.plan.shape["vocab"], session.plan.source == "architecture-twin")
    return analysis, checks


def render_run(run_dir) -> RunAnalysis:
    """Analyse a run directory (finished or interrupted) and write its reports next to the results.
    A report that could not be written is named in analysis.unwritten (one line each); the others
    are written all the same."""
    from .report import write_reports
    analysis = analyze(run_dir)
    analysis.unwritten = [(f"{name} not written: {why}", output) for name, why, output in write_reports(analysis, Path(run_dir))]
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        from .report.markdown import render_markdown
        try:
            text = render_markdown(analysis)
        except Exception:  # already named in analysis.unwritten: report.md could not be rendered either
            return analysis
        try:
            with open(summary, "a") as f:
                f.write(text + "\n")
        except OSError as e:
            raise NandoctorError(f"cannot append to GITHUB_STEP_SUMMARY={summary!r}: {e.strerror}") from None
    return analysis
