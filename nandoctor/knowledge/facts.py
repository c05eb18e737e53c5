"""The facts the rules in rules.yaml are written against, gathered from the environment (env.py's
DeviceFacts), the planned setup (recipe + cell + optional TrainingArguments JSON + tokenizer) and, after a
run, from a probe's recorded steps. Every fact is a plain value; an unknown one is None.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from ..cells import (
    LOAD_DTYPES,
    SHORT_DTYPES,
    Cell,
    compile_of_training_args,
    optimizer_of_training_args,
    precision_of_training_args,
    reduce_dtype,
    weight_dtype,
)
from ..config import STORAGE_DTYPES, Recipe, load_dtype
from ..device import DeviceFacts
from ..errors import NandoctorError
from ..thresholds import THRESHOLDS
from .accelerate_config import accelerate_cell, parallel_of_accelerate

# A token string that reads like a control token: T5's <pad>, Llama-2's <unk>, BERT's [PAD],
# GPT-2's <|endoftext|>. Id 0 spelled otherwise ("!" in Llama 3) is content.
CONTROL_TOKEN = re.compile(r"^(<[^<>]*>|\[[A-Z_]+\])$")


def env_facts(env: DeviceFacts | dict) -> dict:
    env = DeviceFacts.of(env)
    return {
        "device": env.device,
        "gpu_capability": env.gpu_capability,
        "cudnn_version": env.cudnn,
        "flash_attn": env.flash_attn,
    }


def read_trainer_args(path: str | Path) -> dict:
    """A TrainingArguments (or TRL config) file: JSON as `to_json_string()` writes it, or YAML (.yaml, .yml)."""
    import yaml

    as_yaml = Path(path).suffix in (".yaml", ".yml")
    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text) if as_yaml else json.loads(text)
    except OSError as e:
        raise NandoctorError(f"cannot read --trainer-args {str(path)!r}: {e.strerror}") from None
    except (ValueError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NandoctorError(
            f"--trainer-args {str(path)!r} is not valid {'YAML' if as_yaml else 'JSON'}: {first}"
        ) from None
    if not isinstance(data, dict):
        raise NandoctorError(f"--trainer-args {str(path)!r}: expected a mapping of TrainingArguments fields")
    return data


# What each trainer kind's arguments hold that TrainingArguments does not (TRL 1.16 SFTConfig, GRPOConfig;
# loss_type is in both): how `trainer_of` tells the kind of a file from its keys
TRAINER_KEYS = {
    "grpo": (
        "num_generations",
        "max_completion_length",
        "beta",
        "epsilon_high",
        "steps_per_generation",
        "scale_rewards",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
    ),
    "sft": ("dataset_text_field", "completion_only_loss", "assistant_only_loss"),
}
TRAINER_KINDS = ("hf", "sft", "grpo")  # --trainer: transformers.Trainer, trl.SFTTrainer, trl.GRPOTrainer
TRAINER_ARGS = {"hf": "TrainingArguments", "sft": "SFTConfig", "grpo": "GRPOConfig"}  # the arguments class of each
# TRL 1.16 GRPOConfig's defaults of what sets a GRPO probe's rollout (trl/trainer/grpo_config.py)
GRPO_DEFAULTS = {
    "num_generations": 8,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": None,  # None: gradient_accumulation_steps
    "generation_batch_size": None,  # None: per_device_train_batch_size x steps_per_generation
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "max_completion_length": 512,
}


def trainer_of(path: str | Path, kind: str | None = None) -> dict:
    """{"kind": "hf" | "sft" | "grpo", "args": the file's fields}: the trainer a probe runs for --trainer-args
    `path`; the kind is `kind` (--trainer) or read from the file's keys (TRAINER_KEYS)."""
    args = read_trainer_args(path)
    found = next((k for k, keys in TRAINER_KEYS.items() if any(key in args for key in keys)), "hf")
    kind = kind or found
    if kind not in TRAINER_KINDS:
        raise NandoctorError(f"unknown --trainer {kind!r}; valid: {', '.join(TRAINER_KINDS)}")
    return {"kind": kind, "args": args}


def with_trainer(recipe: Recipe, trainer: dict) -> Recipe:
    """The recipe as --trainer-args sets it (`with_trainer_args`). SFTTrainer packs rows itself, as the
    SFTConfig's packing / padding_free say, so the probe hands it unpacked rows: data.packing is refused.
    A GRPOConfig makes the probe a GRPO one (objective=grpo) whose rollout is the GRPOConfig's (`grpo_rollout`)."""
    if trainer["kind"] == "sft" and recipe.data.packing != "none":
        raise NandoctorError(
            f"data.packing={recipe.data.packing} with an SFTConfig: trl.SFTTrainer packs as the SFTConfig says "
            "(packing, padding_free); leave data.packing at none"
        )
    if recipe.objective == "grpo" and trainer["kind"] != "grpo":
        raise NandoctorError(
            f"objective grpo with a {TRAINER_ARGS[trainer['kind']]} (--trainer-args): give a GRPOConfig to probe "
            "trl.GRPOTrainer, or drop --trainer-args for nandoctor's own GRPO loop"
        )
    if trainer["kind"] == "grpo":
        recipe = replace(recipe, objective="grpo", rollout=grpo_rollout(recipe.rollout, trainer["args"]))
    return with_trainer_args(recipe, trainer["args"])


def grpo_rollout(rollout, args: dict):
    """The rollout settings a GRPOConfig's fields (TRL's defaults where it leaves one out) give a probe:
    its sampler (temperature, top_p, top_k, max_completion_length), num_generations, and as many prompts
    per generation as its generation batch holds groups of num_generations completions. The output head
    stays as built (lm_head_fp32 off): GRPOTrainer casts it itself where cast_lm_head_to_fp32 says so."""
    given = {**GRPO_DEFAULTS, **{k: v for k, v in args.items() if k in GRPO_DEFAULTS and v is not None}}
    per_generation = given["steps_per_generation"] or given["gradient_accumulation_steps"]
    completions = given["generation_batch_size"] or given["per_device_train_batch_size"] * per_generation
    groups, left = divmod(int(completions), int(given["num_generations"]))
    if left or not groups:
        raise NandoctorError(
            f"GRPOConfig: a generation batch of {completions} completions is not a whole number of groups of "
            f"num_generations={given['num_generations']}"
        )
    return replace(
        rollout,
        temperature=float(given["temperature"]),
        top_p=float(given["top_p"]),
        top_k=int(given["top_k"]),
        max_new_tokens=int(given["max_completion_length"]),
        num_generations=int(given["num_generations"]),
        prompts=groups,
        lm_head_fp32=False,
    )


def with_trainer_args(recipe: Recipe, args: dict) -> Recipe:
    """The recipe as the trainer's arguments set it: the batch of one micro-batch, the micro-batches per
    step, clipping, and the AdamW hyperparameters the Trainer passes (what the probe's data, its record
    and the rules read; the trainer takes the arguments whole, these fields as the recipe then holds them:
    config.trainer_arguments)."""
    o = recipe.optimizer
    optimizer = replace(
        o,
        lr=float(args.get("learning_rate", o.lr)),
        betas=(float(args.get("adam_beta1", o.betas[0])), float(args.get("adam_beta2", o.betas[1]))),
        eps=float(args.get("adam_epsilon", o.eps)),
        weight_decay=float(args.get("weight_decay", o.weight_decay)),
    )
    return replace(
        recipe,
        optimizer=optimizer,
        grad_clip=float(args["max_grad_norm"] or 0.0) if "max_grad_norm" in args else recipe.grad_clip,
        batch_size=int(args.get("per_device_train_batch_size", recipe.batch_size)),
        gradient_accumulation_steps=int(args.get("gradient_accumulation_steps", recipe.gradient_accumulation_steps)),
    ).validate()


def trainer_cell(trainer_args: dict, attn: str = "sdpa", accelerate: dict | None = None) -> Cell:
    """The grid cell a TrainingArguments setup runs: bf16=True / fp16=True are autocast (-amp) with
    fp32 master weights unless the model was loaded in half; torch_compile selects inductor; `fsdp`
    set is FSDP as accelerate builds it for the Trainer (reducing in the autocast dtype); `optim` is the
    optimizer row that lists it (an optim= no row probes is a NandoctorError saying why). Launched
    with an accelerate config (`accelerate`), that file decides the parallel setup, and the
    precision and compile the TrainingArguments leave unset."""
    precision, compile = precision_of_training_args(trainer_args), compile_of_training_args(trainer_args)
    optimizer = optimizer_of_training_args(trainer_args)
    if accelerate is not None:
        cell = accelerate_cell(
            accelerate, attn, None if precision == "fp32" else precision, None if compile == "off" else compile
        )
        return replace(cell, optimizer=optimizer)
    parallel = parallel_of_accelerate("FSDP", precision, 1) if trainer_args.get("fsdp") else "none"
    return Cell(precision, attn, compile, optimizer, parallel=parallel)


def _cast_to(recipe: Recipe, cell: Cell) -> str | None:
    """The short dtype every weight, the adapter's too, is cast to (a pure cell; an fp32 cell over a 16-bit
    load), as models.build_model casts them; None where the cell keeps the load dtype."""
    held = weight_dtype(cell, load_dtype(recipe))
    return SHORT_DTYPES[held] if held != LOAD_DTYPES[load_dtype(recipe)] else None


def adapter_dtype(recipe: Recipe, cell: Cell) -> str | None:
    """The dtype of the adapter's weights, as peft and models.build_model hold them; None without an
    adapter. A pure cell hard-casts them with everything; otherwise peft keeps them in fp32 over a
    bf16 / fp16 base when adapter.autocast_adapter_dtype (its default), else in the base's load dtype."""
    if recipe.adapter.type == "none":
        return None
    if cast := _cast_to(recipe, cell):  # cast with everything (a pure cell, an fp32 one)
        return cast
    return "fp32" if recipe.adapter.autocast_adapter_dtype else load_dtype(recipe)


def trainable_dtype(recipe: Recipe, cell: Cell) -> str:
    """The lowest dtype the optimizer updates, as models.build_model holds it: the pure cells hard-cast
    everything, an fp32 cell casts to fp32; otherwise a full fine-tune keeps the load dtype; an adapter its
    adapter_dtype, and peft's modules_to_save copies the load dtype (autocast_adapter_dtype casts the adapter
    layers only)."""
    if cast := _cast_to(recipe, cell):
        return cast
    if recipe.adapter.type == "none" or recipe.adapter.modules_to_save:
        return load_dtype(recipe)
    return adapter_dtype(recipe, cell)


def tokenizer_facts(tokenizer) -> dict:
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    return {
        "tokenizer_has_pad": pad is not None,
        "pad_id0_is_content": pad == 0 and not CONTROL_TOKEN.match(tokenizer.convert_ids_to_tokens(0) or ""),
        "pad_is_eos": pad is not None and pad == eos,
    }


def recipe_pad_facts(recipe: Recipe) -> dict:
    """The pad facts of nandoctor's own data stream (pad_token.policy)."""
    policy = recipe.pad_token.policy
    return {"tokenizer_has_pad": True, "pad_id0_is_content": policy == "id0", "pad_is_eos": policy == "eos"}


def setup_facts(
    recipe: Recipe,
    cell: Cell,
    model_config=None,
    trainer_args: dict | None = None,
    tokenizer=None,
    eager_baseline: bool = False,
) -> dict:
    """Facts about one planned cell of a recipe (and the TrainingArguments / tokenizer when given)."""
    args = trainer_args or {}
    trained = trainable_dtype(recipe, cell)
    init_kwargs = args.get("model_init_kwargs") or {}
    fp8 = cell.precision.fp8
    facts = {
        "dtype": cell.dtype,
        "attn": cell.attn,
        "compile": cell.compile,
        "optimizer": cell.optimizer,
        "optimizer_eval_mode": cell.optimizer_row.eval_mode,  # schedule-free: evaluates other weights than it trains
        "uses_bf16": cell.precision.compute == "bfloat16" or trained == "bf16",  # the fp8 cells run in bf16 autocast
        "grad_scaler": cell.precision.scaler,
        "trainable_dtype": trained,
        "adapter_dtype": adapter_dtype(recipe, cell),
        "adapter": recipe.adapter.type,
        "optimizer_eps": float(args.get("adam_epsilon", recipe.optimizer.eps)),
        "padded": recipe.data.pad_fraction > 0,
        "attn_softcapping": getattr(model_config, "attn_logit_softcapping", None) if model_config is not None else None,
        "device_map": args.get("device_map") or init_kwargs.get("device_map"),
        "eager_baseline": eager_baseline or cell.compile == "off",
        "mask_pad_labels": recipe.pad_token.mask_labels,
        "logging_nan_inf_filter": args.get("logging_nan_inf_filter"),
        "trainer_bf16_and_fp16": bool(args.get("bf16") and args.get("fp16")) if trainer_args else None,
        "fp8_backend": fp8.package if fp8 else None,
        "fp8_scaling": fp8.scaling if fp8 else None,
        # the linears see the batch flattened to batch_size * seq_len rows
        "batch_tokens_mod_16": recipe.batch_size * recipe.seq_len % 16,
        "parallel": cell.parallel,
        "reduce_dtype": SHORT_DTYPES.get(reduce_dtype(cell, load_dtype(recipe))),  # None: one process
    }
    facts.update(quant_facts(recipe, cell, model_config))
    facts.update(tokenizer_facts(tokenizer) if tokenizer is not None else recipe_pad_facts(recipe))
    return facts


def quant_facts(recipe: Recipe, cell: Cell, model_config=None) -> dict:
    """The facts of a quantized base (the quant axis; None where the base is not quantized) and of tied
    embeddings trained through modules_to_save (what the round trip checks after training)."""
    quantized = cell.quant != "none"
    weights = weight_dtype(cell, load_dtype(recipe))
    tied = getattr(model_config, "tie_word_embeddings", None) if model_config is not None else None
    saved = set(recipe.adapter.modules_to_save) if recipe.adapter.type != "none" else set()
    return {
        "quant": cell.quant,
        "quant_compute": SHORT_DTYPES[cell.precision.compute] if quantized else None,
        "quant_prepare": recipe.quant.prepare if quantized else None,
        "quant_storage_is_weights": STORAGE_DTYPES[recipe.quant.storage] == weights if quantized else None,
        "gradient_checkpointing": recipe.gradient_checkpointing,
        "tied_embeddings": tied,
        "modules_to_save_embeddings": bool(saved & {"lm_head", "embed_tokens"}),
    }


def router_setup_facts(router: dict | None) -> dict:
    """The rules' facts of a mixture of experts' routing as planned (models.router_facts): its family,
    experts, whether the load-balancing loss is in the trained loss and its weight, whether the router
    trains, and the quantization its weights load in; every one None for a dense model."""
    r = router or {}
    return {
        "moe_family": r.get("model_type"),
        "moe_experts": r.get("experts"),
        "moe_aux_loss": r.get("aux_loss"),
        "moe_aux_coef": r.get("aux_loss_coef"),
        "moe_router_trained": r.get("router_trained"),
        "moe_quant_method": r.get("quant_method"),
        "moe_router_dtype": r.get("router_dtype"),
    }


def observed_facts(record) -> dict:
    """Facts only a run can show, from one probe record: the lowest GradScaler scale it reached
    (a skipped step halves the scale it was taken at); whether every gradient it computed was exactly
    zero (None when no step ran unskipped); for a parallel probe, its master weights' dtype as read
    from the wrapped model, under autocast or not, and whether its step-0 gradient came out
    world-size times the one-process one."""
    scales = [s.scale / 2 if s.skipped else s.scale for s in record.steps if s.scale is not None]
    norms = [s.grad_norm for s in record.steps if not s.skipped]
    facts = {
        "grad_scale_min": min(scales) if scales else None,
        "grad_norm_all_zero": all(n == 0.0 for n in norms) if norms else None,
    }
    parallel = record.parallel or {}
    masters = parallel.get("master_dtype") or []
    ratio = (parallel.get("grad_agreement") or {}).get("norm_ratio")
    world = parallel.get("world_size") or 0
    lowest = next((d for d in ("bfloat16", "float16", "float32") if d in masters), None)  # any half master counts
    facts.update(
        master_dtype=SHORT_DTYPES.get(lowest),
        autocast=record.cell.precision.autocast is not None,
        grad_sum_factor=ratio is not None and world > 1 and abs(ratio / world - 1) <= THRESHOLDS.grad_ratio_rel,
    )
    return facts
