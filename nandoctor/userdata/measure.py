"""The lint's measured checks, on the user's model class, attention implementation and collator (no
training: forwards and one backward per micro-batch, with dropout off so that differences are the
setup's and not noise):

- packing isolation: one packed forward against each segment run alone (max logit difference), as
  the packed batch is collated and with the model config's own use_cache, and again with
  attention_mask=None and use_cache=False;
- gradient accumulation: the gradient of the step's micro-batches averaged per micro-batch, and
  normalised by the step's token count, each against the full batch's (cosine, norm ratio);
- embedding rows: ids the rows use whose rows were never trained (zero, or the vocabulary's mean as
  resize_token_embeddings leaves them), and whether the recipe trains any embedding;
- gradient reach: with gradient checkpointing on, the recipe's adapter (modules_to_save included)
  and checkpointing applied as a probe applies them (models.apply_adapter, models.checkpointing), one
  backward, and the trainable groups (models.trainable_groups) that got no gradient.

The probes measure packing isolation and accumulation on their own model at step 0 too
(child/setup_checks.py), with `packing_isolation` and `accumulation_figures`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..config import Recipe
from .collate import collate
from .encode import IGNORE
from .rows import EncodedRows, row_dicts

LINT_WEIGHTS_BYTES = 2**30  # checkpoints up to 1 GiB are measured with their own weights, larger ones on a twin
UNTRAINED_REL = 1e-3  # a row within 0.1% of the median row norm of the vocabulary's mean (or of zero)


def lint_model(recipe: Recipe, attn: str):
    """(the model the checks run on, in words): the local checkpoint's own weights when they are
    small enough, else a probe-scale twin of its class (models.probe_scale); fp32, train mode, the
    config as the checkpoint or recipe gives it (use_cache included)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from ..models import model_config, probe_scale

    logging.disable_progress_bar()  # the doctor's own lines say what runs

    remote = recipe.model.trust_remote_code
    torch.manual_seed(recipe.seed)
    if local_weights(recipe):
        model = AutoModelForCausalLM.from_pretrained(
            recipe.model.path, dtype=torch.float32, attn_implementation=attn, trust_remote_code=remote
        )
        where = "your weights"
    else:
        config = probe_scale(model_config(recipe))
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn, trust_remote_code=remote
        )
        where = f"a {config.num_hidden_layers}-layer random-init twin"
    model.train()
    return model, f"{type(model).__name__}, attn_implementation={attn}, {where}"


def describe_model(model) -> str:
    return f"{type(model).__name__}, attn_implementation={model.config._attn_implementation}"


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


def _segments(position_ids) -> list[tuple[int, int]]:
    starts = [i for i, p in enumerate(position_ids.tolist()) if p == 0 or i == 0] + [len(position_ids)]
    return [(a, b) for a, b in zip(starts, starts[1:]) if b > a]


def packing_isolation(model, inputs: dict) -> dict:
    """Max |logit| difference between one packed row (row 0 of `inputs`, as collated) and each of its
    segments run alone; and the same with attention_mask=None and use_cache=False, with where that one
    mixes the segments (`packing_layers`: the hidden-state differences of each layer, _layer_diffs)."""
    import torch

    ids, positions = inputs["input_ids"][:1], inputs["position_ids"][:1]
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        keep = mask[0].bool()
    else:
        keep = torch.ones(ids.shape[1], dtype=torch.bool, device=ids.device)
    spans = _segments(positions[0][keep])
    given = {"input_ids": ids, "position_ids": positions}
    if mask is not None:
        given["attention_mask"] = mask[:1]
    with torch.no_grad(), without_dropout(model):
        packed = model(**given).logits[0][keep]
        clean_out = model(
            input_ids=ids[:, keep], position_ids=positions[:, keep], use_cache=False, output_hidden_states=True
        )
        clean = clean_out.logits[0]
        flat = ids[0][keep]
        alone_out = [model(input_ids=flat[a:b][None], output_hidden_states=True) for a, b in spans]
        alone = torch.cat([o.logits[0] for o in alone_out])
        layers = _layer_diffs(model, clean_out.hidden_states, [o.hidden_states for o in alone_out], spans)
    if mask is not None and mask.dim() == 2:
        cause = "a 2-D attention mask is passed beside the position_ids"
    elif getattr(model.config, "use_cache", False):
        cause = "config.use_cache=True: a cache is built in training, and beside a cache position_ids are not packing"
    else:
        cause = "as collated"
    return {
        "packing_segments": len(spans),
        "packing_max_logit_diff": float((packed - alone).abs().max()),
        "packing_clean_diff": float((clean - alone).abs().max()),
        "packing_cause": cause,
        "packing_use_cache": bool(getattr(model.config, "use_cache", False)),
        "packing_layers": layers,
    }


