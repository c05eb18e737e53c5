"""The probes' rules judging a live run: the setup check before any step (can this device run the
cell; the knowledge rules that fire on the setup), the step-0 checks of `nandoctor check` on the first
judged step (with its activation and gradient headroom, from hooks on every module, and the probes'
step-0 setup checks measured on the live model: packing, accumulation; a mixture of experts' routing at
that step, from the probes' router hooks, child/moe.py), then the grid's verdict
(analysis/verdicts: misconfigured, nonfinite, zero-loss, spike, divergence) on the curve so far at every
judged step, and classify's verdict on the whole run at its end.

A failed check warns, or under strict=True raises `CheckFailed`; a run that does not learn is a
warning (once), unless strict, since it may still start learning.
"""

from __future__ import annotations

import math
import warnings

from ..analysis.forensics import headroom
from ..analysis.verdicts import (
    NO_LEARNING,
    Verdict,
    check_results,
    classify,
    numeric_verdict,
    setup_verdict,
    without_reference,
)
from ..capabilities import cell_support
from ..child.instruments import ModuleWatch, OptimizerWatch
from ..child.moe import RouterWatch, router_watch
from ..child.update_loss import step0_updates, update_figures
from ..device import DeviceFacts
from ..errors import NandoctorError
from ..knowledge import evaluate, finding
from ..knowledge.facts import env_facts, router_setup_facts, setup_facts
from ..models import router_facts
from ..record import ProbeRecord, Step
from ..thresholds import THRESHOLDS, Thresholds
from .live import LiveRun


class CheckFailed(NandoctorError):
    """A check failed under strict=True: the one exception a callback lets into the user's run."""


def check_line(name: str, passed: bool, detail: str) -> str:
    return f"  {'ok  ' if passed else 'FAIL'} {name}: {detail}"


def headroom_checks(
    forensics: dict, events: list[dict], scale: float | None = None, t: Thresholds = THRESHOLDS
) -> list[tuple[str, bool, str]]:
    """Activation and gradient headroom of step 0 in the compute dtype: its largest finite value over
    the largest |value| seen, at the tightest module; where a value overflowed, the first module that did.
    With a GradScaler (`scale`, the loss scale step 0 ran at) the hooks see loss-scaled gradients: their
    overflow is the scaler's calibration (it skips the step and halves the scale), not a failure; the
    check on skipped steps judges whether they would overflow even unscaled."""
    rows, dtype = headroom(forensics), forensics["compute_dtype"]
    out = []
    for kind, phase in (("activation", "forward"), ("gradient", "backward")):
        name = f"{kind} headroom in {dtype}"
        first = next((e for e in events if e["phase"] == phase), None)
        seen = [r for r in rows if r[f"{kind}_headroom"] is not None]
        scaled = scale is not None and phase == "backward"
        if first:
            where = f"overflowed first at {first['module']} ({first['tensor']} abs-max {first['stats']['absmax']:.4g})"
            out.append(
                (
                    name,
                    scaled,
                    f"{where} at loss scale {scale:g}: the GradScaler skips the step and halves its scale"
                    if scaled
                    else where,
                )
            )
        elif seen:
            r = min(seen, key=lambda r: r[f"{kind}_headroom"])
            out.append(
                (
                    name,
                    r[f"{kind}_headroom"] > t.headroom_min,
                    f"{r[f'{kind}_headroom']:.3g}x at {r['module']} (largest |{kind}| {r[f'{kind}_absmax']:.4g}"
                    f"{f', loss-scaled by {scale:g}' if scaled else ''})",
                )
            )
    return out


