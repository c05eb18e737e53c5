"""The framework-neutral core of the training callbacks: a live run watched with the probes' rules.

A framework adapter (transformers.py, lightning.py) reads its trainer into a `LiveRun` and calls a
`Watch` at three points of the run:

- `start`: before the first step, the setup check (can this device run the cell; the knowledge
  rules that fire on the setup) and hooks on every module for step 0's headroom;
- `judge`: after backward, before the optimizer step, with the step's real loss and pre-clip
  grad-norm: the step-0 checks of `nandoctor check` on the first step, then the probes' verdict
  rules (nonfinite, zero-loss, spike, divergence) on the curve so far. On the first failure it
  keeps the batch and a copy of the weights and optimizer state the step started from;
- `settle`: after every optimizer step, on every rank: the parameters' min / max of a judged step
  (to name an optimizer step that turns them non-finite); the ranks of a DDP / FSDP run agree on
  whether any saw a failure (ranks.py), and then all stop at that step while the lowest failing rank
  replays the step with forensics hooks and writes the report. Returns True when training must stop.

nandoctor never breaks the run it watches: every framework hook runs through `guarded`, which turns
an exception raised inside nandoctor into one line on stderr and switches the watch off, and the run
trains on. Only a failed check under strict=True raises (CheckFailed), because the user asked for it.
`start` prints one line, `finish` a short summary, so that a user sees the watch was on.

Every nandoctor internal the integrations use is imported here, at the top, so that moving those
modules means re-pointing these lines only. Importing this module needs torch, not a framework.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..analysis.forensics import headroom
from ..analysis.run import analyze_records
from ..analysis.verdicts import NO_LEARNING, check_results, numeric_verdict
from ..capabilities import cell_support
from ..cells import ALIASES, PRECISIONS, SHORT_DTYPES, Cell
from ..child.build import Setup, precision
from ..child.hooks import ModuleWatch, hooked_steps, replay_cost, reproduced, update_event
from ..config import THRESHOLDS, ModelConfig, OptimizerConfig, Recipe, recipe_to_dict
from ..env import collect_summary
from ..errors import NandoctorError
from ..knowledge import evaluate, finding
from ..knowledge.facts import env_facts, setup_facts, trainer_cell
from ..models import shape_of
from ..record import ModelPlan, ProbeRecord, Step
from ..report import write_reports
from .ranks import Ranks

__all__ = [
    "ALIASES",
    "PRECISIONS",
    "Cell",
    "CheckFailed",
    "LiveRun",
    "NandoctorError",
    "Watch",
    "autocast_of",
    "guarded",
    "local",
    "recipe_of",
    "trainer_cell",
]
REPORT_DIR = "nandoctor"  # under the run's output directory
# config.json keys about the file, not the architecture; AutoConfig.for_model takes the rest
ARCH_NOT_SETTINGS = ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "auto_map")


class CheckFailed(NandoctorError):
    """A check failed under strict=True: the one exception a callback lets into the user's run."""


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


@dataclass
class LiveRun:
    """A framework's training run in nandoctor's terms, read by its adapter at train start."""

    framework: str  # "transformers" or "lightning"
    cell: Cell
    recipe: Recipe  # the recipe the run amounts to (optimizer, clipping, shapes, model)
    model: object  # the transformers model the hooks watch
    optimizer: object  # the torch optimizer the framework steps
    device: str  # "cpu" or "cuda"
    output_dir: Path
    step_loss: object  # what the replay trains: step_loss(**batch).loss, plus the model's parameters
    autocast: object  # context factory the replay's forward runs in
    trainer_args: dict | None = None  # TrainingArguments.to_dict(), for the knowledge rules
    moot_rules: tuple = ()  # knowledge rules the watch itself answers

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    @property
    def random_init(self) -> bool:
        """A model built with from_config has no name_or_path; from_pretrained sets it."""
        return not getattr(self.model, "name_or_path", "")


