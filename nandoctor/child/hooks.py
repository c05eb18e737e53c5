"""Numerics forensics, the measuring half (in the probe process): where a probe broke, and how much
margin a stable one has. analysis/forensics.py reads what this writes.

After its timed steps, the probe's child restores the model's initial state from the snapshot taken
before them (snapshot.py), takes a fresh optimizer, GradScaler and data stream, and replays the first
steps eagerly with instrumentation hung off the unchanged training loop (`train.train`):

- forward hooks on every module record the output's min / max / abs-max and the primary input's, and
  hang a tensor hook on each output for its gradient; the first module whose output (forward) or output
  gradient (backward) holds NaN/inf is the first offender of that phase;
- optimizer step pre/post hooks snapshot the weights, name the first parameter an update turns
  non-finite (an optimizer-step origin, e.g. AdamW's eps rounding to 0 in fp16) and count the elements
  whose update rounds away in the weights' storage dtype (update loss);
- one fp32 shadow backward on the first batch measures the fraction of gradient elements that are
  non-zero in fp32 but round to zero in the compute dtype (after loss scaling).

The timed steps run without any of this, so throughput stays honest; the replay measures its own cost.

A probe whose steps all stay finite has no offender to find, and replaying it only re-measures its
margin. So when the cell runs eagerly (no torch.compile, no fp8 casts to watch) the same ModuleWatch
and update-loss hooks hang off its timed step 0 instead (StepZeroWatch), and come off after it; the
fp32 shadow backward runs after the timed steps on the restored initial weights, as in the replay.
Every one of these hooks only reads: none returns a tensor, none keeps an input alive, none draws a
random number, so the step's loss and grad-norm are those of an unhooked step, bit for bit. Step 0 is
a warm-up step that no throughput figure uses (record.warmup_steps). A probe that went non-finite is
replayed as above, hooks on every step up to its failure.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time

from ..cells import weight_dtype
from ..data import batches
from ..record import ProbeRecord, ProbeSpec, Step
from .build import Setup, restart
from .fp8 import fp8_watch
from .optimizers import dense
from .snapshot import Snapshot
from .train import train

ROOT = "(root)"  # named_modules() calls the root ""; "<...>" would vanish as a tag in Markdown


def _floating(obj, out: list) -> list:
    """Every floating-point tensor inside a module's output (tensor, tuple, list, dict, ModelOutput)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _floating(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _floating(x, out)
    return out


def _stats(tensors):
    """A float [min, max] tensor over the given tensors, without a device sync. NaN propagates."""
    import torch

    parts = [torch.stack(torch.aminmax(t.detach())) for t in tensors if t.numel()]
    if len(parts) < 2:
        return parts[0].float() if parts else None
    mm = torch.stack([x.float() for x in parts])
    return torch.stack([mm[:, 0].min(), mm[:, 1].max()])


