"""Which model a probe trains, and the data it trains on.

`plan_model` runs once in the parent: it decides between real local weights and a random-init
architecture twin, at full or probe scale, and says why. `build_model` and `batches` run in the child.
Nothing here downloads: hub ids are resolved from the local cache only (see recipes.py).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from .config import Cell, NandoctorError, Recipe
from .recipes import cached_snapshot

PROBE_LAYERS = 2  # a probe-scale twin keeps two layers: enough for a residual stream across blocks
PROBE_MIN_HEADS = 4
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + grad + AdamW's two moments
FIT_FRACTION = 0.6  # leave room for activations and the allocator
LOAD_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PURE_DTYPES = {"bf16-pure": "bfloat16", "fp16-pure": "float16"}


@dataclass(frozen=True)
class ModelPlan:
    source: str  # "local-weights" or "architecture-twin"
    scale: str  # "full" or "probe"
    model_type: str
    params: int  # parameters of the model actually probed
    full_params: int  # parameters of the model the recipe names
    trainable_params: int
    path: str | None  # weights directory when source is local-weights
    why: str
    shape: dict  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab of the probed model


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
    """(total, trainable) parameters, counted on the meta device (no memory, milliseconds)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls transformers APIs deprecated in v5
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
        model = _apply_adapter(model, recipe)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def memory_budget(device: dict) -> int:
    if device.get("gpus"):
        return device["gpus"][0]["memory_bytes"]
    return device.get("ram_available_bytes") or device.get("ram_bytes") or 0


def plan_model(recipe: Recipe, device: dict) -> ModelPlan:
    """Decide what will be probed: local weights or a twin, full or probe scale, and why."""
    config = model_config(recipe)
    full, trainable = count_params(config, recipe)
    need = full * 4 + trainable * (TRAIN_BYTES_PER_PARAM - 4)
    budget = memory_budget(device)
    fits = need <= FIT_FRACTION * budget
    scale = recipe.model.scale if recipe.model.scale != "auto" else ("full" if fits else "probe")
    weights = _weights_dir(recipe)
    fit_text = f"{full / 1e6:.1f}M params need ~{need / 2**30:.1f} GiB to train; {FIT_FRACTION:.0%} of {budget / 2**30:.0f} GiB is available"
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


def _apply_adapter(model, recipe: Recipe):
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


def weight_dtype(recipe: Recipe, cell: Cell) -> str:
    """The dtype weights are held in: the pure cells hard-cast, the others keep the load dtype."""
    return PURE_DTYPES.get(cell.dtype) or LOAD_DTYPES[recipe.model.dtype_on_load]


def build_model(plan: ModelPlan, recipe: Recipe, cell: Cell, seed: int):
    """The model for one probe, on CPU, in training mode, adapter applied, weights in their dtype."""
    import torch
    from transformers import AutoModelForCausalLM
    attn = "sdpa" if cell.attn.startswith("sdpa") else cell.attn
    load_dtype = getattr(torch, LOAD_DTYPES[recipe.model.dtype_on_load])
    remote = recipe.model.trust_remote_code
    torch.manual_seed(seed)
    if plan.source == "local-weights":
        model = AutoModelForCausalLM.from_pretrained(plan.path, dtype=load_dtype, attn_implementation=attn,
                                                     trust_remote_code=remote)
    else:
        config = model_config(recipe)
        config = probe_scale(config) if plan.scale == "probe" else config
        model = AutoModelForCausalLM.from_config(config, dtype=load_dtype, attn_implementation=attn,
                                                 trust_remote_code=remote)
    model.config.use_cache = False
    model = _apply_adapter(model, recipe)
    model.to(getattr(torch, weight_dtype(recipe, cell)))
    if recipe.adapter.type != "none" and cell.dtype not in PURE_DTYPES:
        # peft keeps adapters in fp32 when the base is half; .to() above undid that for -amp cells
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.data = p.data.float()
    model.train()
    return model


def pad_id(recipe: Recipe, config) -> int:
    policy = recipe.pad_token.policy
    if policy == "id0":
        return 0
    if policy == "eos":
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return eos if eos is not None else config.vocab_size - 2
    return config.vocab_size - 1  # dedicated: an id the content never uses


def batches(recipe: Recipe, config, seed: int):
    """An endless, deterministic stream of training batches, cycling through `data.batches` of them.

    Synthetic rows repeat a random 8-token motif, so a model that learns to copy drives the loss down
    quickly: a probe that stops learning is visible within a few dozen steps."""
    import torch
    vocab = config.vocab_size
    pad = pad_id(recipe, config)
    B, T = recipe.batch_size, recipe.seq_len
    if recipe.data.source == "file":
        raw = Path(recipe.data.path).read_bytes()
        if len(raw) < T + 1:
            raise NandoctorError(f"data file {recipe.data.path!r} is shorter than seq_len={T} bytes")
        tokens = torch.tensor(list(raw), dtype=torch.long) % (vocab - 1)
    fixed = []
    for i in range(recipe.data.batches):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        if recipe.data.source == "file":
            starts = torch.randint(0, len(tokens) - T, (B,), generator=g)
            ids = torch.stack([tokens[s:s + T] for s in starts.tolist()])
        else:
            motif = torch.randint(0, vocab - 1, (B, 8), generator=g)  # never the dedicated pad id
            ids = motif.repeat(1, math.ceil(T / 8))[:, :T]
        mask = torch.ones_like(ids)
        max_pad = int(recipe.data.pad_fraction * T)
        if max_pad:
            lengths = T - torch.randint(0, max_pad + 1, (B,), generator=g)
            mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
            ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
        labels = ids.clone()
        if recipe.pad_token.mask_labels:
            labels[ids == pad] = -100
        fixed.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    step = 0
    while True:
        yield fixed[step % len(fixed)]
        step += 1


def describe(plan: ModelPlan) -> str:
    s = plan.shape
    return (f"{plan.model_type} {plan.source} at {plan.scale} scale, {plan.params / 1e6:.2f}M params "
            f"(hidden {s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, vocab {s['vocab']})")


def plan_from_dict(data: dict) -> ModelPlan:
    return ModelPlan(**{f.name: data[f.name] for f in dataclasses.fields(ModelPlan)})