def _layer_diffs(model, clean: tuple, alone: list[tuple], spans: list[tuple[int, int]]) -> list[dict] | None:
    """Per decoder layer of the packed row run with no mask and no cache: its kind (config.layer_types:
    linear_attention, sliding_attention, ...) and its output's largest difference to the segments run
    alone, on the first segment (which no other segment precedes in a causal model: the model's own
    rounding) and on the later ones (rounding, or a layer that mixes the segments, such as a
    linear-attention fallback that ignores position_ids, huggingface/transformers#46333). None without
    hidden states or with one segment."""
    import torch

    if not clean or len(spans) < 2:
        return None
    kinds = list(getattr(model.config, "layer_types", None) or [])
    first = spans[0][1] - spans[0][0]
    out = []
    for i in range(1, len(clean)):
        diff = (clean[i][0] - torch.cat([h[i][0] for h in alone])).abs().float()
        out.append(
            {
                "layer": i - 1,
                "kind": kinds[i - 1] if i - 1 < len(kinds) else "attention",
                "first_segment": float(diff[:first].max()),
                "later_segments": float(diff[first:].max()),
            }
        )
    return out


def packed_inputs(encoded: EncodedRows, batches: list) -> dict | None:
    """The collated batch packing isolation is measured on: the first packed batch the probe trains
    on, or, for rows the user packed (position_ids restarting inside a row), the first such row
    collated as the data.packing collator does. None when nothing is packed."""
    if encoded.collation.packing != "none":
        return batches[0].inputs
    packed = (encoded.rows.data.column("segments").to_numpy() > 1).nonzero()[0][:1].tolist()
    return collate(row_dicts(encoded, packed), encoded.collation) if packed else None


def _block_parameters(model, elements: int | None = None) -> list:
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