def local(t):
    """A tensor as this process holds it: a DTensor's local shard (FSDP2's parameters, gradients and
    optimizer state), anything else as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _absmax(lo: float, hi: float) -> float:
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))


def _as_dict(row) -> dict:
    lo, hi = (float(x) for x in row)
    return {"min": lo, "max": hi, "absmax": _absmax(lo, hi)}


class ModuleWatch:
    """Forward hooks on every module and gradient hooks on their outputs. Reductions are queued as
    tensors and read once per step (one device sync), in the order the hooks fired."""

    def __init__(self, model, keep_inputs: bool = True):
        self.names = {m: (n or ROOT) for n, m in model.named_modules()}
        self.keep_inputs = keep_inputs  # the offender's input stats; off in a timed step (memory)
        self.forward_calls: list[tuple] = []  # (module name, output stats, primary input tensor or None)
        self.backward_calls: list[tuple] = []  # (module name, output-gradient stats)
        self.activation_absmax: dict[str, float] = {}
        self.gradient_absmax: dict[str, float] = {}
        self.handles = [m.register_forward_hook(self._forward, with_kwargs=True) for m in self.names]

    def _forward(self, module, args, kwargs, output):
        name = self.names[module]
        outs = _floating(output, [])
        stats = _stats(outs)
        if stats is None:
            return
        first = _floating(list(args[:1]) or list(kwargs.values())[:1], [])[:1] if self.keep_inputs else []
        # the input is kept by reference and reduced only for an offender: autograd holds most inputs anyway
        self.forward_calls.append((name, stats, first[0].detach() if first else None))
        for t in outs if name != ROOT else []:  # the root's output gradient is the loss scale itself
            if t.requires_grad:
                t.register_hook(lambda g, name=name: self.backward_calls.append((name, _stats([g]))))

    def end_step(self, step: int) -> list[dict]:
        """Fold this step's calls into the running abs-max per module; return its first offenders."""
        import torch

        events = []
        for phase, calls, seen, what in (
            ("forward", self.forward_calls, self.activation_absmax, "output"),
            ("backward", self.backward_calls, self.gradient_absmax, "gradient of output"),
        ):
            calls = [c for c in calls if c[1] is not None]
            if not calls:
                continue
            rows = torch.stack([c[1] for c in calls]).cpu().tolist()
            for i, (call, row) in enumerate(zip(calls, rows)):
                name, absmax = call[0], _absmax(*row)
                if name != ROOT:  # the root's output is the loss and the lm_head's logits, not a new activation
                    seen[name] = absmax if math.isnan(absmax) else max(seen.get(name, 0.0), absmax)
                if not math.isfinite(absmax) and not any(e["phase"] == phase for e in events):
                    events.append(self._offender(step, phase, what, calls, rows, i))
        self.forward_calls, self.backward_calls = [], []
        return events

    @staticmethod
    def _offender(step, phase, what, calls, rows, i) -> dict:
        name = calls[i][0]
        event = {"step": step, "phase": phase, "module": name, "tensor": what, "stats": _as_dict(rows[i])}
        if phase == "forward" and calls[i][2] is not None:
            event["before"] = {"what": "its input", "module": name, **_as_dict(_stats([calls[i][2]]).cpu().tolist())}
        elif i > 0:  # in backward order, the gradient computed just before this one
            event["before"] = {
                "what": "the gradient computed just before",
                "module": calls[i - 1][0],
                **_as_dict(rows[i - 1]),
            }
        return event

    def remove(self):
        for h in self.handles:
            h.remove()


def update_event(name: str, p, optimizer, before: list[float]) -> dict:
    """The event of a parameter an optimizer step turned non-finite: `p` after the step, `before` its
    [min, max] before it, and the optimizer state that explains the update."""
    import torch

    state = optimizer.state.get(p, {})
    group = optimizer.param_groups[0]
    eps = group.get("eps")
    event = {
        "phase": "optimizer",
        "module": name.rsplit(".", 1)[0] if "." in name else name,
        "parameter": name,
        "tensor": "parameter after the update",
        "stats": _as_dict(_stats([local(p)]).cpu().tolist()),
        "before": {"what": "the parameter before the update", "module": name, **_as_dict(before)},
        "nonfinite_elements": int((~torch.isfinite(local(p).detach())).sum()),
    }
    if "exp_avg_sq" in state:
        v = dense(local(state["exp_avg_sq"]))
        event["exp_avg_sq_zero_fraction"] = float((v == 0).float().mean())
        event["state_dtype"] = str(v.dtype).replace("torch.", "")
    if eps is not None:
        event["eps"] = eps
        event["eps_in_dtype"] = float(torch.tensor(eps, dtype=p.dtype))
    return event