def autocast_of(cell: Cell, device: str):
    """The autocast context factory the probes use for a cell."""
    return precision(cell, device)[0]


def recipe_of(framework: str, model, optimizer, grad_clip: float, seed: int, cell: Cell) -> Recipe:
    """The recipe a live run amounts to: its model (local checkpoint, hub id or config), the AdamW
    settings of its first parameter group, clipping and seed (the batch shape comes with a batch)."""
    source = getattr(model, "name_or_path", "") or ""
    arch = {} if source else {k: v for k, v in model.config.to_diff_dict().items() if k not in ARCH_NOT_SETTINGS}
    weights = SHORT_DTYPES.get(str(next(model.parameters()).dtype).replace("torch.", ""), "fp32")
    on_load = "fp32" if cell.precision.weights else weights  # the pure cells cast the weights themselves
    local = source and Path(source).is_dir()
    group = optimizer.param_groups[0]
    return Recipe(
        name=f"{framework}-run",
        description=f"read from a live {framework} run",
        model=ModelConfig(
            path=source if local else None,
            hub_id=None if local or not source else source,
            arch=arch,
            dtype_on_load=on_load,
            scale="full",
        ),
        optimizer=OptimizerConfig(
            lr=group.get("initial_lr", group["lr"]),
            betas=tuple(group.get("betas", (0.9, 0.999))),
            eps=group.get("eps", 1e-8),
            weight_decay=group.get("weight_decay", 0.0),
        ),
        grad_clip=grad_clip or 0.0,
        seed=seed,
    ).validate()


