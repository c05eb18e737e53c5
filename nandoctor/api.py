"""The Python API the CLI is a thin layer over: run a grid, resume one, run a check, re-render a run."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .analysis.verdicts import References, check_results
from .capabilities import cell_support
from .cells import Cell
from .config import Recipe, recipe_from_dict
from .doctor import doctor_section
from .env import collect_doctor
from .errors import NandoctorError
from .plan import PlannedProbe, plan_grid
from .record import ModelPlan, ProbeRecord
from .run.cache import ProbeCache
from .run.fingerprint import environment_key
from .run.session import Session
from .run.store import ResultsStore

if TYPE_CHECKING:  # the analysis imports pandas: open_session loads it while the workers import torch
    from .analysis.run import RunAnalysis


@dataclass
class Listener:
    """What a run tells its caller while it goes; every hook is optional.

    opened(run_dir): at once, when the run directory is chosen (before the device facts and the model plan);
    started(run_dir, plan, warnings): once the model is planned, before any probe runs;
    probe(done, planned, record, verdict): each record as it is kept, judged against the references so far;
    alive(probe_id, elapsed_s, step): every HEARTBEAT_S while a probe runs (step: its last step as a dict, or None);
    retiming(cells, rounds, steps): a grid is about to re-time its leading cells (retime.py).
    """
    opened: Callable | None = None
    started: Callable | None = None
    probe: Callable | None = None
    alive: Callable | None = None
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
    """A prepared Session whose records and heartbeats go to the listener, which hears about the run
    directory at once and about the model plan once it is made."""
    listener = listener or Listener()
    judge = Progress(listener.probe)
    session = Session(kind, recipe, on_record=judge, on_alive=listener.alive, **session_args)
    try:
        if listener.opened:
            listener.opened(session.dir)
        session.prepare()
        if listener.started:
            listener.started(session.dir, session.plan, session.warnings)
        from . import report  # noqa: F401 -- the analysis and renderers (pandas), while the first worker still imports
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
             cache: ProbeCache | None = None) -> RunAnalysis:
    """Probe every cell of the grid; returns the analysis of the finished run (reports written)."""
    session, judge = open_session("grid", recipe, listener, out=out, jobs=jobs, steps=steps,
                                  device=device, warm=warm, cache=cache)
    with session:
        probes = plan_grid(recipe, session.device, axes)
        runnable = [p.cell for p in probes if not p.unsupported]
        doctor = doctor_section(session.device, recipe, runnable, setup={"recipe": recipe.name, "cells": [c.id for c in runnable]})
        session.start(len(probes), {"axes": axes or {}, "doctor": doctor})
        judge.planned = len(probes)
        session.run(recipe, probes)
        from .retime import retime_leaders  # the analysis (pandas): by now loaded in open_session
        retime_leaders(session, recipe, (listener or Listener()).retiming)
    return render_run(session.dir)


def resume_grid(run_dir, jobs: int | None = None, listener: Listener | None = None, warm: bool = True,
                cache: ProbeCache | None = None, device: dict | None = None) -> RunAnalysis:
    """Finish an interrupted grid: the recipe, axes, steps and model plan come from DIR/run.json;
    only the cells missing from DIR/results.jsonl are probed."""
    device = device or collect_doctor()
    meta, recipe, plan = resumable(run_dir, "grid", device)
    session, judge = open_session("grid", recipe, listener, out=run_dir, jobs=jobs or meta["jobs"], steps=meta["steps"],
                                  device=device, warm=warm, cache=cache, plan=plan, resume=True)
    with session:
        probes = plan_grid(recipe, device, meta.get("axes") or None)
        judge.planned = len(probes)
        for record in session.resume(len(probes)):
            judge(record, quiet=True)
        session.run(recipe, probes)
        from .retime import retime_leaders  # the analysis (pandas): by now loaded in open_session
        retime_leaders(session, recipe, (listener or Listener()).retiming)
    return render_run(run_dir)


def run_check(recipe: Recipe, cell: Cell, steps: int = 1, out=None, device: dict | None = None, warm: bool = True,
              listener: Listener | None = None):
    """One cell for a few steps in a subprocess; returns (analysis, [(check, passed, detail)]). Quick:
    one warm worker, importing while this process plans, and the forensics replay only after a
    non-finite step."""
    session, _ = open_session("check", recipe, listener, out=out, jobs=1, steps=steps, device=device, warm=warm,
                              replay_failed_only=True)
    with session:
        probe = PlannedProbe(cell.id, cell, cell_support(cell, session.device))
        doctor = doctor_section(session.device, recipe, [] if probe.unsupported else [cell], setup={"recipe": recipe.name, "cells": [cell.id]})
        session.start(1, {"cell": cell.id, "doctor": doctor})
        record = session.run(recipe, [probe])[0]
    analysis = render_run(session.dir)
    checks = check_results(record, session.plan.shape["vocab"], session.plan.source == "architecture-twin")
    return analysis, checks


def render_run(run_dir) -> RunAnalysis:
    """Analyse a run directory (finished or interrupted) and write its reports next to the results."""
    from .analysis.run import analyze
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
