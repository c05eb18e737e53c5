"""What one backward reaches, and which embedding rows were never trained."""

from __future__ import annotations

from .numerics import loss_of, without_dropout

UNTRAINED_REL = 1e-3  # a row within 0.1% of the median row norm of the vocabulary's mean (or of zero)


def gradient_reach(model, inputs: dict) -> dict:
    """One backward of a collated batch through the model as it is set up (adapter and gradient
    checkpointing applied), and the trainable groups (models.trainable_groups) none of whose tensors
    got a gradient (none, or all zero). A backward that raises because nothing in the loss needs a
    gradient (reentrant checkpointing over frozen inputs, only the adapter trainable) leaves every
    group without one. The model's gradients are unset before and after."""
    from ..models import trainable_groups

    groups = trainable_groups(model)
    model.zero_grad(set_to_none=True)
    raised = None
    with without_dropout(model):
        try:
            loss_of(model(**inputs, use_cache=False)).backward()
        except RuntimeError as e:
            if "does not require grad" not in str(e):
                raise
            raised = str(e).splitlines()[0]

    def reached(p) -> bool:
        return p.grad is not None and bool(p.grad.any())

    starved = [g for g, params in groups.items() if not any(reached(p) for _, p in params)]
    trained = ", ".join(g for g in groups if g not in starved)
    model.zero_grad(set_to_none=True)
    if raised:
        outcome = f"the backward raised ({raised}): nothing trains"
    else:
        outcome = f"the loss still falls through {trained or 'nothing'} while those weights never move"
    return {
        "groups_without_gradient": len(starved),
        "groups_without_gradient_names": ", ".join(f"{g} (all {len(groups[g])} tensors)" for g in starved),
        "groups_with_gradient": trained or "none",
        "gradient_reach_outcome": outcome,
    }


def embedding_rows(model, content, tokenizer) -> dict:
    """The ids the rows use (content counts > 0) whose input-embedding row was never trained: all zero,
    or the vocabulary's mean (within UNTRAINED_REL of the median row norm)."""
    import torch

    weight = model.get_input_embeddings().weight.detach().float()
    used = torch.as_tensor((content[: weight.shape[0]] > 0).nonzero()[0])
    rows = weight[used]
    scale = weight.norm(dim=1).median()
    zero = rows.norm(dim=1) <= UNTRAINED_REL * scale
    mean = (rows - weight.mean(dim=0)).norm(dim=1) <= UNTRAINED_REL * scale
    untrained = used[zero | mean].tolist()
    name = (lambda t: repr(tokenizer.convert_ids_to_tokens(t))) if tokenizer is not None else (lambda t: f"id {t}")
    how = [w for w, hit in (("all zero", bool(zero.any())), ("the vocabulary's mean", bool(mean.any()))) if hit]
    return {
        "untrained_rows_used": len(untrained),
        "untrained_tokens": ", ".join(f"{name(t)} id {t}" for t in untrained[:5])
        + (" ..." if len(untrained) > 5 else ""),
        "untrained_how": " or ".join(how) or "-",
    }