class Judge:
    """The probes' rules on one live run's steps. strict: a failed setup or step-0 check raises
    CheckFailed instead of warning, and a run that does not learn fails."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.run: LiveRun | None = None
        self.steps: list[Step] = []  # the judged steps
        self.step0: ModuleWatch | None = None  # hooks on every module until the first judged step
        self.warned: set[str] = set()  # the warnings given once per run (no-learning)
        self.setup_checks: dict | None = None  # the probes' step-0 setup checks, measured on the live model
        self.updates: OptimizerWatch | None = None  # step 0's update loss, until its optimizer step is measured
        self.forensics: dict | None = None  # the figures of step 0 a probe's forensics hold: its update loss
        self.routing: RouterWatch | None = None  # a mixture of experts' router hooks, until the first judged step
        self.moe: dict | None = None  # the routing of the first judged step, as a probe's record.moe holds it

    def setup(self, run: LiveRun, device: DeviceFacts, setup_checks: dict | None = None) -> list[dict]:
        """The setup check of `run` on `device` (env.collect_summary() facts), before any step; then hooks
        that measure step 0's headroom. setup_checks: the figures of the probes' step-0 setup checks on
        the live model (setup_lint.setup_check_figures), judged with every step as the grid judges a
        probe's. Returns the knowledge rules' findings on the setup."""
        self.run, self.setup_checks = run, setup_checks or None
        findings = [
            finding(r, [run.cell.id])
            for r in evaluate(
                {
                    **env_facts(device),
                    **setup_facts(run.recipe, run.cell, run.model.config, run.trainer_args),
                    # a mixture of experts: its load-balancing loss as the user's model config has it
                    **router_setup_facts(router_facts(run.model.config, run.recipe)),
                    "model_type": getattr(run.model.config, "model_type", None),
                },
                "setup",
            )
            if r.id not in run.moot_rules
        ]
        unsupported = cell_support(run.cell, device)
        checks = (
            check_results(
                ProbeRecord(run.cell.id, run.cell, "unsupported", reason=unsupported), run.vocab, run.random_init
            )
            if unsupported
            else []
        )
        checks += [
            (f"known issue {f['id']}", f["severity"] != "error", f"{f['title']}. Fix: {f['fix']}") for f in findings
        ]
        self._verdict_on(checks, "setup")
        self.step0 = ModuleWatch(run.model)
        # its first step's routing only: a collapse is judged on it (or said unjudged) as on a probe's
        self.routing = router_watch(run.model, 0)
        self.updates = step0_updates(run.model, run.optimizer)
        return findings

    @property
    def at_step0(self) -> bool:
        """No step judged yet: the next judged step is the step-0 check."""
        return self.step0 is not None

    def step(
        self, step: int, loss: float, grad_norm: float, scale: float | None, supervised: int | None = None
    ) -> Verdict:
        """Judge one step (its loss, pre-clip grad-norm and GradScaler scale, None without one; the fewest
        supervised tokens of its micro-batches, None where unknown: 0 makes a 0/0 loss the data's
        no-target, as a probe's) with the curve so far; returns its Verdict."""
        # a GradScaler skips exactly the steps whose gradients hold inf/nan: calibration, judged by unrecoverable_at
        skipped = scale is not None and not math.isfinite(grad_norm)
        record = Step(step, loss, grad_norm, skipped=skipped, scale=scale, supervised=supervised)
        self.steps.append(record)
        if self.step0 is not None:
            self._check_step0(record)
        # the grid's rules on the new step (classify's, but the GradScaler that skipped every step so
        # far: a live run's first skips are the scaler calibrating)
        verdict = setup_verdict(self.record()) or numeric_verdict(
            self.steps, None, THRESHOLDS, since=len(self.steps) - 1
        )
        if verdict.name == NO_LEARNING and not self.strict and NO_LEARNING not in self.warned:
            self.warned.add(NO_LEARNING)
            warnings.warn(
                f"nandoctor: {NO_LEARNING} in {self.run.cell.id} ({self.run.framework} run) "
                f"at step {verdict.step}: {verdict.reason}",
                stacklevel=4,
            )
        return verdict

    def stops(self, verdict: Verdict) -> bool:
        """Does this verdict stop the run? Every failed one, but no-learning only under strict."""
        return verdict.failed and (self.strict or verdict.name != NO_LEARNING)

    def verdict(self) -> Verdict | None:
        """The grid's verdict of the run judged so far (its setup checks, the whole curve), with no fp32
        reference (a stable one says so: without_reference); None before any step."""
        return without_reference(classify(self.record()), self.run.cell) if self.steps else None

    def record(self, steps: list[Step] | None = None) -> ProbeRecord:
        """The run judged so far as the probe record the grid judges: its cell, its judged `steps`
        (default: all), its setup checks, step 0's update loss and, for a mixture of experts, step 0's
        routing."""
        steps = self.steps if steps is None else steps
        return ProbeRecord(
            self.run.cell.id,
            self.run.cell,
            steps=steps,
            setup_checks=self.setup_checks,
            forensics=self.forensics,
            moe=self.moe,
        )

    def stepped(self) -> None:
        """After the optimizer step of the first judged step: its update loss, measured once, as a probe's
        forensics hold it for the stall rule (classify's stall_verdict)."""
        if not self.steps:
            self._take_off("updates")
            return
        updates, self.updates = self.updates, None
        if updates is not None:
            self.forensics = update_figures(updates, self.steps[0].step)  # which takes its hooks off

    def unhook(self) -> None:
        """Take the step-0 hooks off the model and its optimizer, if they are still on."""
        for held in ("step0", "updates", "routing"):
            self._take_off(held)

    def _take_off(self, held: str):
        """The hooks held in attribute `held`, taken off the model (or optimizer) and no longer held; None
        where none were."""
        hooks = getattr(self, held)
        setattr(self, held, None)
        if hooks is not None:
            hooks.remove()
        return hooks

    def _check_step0(self, record: Step) -> None:
        events = self.step0.end_step(record.step)
        step0 = self._take_off("step0")
        f = {
            "compute_dtype": self.run.cell.precision.compute,
            "activation_absmax": step0.activation_absmax,
            "gradient_absmax": step0.gradient_absmax,
        }
        routing = self._take_off("routing")
        if routing is not None:
            self.moe = routing.figures()
        checks = check_results(self.record([record]), self.run.vocab, self.run.random_init) + headroom_checks(
            f, events, record.scale
        )
        self._verdict_on(checks, f"step-{record.step}")

    def lint(self, findings: list[dict]) -> None:
        """Say the data and setup lint's findings on the run's first batches (setup_lint.py): one warning
        listing each with its figure and fix; under strict an error raises CheckFailed instead."""
        if not findings:
            return
        head = f"nandoctor: data and setup lint of {self.run.cell.id} ({self.run.framework} run) on its first batches"
        errors = [f for f in findings if f["severity"] == "error"]
        if self.strict and errors:
            raise CheckFailed(f"{head}: " + "; ".join(f"{f['id']}: {f['figure']}" for f in errors))
        lines = [f"  {f['severity']} {f['id']}: {f['figure']}. Fix: {f['fix']}" for f in findings]
        warnings.warn("\n".join([head] + lines), stacklevel=4)

    def _verdict_on(self, checks: list, what: str) -> None:
        failed = [c for c in checks if not c[1]]
        if not failed:
            return
        head = f"nandoctor: {what} check of {self.run.cell.id} ({self.run.framework} run) failed"
        if self.strict:
            raise CheckFailed(f"{head}: " + "; ".join(f"{n}: {d}" for n, _, d in failed))
        if any(d.startswith(NO_LEARNING) for _, _, d in failed):
            self.warned.add(NO_LEARNING)  # said here already: step() does not say it again
        warnings.warn("\n".join([head] + [check_line(*c) for c in checks]), stacklevel=4)
