"""Numerics forensics: where a probe broke, and how much margin a stable one has.

After its timed steps, the probe's child rebuilds the model with the same seed and replays the first
steps with instrumentation hung off the unchanged training loop (`probe.train`):

- forward hooks on every module record the output's min / max / abs-max and the primary input's, and
  hang a tensor hook on each output for its gradient; the first module whose output (forward) or output
  gradient (backward) holds NaN/inf is the first offender of that phase;
- optimizer step pre/post hooks snapshot the weights, name the first parameter an update turns
  non-finite (an optimizer-step origin, e.g. AdamW's eps rounding to 0 in fp16) and count the elements
  whose update rounds away in the weights' storage dtype (update loss);
- one fp32 shadow backward on the first batch measures the fraction of gradient elements that are
  non-zero in fp32 but round to zero in the compute dtype (after loss scaling).

The timed steps run without any of this, so throughput stays honest; the replay measures its own cost.
The summaries at the bottom are pure (no torch): the analysis and the reports use them.
"""
from __future__ import annotations

import copy
import math
import statistics
import time

from .config import Cell, recipe_from_dict
from .models import batches, build_model, plan_from_dict, weight_dtype
from .probe import attention, build_optimizer, precision, train, unrecoverable_at

PHASES = ("forward", "backward", "optimizer")  # the order they happen in within one step
COMPUTE_DTYPES = {"bf16-amp": "bfloat16", "fp16-amp": "float16", "bf16-pure": "bfloat16", "fp16-pure": "float16"}
ROOT = "(root)"  # named_modules() calls the root ""; "<...>" would vanish as a tag in Markdown


def compute_dtype(cell_dtype: str) -> str:
    """The dtype the matmuls run in: the autocast dtype, the pure cells' weight dtype, else float32."""
    return COMPUTE_DTYPES.get(cell_dtype, "float32")


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


def _absmax(lo: float, hi: float) -> float:
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))


def _as_dict(row) -> dict:
    lo, hi = (float(x) for x in row)
    return {"min": lo, "max": hi, "absmax": _absmax(lo, hi)}


class ModuleWatch:
    """Forward hooks on every module and gradient hooks on their outputs. Reductions are queued as
    tensors and read once per step (one device sync), in the order the hooks fired."""

    def __init__(self, model):
        self.names = {m: (n or ROOT) for n, m in model.named_modules()}
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
        first = _floating(list(args[:1]) or list(kwargs.values())[:1], [])[:1]
        # the input is kept by reference and reduced only for an offender: autograd holds most inputs anyway
        self.forward_calls.append((name, stats, first[0].detach() if first else None))
        for t in outs if name != ROOT else []:  # the root's output gradient is the loss scale itself
            if t.requires_grad:
                t.register_hook(lambda g, name=name: self.backward_calls.append((name, _stats([g]))))

    def end_step(self, step: int) -> list[dict]:
        """Fold this step's calls into the running abs-max per module; return its first offenders."""
        import torch
        events = []
        for phase, calls, seen, what in (("forward", self.forward_calls, self.activation_absmax, "output"),
                                         ("backward", self.backward_calls, self.gradient_absmax, "gradient of output")):
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
            event["before"] = {"what": "the gradient computed just before", "module": calls[i - 1][0], **_as_dict(rows[i - 1])}
        return event

    def remove(self):
        for h in self.handles:
            h.remove()


