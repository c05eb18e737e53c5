"""fp8 training inside the probe process: put a model into fp8 the way an fp8 `dtype` value's recipe
(cells.Fp8Recipe) says (torchao float8 linears, or Transformer Engine linears under TE's fp8
autocast), and measure how its casts fare (Fp8Watch, hung off the forensics replay).

Not every linear can or should go to fp8; those stay in high precision and are returned by name
with the reason, for the report to list.

The casts: a cast multiplies by a scale and rounds to the format; values beyond the format's largest
finite number saturate (clamped to it), non-zero values below half its smallest subnormal flush to
zero. Both are measured by doing the cast with torch's own float8 dtypes, which exist on CPU too, so
the maths is the same on every device. Scales follow the recipe: torchao computes them from the
current tensor (amax -> format max, so nothing saturates), TE's DelayedScaling from the amax history
of earlier steps (so a tensor larger than any before it saturates).
"""

from __future__ import annotations

import contextlib
import importlib
from collections import deque

from ..cells import Fp8Recipe
from ..config import Fp8Config

# fp8 GEMMs need every matrix dimension divisible by 16: torch._scaled_mm checks it (pytorch/ao#571,
# #3111) and TE asserts it ("FP8 execution requires 2D input matrices with height divisible by 8 and
# width divisible by 16", NVIDIA/TransformerEngine#1422, whose maintainers advise leaving such layers
# out of fp8).
FP8_MULTIPLE = 16
# Linears kept in high precision by name (the last part of the module path), with the reason.
KEEP_HIGH_PRECISION = {
    "lm_head": "the output projection feeds the softmax over the vocabulary and is precision-sensitive; "
    "torchtitan keeps it in bf16 (pytorch/torchtitan#4008)",
}


def fp8_exclusions(model) -> dict[str, str]:
    """{module name: why it stays in high precision} for every nn.Linear fp8 cannot or should not take."""
    import torch

    left_out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in KEEP_HIGH_PRECISION:
            left_out[name] = KEEP_HIGH_PRECISION[leaf]
        elif module.in_features % FP8_MULTIPLE or module.out_features % FP8_MULTIPLE:
            left_out[name] = (
                f"{module.in_features} -> {module.out_features} features: fp8 GEMMs need both "
                f"divisible by {FP8_MULTIPLE}"
            )
    return left_out


def convert_torchao(model, recipe: str) -> dict[str, str]:
    """Swap the model's eligible nn.Linear for torchao Float8Linear with recipe 'tensorwise' or
    'rowwise' (dynamic scaling from the current tensor); returns the linears left out, with why."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    left_out = fp8_exclusions(model)
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn: fqn not in left_out,
    )
    return left_out


def convert_te(model) -> dict[str, str]:
    """Swap the model's eligible nn.Linear for transformer_engine te.Linear with the same weights
    (te.Linear is not an nn.Linear subclass); returns the linears left out, with why."""
    import torch
    import transformer_engine.pytorch as te

    left_out = fp8_exclusions(model)
    targets = [
        (name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name not in left_out
    ]
    for name, linear in targets:
        swapped = te.Linear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            params_dtype=linear.weight.dtype,
            device=linear.weight.device,
        )
        with torch.no_grad():
            swapped.weight.copy_(linear.weight)
            if linear.bias is not None:
                swapped.bias.copy_(linear.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, swapped)
    return left_out


def te_autocast(te_format: str, delayed: Fp8Config):
    """A context factory for TE's fp8 autocast with DelayedScaling: the scale of each fp8 tensor comes
    from the largest (algo 'max') or latest ('most_recent') amax of its last `amax_history_len` steps."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    recipe = DelayedScaling(
        fp8_format=getattr(Format, te_format),
        amax_history_len=delayed.amax_history_len,
        amax_compute_algo=delayed.amax_compute_algo,
    )
    if hasattr(te, "autocast"):  # TE 2.x; fp8_autocast(fp8_recipe=) is its deprecated alias
        return lambda: te.autocast(enabled=True, recipe=recipe)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def prepare_fp8(model, fp8: Fp8Recipe, delayed: Fp8Config = Fp8Config()):
    """Convert `model` in place for an fp8 dtype value's recipe. Returns (context factory to wrap the
    forward in, inside the bf16 autocast; {linear left in high precision: why})."""
    if fp8.torchao_recipe:
        return contextlib.nullcontext, convert_torchao(model, fp8.torchao_recipe)
    left_out = convert_te(model)
    return te_autocast(fp8.te_format, delayed), left_out


# format: (torch dtype name, largest finite value, spacing of the top binade). OCP 8-bit floating point
# spec; torch.finfo agrees on the max. 448 = 1.75 * 2**8 with 3 mantissa bits: step 2**5 = 32;
# 57344 = 1.75 * 2**15 with 2 mantissa bits: step 2**13 = 8192.
FP8_FORMATS = {"e4m3": ("float8_e4m3fn", 448.0, 32.0), "e5m2": ("float8_e5m2", 57344.0, 8192.0)}
# torchao clamps amax from below before dividing (torchao/float8/float8_utils.py EPS).
AMAX_EPS = 1e-12


