"""Bytes a training step holds: weights, gradients and optimizer state, counted as real storage.

Quantized optimizers keep their state in forms that `numel * element_size` misreads: torchao wraps
uint8 codes and fp32 block scales in a tensor subclass whose dtype and shape are those of the fp32
parameter (so the naive sum equals plain AdamW's), and bitsandbytes shares one quantization map
between all parameters. So every tensor is opened down to the plain tensors it is made of
(__tensor_flatten__, recursively) and each distinct storage is counted once.
"""

from __future__ import annotations


def plain_tensors(value):
    """The plain tensors inside a value: a tensor, a tensor subclass (opened through its
    __tensor_flatten__ inner tensors), or a dict / list / tuple of these. Other values hold no tensor memory."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from plain_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from plain_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from plain_tensors(v)


def storage_bytes(values, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `values` (anything plain_tensors takes). `seen` carries
    storages already counted, so that one storage shared by two groups is counted in the first only."""
    seen = set() if seen is None else seen
    total = 0
    for t in plain_tensors(values):
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def naive_bytes(values) -> int:
    """sum(numel * element_size) over the outer tensors, as a reader of `tensor.dtype` would add it
    up: right for plain tensors, wrong for quantized state kept in subclasses."""
    import torch

    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    items = values.values() if isinstance(values, dict) else values if isinstance(values, (list, tuple)) else ()
    return sum(naive_bytes(v) for v in items)


def memory_split(model, optimizer) -> dict:
    """Weight, gradient and optimizer-state bytes as real storage, plus the naive state sum. Call it
    after backward and before zero_grad, when the gradients exist."""
    params = list(model.parameters())
    seen: set = set()
    state = list(optimizer.state.values())
    return {
        "weights_bytes": storage_bytes(params, seen),
        "grads_bytes": storage_bytes([p.grad for p in params if p.grad is not None], seen),
        "optimizer_state_bytes": storage_bytes(state, seen),
        "optimizer_state_naive_bytes": naive_bytes(state),
    }


def split_after_first_step(model, optimizer) -> dict:
    """A dict that memory_split fills after the optimizer's first step, when its state exists and the
    gradients are not yet zeroed (a step post-hook that then removes itself, so later steps run bare)."""
    split: dict = {}

    def measure(opt, args, kwargs):
        split.update(memory_split(model, opt))
        handle.remove()

    handle = optimizer.register_step_post_hook(measure)
    return split
