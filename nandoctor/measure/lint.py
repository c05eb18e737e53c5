"""The data lint's measured checks (`nandoctor doctor --data`, and every grid, check and bisect
through doctor.data_lint), with no training: on the user's model class and attention implementation,
configured as a probe trains it (config.use_cache=False, as the Trainer sets it), with the user's rows
collated as the recipe collates them:

- packing isolation (packing.py) when anything is packed;
- gradient accumulation (accumulation.py) when a step has several micro-batches;
- embedding rows the rows use that were never trained (reach.py), on the checkpoint's own weights;
- gradient reach (reach.py) with gradient checkpointing on: the recipe's adapter (modules_to_save
  included) and checkpointing applied as a probe applies them, one backward, and the trainable groups
  that got no gradient.

The probes measure packing and accumulation on their own model at step 0 with the same functions
(child/setup_checks.py).
"""

from __future__ import annotations

from pathlib import Path

from ..config import Recipe
from ..userdata.collate import collate
from ..userdata.rows import EncodedRows, row_dicts
from .accumulation import accumulation_figures, normalized
from .numerics import NoLoss
from .packing import packing_isolation
from .reach import embedding_rows, gradient_reach

LINT_WEIGHTS_BYTES = 2**30  # checkpoints up to 1 GiB are measured with their own weights, larger ones on a twin


def lint_model(recipe: Recipe, attn: str):
    """(the model the checks run on, in words): the local checkpoint's own weights when they are
    small enough, else a probe-scale twin of its class (models.probe_scale); fp32, train mode, the
    config as the checkpoint or recipe gives it but use_cache=False: what the Trainer trains with (it
    sets config.use_cache from TrainingArguments.use_cache, False by default in transformers 5.24), and
    what a probe trains with (child/build.py)."""
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
    model.config.use_cache = False
    model.train()
    return model, f"{type(model).__name__}, attn_implementation={attn}, {where}"


def describe_model(model) -> str:
    return f"{type(model).__name__}, attn_implementation={model.config._attn_implementation}"


def packed_inputs(encoded: EncodedRows, batches: list) -> dict | None:
    """The collated batch packing isolation is measured on: the first packed batch the probe trains
    on, or, for rows the user packed (position_ids restarting inside a row), the first such row
    collated as the data.packing collator does. None when nothing is packed."""
    if encoded.collation.packing != "none":
        return batches[0].inputs
    packed = (encoded.rows.data.column("segments").to_numpy() > 1).nonzero()[0][:1].tolist()
    return collate(row_dicts(encoded, packed), encoded.collation) if packed else None


def trains_embeddings(recipe: Recipe) -> bool:
    """Whether the recipe's fine-tune updates the embedding rows: a full fine-tune does; an adapter
    only when it targets embed_tokens / lm_head or trains them in full (peft's modules_to_save)."""
    a = recipe.adapter
    if a.type == "none":
        return True
    named = set(a.target_modules) | set(a.modules_to_save)
    return bool(named & {"embed_tokens", "lm_head", "wte", "embed_in", "embed_out"})


def local_weights(recipe: Recipe) -> list:
    """The checkpoint's safetensors files when they are small enough to measure on (LINT_WEIGHTS_BYTES)."""
    path = recipe.model.path
    weights = sorted(Path(path).glob("*.safetensors")) if path else []
    return weights if weights and sum(w.stat().st_size for w in weights) <= LINT_WEIGHTS_BYTES else []


def measure(recipe: Recipe, encoded: EncodedRows, batches: list, content, attn: str, model=None) -> dict:
    """Every measured check that applies to this setup, as figures for the rules: packing isolation
    when anything is packed, accumulation when a step has several micro-batches, embedding rows on
    the checkpoint's own weights. The model (lint_model, unless given) is built only when one applies."""
    steps = recipe.gradient_accumulation_steps
    out = {"adapter": _adapter_text(recipe), "embeddings_trained": trains_embeddings(recipe)}
    out["loss_normalization"] = recipe.loss_normalization
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
        micro = [first[i % len(first)] for i in range(steps)]
        full = collate(row_dicts(encoded, [r for b in micro for r in b.rows]), encoded.collation)
        out.update(
            _needing_loss(accumulation_figures, model, [b.inputs for b in micro], full, normalized(recipe, model))
        )
    if "your weights" in described:
        out.update(embedding_rows(model, content, encoded.tokenizer))
    if checkpointed != "off":  # last: the adapter is applied to the lint's own model in place
        from ..models import apply_adapter, checkpointing

        if not given:  # a model given is the user's, already set up
            model = apply_adapter(model, recipe)
            checkpointing(model, checkpointed)
        out.update(_needing_loss(gradient_reach, model, batches[0].inputs))
    return out


def _needing_loss(figures, model, *args) -> dict:
    """figures(model, *args), a measurement that trains on the model's loss; {"no_loss": why} when the
    model returns none (numerics.NoLoss): the figure is not measured, and every probe ends on that reason."""
    try:
        return figures(model, *args)
    except NoLoss as e:
        return {"no_loss": str(e)}


def _adapter_text(recipe: Recipe) -> str:
    a = recipe.adapter
    if a.type == "none":
        return "full fine-tune"
    saved = f", modules_to_save {', '.join(a.modules_to_save)}" if a.modules_to_save else ""
    return f"{a.type} on {', '.join(a.target_modules)}{saved}"


def lint_rows(recipe: Recipe, attn: str = "sdpa", tokenizer=None, model=None) -> dict | None:
    """What the data lint measures on the recipe's rows, unjudged (doctor.judge_lint judges it), as
    JSON data: {"facts": the scan's figures (userdata/lint.scan), "report": what was read, the scan's
    histograms and tables, the batches a probe of this recipe trains on (with their rows), the checks
    measured on the model (`model`, or one built from the recipe, the user's class and `attn`) and,
    for completion-only chats, whether TRL's assistant_only_loss labels what the probe labels}. Read
    with `tokenizer` or the one tokenizer_of names; None when the recipe trains on the synthetic stream."""
    if recipe.data.source != "file":
        return None
    from ..cells import PACKAGES
    from ..data import make_batch
    from ..models import model_config
    from ..optional import hidden
    from ..userdata.lint import scan
    from ..userdata.read import open_rows
    from ..userdata.rows import encoded_rows, user_batches
    from ..userdata.template import assistant_mask_check
    from ..userdata.tokenizer import load_tokenizer, tokenizer_of

    if tokenizer is None and (path := tokenizer_of(recipe)):
        tokenizer = load_tokenizer(path, recipe.model.trust_remote_code)
    config = model_config(recipe)
    encoded = encoded_rows(recipe, config, tokenizer)
    facts, section, content = scan(encoded, recipe, config)
    chosen = user_batches(encoded, recipe.batch_size, recipe.data.batches, recipe.seed)
    batches = [make_batch(t, rows, kind, encoded.collation.packing) for kind, rows, t in chosen]
    # a model the ids do not fit would fail its embedding lookup: the finding says so instead
    # the lint builds its own model, in a process that trains no cell that needs an optional package:
    # transformers and peft then import none of them, nor print their noise (optional.py)
    with hidden(PACKAGES if model is None else ()):
        measured = measure(recipe, encoded, batches, content, attn, model) if facts["ids_beyond_vocab"] == 0 else {}
    report = {
        "source": encoded.describe(),
        **section,
        "batches": [b.describe() for b in batches],
        "measured": measured,
    }
    if encoded.kind == "messages" and encoded.encoding.labels == "completion_only":
        report["assistant_mask"] = assistant_mask_check(encoded, open_rows(recipe.data.path))
    return {"facts": facts, "report": report}
