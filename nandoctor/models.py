"""Which model a probe trains.

`plan_model` runs once per run, in a child of the first warm worker (child/plan.py) or in the
parent: it decides between real local weights and a random-init architecture twin, at full or probe
scale, and says why. The child builds what the plan says
(child/build.py) from the same `model_config`, `probe_scale` and `apply_adapter`. Nothing here
downloads: hub ids are resolved from the local cache only (see recipes.py).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

from .cells import PACKAGES
from .config import Recipe
from .device import DeviceFacts
from .env import matmul_seconds
from .errors import NandoctorError
from .optional import hidden
from .recipes import cached_snapshot
from .record import ModelPlan

PROBE_LAYERS = 2  # a probe-scale twin keeps two layers: enough for a residual stream across blocks
PROBE_MIN_HEADS = 4
# A probe-scale mixture of experts keeps each token's top-k and at least PROBE_EXPERTS_PER_K times as
# many experts (at least PROBE_MIN_EXPERTS): routing stays a choice among many, at a size a CPU trains.
PROBE_EXPERTS_PER_K = 4
PROBE_MIN_EXPERTS = 8
# What each family calls its number of routed experts and its top-k (Qwen2/3-MoE, OLMoE, Qwen3-Next:
# num_experts; Mixtral, gpt-oss, Llama-4: num_local_experts; DeepSeek-V3, GLM-4-MoE: n_routed_experts),
# and the widths that scale with hidden at probe scale (each expert's, the shared expert's).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERT_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk")
EXPERT_WIDTH_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp")
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight + grad + AdamW's two moments
FIT_FRACTION = 0.6  # leave room for activations and the allocator
# --scale auto trains the full model only when a probe is expected to finish in this time: a default
# grid runs ~10 probes, so 2 minutes each keeps a grid under half an hour.
PROBE_TIME_BUDGET_S = 120.0
# Dense fp16/bf16 tensor-core peak of one GPU per architecture (NVIDIA datasheets: V100, T4, A100, L40S,
# H100 SXM, B200), and the fraction of it a short, small-batch probe reaches. Used only to estimate.
GPU_PEAK_FLOPS = {
    "Volta": 125e12,
    "Turing": 65e12,
    "Ampere": 312e12,
    "Ada": 362e12,
    "Hopper": 989e12,
    "Blackwell": 2250e12,
}
GPU_PROBE_EFFICIENCY = 0.3
CPU_FLOOR_FLOPS = 5e9  # a slow CPU core: a model that trains in budget even at this speed is not timed


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


def model_type_hint(recipe: Recipe) -> str | None:
    """The recipe's model type, read without transformers (the arch's model_type, or a checkpoint's
    config.json), so that a warm worker imports its modeling code before the plan is made; None when
    it cannot be read this cheaply (a hub id: the plan says it)."""
    m = recipe.model
    if m.path:
        try:
            return json.loads((Path(m.path) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
    return None if m.hub_id else dict(m.arch).get("model_type", "llama")


def shape_of(config) -> dict:
    """hidden, layers, heads, kv heads, head_dim, intermediate, vocab, and for a mixture of experts its
    routed experts and top-k."""
    heads = config.num_attention_heads
    hidden = config.hidden_size
    experts = expert_count(config)
    return {
        **({"experts": experts, "top_k": expert_top_k(config)} if experts else {}),
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
    for key in EXPERT_WIDTH_KEYS:
        if getattr(config, key, None):
            setattr(small, key, max(8, round(getattr(config, key) * hidden / s["hidden"] / 8) * 8))
    if getattr(config, "linear_num_key_heads", None):  # linear-attention layers (Qwen3-Next): heads as attention's
        scale = heads / s["heads"]
        small.linear_num_key_heads = max(1, round(config.linear_num_key_heads * scale))
        small.linear_num_value_heads = small.linear_num_key_heads * max(
            1, config.linear_num_value_heads // config.linear_num_key_heads
        )
    experts = expert_count(config)
    if experts:
        key = next(k for k in EXPERT_COUNT_KEYS if getattr(config, k, None))
        k = expert_top_k(config) or 1
        setattr(small, key, min(experts, max(PROBE_MIN_EXPERTS, PROBE_EXPERTS_PER_K * k)))
    if getattr(config, "layer_types", None):
        small.layer_types = list(config.layer_types[: small.num_hidden_layers])
    return small


def expert_count(config) -> int | None:
    """The routed experts of a mixture-of-experts config, whatever its family calls them; None for a
    dense model."""
    return next((int(getattr(config, k)) for k in EXPERT_COUNT_KEYS if getattr(config, k, None)), None)


def expert_top_k(config) -> int | None:
    """How many experts each token is routed to; None for a dense model."""
    return next((int(getattr(config, k)) for k in EXPERT_TOP_K_KEYS if getattr(config, k, None)), None)


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


# attn_implementation -> the class flag transformers reads before it dispatches to that implementation
# (PreTrainedModel._sdpa_can_dispatch / _flash_attn_can_dispatch, transformers 5): a False flag raises
# "does not support an attention implementation through ..." when the model is built.
ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}


# Implementations a family cannot TRAIN with though its class allows them (keyed by model_type, so that
# a local checkpoint of the family is refused them too): gpt-oss's attention sinks have no fused
# backward in flash-attn (Dao-AILab/flash-attention#1895), so its training runs eager attention.
TRAINING_REFUSALS = {
    "gpt_oss": {
        "flash_attention_2": "gpt-oss attention sinks have no fused backward in flash-attn: training runs "
        "attn_implementation='eager' (Dao-AILab/flash-attention#1895)",
        "sdpa": "gpt-oss attention sinks are not an SDPA input: transformers sets GptOssForCausalLM._supports_sdpa "
        "= False and training runs attn_implementation='eager' (Dao-AILab/flash-attention#1895)",
    },
}


def refused_attention(config, recipe: Recipe) -> dict[str, str]:
    """{attn_implementation: why} for each implementation the architecture's class refuses, read from
    the class flags without building the model, and the family's training refusals (TRAINING_REFUSALS).
    Empty for a model with its own (remote) code."""
    import transformers
    from transformers import AutoModelForCausalLM

    if recipe.model.trust_remote_code:
        return {}
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None:
        return {}
    flagged = {
        impl: f"{cls.__name__} does not support attn_implementation={impl!r}: transformers {transformers.__version__} "
        f"sets {cls.__name__}.{flag} = False"
        + (
            " (softcapped attention logits, which SDPA cannot apply)"
            if impl == "sdpa" and getattr(config, "attn_logit_softcapping", None)
            else ""
        )
        for impl, flag in ATTENTION_FLAGS.items()
        if getattr(cls, flag, True) is False
    }
    return flagged | TRAINING_REFUSALS.get(config.model_type, {})  # the family's reason says more


def config_facts(recipe: Recipe) -> dict:
    """What the doctor's rules read from the model's config and the recipe's data (transformers and
    torch load for them): a warm worker's planning child gathers them with the model plan (child/plan.py)."""
    from .data import all_masked_batches

    config = model_config(recipe)
    return {
        # the user's rows: the data lint counts them on the batches it chose (doctor.masked_batches), so that
        # planning never reads a whole file (a large one took the planning child past its time limit)
        "all_masked_batches": None if recipe.data.source == "file" else all_masked_batches(recipe, config),
        "attn_softcapping": getattr(config, "attn_logit_softcapping", None),
        "tied_embeddings": getattr(config, "tie_word_embeddings", None),
        "router": router_facts(config, recipe),
        "model_type": config.model_type,
    }


