"""The Python API the CLI is a thin layer over: run a grid, resume one, run a check, re-render a run,
compare a run with a baseline."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .analysis.verdicts import FAIL_ON as FAIL_ON
from .analysis.verdicts import UNSUPPORTED as UNSUPPORTED
from .analysis.verdicts import References, check_results, roundtrip_check, without_reference
from .capabilities import cell_support
from .cells import Cell
from .config import Recipe, recipe_from_dict
from .device import DeviceFacts
from .doctor import doctor_section, judge_lint, lint_lines
from .env import collect_doctor
from .errors import NandoctorError
from .executors import ExecutorConfig, with_hardware
from .plan import PlannedProbe, engine_without_gpu, plan_grid, quantized_without_adapter
from .record import ModelPlan, ProbeRecord
from .run.cache import ProbeCache as ProbeCache
from .run.cache import default_cache_dir as default_cache_dir
from .run.fingerprint import environment_key
from .run.options import Listener as Listener
from .run.options import RunOptions, run_options
from .run.rundir import kept_device
from .run.session import Session
from .run.store import ROUNDTRIP_FILE, RUN_FILE, ResultsStore
from .runmeta import RunMeta
from .userdata.rows import readable_rows

if TYPE_CHECKING:  # the analysis imports pandas: open_session loads it while the workers import torch
    from .analysis.diff import RunDiff
    from .analysis.outcomes import ProbeOutcome, RunAnalysis


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


def open_session(
    kind: str, recipe: Recipe, options: RunOptions, plan: ModelPlan | None = None, resume: bool = False
) -> tuple[Session, Progress]:
    """A prepared Session whose records and heartbeats go to the options' listener, which hears about the
    run directory at once and about the model plan once it is made."""
    listener = options.hooks()
    judge = Progress(listener.probe)
    if recipe.data.source == "file" and not resume:
        # unreadable rows are the user's error, said at once: before the session starts its first worker
        readable_rows(recipe)
    session = Session(kind, recipe, options, on_record=judge, plan=plan, resume=resume)
    try:
        if listener.opened:
            listener.opened(session.dir)
        from . import report  # noqa: F401 -- the analysis and renderers (pandas), while the first worker still imports

        session.prepare()
        engine_without_gpu(recipe, session.device)  # every door: grid, check and bisect
        # the user's rows are linted before any probe (stored in run.json's "data"); a run goes on either
        # way, and its probes show the consequences
        session.data_lint = None if resume else judge_lint(session.lint())
        session.warnings += lint_lines(session.data_lint)
        if listener.started:
            listener.started(session.dir, session.plan, session.warnings)
    except BaseException:
        session.close()
        raise
    return session, judge


def resumable(run_dir, kind: str, device: DeviceFacts | dict) -> tuple[RunMeta, Recipe, ModelPlan]:
    """What continuing DIR takes from its run.json: the run's meta, recipe and model plan. Refuses a
    run of another kind, and one made in another environment (its probes would not be comparable)."""
    meta = RunMeta.from_dict(ResultsStore(run_dir).meta())
    if meta.kind != kind:
        raise NandoctorError(
            f"{run_dir} is a {meta.kind!r} run; `nandoctor {kind} --resume` continues {kind} runs only"
        )
    then, now = environment_key(meta.env or {}), environment_key(device)
    changed = [f"{k} {then[k]} -> {now[k]}" for k in then if then[k] != now.get(k)]
    if changed:
        raise NandoctorError(
            f"{run_dir} was run in another environment ({'; '.join(changed)}); start a new run instead"
        )
    recipe = recipe_from_dict({k: v for k, v in meta.recipe.items() if k != "name"}, meta.recipe["name"])
    return meta, recipe, ModelPlan.from_dict(meta.model_plan)


def run_dir_of(path) -> Path:
    """A run directory, given as itself or as one of its files (summary.json)."""
    path = Path(path)
    return path.parent if path.is_file() or path.suffix == ".json" else path


def baseline_analysis(path) -> RunAnalysis:
    """The analysis of a --baseline run; a path that is not a readable run is the user's error, said before
    any probe runs."""
    from .analysis.outcomes import analyze

    run_dir = run_dir_of(path)
    analysis = analyze(run_dir)
    if not analysis.outcomes:
        raise NandoctorError(
            f"baseline {str(path)!r} has no probe results; pass a finished run directory (or its summary.json)"
        )
    return analysis


def explain_run(run_dir, probe_id: str | None = None) -> tuple[RunAnalysis, list[ProbeOutcome]]:
    """What `nandoctor explain` shows: the run's analysis and the outcome of `probe_id` (a probe id such as
    'fp16-amp/sdpa/off'), or of every probe that ran when it is None. An unknown id is the user's error."""
    from .analysis.outcomes import analyze

    analysis = analyze(run_dir)
    ran = [o for o in analysis.outcomes if o.verdict.name != UNSUPPORTED]
    if probe_id is None:
        return analysis, ran
    chosen = [o for o in analysis.outcomes if o.probe_id == probe_id]
    if not chosen:
        known = ", ".join(o.probe_id for o in analysis.outcomes) or "none"
        raise NandoctorError(f"no probe {probe_id!r} in {run_dir}; its probes: {known}")
    return analysis, chosen


