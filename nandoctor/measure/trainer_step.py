"""One optimizer step of a transformers `Trainer` run, measured from hooks on its model: the step's real
loss from the model's own output (so a NaN that `logging_nan_inf_filter` replaces in the logs is still
seen) and the pre-clip grad-norm from hooks that fire as each parameter's gradient is accumulated (the
Trainer clips before any callback runs). The training callback (integrations/transformers.py) and the
probe that runs the user's Trainer (child/trainer.py) both measure a step with it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


def supervised(batches) -> int | None:
    """The fewest supervised tokens (labels other than -100 after the causal shift, as transformers' models
    shift them) of a step's micro-batches: 0 when one of them has no target, so its mean loss is 0/0.
    None when a batch is no dict with a labels tensor (a training_step of the user's own reads it)."""
    counts = []
    for b in batches:
        labels = b.get("labels") if isinstance(b, dict) else None
        if not hasattr(labels, "dim") or labels.dim() < 1:
            return None
        counts.append(int((labels[..., 1:] != -100).sum()))
    return min(counts, default=None)


def local(p):
    """This rank's shard of an FSDP2 parameter (a DTensor), or the parameter itself: reading a
    DTensor whole would be a collective that the other ranks do not join."""
    return p.to_local() if hasattr(p, "to_local") else p


@dataclass
class StepFigures:
    """What one optimizer step showed the hooks: the micro-batches' inputs and losses, and the norm of
    each parameter's accumulated gradient (scaled, when a GradScaler is on)."""

    inputs: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    norms: dict = field(default_factory=dict)
    summed: bool = False  # the model took num_items_in_batch: each micro-batch loss is a share of the step's


class Measured(NamedTuple):
    """One step as the hooks measured it, before its optimizer step."""

    loss: float  # the step's loss, as the Trainer trains on it
    grad_norm: float  # pre-clip, unscaled
    scale: float | None  # the GradScaler's scale; None without one
    batch: dict  # the first micro-batch's inputs
    norms: dict  # {parameter: its accumulated gradient's norm, scaled}
    micro_batches: tuple = ()  # every micro-batch's inputs, as the model was given them


class StepMeter:
    """Hooks on a Trainer's model that measure the steps `begin` opens. `share`: over how many processes'
    tokens the Trainer averages each micro-batch loss (integrations.transformers.ranks_sharing_tokens)."""

    def __init__(self, share: int = 1):
        self.share = share
        self.step: StepFigures | None = None

    def begin(self, measured: bool = True) -> None:
        """A step starts: measure it, or (measured=False) leave the hooks quiet through it."""
        self.step = StepFigures() if measured else None

    def inputs(self, module, args, kwargs) -> None:
        if self.step is not None:
            self.step.inputs.append(kwargs)

    def loss(self, module, args, kwargs, output) -> None:
        loss = getattr(output, "loss", None)
        if self.step is not None and loss is not None:
            self.step.losses.append(loss.detach())
            self.step.summed = "num_items_in_batch" in kwargs

    def micro_batch(self, inputs: dict, loss) -> None:
        """A micro-batch the trainer's training_step trained, with the loss it returned (its share of the
        step's loss): for a trainer whose model computes no loss of its own (GRPOTrainer)."""
        if self.step is not None:
            self.step.inputs.append(inputs)
            self.step.losses.append(loss.detach())
            self.step.summed = True

    def grad(self, p) -> None:
        import torch

        if self.step is not None:
            # FSDP2: this rank's shard; a DTensor's whole norm would be a collective a rank whose watch is
            # off never joins
            self.step.norms[p] = torch.linalg.vector_norm(local(p.grad), dtype=torch.float32)

    def take(self, optimizer) -> Measured | None:
        """Before the optimizer step (the Trainer's on_pre_optimizer_step, `optimizer` as it passes it):
        what the open step measured; None when it saw no loss. The hooks go quiet until the next `begin`."""
        import torch

        step, self.step = self.step, None
        if step is None or not step.losses:
            return None
        scaler = getattr(optimizer, "scaler", None)
        scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        losses = torch.stack(step.losses).float()
        loss = losses.sum() * self.share if step.summed else losses.mean()
        grad_norm = torch.linalg.vector_norm(torch.stack(list(step.norms.values())).float()) / (scale or 1.0)
        return Measured(loss.item(), grad_norm.item(), scale, step.inputs[0], step.norms, tuple(step.inputs))
