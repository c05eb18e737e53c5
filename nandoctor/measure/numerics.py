"""What every measurement shares: dropout off, and the fp32 reference a rounding floor comes from."""

from __future__ import annotations

import contextlib
import itertools


@contextlib.contextmanager
def without_dropout(model):
    """Dropout off for the measurement (nn.Dropout modules and the attention_dropout rate attention
    modules read in training), restored afterwards."""
    import torch

    saved = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            saved.append((module, "p", module.p))
            module.p = 0.0
        elif isinstance(getattr(module, "attention_dropout", None), float):
            saved.append((module, "attention_dropout", module.attention_dropout))
            module.attention_dropout = 0.0
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def in_fp32(model):
    """The model in true fp32 for the duration: every floating parameter and buffer of another dtype
    cast to float32 in place (the same tensors, so an optimizer built over them keeps them), and fp32
    matmuls at full precision (no TF32). On the way out each goes back to its dtype, bit for bit (bf16
    and fp16 hold exactly in fp32), the precision settings are restored and the gradients unset (an
    fp32 gradient does not fit a bf16 weight). What a computation gives here against what it gives in
    the model's own precision is that precision's rounding: the floor a check's figure stands out from."""
    import torch

    tensors = itertools.chain(model.parameters(), model.buffers())
    saved = [(t, t.dtype) for t in tensors if t.is_floating_point() and t.dtype != torch.float32]
    matmul, cuda_tf32, cudnn_tf32 = (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    for t, _ in saved:
        t.data = t.data.float()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield model
    finally:
        for p in model.parameters():
            p.grad = None
        for t, dtype in saved:
            t.data = t.data.to(dtype)
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = cuda_tf32, cudnn_tf32


def relative_error(got, want) -> float | None:
    """||got - want|| / ||want|| of two flat tensors, in fp32; None when it is not a number (no gradient
    to compare with, a micro-batch without targets)."""
    value = float((got.float() - want.float()).norm() / want.float().norm())
    return value if value == value else None


def cosine(a, b) -> float | None:
    import torch

    value = float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
    return value if value == value else None