def diff_runs(baseline, current, out=None) -> RunDiff:
    """Compare run `current` with run `baseline` (directories or their summary.json); with `out`, write
    diff.md, diff.html and diff.json there. The Markdown goes to $GITHUB_STEP_SUMMARY when it is set."""
    from .analysis.diff import compare_runs
    from .analysis.outcomes import analyze
    from .report import write_diff
    from .report.diff import render_diff_markdown

    d = compare_runs(baseline_analysis(baseline), analyze(run_dir_of(current)))
    if out is not None:
        try:
            failed = write_diff(d, Path(out))
        except OSError as e:
            raise NandoctorError(f"cannot write the diff to {str(out)!r}: {e.strerror}") from None
        if failed:
            raise NandoctorError("; ".join(f"{name} not written: {why}" for name, why, _ in failed))
    step_summary(render_diff_markdown(d))
    return d


def run_grid(recipe: Recipe, axes: dict | None = None, options: RunOptions | None = None, **settings) -> RunAnalysis:
    """Probe every cell of the grid; returns the analysis of the finished run (reports written).
    options (a RunOptions), or its fields by name as keywords (steps=, jobs=, out=, listener=, device=,
    warm=, cache=, executor=): how the run goes; its baseline: a run directory to compare with
    (analysis.comparison, diff.* reports, exit code); its executor: where the probes run (this machine's
    slots by default, or a SLURM / Ray cluster); roundtrip: the recommended cell is trained once more and
    merged, saved and reloaded (roundtrip.json)."""
    options = run_options(options, **settings)
    if options.baseline is not None:
        baseline_analysis(options.baseline)
    executor = with_hardware(options.executor or ExecutorConfig(), {**recipe.axes, **(axes or {})})
    # the grid's own probes are not round-tripped: its recommended cell is, afterwards
    session, judge = open_session("grid", recipe, dataclasses.replace(options, executor=executor, roundtrip=False))
    with session:
        probes = plan_grid(recipe, session.device, axes, session.devices)
        runnable = [p.cell for p in probes if not p.unsupported]
        doctor = doctor_section(
            session.device,
            recipe,
            runnable,
            setup={"recipe": recipe.name, "cells": [c.id for c in runnable]},
            known=session.model_facts,
            lint=session.data_lint,
        )
        session.start(
            len(probes),
            {"axes": axes or {}, "doctor": doctor, "baseline": _path(options.baseline), "data": session.data_lint},
        )
        judge.planned = len(probes)
        session.run(recipe, probes)
        from .retime import retime_leaders  # the analysis (pandas): by now loaded in open_session

        retime_leaders(session, recipe, options.hooks().retiming)
        if options.roundtrip:
            roundtrip_recommended(session, recipe)
    return render_run(session.dir, options.baseline)


def roundtrip_recommended(session: Session, recipe: Recipe) -> None:
    """The grid's recommended cell trained again with the grid's steps, then merged, saved and reloaded
    (child/roundtrip.py), its figures in roundtrip.json; the analysis judges them. No forensics replay: the
    round trip runs on the model the timed steps left. Nothing when no cell is recommended."""
    from .analysis.outcomes import analyze

    best = analyze(session.dir).recommended
    if best is None:
        return
    cell = best.record.cell
    options, session.options = session.options, dataclasses.replace(session.options, roundtrip=True)
    own = dataclasses.replace(recipe, forensics_steps=0)
    try:
        record = session.time_only(own, [PlannedProbe(f"{cell.id} roundtrip", cell)], session.steps)[0]
    finally:
        session.options = options
    figures = {"probe_id": cell.id, "status": record.status, "first_nonfinite": record.first_nonfinite}
    session.store.write_json(ROUNDTRIP_FILE, {**figures, "roundtrip": record.roundtrip})


def _path(baseline) -> str | None:
    return str(run_dir_of(baseline).resolve()) if baseline is not None else None


def resume_grid(run_dir, options: RunOptions | None = None, **settings) -> RunAnalysis:
    """Finish an interrupted grid: the recipe, axes, steps and model plan come from DIR/run.json;
    only the cells missing from DIR/results.jsonl are probed, on any executor, sized for this host
    (options.jobs, else this host's default: not the interrupted run's, which may have been a cluster's).
    options, or its fields by name as keywords: jobs, listener, warm, cache, device, executor."""
    options = run_options(options, **settings)
    device = options.device or kept_device(run_dir, options.executor) or collect_doctor()
    meta, recipe, plan = resumable(run_dir, "grid", device)
    if meta.baseline:
        baseline_analysis(meta.baseline)
    executor = with_hardware(options.executor or ExecutorConfig(), {**recipe.axes, **(meta.axes or {})})
    own = dataclasses.replace(options, out=run_dir, steps=meta.steps, device=device, executor=executor)
    session, judge = open_session("grid", recipe, own, plan=plan, resume=True)
    with session:
        probes = plan_grid(recipe, session.device, meta.axes or None, session.devices)
        judge.planned = len(probes)
        for record in session.resume(len(probes)):
            judge(record, quiet=True)
        session.run(recipe, probes)
        from .retime import retime_leaders  # the analysis (pandas): by now loaded in open_session

        retime_leaders(session, recipe, options.hooks().retiming)
    return render_run(run_dir, meta.baseline)


