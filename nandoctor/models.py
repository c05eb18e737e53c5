"""Which model a probe trains.

`plan_model` runs once in the parent: it decides between real local weights and a random-init
architecture twin, at full or probe scale, and says why. The child builds what the plan says
(child/build.py) from the same `model_config`, `probe_scale` and `apply_adapter`. Nothing here
downloads: hub ids are resolved from the local cache only (see recipes.py).
"""
from __future__ import annotations

import copy
from pathlib import Path

from .cells import PACKAGES
from .config import Recipe
from .errors import NandoctorError
from .optional import hidden
from .recipes import cached_snapshot
from .record import ModelPlan

PROBE_LAYERS = 2  # a probe-scale twin keeps two layers: enough for a residual stream across blocks
PROBE_MIN_HEADS = 4
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + grad + AdamW's two moments
FIT_FRACTION = 0.6  # leave room for activations and the allocator


def _weights_dir(recipe: Recipe) -> Path | None:
    if recipe.model.path:
        path = Path(recipe.model.path)
        return path if any(path.glob("*.safetensors")) or any(path.glob("*.bin")) else None
    if recipe.model.hub_id:
        return cached_snapshot(recipe.model.hub_id)
    return None


def model_config(recipe: Recipe):
    """The full-size transformers config the recipe names."""
    from transformers import AutoConfig
    m = recipe.model
    try:
        if m.path:
            return AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
        weights = _weights_dir(recipe)
        if weights is not None:
            return AutoConfig.from_pretrained(str(weights))
        arch = dict(m.arch)
        model_type = arch.pop("model_type", "llama")
        return AutoConfig.for_model(model_type, **arch)
    except (ValueError, KeyError, OSError) as e:
        raise NandoctorError(f"model of recipe {recipe.name!r}: {str(e).splitlines()[0]}") from None


def shape_of(config) -> dict:
    heads = config.num_attention_heads
    hidden = config.hidden_size
    return {
        "hidden": hidden,
        "layers": config.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or hidden // heads,
        "intermediate": getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None),
        "vocab": config.vocab_size,
    }


def probe_scale(config):
    """A smaller config of the same family: head_dim, GQA ratio, vocab and rope kept; layers, heads,
    hidden and intermediate reduced (intermediate keeps its ratio to hidden)."""
    s = shape_of(config)
    ratio = max(1, s["heads"] // s["kv_heads"])
    kv = max(1, PROBE_MIN_HEADS // ratio)
    heads = kv * ratio
    hidden = heads * s["head_dim"]
    small = copy.deepcopy(config)
    small.num_hidden_layers = min(s["layers"], PROBE_LAYERS)
    small.num_attention_heads = heads
    small.hidden_size = hidden
    if getattr(config, "num_key_value_heads", None):
        small.num_key_value_heads = kv
    if getattr(config, "head_dim", None):
        small.head_dim = s["head_dim"]
    if getattr(config, "intermediate_size", None):
        small.intermediate_size = max(8, round(s["intermediate"] * hidden / s["hidden"] / 8) * 8)
    if getattr(config, "layer_types", None):
        small.layer_types = list(config.layer_types[: small.num_hidden_layers])
    return small


def count_params(config, recipe: Recipe) -> tuple[int, int]:
    """(total, trainable) parameters, counted on the meta device (no memory, milliseconds). No
    optional package is needed for that: they stay unimported (optional.py)."""
    import warnings

    import torch
    with hidden(PACKAGES), torch.device("meta"), warnings.catch_warnings():
        from transformers import AutoModelForCausalLM
        warnings.simplefilter("ignore", FutureWarning)  # peft calls transformers APIs deprecated in v5
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
        model = apply_adapter(model, recipe)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def training_bytes(params: int, trainable: int) -> int:
    """What training a model needs, before activations: fp32 weights, and for the trainable ones a
    gradient and AdamW's two moments. The planner's fit test and the GPU packing both use it."""
    return params * 4 + trainable * (TRAIN_BYTES_PER_PARAM - 4)


def memory_budget(device: dict) -> int:
    if device.get("gpus"):
        return device["gpus"][0]["memory_bytes"]
    return device.get("ram_available_bytes") or device.get("ram_bytes") or 0


def training_fit(full: int, trainable: int, device: dict) -> tuple[bool, str]:
    """Whether training a model of `full` parameters (`trainable` of them trained) fits this device, and why."""
    need = training_bytes(full, trainable)
    budget = memory_budget(device)
    text = f"{full / 1e6:.1f}M params need ~{need / 2**30:.1f} GiB to train; {FIT_FRACTION:.0%} of {budget / 2**30:.0f} GiB is available"
    return need <= FIT_FRACTION * budget, text


def plan_model(recipe: Recipe, device: dict) -> ModelPlan:
    """Decide what will be probed: local weights or a twin, full or probe scale, and why."""
    config = model_config(recipe)
    full, trainable = count_params(config, recipe)
    fits, fit_text = training_fit(full, trainable, device)
    scale = recipe.model.scale if recipe.model.scale != "auto" else ("full" if fits else "probe")
    weights = _weights_dir(recipe)
    if weights is not None and scale == "full":
        source, why = "local-weights", f"real weights from {weights}"
    elif weights is not None:
        source, why = "architecture-twin", f"weights exist at {weights}, but scale=probe ({fit_text}): random-init twin"
    else:
        named = recipe.model.hub_id or recipe.model.path or recipe.name
        source = "architecture-twin"
        why = f"no local weights for {named}: random-init twin built from its config"
        if scale == "probe":
            why += f", at probe scale ({fit_text})"
    probed = probe_scale(config) if scale == "probe" else config
    params, trainable = count_params(probed, recipe) if scale == "probe" else (full, trainable)
    return ModelPlan(source=source, scale=scale, model_type=config.model_type, params=params, full_params=full,
                     trainable_params=trainable, path=str(weights) if source == "local-weights" else None,
                     why=why, shape=shape_of(probed))


def plan_warnings(recipe: Recipe, plan: ModelPlan, device: dict) -> list[str]:
    """What the user must hear before the probes spend minutes: a --scale full that the planner
    expects not to fit, and a checkpoint of their own that is not what gets trained."""
    warnings = []
    if plan.scale == "full":
        fits, fit_text = training_fit(plan.full_params, plan.trainable_params, device)
        if not fits:
            warnings.append(f"--scale full will likely run out of memory ({fit_text}); --scale auto probes a smaller twin")
    if recipe.model.path and plan.source == "architecture-twin":
        if _weights_dir(recipe) is None:
            warnings.append(f"{recipe.model.path} has a config.json but no weights (*.safetensors or *.bin): every probe "
                            "trains a RANDOM-INIT twin built from that config, not your checkpoint")
        else:
            warnings.append(f"your checkpoint's weights are NOT what gets trained: {plan.why}")
    return warnings


def apply_adapter(model, recipe: Recipe):
    a = recipe.adapter
    if a.type == "none":
        return model
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=a.r, lora_alpha=a.alpha, target_modules=list(a.target_modules),
                      lora_dropout=a.dropout, use_dora=a.type == "dora")
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise NandoctorError(f"adapter of recipe {recipe.name!r}: {str(e).splitlines()[0]}") from None
