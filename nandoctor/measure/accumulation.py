"""Gradient accumulation: the gradient a step accumulates over its micro-batches, each one's loss
computed by the model itself as the Trainer computes it (`micro_loss`: num_items_in_batch passed to
the forward, or each micro-batch's mean over the steps), against the full batch's gradient computed
independently: all the step's rows as one batch, the model's own mean loss, one backward. A model that
ignores num_items_in_batch, or a normalisation that weights the micro-batches' tokens unequally, gives
a gradient that is not the full batch's; the floor is the full batch's gradient in this precision
against the same in fp32 (numerics.in_fp32). Each tensor group (models.checked_groups: a mixture of
experts' router and experts, the embeddings, an adapter, the rest) is compared on its own as well: a
load-balancing loss the model adds to every micro-batch's loss moves the router's gradient by 10% and
more while the whole gradient moves by 1e-3 or less. The balancing loss is defined on a micro-batch's
routing, so the full batch's reference counts it once a step: the micro-batches' balancing losses
averaged, beside the full batch's token loss."""

from __future__ import annotations

import inspect

from ..config import Recipe
from ..userdata.encode import IGNORE
from .numerics import cosine, fp32_batch, in_fp32, loss_of, relative_error, without_dropout


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


def balancing_coefficient(model) -> float | None:
    """The weight a step should count a mixture of experts' load-balancing loss with: its config's
    router_aux_loss_coef, when output_router_logits puts the loss in the model's loss; None where the
    model adds none. transformers adds it to every forward's loss, micro-batch by micro-batch, at the
    weight the model holds (model.router_aux_loss_coef, the config's unless the user changed it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    coef = getattr(base.config, "router_aux_loss_coef", None)
    return float(coef) if coef and getattr(base.config, "output_router_logits", False) else None


def compared_parameters(model, elements: int | None = None) -> list[tuple[str, object]]:
    """[(group, parameter)] of the trainable parameters the check compares, each in its
    models.checked_groups group: the blocks' first ones up to `elements` numbers when given (the check
    keeps three flat copies of their gradient), then the input and output embeddings where they fit
    in what is left (a large vocabulary would make each copy the size of the model)."""
    from ..models import checked_groups

    grouped = [(g, p) for g, params in checked_groups(model).items() for _, p in params]
    order = {id(p): i for i, p in enumerate(model.parameters())}
    grouped.sort(key=lambda gp: order.get(id(gp[1]), 0))
    kept, total = [], 0
    for g, p in grouped:
        if g == "embeddings":
            continue
        if elements is not None and kept and total + p.numel() > elements:
            break
        kept.append((g, p))
        total += p.numel()
    for g, p in grouped:
        if g == "embeddings" and (elements is None or total + p.numel() <= elements):
            kept.append((g, p))
            total += p.numel()
    return kept


def _flat_gradients(params: list) -> dict:
    """{group: the flat fp32 gradient of its parameters}, and "all" for every one of them."""
    import torch

    flat = [(g, (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()) for g, p in params]
    out = {g: torch.cat([f for h, f in flat if h == g]) for g in dict.fromkeys(g for g, _ in flat)}
    out["all"] = torch.cat([f for _, f in flat])
    return out


def _targets(batch: dict) -> int:
    return int((batch["labels"][..., 1:] != IGNORE).sum())


def _step_gradient(model, micro_batches: list[dict], full: dict, balancing: float | None) -> None:
    """The gradient the step should have, into the model's .grad: the full batch's own mean loss, one
    backward; with a balancing loss, the full batch's token loss alone plus each micro-batch's
    balancing loss over the number of micro-batches (the loss is defined on a micro-batch's routing:
    the step counts it once, as Trainer does for a loss normalised per micro-batch)."""
    if balancing is None:
        loss_of(model(**full)).backward()
        return
    loss_of(model(**full, output_router_logits=False)).backward()
    for batch in micro_batches:
        (model(**batch, output_router_logits=True).aux_loss * (balancing / len(micro_batches))).backward()


def accumulation_figures(
    model, micro_batches: list[dict], full: dict, normalization: str, elements: int | None = None
) -> dict:
    """The figures of one accumulated step (module docstring) over the trainable parameters the check
    compares (compared_parameters, up to `elements` numbers): `full` holds the micro-batches' rows as one
    batch. accumulation_error: ||accumulated - full|| / ||full||; accumulation_floor: the same of the
    full batch's gradient in this precision against fp32; accumulation_cosine and
    accumulation_norm_ratio of the accumulated gradient to the full batch's; accumulation_groups:
    {group: {"error", "floor"}} of each models.checked_groups group on its own (a router's gradient can
    be 10% off while the whole model's is 5e-4 off); accumulation_balancing_loss: the weight of a
    balancing loss the model adds to each micro-batch's loss (balancing_coefficient), or None. The
    model's gradients are unset afterwards."""
    import torch

    params = compared_parameters(model, elements)
    balancing = balancing_coefficient(model)
    counts = [_targets(b) for b in micro_batches]
    device = micro_batches[0]["input_ids"].device
    items = torch.tensor(sum(counts), device=device)
    with without_dropout(model):
        model.zero_grad(set_to_none=True)
        for batch in micro_batches:  # the gradients add up over the micro-batches, as in training
            micro_loss(model, batch, items, len(micro_batches), normalization).backward()
        accumulated = _flat_gradients(params)
        model.zero_grad(set_to_none=True)
        _step_gradient(model, micro_batches, full, balancing)
        whole = _flat_gradients(params)
        with in_fp32(model):
            model.zero_grad(set_to_none=True)
            _step_gradient(model, [fp32_batch(b) for b in micro_batches], fp32_batch(full), balancing)
            reference = _flat_gradients(params)
    model.zero_grad(set_to_none=True)
    ratio = float(accumulated["all"].norm() / whole["all"].norm())
    return {
        "accumulation_steps": len(micro_batches),
        "accumulation_targets": ", ".join(map(str, counts)),
        "accumulation_tokens": sum(counts),
        "loss_normalization": normalization,
        "accumulation_error": relative_error(accumulated["all"], whole["all"]),
        "accumulation_floor": relative_error(whole["all"], reference["all"]),
        "accumulation_cosine": cosine(accumulated["all"], whole["all"]),
        "accumulation_norm_ratio": ratio if ratio == ratio else None,
        "accumulation_groups": {
            g: {"error": relative_error(accumulated[g], whole[g]), "floor": relative_error(whole[g], reference[g])}
            for g in whole
            if g != "all"
        },
        "accumulation_balancing_loss": balancing,
    }