def token_shape(batch) -> tuple[int, int] | None:
    """(batch size, sequence length) of the first 2-D integer tensor in a batch (its token ids)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape) if batch.ndim == 2 and not batch.is_floating_point() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return next((shape for shape in map(token_shape, values) if shape), None)


def check_line(name: str, passed: bool, detail: str) -> str:
    return f"  {'ok  ' if passed else 'FAIL'} {name}: {detail}"


def headroom_checks(forensics: dict, events: list[dict], scale: float | None = None) -> list[tuple[str, bool, str]]:
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
                    r[f"{kind}_headroom"] > 1,
                    f"{r[f'{kind}_headroom']:.3g}x at {r['module']} (largest |{kind}| {r[f'{kind}_absmax']:.4g}"
                    f"{f', loss-scaled by {scale:g}' if scaled else ''})",
                )
            )
    return out


def local(p):
    """This rank's shard of an FSDP2 parameter (a DTensor), or the parameter itself: reading a
    DTensor whole would be a collective that the other ranks do not join."""
    return p.to_local() if hasattr(p, "to_local") else p


def parameter_extremes(named: list) -> object:
    """[min, max] per parameter (this rank's shard) as one float tensor, without a device sync (read only
    after a failure)."""
    import torch

    return torch.stack([torch.stack(torch.aminmax(local(p).detach())).float() for _, p in named])


def state_copy(named: list, optimizer) -> dict:
    """The trainable weights and the optimizer state, copied to the CPU."""
    import torch

    def to_cpu(x):
        return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else copy.deepcopy(x)

    state = optimizer.state_dict()
    return {
        "weights": [to_cpu(local(p)) for _, p in named],
        "optimizer": {
            "state": {k: {n: to_cpu(v) for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": copy.deepcopy(state["param_groups"]),
        },
    }


def state_restore(named: list, optimizer, saved: dict) -> None:
    import torch

    with torch.no_grad():
        for (_, p), w in zip(named, saved["weights"]):
            local(p).copy_(w)
    optimizer.load_state_dict(saved["optimizer"])


@dataclass
class Failure:
    verdict: object
    batch: dict
    before: dict  # state_copy() of the weights and optimizer state the failing step started from
    entering: object  # parameter_extremes() of those weights, or None
    earlier: object  # parameter_extremes() one check before, or None
    scale: float | None


class Watch:
    """The probes' checks on a live run. every: judge one step in `every`; strict: a failed setup or
    step-0 check raises NandoctorError instead of warning; device: the device facts as
    env.collect_summary() returns them (default: this machine's)."""

    def __init__(self, every: int = 1, strict: bool = False, device: dict | None = None):
        if every < 1:
            raise NandoctorError(f"every must be >= 1, got {every}")
        self.every, self.strict, self.device = every, strict, device
        self.run: LiveRun | None = None
        self.named: list = []  # the trainable (name, parameter) pairs, in the model's order
        self.findings: list[dict] = []  # the knowledge rules that fire on the setup
        self.step0: ModuleWatch | None = None  # hooks on every module until the first judged step
        self.entering = self.earlier = None  # parameter_extremes() after the last judged step, and one before
        self.steps: list[Step] = []  # the judged steps
        self.failure: Failure | None = None
        self.report_dir: Path | None = None
        self.report_error: str | None = None  # why the report of a failure could not be written
        self.bisect_command: str | None = None
        self.off: str | None = None  # what failed inside nandoctor, once the watch switched itself off
        self.warned: set[str] = set()  # the warnings given once per run (no-learning)
        self.ranks = Ranks()
        self.settled = 0  # optimizer steps settled (the first one is always a judged one)
        self.stopped_by: int | None = None  # the rank whose failure stopped the run, when not this one

    def switch_off(self, where: str, error: BaseException) -> None:
        """nandoctor failed in `where`: say so on one line and stop watching; training is not touched."""
        first = (str(error).strip().splitlines() or [""])[0][:200]
        self.off = f"{where}: {type(error).__name__}: {first}".rstrip(": ")
        if self.step0 is not None:  # the step-0 hooks on every module go with it
            with contextlib.suppress(Exception):
                self.step0.remove()
            self.step0 = None
        _say(f"internal error in {self.off}; nandoctor stopped watching this run, training goes on")

    def start(self, run: LiveRun) -> None:
        """The setup check, before any step; then hooks that measure step 0's headroom."""
        self.run, self.device = run, self.device or collect_summary()
        self.named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        self.findings = [
            finding(r, [run.cell.id])
            for r in evaluate(
                {**env_facts(self.device), **setup_facts(run.recipe, run.cell, run.model.config, run.trainer_args)}
            )
            if r.id not in run.moot_rules
        ]
        unsupported = cell_support(run.cell, self.device)
        checks = (
            check_results(
                ProbeRecord(run.cell.id, run.cell, "unsupported", reason=unsupported), run.vocab, run.random_init
            )
            if unsupported
            else []
        )
        checks += [
            (f"known issue {f['id']}", f["severity"] != "error", f"{f['title']}. Fix: {f['fix']}")
            for f in self.findings
        ]
        self._verdict_on(checks, "setup")
        self.step0 = ModuleWatch(run.model)
        self.entering = self.earlier = parameter_extremes(self.named)
        which = "every step" if self.every == 1 else f"one step in {self.every}"
        ranks = f" on {self.ranks.size} ranks, each judged" if self.ranks.distributed else ""
        if self.ranks.speaks:
            _say(
                f"watching {run.cell.id} ({run.framework} run{ranks}, {len(self.named)} trainable tensors), "
                f"judging {which}{' (strict)' if self.strict else ''}; "
                f"a failure stops training and writes a report to {Path(run.output_dir) / REPORT_DIR}"
            )

    def checking(self, step: int) -> bool:
        """Judge this step? The first step always (the step-0 check), then one in `every`."""
        return self.step0 is not None or step % self.every == 0

    def judge(self, step: int, loss: float, grad_norm: float, scale: float | None, batch: dict):
        """Judge one step before its optimizer step; returns its Verdict."""
        # a GradScaler skips exactly the steps whose gradients hold inf/nan: calibration, judged by unrecoverable_at
        record = Step(step, loss, grad_norm, skipped=scale is not None and not math.isfinite(grad_norm), scale=scale)
        self.steps.append(record)
        if self.step0 is not None:
            self._check_step0(record)
        verdict = numeric_verdict(self.steps, None, THRESHOLDS, since=len(self.steps) - 1)
        if verdict.name == NO_LEARNING and not self.strict:  # a warning: the run may still start learning
            if NO_LEARNING not in self.warned:
                self.warned.add(NO_LEARNING)
                warnings.warn(
                    f"nandoctor: {NO_LEARNING} in {self.run.cell.id} ({self.run.framework} run) "
                    f"at step {verdict.step}: {verdict.reason}",
                    stacklevel=3,
                )
            return verdict
        if verdict.failed and self.failure is None:
            self.failure = Failure(
                verdict, batch, state_copy(self.named, self.run.optimizer), self.entering, self.earlier, scale
            )
        return verdict

    def end_step(self) -> bool:
        """After the optimizer step of a judged step; True when this rank saw a failure."""
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
        verdict = (
            self.failure.verdict
            if self.failure
            else numeric_verdict(self.steps, None, THRESHOLDS)
            if self.steps
            else None
        )
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

    def _check_step0(self, record: Step) -> None:
        events = self.step0.end_step(record.step)
        self.step0.remove()
        f = {
            "compute_dtype": self.run.cell.precision.compute,
            "activation_absmax": self.step0.activation_absmax,
            "gradient_absmax": self.step0.gradient_absmax,
        }
        self.step0 = None
        checks = check_results(
            ProbeRecord(self.run.cell.id, self.run.cell, steps=[record]), self.run.vocab, self.run.random_init
        ) + headroom_checks(f, events, record.scale)
        self._verdict_on(checks, f"step-{record.step}")

    def _verdict_on(self, checks: list, what: str) -> None:
        failed = [c for c in checks if not c[1]]
        if not failed:
            return
        head = f"nandoctor: {what} check of {self.run.cell.id} ({self.run.framework} run) failed"
        if self.strict:
            raise CheckFailed(f"{head}: " + "; ".join(f"{n}: {d}" for n, _, d in failed))
        if any(d.startswith(NO_LEARNING) for _, _, d in failed):
            self.warned.add(NO_LEARNING)  # said here already: judge() does not say it again
        warnings.warn("\n".join([head] + [check_line(*c) for c in checks]), stacklevel=3)

    def _report(self) -> None:
        """Replay the failing step with hooks, write the report, print what happened and the bisect command."""
        f, run = self.failure, self.run
        self.report_dir = Path(run.output_dir) / REPORT_DIR
        self.report_dir.mkdir(parents=True, exist_ok=True)
        # a sharded model's forward gathers its parameters from every rank, and the others have stopped
        forensics = None if any(hasattr(p, "to_local") for _, p in self.named) else self._replay()
        recipe = dataclasses.replace(run.recipe, steps=max(run.recipe.steps, f.verdict.step + 1))
        shape = token_shape(f.batch)
        if shape:
            recipe = dataclasses.replace(recipe, batch_size=shape[0], seq_len=shape[1])
        recipe_path = self.report_dir / "recipe.yaml"
        data = {k: v for k, v in recipe_to_dict(recipe).items() if k != "name"}
        recipe_path.write_text(yaml.safe_dump(_plain(data), sort_keys=False))
        self.bisect_command = shlex.join(
            [
                "nandoctor",
                "bisect",
                "--recipe",
                str(recipe_path),
                "--bad",
                f"dtype={run.cell.dtype},attn={run.cell.attn},compile={run.cell.compile}",
            ]
        )
        write_reports(analyze_records(self._meta(recipe), [self._record(recipe, forensics)]), self.report_dir)
        print(
            f"nandoctor: {f.verdict.name} at step {f.verdict.step}: {f.verdict.reason}. Training stopped.\n"
            f"nandoctor: report {self.report_dir / 'report.md'}\n"
            f"nandoctor: reproduce this setup as probes: {self.bisect_command}",
            file=sys.stderr,
            flush=True,
        )

    def _replay(self) -> dict:
        """The failing step again, from the weights and optimizer state it started from, with the
        forensics hooks on the live model; the model and optimizer are left as the run left them."""
        import torch

        f, run, k = self.failure, self.run, self.failure.verdict.step
        t0 = time.perf_counter()
        after = state_copy(self.named, run.optimizer)
        state_restore(self.named, run.optimizer, f.before)
        scaler = torch.amp.GradScaler(run.device, init_scale=f.scale or 1.0, enabled=f.scale is not None)
        devices = [torch.cuda.current_device()] if run.device == "cuda" else []
        sync = torch.cuda.synchronize if run.device == "cuda" else (lambda: None)
        # no SDPA backend pin: the replay runs the model's attention as the live run does
        s = Setup(run.step_loss, iter([f.batch]), run.optimizer, run.autocast, scaler, contextlib.nullcontext, sync)
        try:
            earlier = self._earlier_update(k)
            with torch.random.fork_rng(devices=devices):
                out = hooked_steps(run.step_loss, s, run.recipe.grad_clip, 1, first_step=k)
        finally:
            state_restore(self.named, run.optimizer, after)
        out["events"] = earlier + out["events"]
        replayed = out.pop("steps")
        return {
            "compute_dtype": run.cell.precision.compute,
            "weight_dtype": str(self.named[0][1].dtype).replace("torch.", ""),
            "replayed_steps": 1,
            "compile": "off",
            **out,
            "steps": [st.to_dict() for st in replayed],
            "reproduced": reproduced(self.steps[-1:], replayed),
            "cost": replay_cost(self.steps[-1:], replayed, time.perf_counter() - t0),
            "note": f"step {k} replayed in process on the live model, "
            "from the weights and optimizer state it started from",
        }

    def _earlier_update(self, k: int) -> list[dict]:
        """When the weights step k read were already non-finite, an optimizer step before it made them
        so: the first such parameter, its extremes one check earlier, and the optimizer state that update
        left (the live state is restored to where step k started)."""
        f = self.failure
        bad = [
            i for i, (lo, hi) in enumerate(f.entering.cpu().tolist()) if not (math.isfinite(lo) and math.isfinite(hi))
        ]
        if not bad:
            return []
        name, p = self.named[bad[0]]
        return [{"step": k - self.every, **update_event(name, p, self.run.optimizer, f.earlier.cpu().tolist()[bad[0]])}]

    def _meta(self, recipe: Recipe) -> dict:
        run, config = self.run, self.run.model.config
        params = sum(p.numel() for p in run.model.parameters())
        plan = ModelPlan(
            "live-run",
            "full",
            config.model_type,
            params,
            params,
            sum(p.numel() for _, p in self.named),
            recipe.model.path,
            f"the model of this {run.framework} run, watched in process",
            shape_of(config),
        )
        return {
            "kind": "watch",
            "run_id": f"{run.framework}-{run.output_dir.name}",
            "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "recipe": recipe_to_dict(recipe),
            "model_plan": plan.to_dict(),
            "steps": len(self.steps),
            "seed": recipe.seed,
            "jobs": 1,
            "env": self.device,
            "planned": 1,
            "doctor": {
                "capabilities": [],
                "setup": {"recipe": recipe.name, "cells": [run.cell.id]},
                "findings": self.findings,
            },
            "run_dir": str(self.report_dir),
            "bisect_command": self.bisect_command,
        }

    def _record(self, recipe: Recipe, forensics: dict) -> ProbeRecord:
        return ProbeRecord(
            self.run.cell.id,
            self.run.cell,
            "ok",
            steps=self.steps,
            seed=recipe.seed,
            recipe=recipe_to_dict(recipe),
            forensics=forensics,
        )


def _plain(data):
    """Tuples as lists, so that yaml.safe_dump writes the recipe as recipes/*.yaml are written."""
    if isinstance(data, dict):
        return {k: _plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    return data