def router_facts(config, recipe: Recipe) -> dict | None:
    """A mixture of experts' routing as configured and as the recipe trains it (None for a dense
    model): its family (model_type), experts and top-k, whether the load-balancing loss reaches the
    trained loss (moe.aux_loss over the config's output_router_logits) and its weight
    (router_aux_loss_coef), whether the router's weights train (a full fine-tune, or an adapter on a
    module named gate or router), the router's dtype setting, and a quantization the weights load in."""
    experts = expert_count(config)
    if not experts:
        return None
    family = bool(getattr(config, "output_router_logits", False))
    aux = {"family": family, "on": True, "off": False}[recipe.moe.aux_loss]
    adapter = recipe.adapter
    return {
        "model_type": config.model_type,
        "experts": experts,
        "top_k": expert_top_k(config),
        "aux_loss": "on" if aux else "off",
        "aux_loss_family": "on" if family else "off",
        "aux_loss_coef": getattr(config, "router_aux_loss_coef", None),
        "router_trained": adapter.type == "none"
        or any(m in ("gate", "router") or m.endswith((".gate", ".router")) for m in adapter.target_modules),
        "router_dtype": recipe.moe.router_dtype,
        "quant_method": _quant_method(config),
    }


def _quant_method(config) -> str | None:
    """The quantization a checkpoint's weights are stored in (mxfp4 for gpt-oss), else None."""
    q = getattr(config, "quantization_config", None)
    q = q.to_dict() if hasattr(q, "to_dict") else q
    return (q or {}).get("quant_method")