class OptimizerWatch:
    """Step pre/post hooks: the first parameter an optimizer step turns non-finite, and the fraction of
    elements whose update was meant to move them but rounded away in the stored dtype."""

    def __init__(self, model, optimizer, initial: dict | None = None, deferred: bool = False):
        self.optimizer = optimizer
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.before = None
        self.initial = initial  # name -> the weights before the first step (a Snapshot's): that step clones nothing
        # deferred: the post-hook only notes that the step ran, and `take` (after the step's timing) measures;
        # the weights and AdamW's state stay as the step left them until the next one
        self.deferred, self.stepped = deferred, False
        self.update_loss: float | None = None
        self.event: dict | None = None
        self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, optimizer, args, kwargs):
        if self.initial is not None:
            self.before, self.initial = [self.initial[n] for n, _ in self.named], None
        else:
            self.before = [local(p).detach().clone() for _, p in self.named]

    def _post(self, optimizer, args, kwargs):
        if self.deferred:
            self.stepped = True
        else:
            self._measure()

    def _measure(self):
        import torch

        lost = torch.zeros((), dtype=torch.float64, device=local(self.named[0][1]).device)
        meant = torch.zeros_like(lost)
        decay = self.optimizer.param_groups[0].get("weight_decay", 0.0)
        bad = []
        for (_name, p), old in zip(self.named, self.before):
            now = local(p).detach()
            old = old.to(now.device)  # a snapshot in pinned host memory: one parameter at a time
            bad.append(~torch.isfinite(now).all())
            state = self.optimizer.state.get(p, {})
            if "exp_avg" not in state:
                continue  # no gradient yet: AdamW left it alone on purpose
            moving = dense(local(state["exp_avg"])) != 0  # an element with a non-zero first moment is meant to move
            if decay:
                moving = moving | (old != 0)
            lost += (moving & (now == old)).sum()
            meant += moving.sum()
        self.update_loss = float(lost / meant) if float(meant) else None
        flags = torch.stack(bad).cpu().tolist()
        if any(flags) and self.event is None:
            i = flags.index(True)
            self.event = self._describe(i)

    def _describe(self, i: int) -> dict:
        name, p = self.named[i]
        return update_event(name, p, self.optimizer, _stats([self.before[i]]).cpu().tolist())

    def take(self) -> tuple[float | None, dict | None]:
        if self.stepped:
            self._measure()
            self.stepped = False
        out = (self.update_loss, self.event)
        self.update_loss, self.event, self.before = None, None, None
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def gradient_underflow(model, batch, dtype_name: str, scale: float) -> dict:
    """Fraction of the fp32 gradient's non-zero elements that round to 0 in the compute dtype once
    multiplied by the loss scale: one fp32 forward/backward of a float copy of `model` on `batch`."""
    import torch

    dtype = getattr(torch, dtype_name)
    shadow = copy.deepcopy(model).float()
    with torch.autocast(batch["input_ids"].device.type, enabled=False):
        shadow(**batch).loss.backward()
    total = lost = 0
    worst = []
    for name, p in shadow.named_parameters():
        if p.grad is None:
            continue
        g = p.grad * scale
        nonzero = g != 0
        gone = int((nonzero & (g.to(dtype) == 0)).sum())
        n = int(nonzero.sum())
        total, lost = total + n, lost + gone
        if n:
            worst.append((gone / n, name))
    del shadow
    worst.sort(reverse=True)
    return {
        "dtype": dtype_name,
        "loss_scale": scale,
        "fraction": lost / total if total else 0.0,
        "nonzero_elements": total,
        "worst": [{"parameter": n, "fraction": f} for f, n in worst[:3]],
    }


def hooked_steps(
    model, s: Setup, grad_clip: float, n_steps: int, first_step: int = 0, watched=None, more=(), agree=None
) -> dict:
    """Train n_steps through `train.train` with ModuleWatch and OptimizerWatch hung off it; stops after
    the first unrecoverable step. `model` is what the loop calls (s.model, a live run's training step,
    or a rank's DDP/FSDP2 wrapper); `watched` the module whose modules and parameters the watches name
    (default: `model`). A parallel rank adds its own watches (`more`: each with end_step(step) ->
    events, and remove()) and `agree`, which makes its Step the probe's (the loss averaged over the
    ranks) so that every rank stops at the same step. Returns the events, the Steps (numbered from
    first_step) and the largest |activation| and |gradient| per module."""
    watched = model if watched is None else watched
    out = {"events": [], "steps": []}
    modules, opt = ModuleWatch(watched), OptimizerWatch(watched, s.optimizer)

    def on_step(step: Step) -> bool:
        step.step += first_step
        if agree is not None:
            agree(step)
        step.update_loss, opt_event = opt.take()
        events = modules.end_step(step.step) + [e for w in more for e in w.end_step(step.step)]
        out["events"] += events + ([{"step": step.step, **opt_event}] if opt_event else [])
        out["steps"].append(step)
        return step.unrecoverable() is None

    try:
        train(model, s, grad_clip, n_steps, on_step)
    finally:
        for w in (modules, opt, *more):
            w.remove()
    out["activation_absmax"] = modules.activation_absmax
    out["gradient_absmax"] = modules.gradient_absmax
    return out


