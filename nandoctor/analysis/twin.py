"""What a random-init twin cannot show: a verdict in half precision on a twin is a verdict on random
weights, whose activations stay small (a random init's residual stream holds values near 1). A trained
model's are larger, with outliers in a few channels: some 2025 families overflow fp16's 65504 on their
trained weights (knowledge/rules.yaml fp16-overflow-on-trained-weights, with the public reports), which
no twin of them reproduces."""

from __future__ import annotations

from ..cells import Cell
from ..record import ModelPlan

HALF_PRECISION = ("float16", "bfloat16")


def twin_caveat(plan: ModelPlan, cells: list[Cell]) -> str | None:
    """The caveat of the half-precision cells among `cells` when the probes trained a random-init
    architecture twin, in one sentence; None for real weights or no half-precision cell."""
    half = [c.id for c in cells if c.precision.compute in HALF_PRECISION]
    if plan.source != "architecture-twin" or not half:
        return None
    shown = ", ".join(half[:3]) + (f" and {len(half) - 3} more" if len(half) > 3 else "")
    return (
        f"the half-precision verdicts ({shown}) are measured on a random-init twin, whose activations are "
        "smaller than the trained model's: trained weights carry larger activations and outlier channels "
        "(past fp16's 65504 in some families), which a twin cannot show; probe the real checkpoint "
        "(--model DIR) to judge them on its weights"
    )