def apply_moe(model, recipe: Recipe) -> None:
    """moe.aux_loss on the built model: output_router_logits, which the model's forward reads to add
    router_aux_loss_coef times the load-balancing loss to the loss it returns. A dense model is left alone."""
    if expert_count(model.config) and recipe.moe.aux_loss != "family":
        model.config.output_router_logits = recipe.moe.aux_loss == "on"


def training_bytes(params: int, trainable: int) -> int:
    """What training a model needs, before activations: fp32 weights, and for the trainable ones a
    gradient and AdamW's two moments. The planner's fit test and the GPU packing both use it."""
    return params * 4 + trainable * (TRAIN_BYTES_PER_PARAM - 4)


def memory_budget(device: DeviceFacts | dict) -> int:
    """The memory one probe's training may take: the first GPU's, else the RAM available (else total)."""
    device = DeviceFacts.of(device)
    if device.gpus:
        return device.gpus[0].memory_bytes
    return device.ram_available_bytes or device.ram_bytes or 0


def training_fit(full: int, trainable: int, device: DeviceFacts) -> tuple[bool, str]:
    """Whether training a model of `full` parameters (`trainable` of them trained) fits this device, and why."""
    need = training_bytes(full, trainable)
    budget = memory_budget(device)
    text = (
        f"{full / 1e6:.1f}M params need ~{need / 2**30:.1f} GiB to train; "
        f"{FIT_FRACTION:.0%} of {budget / 2**30:.0f} GiB is available"
    )
    return need <= FIT_FRACTION * budget, text


def step_flops(params: int, trainable: int, tokens: int) -> float:
    """FLOPs of one training step: 2 per parameter and token forward, 2 more backward through the
    activations, and 2 per trainable parameter and token for the weight gradients (6 * params *
    tokens for full fine-tuning, the usual transformer estimate)."""
    return (4 * params + 2 * trainable) * tokens


@functools.cache
def measured_cpu_flops() -> float:
    """fp32 matmul FLOP/s of this CPU with torch's threads: the best of five 1024x1024 products
    (~0.1 s on the 2-core dev machine). An upper bound on training speed, so --scale auto falls back to
    probe scale only when even that is too slow."""
    n = 1024
    return 2 * n**3 / matmul_seconds(n, tries=5)


def device_flops(device: DeviceFacts | dict) -> tuple[float, str]:
    """(FLOP/s a probe can expect, where that figure comes from): the facts' own `train_flops` when the
    caller gives one, a GPU's tabled peak times GPU_PROBE_EFFICIENCY, or the CPU measured now."""
    device = DeviceFacts.of(device)
    if device.train_flops:
        return device.train_flops, "given"
    if device.gpus:
        from .capabilities import capability_row

        row = capability_row(device.gpu_capability)
        peak = GPU_PEAK_FLOPS.get(row[0] if row else "", 10e12)
        return peak * GPU_PROBE_EFFICIENCY, f"{GPU_PROBE_EFFICIENCY:.0%} of the {row[0] if row else 'GPU'} tabled peak"
    return measured_cpu_flops(), "measured on this CPU"


def probe_time(params: int, trainable: int, recipe: Recipe, steps: int, device: DeviceFacts) -> tuple[float, str]:
    """(seconds, one line saying how) a probe of `steps` steps is expected to train, at best."""
    flops = step_flops(params, trainable, recipe.batch_size * recipe.seq_len)
    speed, source = device_flops(device)
    seconds = flops * steps / speed
    rate = f"{speed / 1e12:.3g} TFLOP/s" if speed >= 1e12 else f"{speed / 1e9:.3g} GFLOP/s"
    # a floor, said as one: a small model's steps are mostly overhead (a chat grid's twin estimated at 7.1 s
    # for 8 steps trained in 41-49 s), and a dtype the CPU emulates is slower still (capabilities.emulated_notes)
    return (
        seconds,
        f"at least {_duration(seconds)} for {steps} steps: {flops / 1e12:.2g} TFLOP per step at {rate} {source}",
    )


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.2g} s"
        if seconds < 120
        else f"{seconds / 60:.0f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )


