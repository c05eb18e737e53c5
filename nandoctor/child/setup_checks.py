"""The probe's own setup, measured at step 0 where a training option can break it without the loss
saying so, with the data lint's measurements (userdata/measure.py) on the probe's own model,
attention implementation and collator, before the timed steps:

- packed batches (data.packing): packing isolation, the largest logit difference between the first
  packed micro-batch's forward and each of its segments run alone (`packing_max_logit_diff`), beside
  the same forward with no mask and no cache (`packing_clean_diff`: what the model's own arithmetic
  moves a logit by, the floor a leak stands out from);
- several micro-batches a step (gradient_accumulation_steps > 1): the cosine of step 0's accumulated
  gradient, as the probe's loss normalisation makes it, to the full batch's token-normalised gradient
  (`accumulation_cosine`), with both normalisations' figures.

Skipped (None) when neither option is on. No dropout, no RNG draw, no weight moves, and the
gradients are unset afterwards, so the timed steps train as they would without it.
"""

from __future__ import annotations

import time

from ..data import Batch
from ..record import ProbeSpec
from .build import Setup
from .train import reset_peak_memory

# The trainable block parameters the accumulation check compares (three flat fp32 copies of their
# gradient): the first 2**26 numbers, 768 MiB at most, whatever the model's size.
ACCUMULATION_ELEMENTS = 2**26


def setup_checks(spec: ProbeSpec, s: Setup) -> dict | None:
    """The figures of the checks this probe's options call for (module docstring), with the seconds
    they took; None when none applies. `s` is the setup before any rank wraps its model."""

    from ..userdata.measure import accumulation_figures, packing_isolation

    recipe = spec.recipe
    packed, micro = recipe.data.packing != "none", recipe.gradient_accumulation_steps
    if not packed and micro == 1:
        return None
    t0 = time.perf_counter()
    dtype = s.model.get_input_embeddings().weight.dtype  # no autocast here: a float mask in the weights' dtype
    group, _ = next(s.stream.steps(micro))
    batches = [b.to(spec.device, dtype) for b in group]
    out = {}
    if packed:
        out.update(packing_isolation(s.model, batches[0]))
    if micro > 1:
        full = Batch(s.stream.joined(group)).to(spec.device, dtype)
        figures = accumulation_figures(s.model, batches, full, ACCUMULATION_ELEMENTS)
        figures["accumulation_cosine"] = figures[f"accumulation_cosine_{s.normalization}"]
        out.update(figures, loss_normalization=s.normalization)
        s.model.zero_grad(set_to_none=True)
    reset_peak_memory(spec.device)  # the checks' transients are not the training's peak
    out["seconds"] = time.perf_counter() - t0
    return out
