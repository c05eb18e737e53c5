"""The framework-neutral core of the training callbacks: a live run watched with the probes' rules.

A framework adapter (transformers.py, lightning.py) reads its trainer into a `LiveRun` (live.py) and
calls a `Watch` at three points of the run:

- `start`: before the first step, the setup check and hooks for step 0's headroom (judge.py), and the
  data and setup lint on the trainer's own first batches with the probes' step-0 setup checks (packing,
  accumulation) on the live model (setup_lint.py), judged with every step as the grid judges them;
- `judge`: after backward, before the optimizer step, with the step's real loss and pre-clip
  grad-norm: the step-0 checks on the first step, then the probes' verdict rules on the curve so far
  (judge.py). On the first failure it keeps the batch and a copy of the weights and optimizer state
  the step started from (child/failing_step.py);
- `settle`: after every optimizer step, on every rank: the parameters' min / max of a judged step
  (to name an optimizer step that turns them non-finite); the ranks of a DDP / FSDP run agree on
  whether any saw a failure (ranks.py), and then all stop at that step while the lowest failing rank
  replays the step with forensics hooks (child/failing_step.py) and writes the report (failure_report.py).
  Returns True when training must stop.

nandoctor never breaks the run it watches: every framework hook runs through `guarded`, which turns
an exception raised inside nandoctor into one line on stderr and switches the watch off, and the run
trains on. Only a failed check under strict=True raises (CheckFailed), because the user asked for it.
`start` prints one line, `finish` a short summary, so that a user sees the watch was on.

Importing this module needs torch, not a framework.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

from ..child.failing_step import Failure, parameter_extremes, replay, state_copy
from ..device import DeviceFacts
from ..env import collect_summary
from ..errors import NandoctorError
from ..measure.accumulation import normalized
from .failure_report import REPORT_DIR, write_recipe, write_report
from .judge import CheckFailed, Judge
from .live import LiveRun, recipe_at
from .ranks import Ranks
from .setup_lint import LINT_BATCHES, first_batches, lint_live

__all__ = ["CheckFailed", "LiveRun", "Watch", "guarded"]


def _say(line: str) -> None:
    print(f"nandoctor: {line}", file=sys.stderr, flush=True)


def guarded(hook):
    """Wrap a callback's hook (a method of an object with a `watch`): an exception raised inside
    nandoctor is one line on stderr, the watch goes off for the rest of the run (the callback's
    `quiet()`, when it has one, unhooks the model) and the hook returns None, so training goes on.
    A CheckFailed (strict=True) passes through."""

    @functools.wraps(hook)
    def run(callback, *args, **kwargs):
        watch = callback.watch
        if watch.off:
            return None
        try:
            return hook(callback, *args, **kwargs)
        except CheckFailed:
            raise
        except Exception as e:  # noqa: BLE001 - nandoctor's own failure must not reach the user's loop
            watch.switch_off(f"{type(callback).__module__.rsplit('.', 1)[-1]} callback {hook.__name__}", e)
            with contextlib.suppress(Exception):
                getattr(callback, "quiet", lambda: None)()
            return None

    return run


class Watch:
    """The probes' checks on a live run. every: judge one step in `every`; strict: a failed setup or
    step-0 check raises NandoctorError instead of warning; device: the device facts as
    env.collect_summary() returns them (default: this machine's)."""

    def __init__(self, every: int = 1, strict: bool = False, device: DeviceFacts | dict | None = None):
        if every < 1:
            raise NandoctorError(f"every must be >= 1, got {every}")
        self.every, self.strict, self.device = every, strict, DeviceFacts.of(device)
        self.run: LiveRun | None = None
        self.judging = Judge(strict)
        self.named: list = []  # the trainable (name, parameter) pairs, in the model's order
        self.findings: list[dict] = []  # the knowledge rules that fire on the setup
        self.entering = self.earlier = None  # parameter_extremes() after the last judged step, and one before
        self.failure: Failure | None = None
        self.report_dir: Path | None = None
        self.report_error: str | None = None  # why the report of a failure could not be written
        self.bisect_command: str | None = None
        self.off: str | None = None  # what failed inside nandoctor, once the watch switched itself off
        self.ranks = Ranks()
        self.settled = 0  # optimizer steps settled (the first one is always a judged one)
        self.stopped_by: int | None = None  # the rank whose failure stopped the run, when not this one

    @property
    def steps(self) -> list:
        """The judged steps (record.Step), in order."""
        return self.judging.steps

    def switch_off(self, where: str, error: BaseException) -> None:
        """nandoctor failed in `where`: say so on one line and stop watching; training is not touched."""
        first = (str(error).strip().splitlines() or [""])[0][:200]
        self.off = f"{where}: {type(error).__name__}: {first}".rstrip(": ")
        with contextlib.suppress(Exception):  # the step-0 hooks on every module go with it
            self.judging.unhook()
        _say(f"internal error in {self.off}; nandoctor stopped watching this run, training goes on")

    def start(
        self,
        run: LiveRun,
        loader=None,
        batch_size: int | None = None,
        pad_id: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        """The setup check, and the data and setup lint on the first batches of the trainer's data
        `loader` (its dataset through its collator, `batch_size` rows each: setup_lint.py; measured before
        any hook is on the model), before any step; then hooks that measure step 0's headroom. The lint's
        findings join the setup's (the failure report lists them) and warn; an error raises CheckFailed
        under strict."""
        self.run, self.device = run, self.device or collect_summary()
        self.named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        linted, checks = self._lint(loader, batch_size, pad_id, eos_id)
        self.findings = self.judging.setup(run, self.device, checks) + linted
        self.judging.lint(linted)
        self.entering = self.earlier = parameter_extremes(self.named)
        which = "every step" if self.every == 1 else f"one step in {self.every}"
        ranks = f" on {self.ranks.size} ranks, each judged" if self.ranks.distributed else ""
        if self.ranks.speaks:
            _say(
                f"watching {run.cell.id} ({run.framework} run{ranks}, {len(self.named)} trainable tensors), "
                f"judging {which}{' (strict)' if self.strict else ''}; "
                f"a failure stops training and writes a report to {Path(run.output_dir) / REPORT_DIR}"
            )

    def _lint(self, loader, batch_size: int | None, pad_id: int | None, eos_id: int | None) -> tuple[list[dict], dict]:
        """The data and setup lint's findings on the loader's first batches, and the figures of the probes'
        step-0 setup checks on them (setup_lint.py): as many batches as a step's micro-batches. A lint that
        cannot read or measure them says so in one line; the watch goes on."""
        if loader is None:
            return [], {}
        try:
            recipe = self.run.recipe
            micro = recipe.gradient_accumulation_steps
            batches = first_batches(loader, batch_size, max(LINT_BATCHES, micro))
            return lint_live(
                self.run.model,
                batches,
                pad_id,
                eos_id,
                measured=not self.ranks.distributed,
                micro=micro,
                normalization=normalized(recipe, self.run.model),
            )
        except Exception as e:  # noqa: BLE001 - a collator or model the lint cannot run leaves the watch on
            first = (str(e).splitlines() or [""])[0][:200]
            _say(f"the data and setup lint could not run ({type(e).__name__}: {first}); watching goes on")
            return [], {}

    def checking(self, step: int) -> bool:
        """Judge this step? The first step always (the step-0 check), then one in `every`."""
        return self.judging.at_step0 or step % self.every == 0

    def judge(
        self, step: int, loss: float, grad_norm: float, scale: float | None, batch: dict, supervised: int | None = None
    ):
        """Judge one step before its optimizer step (`supervised`: the fewest supervised tokens of its
        micro-batches, measure/trainer_step.supervised); returns its Verdict."""
        verdict = self.judging.step(step, loss, grad_norm, scale, supervised)
        if self.judging.stops(verdict) and self.failure is None:
            self.failure = Failure(
                verdict, batch, state_copy(self.named, self.run.optimizer), self.entering, self.earlier, scale
            )
        return verdict

    def end_step(self) -> bool:
        """After the optimizer step of a judged step; True when this rank saw a failure."""
        self.judging.stepped()
        self.earlier, self.entering = self.entering, parameter_extremes(self.named)
        return self.failure is not None

    def settle(self, step: int, judged: bool) -> bool:
        """After every optimizer step, on every rank, with the watch on or off (call it outside
        `guarded`): at the steps the watches judge (the first, then one in `every`), the ranks agree
        on whether any saw a failure; True when training must stop, on every rank at the same step.
        The lowest failing rank writes the report. Never raises."""
        due = self.settled == 0 or step % self.every == 0
        self.settled += 1
        if not due:
            return False
        failed = False
        if judged and not self.off:
            try:
                failed = self.end_step()
            except Exception as e:  # noqa: BLE001 - this rank stops watching, and still takes part in the agreement
                self.switch_off("watch end_step", e)
        try:
            by = self.ranks.agree(failed)
        except Exception as e:  # noqa: BLE001 - a broken process group is the run's to report, not nandoctor's
            if not self.off:
                self.switch_off("agreement between ranks", e)
            return False
        if by is None:
            return False
        if by != self.ranks.rank or self.failure is None:
            self.stopped_by = by
        elif not self.off and self.report_dir is None and self.report_error is None:
            try:
                self._report()
            except Exception as e:  # noqa: BLE001 - the run failed either way; it stops, with or without a report
                self.report_dir, self.report_error = (
                    None,
                    f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}",
                )
                f = self.failure.verdict
                _say(
                    f"{f.name} at step {f.step}: {f.reason}. Training stopped. "
                    f"Internal error while writing the report ({self.report_error}): no report"
                )
        return True

    def finish(self) -> str | None:
        """The summary line at the end of the run: steps watched, the verdict of the curve, where the
        report is. None when the watch never started. (A watch that switched itself off says nothing
        more: `guarded` skips its hooks.)"""
        if self.run is None:
            return None
        verdict = self.failure.verdict if self.failure else self.judging.verdict()
        said = "no step judged" if verdict is None else f"{verdict.name} ({verdict.reason})"
        where = (
            f"report {self.report_dir / 'report.md'}"
            if self.report_dir
            else f"no report ({self.report_error})"
            if self.report_error
            else "no report (nothing stopped the run)"
        )
        if self.stopped_by is not None:  # another rank saw the failure: its report, in the same directory
            said += f"; stopped with every rank when rank {self.stopped_by} failed"
            where = f"report by rank {self.stopped_by} in {Path(self.run.output_dir) / REPORT_DIR}"
        ranks = f" on {self.ranks.size} ranks" if self.ranks.distributed else ""
        line = f"watched {len(self.steps)} steps of {self.run.cell.id}{ranks}: {said}; {where}"
        if self.ranks.speaks:
            _say(line)
        return line

    def _report(self) -> None:
        """Replay the failing step with hooks, write the report, print what happened and the bisect command."""
        f, run = self.failure, self.run
        self.report_dir = Path(run.output_dir) / REPORT_DIR
        self.report_dir.mkdir(parents=True, exist_ok=True)
        # a sharded model's forward gathers its parameters from every rank, and the others have stopped
        sharded = any(hasattr(p, "to_local") for _, p in self.named)
        forensics = None if sharded else replay(run, self.named, f, self.steps[-1], self.every)
        recipe = recipe_at(run.recipe, f.verdict.step, f.batch)
        self.bisect_command = write_recipe(self.report_dir, recipe, run.cell)
        write_report(
            self.report_dir,
            run,
            recipe,
            self.steps,
            forensics,
            device=self.device,
            findings=self.findings,
            bisect_command=self.bisect_command,
            setup_checks=self.judging.setup_checks,
        )
        print(
            f"nandoctor: {f.verdict.name} at step {f.verdict.step}: {f.verdict.reason}. Training stopped.\n"
            f"nandoctor: report {self.report_dir / 'report.md'}\n"
            f"nandoctor: reproduce this setup as probes: {self.bisect_command}",
            file=sys.stderr,
            flush=True,
        )