class OptimizerWatch:
    """Step pre/post hooks: the first parameter an optimizer step turns non-finite, and the fraction of
    elements whose update was meant to move them but rounded away in the stored dtype."""

    def __init__(self, model, optimizer):
        self.optimizer = optimizer
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.before = None
        self.update_loss: float | None = None
        self.event: dict | None = None
        self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, optimizer, args, kwargs):
        self.before = [p.detach().clone() for _, p in self.named]

    def _post(self, optimizer, args, kwargs):
        import torch
        lost = torch.zeros((), dtype=torch.float64, device=self.before[0].device)
        meant = torch.zeros_like(lost)
        decay = optimizer.param_groups[0].get("weight_decay", 0.0)
        bad = []
        for (name, p), old in zip(self.named, self.before):
            bad.append(~torch.isfinite(p.detach()).all())
            state = optimizer.state.get(p, {})
            if "exp_avg" not in state:
                continue  # no gradient yet: AdamW left it alone on purpose
            moving = state["exp_avg"] != 0  # an element with a non-zero first moment is meant to move
            if decay:
                moving = moving | (old != 0)
            lost += (moving & (p.detach() == old)).sum()
            meant += moving.sum()
        self.update_loss = float(lost / meant) if float(meant) else None
        flags = torch.stack(bad).cpu().tolist()
        if any(flags) and self.event is None:
            i = flags.index(True)
            self.event = self._describe(i)

    def _describe(self, i: int) -> dict:
        import torch
        name, p = self.named[i]
        old, state = self.before[i], self.optimizer.state.get(p, {})
        group = self.optimizer.param_groups[0]
        eps = group.get("eps")
        event = {"phase": "optimizer", "module": name.rsplit(".", 1)[0] if "." in name else name, "parameter": name,
                 "tensor": "parameter after the update", "stats": _as_dict(_stats([p]).cpu().tolist()),
                 "before": {"what": "the parameter before the update", "module": name, **_as_dict(_stats([old]).cpu().tolist())},
                 "nonfinite_elements": int((~torch.isfinite(p.detach())).sum())}
        if "exp_avg_sq" in state:
            v = state["exp_avg_sq"]
            event["exp_avg_sq_zero_fraction"] = float((v == 0).float().mean())
            event["state_dtype"] = str(v.dtype).replace("torch.", "")
        if eps is not None:
            event["eps"] = eps
            event["eps_in_dtype"] = float(torch.tensor(eps, dtype=p.dtype))
        return event

    def take(self) -> tuple[float | None, dict | None]:
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
    return {"dtype": dtype_name, "loss_scale": scale, "fraction": lost / total if total else 0.0,
            "nonzero_elements": total, "worst": [{"parameter": n, "fraction": f} for f, n in worst[:3]]}


def replay(spec: dict, timed: dict) -> dict:
    """Rebuild the probe's model with the same seed, replay its first steps with hooks, and return the
    forensics record. `timed` is the child's result of the timed run (steps, first_nonfinite)."""
    import torch
    t0 = time.perf_counter()
    device = spec["device"]
    recipe = recipe_from_dict(spec["recipe"], spec["recipe"]["name"])
    cell, plan, seed = Cell(**spec["cell"]), plan_from_dict(spec["model_plan"]), spec["seed"]
    first_bad = timed.get("first_nonfinite")
    n_steps = first_bad["step"] + 1 if first_bad else min(len(timed["steps"]), recipe.forensics_steps)
    model = build_model(plan, recipe, cell, seed).to(device)
    stream = ({k: v.to(device) for k, v in b.items()} for b in batches(recipe, model.config, seed))
    optimizer = build_optimizer(model, recipe)
    autocast, scaler = precision(cell, device)
    dtype = compute_dtype(cell.dtype)
    out = {"compute_dtype": dtype, "weight_dtype": weight_dtype(recipe, cell), "replayed_steps": n_steps,
           "compile": "off", "events": [], "steps": []}
    if cell.compile != "off":
        out["note"] = f"replayed without torch.compile ({cell.compile}): module hooks need eager execution"
    if dtype != "float32":
        t1 = time.perf_counter()
        scales = [s["scale"] for s in timed["steps"] if s.get("scale")]
        first = {k: v.to(device) for k, v in next(batches(recipe, model.config, seed)).items()}
        out["underflow"] = gradient_underflow(model, first, dtype, scales[-1] if scales else 1.0)
        out["underflow"]["seconds"] = time.perf_counter() - t1
    modules, opt = ModuleWatch(model), OptimizerWatch(model, optimizer)

    def on_step(step, loss, grad_norm, skipped, scale, seconds, tokens):
        update_loss, opt_event = opt.take()
        for e in modules.end_step(step) + ([{"step": step, **opt_event}] if opt_event else []):
            out["events"].append(e)
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "skipped": skipped, "scale": scale,
                  "time_s": seconds, "update_loss": update_loss}
        out["steps"].append(record)
        return unrecoverable_at(record) is None

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        train(model, stream, optimizer, scaler, autocast, attention(cell), recipe.grad_clip, n_steps, on_step, sync)
    finally:
        modules.remove()
        opt.remove()
    out["activation_absmax"] = modules.activation_absmax
    out["gradient_absmax"] = modules.gradient_absmax
    out["reproduced"] = reproduced(timed["steps"], out["steps"])
    out["cost"] = replay_cost(timed["steps"], out["steps"], time.perf_counter() - t0)
    return out


