"""`nandoctor bisect` as an API: parse the good and bad configurations, run the bisection engine with
real probes (each in its own process through a Session), write bisect.json next to results.jsonl and
render the reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..analysis.outcomes import RunAnalysis
from ..analysis.ranking import tokens_per_s
from ..analysis.verdicts import FAIL_ON, NO_TARGET, STABLE, UNRESOLVED_VERDICTS, VERDICTS, References, is_reference
from ..api import open_session, render_run, resumable
from ..capabilities import cell_support
from ..cells import AXES, Cell, reference_of
from ..config import Recipe, get_field
from ..env import collect_summary
from ..errors import NandoctorError
from ..plan import PlannedProbe
from ..recommend import recommendation
from ..record import ProbeRecord
from ..run.options import RunOptions, run_options
from ..run.rundir import kept_device
from ..run.session import Session
from ..run.store import BISECT_FILE
from .engine import Bisection, BisectResult, Run, Trial
from .factors import WORKLOAD, fmt_value, parse_configurations, precision_ladder, variant

# What to do when the target or the baseline could not be tested, by the verdict its probes ended with.
UNRESOLVED_ADVICE = {v.name: v.advice for v in VERDICTS if v.unresolved}


STAND_IN_ATTN = "sdpa"  # the attention of the fp32 probe run when fp32/eager did not train stably


def data_factors(good: dict, bad: dict) -> bool:
    """Whether the good and bad configurations differ in how the data is read (a data.* field such as
    data.max_length): a batch with no target is then the configuration's doing, which bisect can name."""
    return any(k.startswith("data.") and good.get(k) != bad.get(k) for k in {*good, *bad})


def resolved(verdict: str, fail_on: tuple[str, ...]) -> bool:
    """A probe that could not say (unsupported, timed out, out of memory, killed) is unresolved: ddmin
    neither passes nor fails it, as git bisect skips an untestable revision, unless the user hunts
    that very failure (--fail-on)."""
    return verdict not in UNRESOLVED_VERDICTS or verdict in fail_on


class ProbeOracle:
    """The bisection's oracle: runs each trial as a real probe process, and before trusting a stable
    verdict runs the fp32/eager reference of the same recipe variant and seed, since drift is
    measured against it; when that one does not train stably (out of memory, timed out), fp32 with
    STAND_IN_ATTN attention stands in for it (References), and with neither the reports say that drift
    was not judged. Records are cached by probe id, which names the full configuration."""

    def __init__(self, session: Session, recipe: Recipe, fail_on: tuple[str, ...] = (), data: bool = False):
        """data: the configurations differ in a data.* field (data_factors), so a batch with no target is
        a failure of the configuration, not of the data whatever the configuration."""
        self.session, self.recipe = session, recipe
        self.fail_on = (*fail_on, NO_TARGET) if data else fail_on
        self.records: dict[str, ProbeRecord] = {}
        self.references = References()

    def planned(self, trial: Trial) -> PlannedProbe:
        cell = Cell.of(trial.config)
        own = variant(self.recipe, trial.config)
        overrides = {k: v for k, v in trial.config.items() if k not in AXES and v != get_field(self.recipe, k)}
        probe_id = cell.id + "".join(f" {k}={fmt_value(v)}" for k, v in overrides.items())
        probe_id += (f" seed+{trial.seed}" if trial.seed else "") + (f" rerun{trial.attempt}" if trial.attempt else "")
        return PlannedProbe(
            probe_id,
            cell,
            cell_support(cell, self.session.device),
            {k: fmt_value(v) for k, v in overrides.items()},
            trial.seed,
            own,
        )

    def _run(self, probes: list[PlannedProbe]) -> None:
        todo = [p for p in probes if p.probe_id not in self.records]
        for record in self.session.run(self.recipe, todo) if todo else []:
            self.records[record.probe_id] = record
            self.references.learn(record)

    def __call__(self, trials: list[Trial]) -> list[Run]:
        probes = [self.planned(t) for t in trials]
        self._run(probes)
        needed = {}
        for t, p in zip(trials, probes):
            r = self.records[p.probe_id]
            if not is_reference(r) and not self.references.knows(r) and self.references.judge(r).name == STABLE:
                base = reference_of(Cell.of(t.config))  # fp32/eager over the trial's own base
                ref = Trial({**t.config, **{axis: getattr(base, axis) for axis in AXES}}, t.seed, 0)
                needed[self.planned(ref).probe_id] = self.planned(ref)
        self._run(list(needed.values()))
        stand_ins = {}
        for t, p in zip(trials, probes):
            r = self.records[p.probe_id]
            if not self.references.is_own(r) and self.references.reference(r).probe_id is None:
                if self.references.judge(r).name == STABLE:
                    base = reference_of(Cell.of(t.config))  # fp32 over the trial's own base, another attention
                    ref = Trial({**t.config, **{a: getattr(base, a) for a in AXES}, "attn": STAND_IN_ATTN}, t.seed, 0)
                    stand_ins[self.planned(ref).probe_id] = self.planned(ref)
        self._run(list(stand_ins.values()))
        return [self._outcome(self.records[p.probe_id]) for p in probes]

    def _outcome(self, record: ProbeRecord) -> Run:
        v = self.references.judge(record)
        return Run(record.probe_id, v.name, v.failed, resolved(v.name, self.fail_on), tokens_per_s(record.steps))


