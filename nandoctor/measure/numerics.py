"""What every measurement shares: dropout off, the fp32 reference a rounding floor comes from, and the SDPA
backend an attention row pins."""

from __future__ import annotations

import contextlib
import itertools


class NoLoss(TypeError):
    """The model's forward returned no loss for a batch with labels."""


def loss_of(out):
    """The loss a forward given `labels` returned; NoLoss, saying what is wrong and what is valid, when it
    returned none (arithmetic on None would raise a TypeError that names neither)."""
    loss = getattr(out, "loss", None)
    if loss is None:
        raise NoLoss(
            f"the model returned loss=None ({type(out).__name__}) for a batch with labels: its forward computes "
            "none from them (custom code that drops `labels`, or no LM head); nandoctor trains the loss "
            "forward(labels=...) returns"
        )
    return loss


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


def fp32_precision_knobs() -> list:
    """The per-backend fp32 precision settings of torch >= 2.9 (`torch.backends.<backend>.<op>.fp32_precision`:
    "ieee", "tf32" or "none" to follow the global one), or [] on an older torch, which has only the
    legacy API (`allow_tf32`, `set_float32_matmul_precision`). Where the new API exists nandoctor reads
    it, never the legacy reader: from torch 2.9 to at least 2.13, `get_float32_matmul_precision()` raises
    once a process has set precision through both APIs (the user's code, Lightning or an earlier probe)."""
    import torch

    backends = torch.backends
    if not hasattr(getattr(backends.cuda, "matmul", None), "fp32_precision"):
        return []
    ops = (("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"), ("mkldnn", "matmul"), ("mkldnn", "conv"))
    found = (getattr(getattr(backends, b, None), op, None) for b, op in ops)
    return [knob for knob in found if hasattr(knob, "fp32_precision")]


def cuda_matmul_precision() -> str:
    """How float32 matmuls run on CUDA in this process, in Lightning's and
    `set_float32_matmul_precision`'s words: "highest" (IEEE fp32), "high" (TF32) or "medium" (bf16).
    Read without raising on any torch (fp32_precision_knobs)."""
    import torch

    if fp32_precision_knobs():
        mode = torch.backends.cuda.matmul.fp32_precision
        if mode == "none":
            mode = getattr(torch.backends, "fp32_precision", "ieee")
        return {"tf32": "high", "bf16": "medium"}.get(mode, "highest")
    return torch.get_float32_matmul_precision()


def set_tf32(on: bool) -> None:
    """TF32 tensor-core matmuls and convolutions on CUDA on or off (a probe's cell decides), through the
    legacy switches: torch keeps its per-backend settings in step with them, and its legacy reader
    (which inductor's cache key still calls) stays consistent. Setting the per-backend CUDA matmul
    setting to "tf32" instead makes that reader raise (torch 2.13)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on


@contextlib.contextmanager
def _full_fp32_precision():
    """Every fp32 matmul and convolution at IEEE precision (no TF32, no bf16) for the duration; each
    setting restored afterwards, through the API it was read with."""
    import torch

    knobs = fp32_precision_knobs()
    if knobs:
        saved, legacy = [(knob, "fp32_precision", knob.fp32_precision) for knob in knobs], None
    else:
        backends = torch.backends
        saved = [(m, "allow_tf32", m.allow_tf32) for m in (backends.cuda.matmul, backends.cudnn)]
        legacy = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
    for owner, name, _ in saved:
        setattr(owner, name, "ieee" if knobs else False)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)


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
    for t, _ in saved:
        t.data = t.data.float()
    try:
        with _full_fp32_precision():
            yield model
    finally:
        for p in model.parameters():
            p.grad = None
        for t, dtype in saved:
            t.data = t.data.to(dtype)


def fp32_batch(batch: dict) -> dict:
    """A batch for a model in_fp32: its floating tensors (a float attention mask) in fp32."""
    return {k: v.float() if v.is_floating_point() else v for k, v in batch.items()}


def relative_error(got, want) -> float | None:
    """||got - want|| / ||want|| of two flat tensors, in fp32; None when it is not a number (no gradient
    to compare with, a micro-batch without targets)."""
    value = float((got.float() - want.float()).norm() / want.float().norm())
    return value if value == value else None


def cosine(a, b) -> float | None:
    """The cosine of two flat tensors, in [-1, 1]; None when one is all zeros or not finite. Accumulated in
    fp64: torch's fp32 cosine_similarity rounds a million-element gradient's dot and norms apart to 1.0008
    (1.016 for ten million equal elements), and flushes norms below 1e-8 or past 1e19."""

    a, b = a.double(), b.double()
    norms = float(a.norm() * b.norm())
    if not norms or norms != norms or norms == float("inf"):
        return None
    value = float(a @ b) / norms
    return max(-1.0, min(1.0, value)) if value == value else None


def sdpa_pin(row):
    """A context factory that pins the SDPA backend of an `attn` row (cells.Attention; sdpa:*); the others
    dispatch as usual."""
    if row.sdpa_backend is None:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, row.sdpa_backend)
    return lambda: sdpa_kernel([backend])
