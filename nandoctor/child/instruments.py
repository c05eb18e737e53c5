"""Numerics forensics, the instruments (in the probe process): read-only hooks hung off the unchanged
training loop (`train.train`) that say where a probe broke and how much margin a stable one has.
analysis/forensics.py reads what they measure; replay.py decides when they run.

- forward hooks on every module record the output's min / max / abs-max and the primary input's, and
  hang a tensor hook on each output for its gradient; the first module whose output (forward) or output
  gradient (backward) holds NaN/inf is the first offender of that phase (ModuleWatch);
- optimizer step pre/post hooks snapshot the weights, name the first parameter an update turns
  non-finite (an optimizer-step origin, e.g. AdamW's eps rounding to 0 in fp16) and count the elements
  whose update rounds away in the weights' storage dtype, the update loss (OptimizerWatch);
- one fp32 shadow backward on the first batch measures the fraction of gradient elements that are
  non-zero in fp32 but round to zero in the compute dtype after loss scaling (gradient_underflow).

Every hook only reads: none returns a tensor, none keeps an input alive past its step, none draws a
random number, so a hooked step's loss and grad-norm are those of an unhooked step, bit for bit
(StepZeroWatch relies on it).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

from ..record import Step
from .build import Setup
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


def minmax(tensors):
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


def minmax_dict(row) -> dict:
    lo, hi = (float(x) for x in row)
    return {"min": lo, "max": hi, "absmax": _absmax(lo, hi)}


def is_identity(x) -> bool:
    """Whether a module's input is an identity matrix: peft's DoRA calls lora_A on torch.eye to form
    lora_B @ lora_A (for the weight norm) before it calls it on the batch. Only a plain square matrix is
    compared (a DTensor or other subclass is not), in fp32, so that no dtype or layout can make it raise."""
    import torch

    if type(x) is not torch.Tensor or x.layout != torch.strided or x.dim() != 2 or x.shape[0] != x.shape[1]:
        return False
    return torch.equal(x.float(), torch.eye(len(x), device=x.device))


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
        stats = minmax(outs)
        if stats is None:
            return
        first = _floating(list(args[:1]) or list(kwargs.values())[:1], [])[:1] if self.keep_inputs else []
        # the input is kept by reference and reduced only for an offender: autograd holds most inputs anyway
        self.forward_calls.append((name, stats, first[0].detach() if first else None))
        for t in outs if name != ROOT else []:  # the root's output gradient is the loss scale itself
            if t.requires_grad:
                t.register_hook(lambda g, name=name: self.backward_calls.append((name, minmax([g]))))

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
        event = {"step": step, "phase": phase, "module": name, "tensor": what, "stats": minmax_dict(rows[i])}
        if phase == "forward" and calls[i][2] is not None:
            x = calls[i][2]
            event["before"] = {"what": "its input", "module": name, **minmax_dict(minmax([x]).cpu().tolist())}
            if is_identity(x):
                event["before"]["identity"] = True
        elif i > 0:  # in backward order, the gradient computed just before this one
            event["before"] = {
                "what": "the gradient computed just before",
                "module": calls[i - 1][0],
                **minmax_dict(rows[i - 1]),
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
        "stats": minmax_dict(minmax([local(p)]).cpu().tolist()),
        "before": {"what": "the parameter before the update", "module": name, **minmax_dict(before)},
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

    def __init__(
        self, model, optimizer, initial: dict | None = None, deferred: bool = False, elements: int | None = None
    ):
        self.optimizer = optimizer
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.before = None
        self.initial = initial  # name -> the weights before the first step (a Snapshot's): that step clones nothing
        # the update loss over the first `elements` of each tensor (a live run's sample: its weights are not
        # copied whole), `initial` holding those; None: every element
        self.elements = elements
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
            self.before = [self.kept(local(p).detach()).clone() for _, p in self.named]

    def kept(self, t):
        """The elements of tensor t the update loss counts."""
        return t if self.elements is None else t.flatten()[: self.elements]

    def _post(self, optimizer, args, kwargs):
        if self.deferred:
            self.stepped = True
        else:
            self._measure()

    def _measure(self):
        import torch

        lost = torch.zeros((), dtype=torch.float64, device=local(self.named[0][1]).device)
        meant = torch.zeros_like(lost)
        decays = {id(p): g.get("weight_decay", 0.0) for g in self.optimizer.param_groups for p in g["params"]}
        bad = []
        for (_name, p), old in zip(self.named, self.before):
            whole = local(p).detach()
            now = self.kept(whole)
            old = old.to(now.device)  # a snapshot in pinned host memory: one parameter at a time
            bad.append(~torch.isfinite(whole).all())
            state = self.optimizer.state.get(p, {})
            if "exp_avg" not in state:
                continue  # no gradient yet: AdamW left it alone on purpose
            # an element with a non-zero first moment is meant to move
            moving = self.kept(dense(local(state["exp_avg"]))) != 0
            if decays.get(id(p)):  # decay moves every non-zero weight of its group
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
        return update_event(name, p, self.optimizer, minmax([self.before[i]]).cpu().tolist())

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
    model,
    s: Setup,
    grad_clip: float,
    n_steps: int,
    first_step: int = 0,
    watched=None,
    more=(),
    agree=None,
    deadline: float | None = None,
) -> dict:
    """Train n_steps through `train.train` with ModuleWatch and OptimizerWatch hung off it; stops after
    the first unrecoverable step. `model` is what the loop calls (s.model, a live run's training step,
    or a rank's DDP/FSDP2 wrapper); `watched` the module whose modules and parameters the watches name
    (default: `model`). A parallel rank adds its own watches (`more`: each with end_step(step) ->
    events, and remove()) and `agree`, which makes its Step the probe's (the loss averaged over the
    ranks) so that every rank stops at the same step. Returns the events, the Steps (numbered from
    first_step) and the largest |activation| and |gradient| per module. Past `deadline` (a
    time.perf_counter() reading) it starts no further step and records where it stopped (`stopped_at`)."""
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
        if step.unrecoverable() is not None:
            return False
        if deadline is not None and time.perf_counter() > deadline and len(out["steps"]) < n_steps:
            out["stopped_at"] = step.step
            return False
        return True

    try:
        train(model, s, grad_clip, n_steps, on_step)
    finally:
        for w in (modules, opt, *more):
            w.remove()
    out["activation_absmax"] = modules.activation_absmax
    out["gradient_absmax"] = modules.gradient_absmax
    return out


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