def choose_scale(
    recipe: Recipe, full: int, trainable: int, steps: int, device: DeviceFacts
) -> tuple[str, str, str | None]:
    """(scale, why, the time estimate or None) under the recipe's model.scale: auto takes the full model
    only when training it fits the device's memory AND a probe is expected to finish within
    PROBE_TIME_BUDGET_S; on a CPU a model quick even at CPU_FLOOR_FLOPS is not timed."""
    fits, fit_text = training_fit(full, trainable, device)
    if recipe.model.scale != "auto" or not fits:
        return ("probe" if recipe.model.scale == "auto" else recipe.model.scale), fit_text, None
    flops = step_flops(full, trainable, recipe.batch_size * recipe.seq_len) * steps
    if not device.gpus and not device.train_flops and flops / CPU_FLOOR_FLOPS <= PROBE_TIME_BUDGET_S:
        return "full", fit_text, None
    seconds, time_text = probe_time(full, trainable, recipe, steps, device)
    if seconds > PROBE_TIME_BUDGET_S:
        return (
            "probe",
            f"{fit_text}, but a full-scale probe would take {time_text}, over the {PROBE_TIME_BUDGET_S:.0f} s budget",
            time_text,
        )
    return "full", fit_text, f"a full-scale probe takes {time_text}"


def plan_model(recipe: Recipe, device: DeviceFacts | dict, steps: int | None = None) -> ModelPlan:
    """Decide what will be probed: local weights or a twin, full or probe scale, and why. `steps`
    (default: the recipe's) is what --scale auto weighs the time of a full-scale probe by."""
    device = DeviceFacts.of(device)
    config = model_config(recipe)
    full, trainable = count_params(config, recipe)
    scale, fit_text, timed = choose_scale(recipe, full, trainable, steps or recipe.steps, device)
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
    if scale == "full" and timed:
        why += f"; {timed}"
    probed = probe_scale(config) if scale == "probe" else config
    params, trainable = count_params(probed, recipe) if scale == "probe" else (full, trainable)
    if scale == "probe" and timed:  # the user weighs the twin's time too: its vocab can dominate it
        why += f"; the probe-scale twin takes {probe_time(params, trainable, recipe, steps or recipe.steps, device)[1]}"
    return ModelPlan(
        source=source,
        scale=scale,
        model_type=config.model_type,
        params=params,
        full_params=full,
        trainable_params=trainable,
        path=str(weights) if source == "local-weights" else None,
        why=why,
        shape=shape_of(probed),
        named_shape=shape_of(config),
        refuses=refused_attention(config, recipe),
    )


def plan_warnings(recipe: Recipe, plan: ModelPlan, device: DeviceFacts | dict) -> list[str]:
    """What the user must hear before the probes spend minutes: a --scale full that the planner
    expects not to fit, and a checkpoint of their own that is not what gets trained."""
    device = DeviceFacts.of(device)
    warnings = []
    if plan.scale == "full":
        fits, fit_text = training_fit(plan.full_params, plan.trainable_params, device)
        if not fits:
            warnings.append(
                f"--scale full will likely run out of memory ({fit_text}); --scale auto probes a smaller twin"
            )
    if recipe.model.path and plan.source == "architecture-twin":
        if _weights_dir(recipe) is None:
            warnings.append(
                f"{recipe.model.path} has a config.json but no weights (*.safetensors or *.bin): every probe "
                "trains a RANDOM-INIT twin built from that config, not your checkpoint"
            )
        else:
            # the model line just above says why; the warning says only what it means, once
            warnings.append(
                f"your checkpoint's weights are NOT what gets trained: every probe trains a random-init "
                f"twin at {plan.scale} scale (--scale full trains your weights)"
            )
    return warnings