def cast_stats(x, fmt: str, scale) -> dict:
    """How `x` fares cast to `fmt` after multiplying by `scale` (a number, or a tensor that broadcasts
    against x): its amax, the scale range, and the shares of its non-zero values that saturate at the
    format's max and that flush to zero."""
    import torch

    dtype, fmax, top_step = FP8_FORMATS[fmt]
    x = x.detach().float()
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    scaled = x * scale
    cast = scaled.clamp(-fmax, fmax).to(getattr(torch, dtype)).float()
    nonzero = max(int((x != 0).sum()), 1)
    return {
        "amax": x.abs().max().item() if x.numel() else 0.0,
        "scale_min": scale.min().item(),
        "scale_max": scale.max().item(),
        # beyond max + half the top step even round-to-nearest would not land on max: that is clipping
        # (the float rounding of amax * scale sits well inside that margin)
        "saturated": int((scaled.abs() >= fmax + top_step / 2).sum()) / nonzero,
        "flushed": int(((x != 0) & (cast == 0)).sum()) / nonzero,
    }


def dynamic_scale(x, fmt: str, rowwise: bool = False, power_of_2: bool = False):
    """torchao's dynamic scale: format max over the current amax (per tensor, or per row along the
    last dimension), optionally rounded down to a power of 2 as the rowwise recipe does."""
    import torch

    amax = x.detach().abs().float()
    amax = amax.amax(dim=-1, keepdim=True) if rowwise else amax.max()
    scale = FP8_FORMATS[fmt][1] / amax.double().clamp(min=AMAX_EPS)
    scale = scale.float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


class DelayedScale:
    """TE DelayedScaling for one tensor: the scale used at a step comes from the amaxes of the steps
    before it (the largest of the last `history_len` for algo 'max', the latest for 'most_recent'),
    starting at 1.0; a zero or non-finite amax keeps the previous scale."""

    def __init__(
        self,
        fmt: str,
        history_len: int = Fp8Config.amax_history_len,
        algo: str = Fp8Config.amax_compute_algo,
        margin: int = 0,
    ):
        self.fmt, self.algo, self.margin = fmt, algo, margin
        self.history: deque = deque(maxlen=history_len)
        self.scale = 1.0

    def observe(self, x) -> dict:
        """Cast x with the current scale, then record its amax and update the scale for the next step."""
        stats = cast_stats(x, self.fmt, self.scale)
        self.history.append(stats["amax"])
        amax = max(self.history) if self.algo == "max" else self.history[-1]
        if 0 < amax < float("inf"):
            self.scale = FP8_FORMATS[self.fmt][1] / amax / 2**self.margin
        return stats


# Where each fp8 package keeps its linear class (package: (module, class)).
FP8_LINEARS = {
    "torchao": ("torchao.float8.float8_linear", "Float8Linear"),
    "transformer_engine": ("transformer_engine.pytorch", "Linear"),
}
WORST = {"amax": max, "scale_min": min, "scale_max": max, "saturated": max, "flushed": max}


class Fp8Watch:
    """Hooks on every fp8 linear of a converted model (torchao Float8Linear, TE Linear) that record,
    per linear and tensor role (input, weight, grad_output), the worst amax, scale range, saturation
    and flush shares over the steps it watched. Hangs off the training loop: no change to it."""

    def __init__(self, model, fp8: Fp8Recipe, delayed: Fp8Config = Fp8Config()):
        self.formats = {"input": fp8.forward_format, "weight": fp8.forward_format, "grad_output": fp8.backward_format}
        self.rowwise = fp8.scaling == "rowwise"
        self.delayed = {} if fp8.scaling == "delayed" else None
        self.history = (delayed.amax_history_len, delayed.amax_compute_algo)
        self.stats: dict[str, dict[str, dict]] = {}
        self.handles = []
        module_path, cls = FP8_LINEARS[fp8.package]
        fp8_linear = getattr(importlib.import_module(module_path), cls)
        for name, module in model.named_modules():
            if isinstance(module, fp8_linear):
                self.handles.append(module.register_forward_hook(self._forward(name)))
                self.handles.append(module.register_full_backward_hook(self._backward(name)))

    def _observe(self, name: str, role: str, x, power_of_2: bool = False):
        fmt = self.formats[role]
        if self.delayed is not None:
            scaler = self.delayed.setdefault((name, role), DelayedScale(fmt, *self.history))
            stats = scaler.observe(x)
        else:
            stats = cast_stats(x, fmt, dynamic_scale(x, fmt, self.rowwise, power_of_2))
        seen = self.stats.setdefault(name, {}).get(role)
        self.stats[name][role] = stats if seen is None else {k: WORST[k](seen[k], stats[k]) for k in stats}

    def _forward(self, name):
        def hook(module, args, output):
            power_of_2 = getattr(getattr(module, "config", None), "round_scales_to_power_of_2", False)
            self._observe(name, "input", args[0], power_of_2)
            self._observe(name, "weight", module.weight, power_of_2)

        return hook

    def _backward(self, name):
        def hook(module, grad_input, grad_output):
            power_of_2 = getattr(getattr(module, "config", None), "round_scales_to_power_of_2", False)
            if grad_output[0] is not None:
                self._observe(name, "grad_output", grad_output[0], power_of_2)

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def fp8_watch(model, cell, recipe):
    """An Fp8Watch on the model of an fp8 cell (the forensics replay hangs it on); None for other cells."""
    return Fp8Watch(model, cell.precision.fp8, recipe.fp8) if cell.precision.fp8 else None
