"""Gradient accumulation: the gradient a step accumulates over its micro-batches, each one's loss
computed by the model itself as the Trainer computes it (`micro_loss`: num_items_in_batch passed to
the forward, or each micro-batch's mean over the steps), against the full batch's gradient computed
independently: all the step's rows as one batch, the model's own mean loss, one backward. A model that
ignores num_items_in_batch, or a normalisation that weights the micro-batches' tokens unequally, gives
a gradient that is not the full batch's; the floor is the full batch's gradient in this precision
against the same in fp32 (numerics.in_fp32)."""

from __future__ import annotations

import inspect

from ..config import Recipe
from ..userdata.encode import IGNORE
from .numerics import cosine, in_fp32, loss_of, relative_error, without_dropout


def normalized(recipe: Recipe, model) -> str:
    """loss_normalization as Trainer applies it to this model: by tokens (num_items_in_batch passed to
    the forward) only when the model takes loss kwargs (its accepts_loss_kwargs, else a **kwargs in its
    forward, read on the model under the adapter); Trainer normalises any other per micro-batch."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    accepts = getattr(base, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(base.forward).parameters.values())
    return recipe.loss_normalization if accepts else "micro_batch"


def micro_loss(model, batch: dict, items, micro_batches: int, normalization: str, world_size: int = 1):
    """One micro-batch's share of its step's loss, as Trainer computes it (transformers 5.24
    compute_loss / training_step). By tokens: the model's own loss given the step's loss terms over
    every rank (`items`, passed as num_items_in_batch), times the ranks (DDP and FSDP average the ranks'
    gradients, Trainer's average_tokens_across_devices undoes it): the step's gradient is the full
    batch's. Per micro-batch (also where `items` is None): the micro-batch's mean token loss over the
    number of micro-batches."""
    if normalization == "tokens" and items is not None:
        return loss_of(model(**batch, num_items_in_batch=items)) * world_size
    return loss_of(model(**batch)) / micro_batches


def block_parameters(model, elements: int | None = None) -> list:
    """The trainable parameters but the input and output embeddings (a large vocabulary would make
    each gradient copy the size of the model; the blocks show the weighting all the same), the first
    ones up to `elements` numbers when given (the check keeps three flat copies of their gradient)."""
    skip = {
        id(p)
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
        for p in m.parameters()
    }
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    if elements is None:
        return params
    kept, total = [], 0
    for p in params:
        if kept and total + p.numel() > elements:
            break
        kept.append(p)
        total += p.numel()
    return kept


def _flat_gradient(params: list):
    import torch

    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


def _targets(batch: dict) -> int:
    return int((batch["labels"][..., 1:] != IGNORE).sum())


def accumulation_figures(
    model, micro_batches: list[dict], full: dict, normalization: str, elements: int | None = None
) -> dict:
    """The figures of one accumulated step (module docstring) over the trainable block parameters (up to
    `elements` numbers: block_parameters): `full` holds the micro-batches' rows as one batch.
    accumulation_error: ||accumulated - full|| / ||full||; accumulation_floor: the same of the full
    batch's gradient in this precision against fp32; accumulation_cosine and accumulation_norm_ratio
    of the accumulated gradient to the full batch's. The model's gradients are unset afterwards."""
    import torch

    params = block_parameters(model, elements)
    counts = [_targets(b) for b in micro_batches]
    device = micro_batches[0]["input_ids"].device
    items = torch.tensor(sum(counts), device=device)
    with without_dropout(model):
        model.zero_grad(set_to_none=True)
        for batch in micro_batches:  # the gradients add up over the micro-batches, as in training
            micro_loss(model, batch, items, len(micro_batches), normalization).backward()
        accumulated = _flat_gradient(params)
        model.zero_grad(set_to_none=True)
        loss_of(model(**full)).backward()
        whole = _flat_gradient(params)
        with in_fp32(model):
            model.zero_grad(set_to_none=True)
            loss_of(model(**{k: v.float() if v.is_floating_point() else v for k, v in full.items()})).backward()
            reference = _flat_gradient(params)
    model.zero_grad(set_to_none=True)
    ratio = float(accumulated.norm() / whole.norm())
    return {
        "accumulation_steps": len(micro_batches),
        "accumulation_targets": ", ".join(map(str, counts)),
        "accumulation_tokens": sum(counts),
        "loss_normalization": normalization,
        "accumulation_error": relative_error(accumulated, whole),
        "accumulation_floor": relative_error(whole, reference),
        "accumulation_cosine": cosine(accumulated, whole),
        "accumulation_norm_ratio": ratio if ratio == ratio else None,
    }