def run_check(recipe: Recipe, cell: Cell, options: RunOptions | None = None, **settings):
    """One cell for a few steps in a subprocess; returns (analysis, [(check, passed, detail)]). Quick:
    one warm worker, importing while this process plans, and the forensics replay only after a
    non-finite step. options (a RunOptions), or its fields by name as keywords (steps=, out=, device=,
    warm=, listener=, baseline=, roundtrip=); steps default to 1. baseline: a run directory with a probe of
    the same cell; its step-0 loss and grad-norm are the golden values this probe's must match, within the
    tolerance of the cell's matmul dtype. roundtrip: after its steps the probe merges, saves and reloads
    what it trained (child/roundtrip.py); the live, merged and reloaded model must agree
    (verdicts.roundtrip_check)."""
    options = run_options(options, **settings)
    baseline = options.baseline
    quantized_without_adapter(recipe, [cell])
    ids = [o.probe_id for o in baseline_analysis(baseline).outcomes] if baseline is not None else [cell.id]
    if cell.id not in ids:
        raise NandoctorError(f"baseline {str(baseline)!r} has no probe of {cell.id}; it has {', '.join(ids)}")
    own = dataclasses.replace(options, jobs=1, steps=options.steps or 1, replay_failed_only=True)
    session, _ = open_session("check", recipe, own)
    with session:
        probe = PlannedProbe(cell.id, cell, cell_support(cell, session.device))
        doctor = doctor_section(
            session.device,
            recipe,
            [] if probe.unsupported else [cell],
            setup={"recipe": recipe.name, "cells": [cell.id]},
            known=session.model_facts,
            lint=session.data_lint,
        )
        session.start(1, {"cell": cell.id, "doctor": doctor, "baseline": _path(baseline), "data": session.data_lint})
        record = session.run(recipe, [probe])[0]
    analysis = render_run(session.dir, baseline)
    # judged as a grid judges it: the probe's verdict fails the check wherever it is a failure
    outcome = next(o for o in analysis.outcomes if o.record.probe_id == record.probe_id)
    verdict = outcome.verdict if outcome.reference else without_reference(outcome.verdict, cell)
    checks = check_results(
        record, session.plan.shape["vocab"], session.plan.source == "architecture-twin", verdict=verdict
    )
    if options.roundtrip:
        checks.append(roundtrip_check(record))
    if analysis.comparison:
        checks += golden_checks(analysis.comparison, cell.id)
    return analysis, checks


def golden_checks(d: RunDiff, probe_id: str) -> list[tuple[str, bool, str]]:
    """A check's step-0 values against its baseline's, as (check, passed, detail)."""
    change = next(c for c in d.cells if c.probe_id == probe_id)
    return [
        (
            f"{g.name} matches the baseline",
            g.passed,
            f"{g.after!r} vs {g.before!r}: relative change {g.change:.3g}, "
            f"tolerance ±{g.tolerance:.3g} for {probe_id.split('/')[0]}",
        )
        for g in change.golden
    ]


def render_run(run_dir, baseline=None) -> RunAnalysis:
    """Analyse a run directory (finished or interrupted) and write its reports next to the results;
    with a baseline run directory, the comparison with it too (diff.md, diff.html, diff.json). A run
    made with --baseline is compared again with that run while its directory still exists. A report
    that could not be written is named in analysis.unwritten (one line each); the others are written
    all the same."""
    from .analysis.diff import compare_runs
    from .analysis.outcomes import analyze
    from .report import write_reports

    analysis = analyze(run_dir)
    stored = analysis.meta.baseline
    if baseline is None and stored and (Path(stored) / RUN_FILE).exists():
        baseline = stored
    if baseline is not None:
        analysis.comparison = compare_runs(baseline_analysis(baseline), analysis)
    analysis.unwritten = [
        (f"{name} not written: {why}", output) for name, why, output in write_reports(analysis, Path(run_dir))
    ]
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        from .report.markdown import render_markdown

        try:
            text = render_markdown(analysis)
            if analysis.comparison:
                from .report.diff import render_diff_markdown

                text = render_diff_markdown(analysis.comparison) + "\n" + text
        except Exception:  # already named in analysis.unwritten: report.md could not be rendered either
            return analysis
        step_summary(text)
    return analysis


def step_summary(markdown: str) -> None:
    """Append to the GitHub Actions job summary ($GITHUB_STEP_SUMMARY), when there is one."""
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if not summary:
        return
    try:
        with open(summary, "a") as f:
            f.write(markdown + "\n")
    except OSError as e:
        raise NandoctorError(f"cannot append to GITHUB_STEP_SUMMARY={summary!r}: {e.strerror}") from None