# ---- pure summaries: no torch below this line ------------------------------------------------------

FINFO_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}  # torch.finfo(dtype).max


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def reproduced(timed: list[dict], replayed: list[dict]) -> bool:
    """Did the replay retrace the timed run: the same loss, bit for bit, at every replayed step?"""
    return bool(replayed) and all(_same(a["loss"], b["loss"]) for a, b in zip(timed, replayed))


def replay_cost(timed: list[dict], replayed: list[dict], seconds: float) -> dict:
    """The replay's wall time and how much slower a hooked step is than the same timed step (median of
    the per-step ratios, step 0 left out when there are others: it carries allocator warm-up)."""
    pairs = [(b["time_s"], a["time_s"]) for a, b in zip(timed, replayed) if a.get("time_s") and b.get("time_s")]
    pairs = pairs[1:] or pairs
    return {"seconds": seconds, "hooked_step_overhead": statistics.median(h / t for h, t in pairs) if pairs else None}


def origin(forensics: dict | None) -> dict | None:
    """The first event that made the run unrecoverable: the earliest by (step, phase), leaving out
    backward overflows at steps the GradScaler skipped and recovered from (its calibration)."""
    if not forensics:
        return None
    steps = {s["step"]: s for s in forensics.get("steps", [])}

    def harmful(e):
        s = steps.get(e["step"])
        calibration = s is not None and s["skipped"] and unrecoverable_at(s) is None
        return not (e["phase"] == "backward" and calibration)

    events = sorted((e for e in forensics.get("events", []) if harmful(e)), key=lambda e: (e["step"], PHASES.index(e["phase"])))
    return events[0] if events else None


def headroom(forensics: dict | None) -> list[dict]:
    """Per module: largest |activation| and |gradient| seen, and the compute dtype's largest finite
    value divided by each (1.0 = at the edge, below 1 = overflowed). Tightest activation first."""
    if not forensics:
        return []
    limit = FINFO_MAX[forensics["compute_dtype"]]
    acts, grads = forensics.get("activation_absmax", {}), forensics.get("gradient_absmax", {})

    def ratio(x):
        return None if x is None else (0.0 if not math.isfinite(x) else (math.inf if x == 0 else limit / x))

    rows = [{"module": m, "activation_absmax": acts.get(m), "activation_headroom": ratio(acts.get(m)),
             "gradient_absmax": grads.get(m), "gradient_headroom": ratio(grads.get(m))} for m in set(acts) | set(grads)]
    big = math.inf
    return sorted(rows, key=lambda r: (r["activation_headroom"] if r["activation_headroom"] is not None else big,
                                       r["gradient_headroom"] if r["gradient_headroom"] is not None else big, r["module"]))


def update_loss(forensics: dict | None) -> dict | None:
    """Mean and largest per-step fraction of parameter elements whose update rounded away."""
    values = [s["update_loss"] for s in (forensics or {}).get("steps", []) if s.get("update_loss") is not None]
    if not values:
        return None
    return {"mean": sum(values) / len(values), "max": max(values), "steps": len(values),
            "weight_dtype": forensics["weight_dtype"]}