def replayed_steps(spec: ProbeSpec, timed: ProbeRecord) -> int:
    """How many steps the replay runs: up to the timed run's first non-finite step, else forensics_steps."""
    first_bad = timed.first_nonfinite
    return first_bad["step"] + 1 if first_bad else min(len(timed.steps), spec.recipe.forensics_steps)


def restored(spec: ProbeSpec, s: Setup, snapshot: Snapshot, n_steps: int) -> tuple[Setup, dict]:
    """The model back at its state before the timed steps, with a fresh optimizer, GradScaler and data
    stream; and the head of the forensics record."""
    seconds = snapshot.restore(s.model)
    s = restart(spec, s)
    cell = spec.cell
    out = {
        "compute_dtype": cell.precision.compute,
        "weight_dtype": weight_dtype(cell, spec.recipe.model.dtype_on_load),
        "replayed_steps": n_steps,
        "compile": "off",
        "snapshot": {**snapshot.describe(), "restore_seconds": seconds},
    }
    if cell.compile != "off":
        out["note"] = f"replayed without torch.compile ({cell.compile}): module hooks need eager execution"
    return s, out


def underflow(spec: ProbeSpec, timed: ProbeRecord, s: Setup) -> dict:
    """gradient_underflow on the first batch of the probe's stream, at the timed run's last loss scale."""
    t1 = time.perf_counter()
    scales = [st.scale for st in timed.steps if st.scale]
    first = {k: v.to(spec.device) for k, v in next(batches(spec.recipe, s.model.config, spec.seed)).items()}
    out = gradient_underflow(s.model, first, spec.cell.precision.compute, scales[-1] if scales else 1.0)
    out["seconds"] = time.perf_counter() - t1
    return out


def finished(spec: ProbeSpec, timed: ProbeRecord, out: dict, t0: float) -> dict:
    """The forensics record completed: reproduced, cost, peak memory, steps as dicts."""
    out["reproduced"] = reproduced(timed.steps, out["steps"])
    out["cost"] = replay_cost(timed.steps, out["steps"], time.perf_counter() - t0)
    if spec.device == "cuda":  # the whole process's allocator peak, replay included: what packing probes must allow for
        import torch

        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    out["steps"] = [st.to_dict() for st in out["steps"]]
    return out


def replay(spec: ProbeSpec, timed: ProbeRecord, s: Setup, snapshot: Snapshot) -> dict:
    """Restore the probe's model to its state before the timed steps, replay its first steps with hooks
    on a fresh optimizer, GradScaler and data stream, and return the forensics record. `timed` is the
    record of the timed run (steps, first_nonfinite)."""
    t0 = time.perf_counter()
    n_steps = replayed_steps(spec, timed)
    s, out = restored(spec, s, snapshot, n_steps)
    if spec.cell.precision.compute != "float32":
        out["underflow"] = underflow(spec, timed, s)
    casts = fp8_watch(s.model, spec.cell, spec.recipe)
    try:
        out.update(hooked_steps(s.model, s, spec.recipe.grad_clip, n_steps))
    finally:
        if casts:
            casts.remove()
    if casts:
        out["fp8"] = {"recipe": spec.cell.dtype, "casts": casts.stats, "excluded": s.fp8_excluded}
    return finished(spec, timed, out, t0)


