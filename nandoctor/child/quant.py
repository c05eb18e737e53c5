"""A quantized base (the `quant` axis): loaded as transformers loads it with a BitsAndBytesConfig, prepared
as peft prepares it, and measured as stored.

transformers quantizes a model's linears while it loads weights (from_pretrained), never after: a twin
(random-init, built from its config) is therefore saved once to a temporary directory and loaded back
quantized, so that the probe's base is exactly what a user's `from_pretrained(..., quantization_config=...)`
gives. Every linear but the output head is quantized (transformers keeps lm_head in high precision);
the embeddings, norms and the head keep the weight dtype.
"""

from __future__ import annotations

import tempfile

from ..cells import Cell
from ..config import STORAGE_DTYPES, Recipe
from ..record import ModelPlan


def bnb_config(cell: Cell, recipe: Recipe):
    """The BitsAndBytesConfig of the cell's quant row: its compute dtype is the cell's."""
    import torch
    from transformers import BitsAndBytesConfig

    kwargs = cell.quantization.bnb_kwargs(
        cell.precision.compute, recipe.quant.double_quant, STORAGE_DTYPES[recipe.quant.storage]
    )
    dtypes = ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")
    typed = {k: getattr(torch, v) if k in dtypes else v for k, v in kwargs.items()}
    return BitsAndBytesConfig(**typed)


def load_quantized(plan: ModelPlan, recipe: Recipe, cell: Cell, dtype, attn: str, device: str, build):
    """The base, quantized as the cell says, on `device`. `build()` makes the twin (local weights load
    straight from plan.path); dtype is the weight dtype of what stays unquantized."""
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=recipe.model.trust_remote_code,
            quantization_config=bnb_config(cell, recipe),
            device_map=device,
        )

    if plan.source == "local-weights":
        return load(plan.path)
    with tempfile.TemporaryDirectory(prefix="nandoctor-twin-") as tmp:
        build().save_pretrained(tmp)
        return load(tmp)


def prepare(model):
    """peft's prepare_model_for_kbit_training (quant.prepare), with checkpointing left to the recipe: its
    default use_gradient_checkpointing=True would switch it on whatever gradient_checkpointing says;
    models.checkpointing enables it after, as the recipe asks."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def bnb_layer(module) -> bool:
    """A bitsandbytes 4-bit or 8-bit linear itself; peft's LoRA wrappers around one share its class name."""
    kind = type(module)
    return kind.__name__ in ("Linear4bit", "Linear8bitLt") and kind.__module__.startswith("bitsandbytes")


def quant_state_tensors(module) -> list:
    """The quantization constants of a bitsandbytes layer's weight: a 4-bit weight's block scales (absmax),
    code book and, with double quantization, the scales' own (state2); an 8-bit weight's row scales (SCB)."""
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    out = []
    if state is not None:
        out += [t for t in (state.absmax, state.code) if t is not None]
        if getattr(state, "state2", None) is not None:
            out += [t for t in (state.state2.absmax, state.state2.code) if t is not None]
    scb = getattr(weight, "SCB", None)
    return out + ([scb] if scb is not None else [])


def base_facts(model, cell: Cell, recipe: Recipe) -> dict:
    """The record's `quant`: the cell's quantization settings and its base's bytes as stored, the frozen
    weights and the quantization constants (each storage counted once)."""
    from .memory import storage_bytes

    seen: set = set()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    weights = storage_bytes(frozen, seen)
    quantized = [m for m in model.modules() if bnb_layer(m)]
    constants = storage_bytes([t for m in quantized for t in quant_state_tensors(m)], seen)
    row = cell.quantization
    facts = {"type": cell.quant, "base_bytes": weights + constants, "constants_bytes": constants}
    facts["quantized_modules"] = len(quantized)
    if row.bits is None:
        return facts
    settings = {"bits": row.bits, "compute": cell.precision.compute, "prepare": recipe.quant.prepare}
    if row.bits == 4:
        settings.update(quant_type=row.quant_type, double_quant=recipe.quant.double_quant, storage=recipe.quant.storage)
    return {**facts, **settings}