@dataclass(frozen=True)
class BisectRequest:
    """What the user asked a bisection: the good and bad configurations (None: the defaults
    factors.parse_configurations gives), more target settings to consider (factors), identical reruns and
    other data seeds of every decisive probe, the unresolved verdicts to count as failures (fail_on: timeout,
    oom, killed, for hunting a hang or a leak); model_flags: the flags that named the model and recipe, for
    the recommended command line."""

    good: str | None = None
    bad: str | None = None
    factors: tuple[str, ...] = ()
    reruns: int = 1
    data_seeds: int = 0
    fail_on: tuple[str, ...] = ()
    model_flags: tuple[str, ...] = ()


def run_bisect(
    recipe: Recipe, request: BisectRequest, options: RunOptions | None = None, **settings
) -> tuple[RunAnalysis, BisectResult]:
    """Bisect between a good and a bad configuration with real probes; returns the analysis of the
    run directory (reports written) and the bisection result (also saved as bisect.json).
    options (a RunOptions), or its fields by name as keywords (steps=, jobs=, out=, listener=, device=,
    executor=): how the run goes; the listener's step hook hears each step of the search."""
    options = run_options(options, **settings)
    reruns, data_seeds, fail_on = request.reruns, request.data_seeds, request.fail_on
    if reruns < 0 or data_seeds < 0:
        raise NandoctorError(f"--reruns and --data-seeds must be >= 0, got {reruns} and {data_seeds}")
    unknown = [v for v in fail_on if v not in FAIL_ON]
    if unknown:
        raise NandoctorError(f"--fail-on: unknown verdict {unknown[0]!r}; valid: {', '.join(FAIL_ON)}")
    asked = {"good": request.good, "bad": request.bad, "factors": list(request.factors)}  # resume parses it again
    # placed by an executor, the configurations are judged by the facts of the hardware the probes run
    # on, which its start-up job gathers there; locally before any model work
    placed = options.executor is not None and options.executor.remote
    if not placed:
        options = dataclasses.replace(options, device=options.device or collect_summary())
        good_cfg, bad_cfg = parse_configurations(recipe, options.device, **asked)
    session, _ = open_session("bisect", recipe, options)
    with session:
        if placed:
            good_cfg, bad_cfg = parse_configurations(recipe, session.device, **asked)
        session.start(
            0,
            {
                "good": good_cfg,
                "bad": bad_cfg,
                "reruns": reruns,
                "data_seeds": data_seeds,
                "fail_on": list(fail_on),
                "request": asked,
                "model_flags": list(request.model_flags),
                "data": session.data_lint,
            },
        )
        oracle = ProbeOracle(session, recipe, tuple(fail_on), data_factors(good_cfg, bad_cfg))
        result = Bisection(
            good_cfg,
            bad_cfg,
            oracle,
            reruns,
            data_seeds,
            session.jobs,
            options.hooks().step,
            precision_ladder(good_cfg, bad_cfg, session.device),
            WORKLOAD,
        ).run()
    return _finish(session, recipe, oracle, result, list(request.model_flags))


def resume_bisect(run_dir, options: RunOptions | None = None, **settings) -> tuple[RunAnalysis, BisectResult]:
    """Continue an interrupted bisect with the settings of DIR/run.json, sized for this host (options.jobs,
    else this host's default). The probes DIR/results.jsonl holds are replayed, not rerun: the search
    retraces its path from them and goes on where it stopped. options, or its fields by name as keywords:
    jobs, listener, device, executor."""
    options = run_options(options, **settings)
    device = options.device or kept_device(run_dir, options.executor) or collect_summary()
    meta, recipe, plan = resumable(run_dir, "bisect", device)
    if meta.request is None:
        raise NandoctorError(
            f"{run_dir} was written by a nandoctor that did not record its --good / --bad; start a new bisect"
        )
    good_cfg, bad_cfg = parse_configurations(recipe, device, **meta.request)
    own = dataclasses.replace(options, out=run_dir, steps=meta.steps, device=device)
    session, judge = open_session("bisect", recipe, own, plan=plan, resume=True)
    with session:
        for record in session.resume(0):
            judge(record, quiet=True)
        oracle = ProbeOracle(session, recipe, tuple(meta.fail_on), data_factors(good_cfg, bad_cfg))
        result = Bisection(
            good_cfg,
            bad_cfg,
            oracle,
            meta.reruns,
            meta.data_seeds,
            session.jobs,
            options.hooks().step,
            precision_ladder(good_cfg, bad_cfg, session.device),
            WORKLOAD,
        ).run()
    return _finish(session, recipe, oracle, result, meta.model_flags)


def _finish(
    session: Session, recipe: Recipe, oracle: ProbeOracle, result: BisectResult, model_flags: list[str]
) -> tuple[RunAnalysis, BisectResult]:
    """Save bisect.json next to the results and render the reports."""
    result.probes = len(oracle.records)  # processes actually run, references for drift included
    stuck = next(
        (step for step in result.path if step.outcome == "unresolved" and step.phase.startswith("confirm")), None
    )
    if result.status.startswith("unresolved") and stuck is not None:
        advice = [UNRESOLVED_ADVICE[v] for v in dict.fromkeys(stuck.verdicts) if v in UNRESOLVED_ADVICE]
        result.message += "; to test it: " + "; ".join(advice)
    data = result.to_dict()
    if result.recommended is not None:
        lint = session.store.meta().get("data")  # run.json's data lint (a resumed session has not run it again)
        device = next((r.device for r in oracle.records.values()), None)  # where the bisection's probes ran
        data["recommendation"] = recommendation(
            result.recommended, variant(recipe, result.recommended), recipe, model_flags, lint, device=device
        )
    session.store.write_json(BISECT_FILE, data)
    return render_run(session.dir), result