def apply_adapter(model, recipe: Recipe):
    """The model with the recipe's adapter, made as peft makes it (get_peft_model with a LoraConfig):
    the base frozen, the adapter weights trainable (in fp32 over a half-precision base when
    adapter.autocast_adapter_dtype, peft's default), and each of adapter.modules_to_save copied and
    trained in full beside it. The model itself when the recipe trains no adapter."""
    a = recipe.adapter
    if a.type == "none":
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        target_modules=list(a.target_modules),
        lora_dropout=a.dropout,
        use_dora=a.type == "dora",
        modules_to_save=list(a.modules_to_save) or None,
    )
    try:
        return get_peft_model(model, lora, autocast_adapter_dtype=a.autocast_adapter_dtype)
    except ValueError as e:
        raise NandoctorError(f"adapter of recipe {recipe.name!r}: {str(e).splitlines()[0]}") from None


def checkpointing(model, mode: str) -> None:
    """Gradient checkpointing as recipe.gradient_checkpointing says (config.GRADIENT_CHECKPOINTING),
    enabled as the Trainer enables it after get_peft_model: the model's activation_checkpointing_enable
    (gradient_checkpointing_enable in older releases, 5.17 among them)
    with use_reentrant as asked (transformers 5.24, which also adds the input-gradient hook,
    enable_input_require_grads, to every model whose main input is input_ids). `reentrant` then takes
    that hook off: reentrant checkpointing as a setup without the hook runs it (a loop that checkpoints
    the layers itself; Trainer + get_peft_model before transformers added the hook for them,
    huggingface/transformers#26221, #42489), where a block whose inputs need no gradient passes none
    to the adapter weights inside it. docs/training-options.md."""
    if mode == "off":
        return
    kwargs = {"use_reentrant": mode == "reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # older transformers (5.17) names it gradient_checkpointing_enable: the same steps, hook included
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode == "reentrant":
        model.disable_input_require_grads()


# The parameter groups a probe accounts gradients to, each parameter in the first that claims it:
# the adapter's own weights (peft names them with its tuner's prefix, lora_), the copies peft trains
# in full beside it (adapter.modules_to_save, kept under ".modules_to_save."), the input and output
# embeddings when trained, and every other trainable parameter.
GROUPS = ("adapter", "modules_to_save", "embeddings", "rest")


# The tensor groups the gradient checks compare each on its own (measure/accumulation.py): a mixture of
# experts' router weights (transformers names the router linear `gate` or `router` under the MoE block)
# and its experts' weights (routed and shared), then GROUPS. A balancing loss counted once per
# micro-batch moves the router's gradient by 10-30% while the whole model's moves by 1e-3.
CHECKED_GROUPS = ("router", "experts", *GROUPS)
_ROUTER = re.compile(r"\.(gate|router)\.(weight|bias)$")
_EXPERTS = re.compile(r"\.(experts|shared_experts?)\.")


def checked_groups(model) -> dict[str, list[tuple[str, object]]]:
    """{group: [(name, parameter)]} of the model's trainable parameters in CHECKED_GROUPS order, empty
    groups left out: trainable_groups with a mixture of experts' router and expert weights taken out
    of `rest` (a dense model's are trainable_groups')."""
    groups = trainable_groups(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not expert_count(base.config):
        return groups
    out = {g: [] for g in CHECKED_GROUPS}
    for g, params in groups.items():
        for name, p in params:
            moe = "router" if _ROUTER.search(name) else "experts" if _EXPERTS.search(name) else g
            out[moe if g == "rest" else g].append((name, p))
    return {g: params for g, params in out.items() if params}


def trainable_groups(model) -> dict[str, list[tuple[str, object]]]:
    """{group: [(name, parameter)]} of the model's trainable parameters, in GROUPS order, empty groups
    left out. `model` is the module built (a PeftModel for an adapter), not a DDP / compile wrapper."""
    prefix = getattr(model.base_model, "prefix", None) if hasattr(model, "get_base_model") else None
    embeddings = {
        id(p)
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
        for p in m.parameters()
    }

    def group(name: str, p) -> str:
        if prefix and prefix in name:
            return "adapter"
        if ".modules_to_save." in name:
            return "modules_to_save"
        return "embeddings" if id(p) in embeddings else "rest"

    out = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[group(name, p)].append((name, p))
    return {g: params for g, params in out.items() if params}
