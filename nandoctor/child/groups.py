"""Gradient accounting per parameter group (models.trainable_groups: adapter, modules_to_save,
embeddings, rest): each trainable group's gradient norm at every timed step, so that a group that
never learns is seen even while the loss falls through another (issue 30: LoRA weights cut off by
reentrant gradient checkpointing while a modules_to_save lm_head trains).

The norms are read where the loop unscales (after the backward, a rank's reduction and the
GradScaler's unscale_, before clipping): `GroupNorms` wraps the GradScaler as
reduction_watch.ObservedScaler does, so the loop itself is unchanged. A group none of whose parameters
received a gradient reads None.
"""

from __future__ import annotations


def describe(groups: dict) -> dict:
    """{group: {"tensors", "elements", "first"}}: what each group of models.trainable_groups holds."""
    return {
        g: {"tensors": len(params), "elements": sum(p.numel() for _, p in params), "first": params[0][0]}
        for g, params in groups.items()
    }


class GroupNorms:
    """The GradScaler of the timed steps, reading each group's gradient norm once it has unscaled them.
    `take` returns the last step's {group: norm or None} as floats (read after the step's timing)."""

    def __init__(self, scaler, groups: dict):
        self.scaler, self.groups = scaler, groups
        self.norms: dict = {}

    def unscale_(self, optimizer):
        out = self.scaler.unscale_(optimizer)
        self.norms = {g: _norm([p.grad for _, p in params if p.grad is not None]) for g, params in self.groups.items()}
        return out

    def take(self) -> dict:
        norms, self.norms = self.norms, {}
        return {g: None if n is None else n.item() for g, n in norms.items()}

    def __getattr__(self, name):
        return getattr(self.scaler, name)


def _norm(grads: list):
    """The 2-norm of these gradients together, as a 0-d tensor (no device sync), or None for none.
    FSDP2's gradients are shards (DTensors): their norm is gathered whole, on every rank alike."""
    import torch

    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
