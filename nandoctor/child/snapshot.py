"""The model's initial state, kept before the timed steps so that the forensics replay can start from
it again without building the model a second time (a second build of an 8B twin cost ~95 s of an H100
probe, issue 10).

Only the trainable parameters are kept when an adapter freezes the base (the frozen weights never
change); the whole state (parameters and buffers) otherwise. On a GPU the copy stays on the GPU when
it fits beside what training still allocates, else it goes to pinned host memory; on a CPU it is a
plain copy. The RNG states are kept too, so that anything random in the forward (dropout) replays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

TRAINING_STATE_FACTOR = 3  # what training still allocates per trainable byte: its gradient and AdamW's two moments
SNAPSHOT_FIT = 0.5  # keep on the GPU only within half the free memory: activations are not counted above


def keep_on_device(snapshot_bytes: int, trainable_bytes: int, free_bytes: int) -> bool:
    """Whether a snapshot of `snapshot_bytes` can stay on the GPU next to the training state still to come."""
    return snapshot_bytes + TRAINING_STATE_FACTOR * trainable_bytes <= SNAPSHOT_FIT * free_bytes


def _tensors(model) -> dict:
    if any(not p.requires_grad for p in model.parameters()):
        return {n: p for n, p in model.named_parameters() if p.requires_grad}  # an adapter: the base is frozen
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@dataclass
class Snapshot:
    saved: dict  # name -> a copy of the tensor
    rng: tuple  # (CPU generator state, CUDA generator state or None)
    where: str  # "cuda", "pinned-host" or "cpu"
    bytes: int
    seconds: float

    @classmethod
    def take(cls, model, device: str) -> Snapshot:
        import torch

        t0 = time.perf_counter()
        live = _tensors(model)
        size = sum(t.numel() * t.element_size() for t in live.values())
        where = "cpu"
        if device == "cuda":
            trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            where = "cuda" if keep_on_device(size, trainable, torch.cuda.mem_get_info()[0]) else "pinned-host"
        with torch.no_grad():
            if where == "pinned-host":
                saved = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for n, t in live.items()}
            else:
                saved = {n: t.detach().clone() for n, t in live.items()}
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state() if device == "cuda" else None)
        if device == "cuda":
            torch.cuda.synchronize()
        return cls(saved, rng, where, size, time.perf_counter() - t0)

    def restore(self, model) -> float:
        """Copy the kept state back into `model`; returns the seconds it took."""
        import torch

        t0 = time.perf_counter()
        live = _tensors(model)
        with torch.no_grad():
            for name, saved in self.saved.items():
                live[name].copy_(saved)
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None:
            torch.cuda.set_rng_state(self.rng[1])
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def describe(self) -> dict:
        return {"where": self.where, "bytes": self.bytes, "seconds": self.seconds}
