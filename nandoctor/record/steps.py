"""One training step as a probe measured it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..thresholds import THRESHOLDS
from .fields import ints_as_floats, known_fields


@dataclass
class Step:
    """One training step as measured: loss and grad-norm (before clipping), and the GradScaler's say."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool = False  # the GradScaler skipped the optimizer step (inf/nan in the unscaled grads)
    scale: float | None = None  # the loss scale the step ran at; None without a GradScaler
    time_s: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    update_loss: float | None = None  # forensics replay only: share of meant updates that rounded away
    # each trainable parameter group's gradient norm after unscaling, before clipping (child/groups.py;
    # models.GROUPS: adapter, modules_to_save, embeddings, rest); None for a group no parameter of which
    # got a gradient. Records before it, and replayed steps: None
    groups: dict | None = None
    # the loss terms (labels other than -100 after the shift) of the step's micro-batch that has the
    # fewest: 0 when a batch has no target, whose mean loss is 0/0. None where unknown (records before
    # it, a live run's steps)
    supervised: int | None = None
    # the kind of batch the step trained (data.Batch.kind: synthetic, first, longest, most_padded,
    # fewest_supervised; a step of several micro-batches joins theirs with "+"): a loss spike is judged
    # against earlier steps of the same kind. None where unknown
    batch: str | None = None
    # a mixture of experts: the load-balancing loss the model added to this step's loss, before its
    # router_aux_loss_coef (summed over the step's micro-batches); None where the loss held none
    aux_loss: float | None = None
    # objective=grpo (child/rollout.py): the mean toy reward of the step's completions, and the policy's
    # mean entropy over their tokens as the training path computed it. None for an sft step
    reward: float | None = None
    entropy: float | None = None

    def __post_init__(self):
        ints_as_floats(self, ("loss", "grad_norm", "scale", "time_s", "tokens_per_s", "update_loss"))

    def unrecoverable(self, min_scale: float = THRESHOLDS.min_scale) -> str | None:
        """What made this step unrecoverable ('loss', 'grad' or 'scale'), or None. A GradScaler skip
        with a finite loss is calibration, not failure, until the scale would fall below min_scale."""
        if not math.isfinite(self.loss):
            return "loss"
        if self.scale is None and not math.isfinite(self.grad_norm):
            return "grad"  # without a scaler, a non-finite grad reaches the weights
        if self.scale is not None and self.skipped and self.scale / 2 < min_scale:
            return "scale"
        return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Step:
        return cls(**known_fields(cls, data))