def _summed_loss_gradient(model, inputs: dict, params: list):
    """(the gradient of the micro-batch's summed token loss, flattened over params; its loss terms)."""
    import torch

    for p in params:
        p.grad = None
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits
    targets = labels[..., 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(
        logits[..., :-1, :].reshape(-1, logits.shape[-1]).float(), targets, ignore_index=IGNORE, reduction="sum"
    )
    loss.backward()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    return grad, int((targets != IGNORE).sum())


def accumulation(model, encoded: EncodedRows, micro_batches: list) -> dict:
    """accumulation_figures for a step of these micro-batches (data.Batch) of the user's rows, against
    all their rows collated as one batch."""
    rows = [r for b in micro_batches for r in b.rows]
    full = collate(row_dicts(encoded, rows), encoded.collation)
    return accumulation_figures(model, [b.inputs for b in micro_batches], full)


def accumulation_figures(model, micro_batches: list[dict], full: dict, elements: int | None = None) -> dict:
    """Cosine to the full batch's gradient (`full`: the micro-batches' rows as one batch, loss averaged
    over its tokens) of the accumulated gradient normalised per micro-batch (each one's mean, divided
    by the steps) and by the step's token count (num_items_in_batch); the norm ratio of the first to
    the full batch's. Over the trainable block parameters (up to `elements` numbers: _block_parameters).
    Leaves the gradients of `model` unset or as the last backward left them."""
    import torch

    params = _block_parameters(model, elements)
    with without_dropout(model):
        summed, per_micro, counts = None, None, []
        for inputs in micro_batches:
            g, n = _summed_loss_gradient(model, inputs, params)
            counts.append(n)
            summed = g if summed is None else summed + g
            part = g / n if n else torch.full_like(g, float("nan"))
            per_micro = part if per_micro is None else per_micro + part
        full, total = _summed_loss_gradient(model, full, params)
    full, per_micro, by_tokens = full / total, per_micro / len(micro_batches), summed / sum(counts)

    def cosine(a, b):
        value = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        return value if value == value else None  # NaN (a micro-batch without targets): no figure

    return {
        "accumulation_steps": len(micro_batches),
        "accumulation_targets": ", ".join(map(str, counts)),
        "accumulation_tokens": sum(counts),
        "accumulation_cosine_micro_batch": cosine(per_micro, full),
        "accumulation_cosine_tokens": cosine(by_tokens, full),
        "accumulation_norm_ratio": float(per_micro.norm() / full.norm()),
    }


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
            model(**inputs, use_cache=False).loss.backward()
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


def trains_embeddings(recipe: Recipe) -> bool:
    """Whether the recipe's fine-tune updates the embedding rows: a full fine-tune does; an adapter
    only when it targets embed_tokens / lm_head or trains them in full (peft's modules_to_save)."""
    a = recipe.adapter
    if a.type == "none":
        return True
    named = set(a.target_modules) | set(a.modules_to_save)
    return bool(named & {"embed_tokens", "lm_head", "wte", "embed_in", "embed_out"})


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


def local_weights(recipe: Recipe) -> list:
    """The checkpoint's safetensors files when they are small enough to measure on (LINT_WEIGHTS_BYTES)."""
    path = recipe.model.path
    weights = sorted(Path(path).glob("*.safetensors")) if path else []
    return weights if weights and sum(w.stat().st_size for w in weights) <= LINT_WEIGHTS_BYTES else []


def measure(recipe: Recipe, encoded: EncodedRows, batches: list, content, attn: str, model=None) -> dict:
    """Every measured check that applies to this setup, as figures for the rules: packing isolation
    when anything is packed, accumulation when a step has several micro-batches, embedding rows on
    the checkpoint's own weights. The model (lint_model, unless given) is built only when one applies."""
    steps, normalization = recipe.gradient_accumulation_steps, recipe.loss_normalization
    out = {"adapter": _adapter_text(recipe), "embeddings_trained": trains_embeddings(recipe)}
    out["loss_normalization"] = normalization
    out["gradient_checkpointing"] = checkpointed = recipe.gradient_checkpointing
    inputs = packed_inputs(encoded, batches)
    if inputs is None and steps == 1 and model is None and not local_weights(recipe) and checkpointed == "off":
        return out
    given = model is not None
    model, described = (model, describe_model(model)) if given else lint_model(recipe, attn)
    out["measured_on"] = described
    if inputs is not None:
        out.update(packing_isolation(model, inputs), packing_model=described)
    if steps > 1:
        first = [b for b in batches if b.kind == "first"] or batches
        out.update(accumulation(model, encoded, [first[i % len(first)] for i in range(steps)]))
    if "your weights" in described:
        out.update(embedding_rows(model, content, encoded.tokenizer))
    if checkpointed != "off":  # last: the adapter is applied to the lint's own model in place
        from ..models import apply_adapter, checkpointing

        if not given:  # a model given is the user's, already set up
            model = apply_adapter(model, recipe)
            checkpointing(model, checkpointed)
        out.update(gradient_reach(model, batches[0].inputs))
    return out


def _adapter_text(recipe: Recipe) -> str:
    a = recipe.adapter
    if a.type == "none":
        return "full fine-tune"
    saved = f", modules_to_save {', '.join(a.modules_to_save)}" if a.modules_to_save else ""
    return f"{a.type} on {', '.join(a.target_modules)}{saved}"