MEASURED_ON = "timed step 0"  # forensics["measured_on"] of a probe measured without a replay


class StepZeroWatch:
    """ModuleWatch and the update loss hung off a probe's timed step 0 (see the module docstring): wrap
    the step log with `on_step`, and the hooks come off once step 0 is done (or with `remove`)."""

    def __init__(self, model, optimizer, snapshot: Snapshot):
        self.modules = ModuleWatch(model, keep_inputs=False)
        self.updates = OptimizerWatch(model, optimizer, initial=snapshot.saved, deferred=True)
        self.events: list[dict] = []
        self.step: Step | None = None  # step 0 as measured, with its update loss

    def on_step(self, log):
        """`log` (a train() on_step) with step 0's measurements folded in before it sees the step."""

        def measured(step: Step) -> bool:
            if self.step is None:
                update_loss, opt_event = self.updates.take()
                self.events = self.modules.end_step(step.step) + (
                    [{"step": step.step, **opt_event}] if opt_event else []
                )
                self.step = dataclasses.replace(step, update_loss=update_loss)
                self.remove()
            return log(step)

        return measured

    def remove(self):
        self.modules.remove()
        self.updates.remove()


def eager_forensics(spec: ProbeSpec) -> bool:
    """Whether a stable probe of this spec is measured on its timed step 0 rather than replayed: the
    cell runs eagerly without fp8 casts to watch, and step 0 is a warm-up step (at least 2 steps)."""
    cell = spec.cell
    return (
        spec.recipe.forensics_steps > 0
        and not spec.replay_failed_only
        and cell.compilation.backend is None
        and not cell.precision.fp8
        and spec.steps >= 2
    )


def _header(spec: ProbeSpec, s: Setup, timed: ProbeRecord, snapshot: Snapshot) -> dict:
    """The head of a forensics record measured in the timed run: the dtypes, the snapshot restored, and
    for a half-precision cell the gradient underflow of the initial weights on the first batch."""
    cell = spec.cell
    out = {
        "compute_dtype": cell.precision.compute,
        "weight_dtype": weight_dtype(cell, spec.recipe.model.dtype_on_load),
        "snapshot": {**snapshot.describe(), "restore_seconds": snapshot.restore(s.model)},
    }
    if cell.precision.compute != "float32":
        out["underflow"] = underflow(spec, timed, s)
    return out


def measured_in_run(spec: ProbeSpec, timed: ProbeRecord, s: Setup, snapshot: Snapshot, watch: StepZeroWatch) -> dict:
    """The forensics record of a probe whose timed steps stayed finite, from its hooked step 0: the
    same fields as a replay's (a one-step 'steps'), with measured_on saying where they came from."""
    t0 = time.perf_counter()
    out = _header(spec, s, timed, snapshot)
    out.update(
        {
            "measured_on": MEASURED_ON,
            "replayed_steps": 0,
            "compile": "off",
            "events": watch.events,
            "steps": [watch.step.to_dict()],
            "activation_absmax": watch.modules.activation_absmax,
            "gradient_absmax": watch.modules.gradient_absmax,
            "reproduced": None,
        }
    )
    out["cost"] = {"seconds": time.perf_counter() - t0, "hooked_step_overhead": None}
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def reproduced(timed: list[Step], replayed: list[Step]) -> bool:
    """Did the replay retrace the timed run: the same loss, bit for bit, at every replayed step?"""
    return bool(replayed) and all(_same(a.loss, b.loss) for a, b in zip(timed, replayed))


def replay_cost(timed: list[Step], replayed: list[Step], seconds: float) -> dict:
    """The replay's wall time and how much slower a hooked step is than the same timed step (median of
    the per-step ratios, step 0 left out when there are others: it carries allocator warm-up)."""
    pairs = [(b.time_s, a.time_s) for a, b in zip(timed, replayed) if a.time_s and b.time_s]
    pairs = pairs[1:] or pairs
    return {"seconds": seconds, "hooked_step_overhead": statistics.median(h / t for h, t in pairs) if pairs else None}
