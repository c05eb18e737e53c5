"""The probe's own setup, measured at step 0 where a training option can break it without the loss
saying so, with the measurements of nandoctor/measure/ (the data lint's too) on the probe's own
model, precision, attention implementation and collator, before the timed steps:

- packed batches (data.packing): packing isolation (measure/packing.py), the largest logit difference
  between the first packed micro-batch's forward and each of its segments run alone
  (`packing_max_logit_diff`), beside the segments alone in the probe's precision against fp32
  (`packing_floor`: what the model's own rounding moves a logit by, the floor a leak stands out from);
- several micro-batches a step (gradient_accumulation_steps > 1): step 0's gradient accumulated over
  its micro-batches through the model's own loss, as the probe trains (train.micro_loss), against the
  full batch's gradient from one backward of all its rows (`accumulation_error`, beside its
  `accumulation_floor`; measure/accumulation.py).

Skipped (None) when neither option is on. No dropout, no RNG draw, no weight moves (the fp32 floor
casts the weights up and back bit for bit), and the gradients are unset afterwards, so the timed steps
train as they would without it.
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

    from ..measure.accumulation import accumulation_figures
    from ..measure.packing import packing_isolation

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
        out.update(accumulation_figures(s.model, batches, full, s.normalization, ACCUMULATION_ELEMENTS))
    reset_peak_memory(spec.device)  # the checks' transients are not the training's peak
    out["seconds"] = time.perf_counter() - t0
    return out
