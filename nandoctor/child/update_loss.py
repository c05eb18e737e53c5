"""Step 0's update loss on a run nandoctor does not drive, without a replay: the training callbacks'
(integrations/judge.py) on the user's own run, and a probe's under the user's trainer (trainer.py), whose
steps nandoctor's own loop would not retrace. OptimizerWatch's hooks on the live optimizer count the
elements that step 0's update was meant to move and rounding in the weights' dtype left as they were,
against the weights copied to host memory before any step; the figure goes where a probe's forensics
hold it, which the stall rule reads (analysis/verdicts/curve.update_lost)."""

from __future__ import annotations

from .instruments import OptimizerWatch, local

# the elements of each trainable tensor whose step-0 update the callbacks count toward the update loss (a
# probe counts every element of its own copy; a live run's weights are not copied whole)
UPDATE_ELEMENTS = 1 << 16


def step0_updates(model, optimizer, elements: int | None = UPDATE_ELEMENTS) -> OptimizerWatch | None:
    """Optimizer hooks that count, over the first `elements` of each trainable tensor (None: all), the
    elements step 0's update was meant to move and rounding in the weights' dtype left as they were: the
    weights before any step copied to host memory now, compared after the optimizer step
    (`update_figures`). A step the GradScaler skips measures nothing. None for an optimizer that is not a
    torch one (no step hooks to put on it)."""
    if not hasattr(optimizer, "register_step_pre_hook"):
        return None
    watch = OptimizerWatch(model, optimizer, deferred=True, elements=elements)
    watch.initial = {n: watch.kept(local(p).detach()).to("cpu", copy=True) for n, p in watch.named}
    return watch


def update_figures(updates: OptimizerWatch, step: int) -> dict | None:
    """After the optimizer step of `step` (the first): its update loss as a probe's forensics hold it,
    {"weight_dtype", "steps": [{"step", "update_loss"}]}; None where nothing was measured (the GradScaler
    skipped the step, or no parameter got AdamW's state). The hooks come off."""
    try:
        lost, _ = updates.take()
    finally:
        updates.remove()
    if lost is None:
        return None
    weights = str(updates.named[0][1].dtype).replace("torch.", "")
    return {"weight_dtype": weights, "steps": [{"step": step, "update_loss": lost}]}
