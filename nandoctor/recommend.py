"""A probed configuration as the arguments a user passes to train with it: a `nandoctor check` command
line, `transformers.TrainingArguments`, the model-loading call, Lightning's `precision`, and the code
that no flag writes (an fp8 conversion, an optimizer built by hand, a DDP / FSDP2 wrapping), each
rendered here from what the cell table's rows say (their fp8 recipe, wrapper, reduce dtype, comm hook).
A quantized base (the quant axis) adds its BitsAndBytesConfig and, when the probe ran it, peft's
prepare_model_for_kbit_training. Pure: imports only cells and config.

The Trainer's lines run as pasted, imports added: they bind `args`, `model` (and `tokenizer`, `optimizer`)
and train what the probe trained (a constant lr, both precision flags written). Names come from the
transformers v5 TrainingArguments reference (output_dir, bf16, fp16, tf32, use_cpu, torch_compile,
torch_compile_backend, learning_rate, lr_scheduler_type, adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm,
per_device_train_batch_size, seed, optim, gradient_accumulation_steps, average_tokens_across_devices,
gradient_checkpointing, gradient_checkpointing_kwargs), `from_pretrained(dtype=, attn_implementation=)`,
peft's LoraConfig (r, lora_alpha, target_modules, lora_dropout, use_dora, modules_to_save) and
get_peft_model(autocast_adapter_dtype=), transformers' DataCollatorWithFlattening and
DataCollatorForLanguageModeling, TRL 1.16's SFTConfig (max_length, truncation_mode, completion_only_loss,
assistant_only_loss), and torch.nn.attention.sdpa_kernel. The data and training settings are
written only where the recipe sets them (the user's rows, accumulation, checkpointing, an adapter), so a
recommendation for the synthetic stream reads as it always did.
"""

from __future__ import annotations

import dataclasses
import shlex

from .cells import (
    ACCELERATE_MIXED_PRECISION,
    AXES,
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    SHORT_DTYPES,
    Cell,
    optimizer_kwargs,
    weight_dtype,
)
from .config import STORAGE_DTYPES, VLLM_DTYPES, Recipe, get_field, load_dtype, trainer_arguments
from .thresholds import THRESHOLDS

# The fp8 conversion a user writes, by the row's Fp8Recipe.package: {torchao_recipe} / {te_format} come
# from the row, {amax_history_len} / {amax_compute_algo} from the recipe's fp8 section (config.Fp8Config).
FP8_CODE = {
    "torchao": (
        'convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("{torchao_recipe}"), '
        "module_filter_fn=lambda m, fqn: fqn not in KEEP_HIGH_PRECISION)  # from torchao.float8; "
        "KEEP_HIGH_PRECISION: the modules the report lists"
    ),
    "transformer_engine": (
        "swap the eligible nn.Linear layers for te.Linear, then train under te.autocast(recipe=DelayedScaling("
        'fp8_format=Format.{te_format}, amax_history_len={amax_history_len}, amax_compute_algo="{amax_compute_algo}"))'
        "  # transformer_engine"
    ),
}
DDP_CODE = "model = DistributedDataParallel(model, device_ids=[local_rank])"
FSDP2_CODE = (
    "mp = MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype={reduce})  {why}\n"
    "for layer in model.model.layers: fully_shard(layer, mp_policy=mp)\n"
    "fully_shard(model, mp_policy=mp)  # then build the optimizer over model.parameters()"
)
# accelerate's FSDP2 plugin, in code: its YAML has no reduce dtype, and `mixed_precision: bf16` alone
# builds MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) (accelerate 1.15,
# utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision)
ACCELERATE_FSDP2_CODE = (
    "accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="
    '{{"param_dtype": torch.{dtype}, "reduce_dtype": torch.{reduce}, "output_dtype": torch.{dtype}}}))  {why}'
)


def call_text(name: str, kwargs: dict) -> str:
    """kwargs whose value is a str starting with 'torch.' are written as code, the rest as literals."""

    def show(v):
        return v if isinstance(v, str) and v.startswith("torch.") else repr(v)

    return f"{name}(" + ", ".join(f"{k}={show(v)}" for k, v in kwargs.items()) + ")"


def input_flags(base: Recipe) -> list[str]:
    """--data and --tokenizer naming the files the run read (absolute, as the recipe holds them)."""
    d = base.data
    flags = ["--data", d.path] if d.source == "file" and d.path else []
    return flags + (["--tokenizer", d.tokenizer] if d.tokenizer else [])


def check_command(config: dict, base: Recipe, model_flags: list[str]) -> str:
    """The `nandoctor check` command line of a configuration: the model flags of the run's command, the
    data and tokenizer it read, the cell and every recipe field set otherwise than in `base`."""
    cell = Cell.of(config)
    flags = [*model_flags, *input_flags(base)]
    parts = ["nandoctor", "check", *flags, "--dtype", cell.dtype, "--attn", cell.attn, "--compile", cell.compile]
    if base.objective != Recipe.objective:
        parts += ["--objective", base.objective]
    if cell.optimizer != DEFAULT_OPTIMIZER:
        parts += ["--optimizer", cell.optimizer]
    if cell.parallel != "none":
        parts += ["--parallel", cell.parallel]
    if cell.quant != "none":
        parts += ["--quant", cell.quant]
    for name, value in config.items():
        if name not in AXES and value != get_field(base, name):
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts += ["--set", f"{name}={text}"]
    return shlex.join(parts)


# The flags of a run's command line that choose the model, the recipe and the user's trainer: a `check` of
# the recommendation passes them again (bisect's CLI hands them over itself), so that it trains what the
# run probed; the data and tokenizer come from the recipe (input_flags), as resolved paths.
MODEL_FLAG_NAMES = ("--model", "--recipe", "--scale", "--set", "--world-size", "--trainer-args", "--trainer")


def model_flags_of(command: str, recipe: Recipe) -> list[str]:
    """The model and recipe flags of a recorded command line (run.json's `command`), in their order;
    `--model` naming the recipe's checkpoint or name when the command had neither --model nor --recipe
    (a run from Python)."""
    try:
        words = shlex.split(command or "")
    except ValueError:  # run.json keeps argv joined by spaces: an unbalanced quote inside a value
        words = (command or "").split()
    flags, i = [], 0
    while i < len(words):
        name, eq, value = words[i].partition("=")
        if name in MODEL_FLAG_NAMES and (eq or i + 1 < len(words)):
            flags += [name, value] if eq else [name, words[i + 1]]
            i += 0 if eq else 1
        elif words[i] == "--trust-remote-code":
            flags.append(words[i])
        i += 1
    if "--model" not in flags and "--recipe" not in flags:
        flags = ["--model", recipe.model.hub_id or recipe.model.path or recipe.name] + flags
    return flags


# The collator of the user's rows, by data.labels, when nothing is packed (docs/data.md): what the
# probe's collator did, in transformers' (or TRL's) terms. completion_only is written by completion_code.
COLLATORS = {
    "pad_id": "collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels: the ids, -100 at the pad id",
    "attention_mask": "collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # labels -100 at the pad "
    "id: where attention_mask is 0 when the pad token is its own (a pad that is also a real token masks it too)",
}
# data.labels=completion_only, by the kind of rows and what the run's lint found of the chat template
# (userdata/lint.py "assistant_mask"): TRL's setting that labels the tokens the probe labelled (its SFTConfig
# keyword, then why), or None and what to add. TRL's assistant_only_loss takes its mask from transformers'
# apply_chat_template(return_assistant_tokens_mask=True), which marks only the {% generation %} spans of
# the template and returns all zeros for a template without them (Llama 3.1's, Qwen3's and Gemma 3's
# stock templates). TRL 1.16's SFTTrainer swaps its own marked training copy in for a stock template without
# marks, and the probe's labels then follow that copy (userdata/template.trl_training_template); it refuses
# any other template without marks, for which the probe placed its mask by rendering each turn's prefix,
# from the end of the generation prompt through the turn's text after its content.
PROMPT_COMPLETION = ({"completion_only_loss": True}, "# labels on the completion only, -100 on the prompt: as probed")
MARKED_TEMPLATE = (
    {"assistant_only_loss": True},
    "# labels on the chat template's {{% generation %}} spans, -100 elsewhere: the probe's mask on the {checked} "
    "rows checked",
)
TRL_TEMPLATE = (
    {"assistant_only_loss": True},
    "# labels follow TRL's training template for {name}, which trl.SFTTrainer swaps in for assistant_only_loss=True "
    "(the tokenizer's own has no {{% generation %}} marks): the probe's mask on the {checked} rows checked",
)
MARKS_DIFFER = (
    None,
    "# the chat template's {{% generation %}} spans differ from the probed mask (each assistant turn and its "
    "end-of-turn) in {differing} of {checked} rows checked (row {first}): trl.SFTConfig(assistant_only_loss=True) "
    "would train on other tokens than the probe did; move the marks around each assistant turn's content and "
    "its end-of-turn, or give prompt/completion rows and trl.SFTConfig(completion_only_loss=True)",
)
UNMARKED_TEMPLATE = (
    None,
    "# as probed, labels on each assistant turn and its end-of-turn, -100 elsewhere. The chat template has no "
    "{{% generation %}} marks, which trl.SFTConfig(assistant_only_loss=True) reads the mask from. {where}, then "
    "trl.SFTConfig(assistant_only_loss=True); or give prompt/completion rows (the chat before each assistant turn, "
    "that turn) and trl.SFTConfig(completion_only_loss=True)",
)
NO_TRL = (
    ". TRL is not installed where nandoctor ran: a stock template TRL knows (qwen2_5, llama3, ...) was not "
    "recognised, and for one SFTTrainer swaps in its own training template, whose mask may differ from this one"
)
# where the marks go, from the template's own render (userdata/template.generation_mark_places)
MARKS_AT = (
    "In each assistant turn put {{% generation %}} right after {opens!r} and {{% endgeneration %}} right after "
    "{closes!r}: those marks give the probe's mask (marks elsewhere, such as before a newline that ends the turn, "
    "train other tokens)"
)
MARKS_AROUND = (
    "Add them around each assistant turn's content and end-of-turn ({% generation %}...{% endgeneration %}), "
    "where its generation prompt ends and where the turn's text ends"
)
UNKNOWN_TEMPLATE = (
    {"assistant_only_loss": True},
    "# labels on the assistant turns only, -100 elsewhere, as probed: only where the chat template marks them "
    "with {% generation %}...{% endgeneration %} (without the marks transformers returns an all-zero mask); or "
    "prompt/completion rows and completion_only_loss=True",
)
# The collator of packed rows, by data.packing: the one the probe's collator stands for (userdata/collate.py).
PACKED_COLLATORS = {
    "position_ids": "DataCollatorWithFlattening",
    "block_mask": "DataCollatorWithFlattening + a 4-D block-diagonal attention_mask",
    "position_ids_with_mask": "DataCollatorWithFlattening + a 2-D all-ones attention_mask",
}
PACKED_CODE = {
    "position_ids": [
        "collator = DataCollatorWithFlattening()  # each batch one row, position_ids restarting per row, no attention "
        "mask: transformers then keeps the packed rows apart",
        "model.config.use_cache = False  # with a cache, position_ids are not packing: the rows would see each other",
    ],
    "block_mask": [
        "def block_diagonal(batch):  # as probed: an explicit additive mask keeping the packed rows apart",
        "    seg = (batch['position_ids'][0] == 0).cumsum(0); keep = (seg[:, None] == seg[None, :]) & "
        "torch.ones(len(seg), len(seg), dtype=torch.bool).tril()",
        "    batch['attention_mask'] = torch.zeros(keep.shape, dtype=model.dtype).masked_fill(~keep, "
        "torch.finfo(model.dtype).min)[None, None]  # [1, 1, T, T]: 0 where a token attends, the lowest value "
        "elsewhere",
        "    return batch",
        "collator = lambda rows: block_diagonal(DataCollatorWithFlattening()(rows))  # each batch one row, "
        "position_ids restarting per row",
    ],
    "position_ids_with_mask": [
        "collator = DataCollatorWithFlattening()  # as probed: each batch one row, position_ids restarting per row, "
        "then a 2-D all-ones attention_mask beside them (a padding collator adds it): the packed rows attend to "
        "each other",
    ],
}
TOKEN_NORMALISED = (
    "# a custom loop: loss = each micro-batch's summed token loss / the step's supervised tokens "
    "(num_items_in_batch), summed over the micro-batches"
)
MICRO_BATCH_NORMALISED = (
    "# a custom loop, as probed: loss = each micro-batch's mean token loss / gradient_accumulation_steps "
    "(the Trainer normalises by the step's tokens instead)"
)


def completion_setting(lint: dict | None) -> tuple[dict | None, str]:
    """(TRL's SFTConfig keyword that labels the completions as the probe did, or None where none does;
    the comment that says why, or what to add); lint: the run's data lint (run.json's "data"), which
    names the kind of rows and checks the chat template."""
    lint = lint or {}
    if (lint.get("source") or {}).get("kind") == "prompt_completion":
        return PROMPT_COMPLETION
    check = lint.get("assistant_mask")
    if not check:
        return UNKNOWN_TEMPLATE
    if not check["generation_marks"] and not check.get("trl_template"):
        kwargs, why = UNMARKED_TEMPLATE
        places = check.get("mark_after")
        where = MARKS_AT.format(opens=places[0], closes=places[1]) if places else MARKS_AROUND
        return kwargs, why.format(where=where) + ("" if check.get("trl_found", True) else NO_TRL)
    if not check["rows_checked"]:
        return UNKNOWN_TEMPLATE
    if check["rows_differing"]:
        kwargs, why = MARKS_DIFFER
        first = check["first_differing"]
        return kwargs, why.format(differing=check["rows_differing"], checked=check["rows_checked"], first=first)
    if check.get("trl_template"):
        kwargs, why = TRL_TEMPLATE
        return kwargs, why.format(name=check["trl_template"], checked=check["rows_checked"])
    kwargs, why = MARKED_TEMPLATE
    return kwargs, why.format(checked=check["rows_checked"])


def trl_setting(recipe: Recipe, lint: dict | None) -> tuple[dict | None, str | None]:
    """completion_setting for a recipe that labels the completions of the user's rows; (None, None) otherwise."""
    if recipe.data.source != "file" or recipe.data.labels != "completion_only":
        return None, None
    return completion_setting(lint)


def data_settings(recipe: Recipe) -> dict | None:
    """The data settings a probe of the user's rows trained with (None for the synthetic stream): the
    collator, padding and truncation, packing and labels, and the model config they need."""
    d = recipe.data
    if d.source != "file":
        return None
    packed = d.packing != "none"
    return {
        "collator": PACKED_COLLATORS[d.packing] if packed else "DataCollatorForLanguageModeling",
        "packing": d.packing,
        "padding_side": d.padding_side,
        "labels": d.labels,
        "max_length": d.max_length or recipe.seq_len,
        "truncation_side": d.truncation_side,
        "use_cache": False if packed else None,
    }


def training_settings(recipe: Recipe) -> dict:
    """The training options the probe applied (docs/training-options.md), as the recommendation's data."""
    a = recipe.adapter
    return {
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "loss_normalization": recipe.loss_normalization,
        "gradient_checkpointing": recipe.gradient_checkpointing,
        "dtype_on_load": load_dtype(recipe),
        "modules_to_save": list(a.modules_to_save) if a.type != "none" else None,
        "autocast_adapter_dtype": a.autocast_adapter_dtype if a.type != "none" else None,
    }


def data_code(recipe: Recipe, lint: dict | None = None) -> list[str]:
    """The tokenizer, label and collator lines of the user's rows; [] for the synthetic stream. lint: the
    run's data lint, which says how the chat template marks the assistant turns (a TRL setting that labels
    as the probe did is written into the arguments' line: arguments_line)."""
    d = data_settings(recipe)
    if d is None:
        return []
    lines = [
        f"tokenizer = AutoTokenizer.from_pretrained({recipe.data.tokenizer or checkpoint_name(recipe)!r})",
        f"tokenizer.padding_side, tokenizer.truncation_side = {d['padding_side']!r}, {d['truncation_side']!r}"
        f"  # rows tokenized with truncation=True, max_length={d['max_length']}",
    ]
    sft, why = trl_setting(recipe, lint)
    if why and sft is None:
        lines.append(why)
    if d["packing"] != "none":
        return lines + PACKED_CODE[d["packing"]]
    return lines + ([COLLATORS[d["labels"]]] if d["labels"] in COLLATORS else [])


def loss_code(recipe: Recipe) -> list[str]:
    """How a custom loop normalises an accumulated step's loss, as the probe did; [] for one micro-batch."""
    if recipe.gradient_accumulation_steps == 1:
        return []
    return [TOKEN_NORMALISED if recipe.loss_normalization == "tokens" else MICRO_BATCH_NORMALISED]


def training_arguments(cell: Cell, recipe: Recipe) -> dict:
    # the optimizer's and clipping's fields as a probe under the user's trainer is given them (one mapping)
    given = trainer_arguments(recipe)
    accumulation = given.pop("gradient_accumulation_steps")
    args = {
        "bf16": False,  # both written: TRL's SFTConfig turns bf16 on by itself where the device has it
        "fp16": False,
        **cell.precision.training_args,
        "learning_rate": given.pop("learning_rate"),
        "lr_scheduler_type": "constant",  # the probe steps at one lr: no warm-up, no decay (the Trainer's is linear)
        **given,
        "per_device_train_batch_size": recipe.batch_size,
        "seed": recipe.seed,
    }
    if cell.optimizer_row.transformers_optim:  # none for muon: the Trainer takes the built optimizer
        args["optim"] = cell.optimizer_row.transformers_optim[0]
    if cell.compilation.backend:
        args.update(torch_compile=True, torch_compile_backend=cell.compilation.backend)
    if cell.parallel_row.wrapper:  # one rank's rows of the global batch; launched with torchrun / accelerate
        args.update(cell.parallel_row.training_args, per_device_train_batch_size=recipe.batch_size // recipe.world_size)
    if accumulation > 1:
        args["gradient_accumulation_steps"] = accumulation
        if recipe.loss_normalization == "tokens":  # num_items_in_batch over every rank's tokens
            args["average_tokens_across_devices"] = True
    if recipe.gradient_checkpointing != "off":
        args.update(
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": recipe.gradient_checkpointing == "reentrant"},
        )
    return args


# Where the printed TrainingArguments / SFTConfig write checkpoints: a directory of the working directory
OUTPUT_DIR = "trained"


def sft_arguments(recipe: Recipe) -> dict:
    """The SFTConfig settings whose TRL default differs from what the probe trained with: TRL checkpoints
    activations unless told not to, and truncates at its own max_length (1024, keeping the start)."""
    d = recipe.data
    args = {} if recipe.gradient_checkpointing != "off" else {"gradient_checkpointing": False}
    keep = "keep_start" if d.truncation_side == "right" else "keep_end"
    return {**args, "max_length": d.max_length or recipe.seq_len, "truncation_mode": keep}


def arguments_line(cell: Cell, recipe: Recipe, lint: dict | None, device: str | None) -> str:
    """`args = TrainingArguments(...)`, or `args = trl.SFTConfig(...)` with its labelling keyword (and why)
    where TRL labels the completions as the probe did; use_cpu=True where the probes ran on a CPU (without
    it, bf16=True there stops with "Your setup doesn't support bf16/gpu")."""
    args = {
        "output_dir": OUTPUT_DIR,
        **training_arguments(cell, recipe),
        **({"use_cpu": True} if device == "cpu" else {}),
    }
    sft, why = trl_setting(recipe, lint)
    if sft is None:
        return "args = " + call_text("TrainingArguments", args)
    return "args = " + call_text("trl.SFTConfig", {**args, **sft_arguments(recipe), **sft}) + "  " + why


# -- GRPO (objective=grpo, docs/rl.md) -------------------------------------------------------------------

# The loss and importance-sampling correction the probe trained with (child/rollout.py), as TRL 1.16's
# GRPOConfig spells them: its defaults, written out so that a later default does not change the run
GRPO_LOSS = {
    "loss_type": "dapo",
    "beta": 0.0,
    "scale_rewards": "group",
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": THRESHOLDS.rollout_ratio_cap,
}


def grpo_arguments(recipe: Recipe) -> dict:
    """The GRPOConfig settings of the probe's GRPO step beyond TrainingArguments': its loss and
    importance-sampling correction, the sampler's settings (rollout.*), each step's completions as one
    batch trained once, the head's precision (rollout.lm_head_fp32); GRPOConfig checkpoints activations
    unless told not to."""
    r = recipe.rollout
    return {
        **GRPO_LOSS,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "max_completion_length": r.max_new_tokens,
        "num_generations": r.num_generations,
        "per_device_train_batch_size": r.prompts * r.num_generations,
        "cast_lm_head_to_fp32": r.lm_head_fp32,  # TRL takes it for an untied head only
        **({} if recipe.gradient_checkpointing != "off" else {"gradient_checkpointing": False}),
    }


def grpo_settings(cell: Cell, recipe: Recipe) -> dict:
    """What a GRPO recommendation says of precision: the rollout's and the training's (the probe ran both
    in the cell's), the dtype a vLLM rollout engine should hold the weights in (None where vLLM has none
    to match), and whether fp16's GradScaler scales the loss."""
    p = cell.precision
    weights = weight_dtype(cell, load_dtype(recipe))
    held = f"{p.autocast} autocast over {weights} weights" if p.autocast else f"{weights} weights"
    return {
        "rollout_precision": cell.dtype,
        "training_precision": cell.dtype,
        "precision": held,
        "vllm_dtype": p.compute if p.compute in VLLM_DTYPES else None,
        "grad_scaler": p.scaler,
    }


def grpo_code(cell: Cell, recipe: Recipe, device: str | None) -> tuple[list[str], list[str]]:
    """(the lines before the model's: what precision both sides ran in, the GRPOConfig line; the lines
    after it: fp16's GradScaler, the vLLM dtype)."""
    s = grpo_settings(cell, recipe)
    args = {
        "output_dir": OUTPUT_DIR,
        **training_arguments(cell, recipe),
        **grpo_arguments(recipe),
        **({"use_cpu": True} if device == "cpu" else {}),
    }
    head = [
        f"# GRPO: rollout and training both in {cell.dtype} ({s['precision']}), as probed: their log-probs then "
        "differ by the two paths' rounding alone",
        "args = " + call_text("trl.GRPOConfig", args),
    ]
    tail = []
    if s["grad_scaler"]:
        tail.append(
            f"scaler = torch.amp.GradScaler({device or 'cuda'!r})  # fp16 as probed: the loss scaled, unscaled "
            "before clipping. On a GPU GRPOTrainer (accelerate) does it for fp16=True; a custom loop: "
            "scaler.scale(loss).backward(), scaler.unscale_(optimizer), clip, scaler.step(optimizer), scaler.update()"
        )
        if device == "cpu":  # accelerate 1.15 Accelerator.__init__: native_amp only off the CPU
            tail.append(
                "# on a CPU accelerate runs fp16=True in fp32 (no fp16 autocast, no scaler): the probe's fp16 "
                "step is a custom loop's, under torch.autocast('cpu', dtype=torch.float16)"
            )
    if s["vllm_dtype"]:
        tail.append(
            f"# vLLM rollouts (use_vllm=True) in the same precision: vllm.LLM(dtype={s['vllm_dtype']!r}), or "
            f"`trl vllm-serve --dtype {s['vllm_dtype']}` with vllm_mode='server' (GRPOConfig has no vLLM dtype; "
            "colocate mode passes none, and vLLM takes the checkpoint's)"
        )
    return head, tail


def checkpoint_name(recipe: Recipe) -> str:
    """What from_pretrained loads: the hub id, else the local directory; a recipe built from an
    architecture alone (tiny-llama) names no checkpoint, so the line says to put the user's own."""
    return recipe.model.hub_id or recipe.model.path or "<your checkpoint>"


def model_loading(cell: Cell, recipe: Recipe) -> dict:
    """Pure cells hold the weights themselves in half precision: load them so (autocast stays off)."""
    return {
        "dtype": f"torch.{weight_dtype(cell, load_dtype(recipe))}",
        "attn_implementation": cell.attention.implementation,
    }


def lightning_arguments(cell: Cell, recipe: Recipe) -> dict:
    args = {"precision": cell.precision.lightning, "gradient_clip_val": recipe.grad_clip}
    row = cell.parallel_row
    return {**args, "strategy": row.lightning_strategy, "devices": recipe.world_size} if row.wrapper else args


def accelerate_config(cell: Cell, recipe: Recipe) -> dict | None:
    """A parallel cell's `accelerate config` keys (its YAML), or None for one process."""
    row = cell.parallel_row
    if not row.wrapper:
        return None
    mixed = ACCELERATE_MIXED_PRECISION.get(cell.precision.autocast or "", "no")
    return {**row.accelerate, "mixed_precision": mixed, "num_processes": recipe.world_size}


def parallel_code(cell: Cell) -> list[str]:
    """The lines a custom training loop writes for a parallel cell, from its row: DDP (and its comm hook),
    or FSDP2's fully_shard with a MixedPrecisionPolicy reducing in the row's reduce dtype (None, param_dtype,
    for "compute"), then the same through accelerate's plugin."""
    row, dtype = cell.parallel_row, cell.precision.compute
    if row.wrapper == "ddp":
        if row.comm_hook:
            short = SHORT_DTYPES.get(row.reduce, row.reduce)
            return [DDP_CODE, f"model.register_comm_hook(None, default_hooks.{row.comm_hook})  # a {short} all-reduce"]
        return [f"{DDP_CODE}  # all-reduce in the gradients' dtype"]
    if row.wrapper != "fsdp2":
        return []
    low = row.reduce == "compute"  # reduce_dtype=None: FSDP2 reduces in param_dtype
    code = FSDP2_CODE.format(
        dtype=dtype,
        reduce="None" if low else f"torch.{row.reduce}",
        why="# gradients reduced in param_dtype" if low else "# torch.distributed.fsdp",
    )
    accelerate = ACCELERATE_FSDP2_CODE.format(
        dtype=dtype,
        reduce=dtype if low else row.reduce,
        why="# what `mixed_precision: bf16` alone does"
        if low
        else f"# accelerate: an {SHORT_DTYPES.get(row.reduce, row.reduce)} reduction",
    )
    return code.splitlines() + [accelerate]


# The optimizer built by hand decays what the Trainer (and the probe: child/optimizers.param_groups) decays:
# every trainable parameter but the biases and norm weights (get_decay_parameter_names does not use its self).
DECAY_GROUPS_CODE = [
    "decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # as the Trainer and the probe: "
    "no weight decay on biases and norm weights",
    "params = [{'params': [p for n, p in model.named_parameters() if p.requires_grad and n in decay]}, "
    "{'params': [p for n, p in model.named_parameters() if p.requires_grad and n not in decay], 'weight_decay': 0.0}]",
]


def own_code(cell: Cell, recipe: Recipe) -> list[str]:
    """Lines for what no TrainingArguments flag does: the fp8 conversion (FP8_CODE, with the row's fp8
    recipe and the recipe's fp8 settings), and building the optimizer by hand for Lightning or a custom loop."""
    lines = []
    fp8 = cell.precision.fp8
    if fp8 is not None:
        lines.append(FP8_CODE[fp8.package].format(**dataclasses.asdict(fp8), **dataclasses.asdict(recipe.fp8)))
    row = cell.optimizer_row
    if row.split == "muon":
        lines += muon_code(recipe)
    elif row.name != DEFAULT_OPTIMIZER:
        o = recipe.optimizer
        kwargs = optimizer_kwargs(row, o.lr, o.betas, o.eps, o.weight_decay)
        params = "model.parameters()"
        if o.weight_decay:
            lines += DECAY_GROUPS_CODE
            params = "params"
        lines.append(
            "optimizer = "
            + call_text(row.import_path.replace(":", "."), kwargs).replace("(", f"({params}, ", 1)
            + "  # Lightning's configure_optimizers, or a custom loop"
        )
    if row.eval_mode:
        lines.append(SCHEDULE_FREE_SAVE)
    return lines


# A schedule-free optimizer trains on one sequence of weights and evaluates their average: the Trainer swaps
# in the average for evaluate() but not for save_model() (accelerate#4159, facebookresearch/schedule_free#22)
SCHEDULE_FREE_SAVE = (
    "trainer.optimizer.eval(); trainer.save_model(); trainer.optimizer.train()  # save the weights evaluate() "
    "scores (the schedule-free average), not the train-mode ones; optimizer.eval() in a custom loop"
)


def muon_code(recipe: Recipe) -> list[str]:
    """Muon with the usual split, as the probe built it (child/muon.py): the 2-D hidden matrices to Muon, the
    embeddings, head, norms and biases to AdamW (decay groups as the Trainer's), both stepped every step."""
    o = recipe.optimizer
    muon = optimizer_kwargs(OPTIMIZERS["muon"], o.lr, o.betas, o.eps, o.weight_decay)
    adamw = optimizer_kwargs(OPTIMIZERS["adamw"], o.lr, o.betas, o.eps, o.weight_decay)
    lines = [
        "outer = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None "
        "for p in m.parameters()}  # embeddings and head: AdamW",
        "hidden = [p for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in outer]",
    ]
    rest = "[p for p in model.parameters() if p.requires_grad and (p.ndim != 2 or id(p) in outer)]"
    if o.weight_decay:
        lines.append(DECAY_GROUPS_CODE[0])
        lines.append(
            "rest = [(n, p) for n, p in model.named_parameters() "
            "if p.requires_grad and (p.ndim != 2 or id(p) in outer)]"
        )
        rest = (
            "[{'params': [p for n, p in rest if n in decay]}, "
            "{'params': [p for n, p in rest if n not in decay], 'weight_decay': 0.0}]"
        )
    lines.append(
        "optimizers = ["
        + call_text("torch.optim.Muon", muon).replace("(", "(hidden, ", 1)
        + ", "
        + call_text("torch.optim.AdamW", adamw).replace("(", f"({rest}, ", 1)
        + "]  # step both every step (a custom loop, or Lightning's configure_optimizers)"
    )
    return lines


# -- a quantized base (issue 36) -------------------------------------------------------------------------


class Code(str):
    """A value call_text writes as code, not as a literal (a variable's name)."""

    def __repr__(self) -> str:
        return str(self)


def quantization(cell: Cell, recipe: Recipe) -> dict | None:
    """A quant cell's BitsAndBytesConfig keyword arguments (dtypes as torch attribute names) and whether
    prepare_model_for_kbit_training runs; None for a 16-bit base."""
    row = cell.quantization
    if row.bits is None:
        return None
    kwargs = row.bnb_kwargs(cell.precision.compute, recipe.quant.double_quant, STORAGE_DTYPES[recipe.quant.storage])
    return {"bnb_config": kwargs, "prepare_model_for_kbit_training": recipe.quant.prepare}


def quant_code(cell: Cell, recipe: Recipe) -> list[str]:
    """The BitsAndBytesConfig line (from_pretrained then takes quantization_config=bnb_config); [] for none."""
    q = quantization(cell, recipe)
    if q is None:
        return []
    shown = {k: f"torch.{v}" if k.endswith(("_dtype", "_storage")) else v for k, v in q["bnb_config"].items()}
    return ["bnb_config = " + call_text("BitsAndBytesConfig", shown)]


def prepare_code(cell: Cell, recipe: Recipe) -> list[str]:
    """The prepare_model_for_kbit_training call as the probe made it, checkpointing left to
    TrainingArguments (its default, True, would switch it on unasked); [] when it did not run."""
    q = quantization(cell, recipe)
    if q is None or not q["prepare_model_for_kbit_training"]:
        return []
    return ["model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # peft"]


def router_loading(moe: dict | None) -> dict:
    """A mixture of experts probed with its load-balancing loss: the from_pretrained keywords that put
    it in the loss (output_router_logits) at the weight it trained with; {} otherwise."""
    if not moe or not moe.get("aux_loss_on"):
        return {}
    return {"output_router_logits": True, "router_aux_loss_coef": moe.get("aux_loss_coef")}


def router_code(moe: dict | None, recipe: Recipe) -> list[str]:
    """A mixture of experts probed without its load-balancing loss: a comment with the keywords that add
    it (knowledge rule moe-load-balancing-off); a router pinned to fp32: how to do the same."""
    if not moe:
        return []
    lines = []
    if not moe.get("aux_loss_on"):
        coef = moe.get("aux_loss_coef")
        lines.append(
            "# probed WITHOUT the load-balancing loss; from_pretrained(..., output_router_logits=True"
            + (f", router_aux_loss_coef={coef!r}" if coef is not None else "")
            + ") adds it (nandoctor: --set moe.aux_loss=on)"
        )
    if recipe.moe.router_dtype == "fp32":
        lines.append(
            "# moe.router_dtype=fp32: keep each router's gate weights in fp32 and call it under "
            "torch.autocast(device_type, enabled=False) with its input cast to fp32"
        )
    return lines


def recommendation(
    config: dict,
    recipe: Recipe,
    base: Recipe,
    model_flags: list[str],
    lint: dict | None = None,
    moe: dict | None = None,
    device: str | None = None,
) -> dict:
    """What the reports print for a recommended configuration (`recipe` is its variant of `base`; lint:
    the run's data lint, run.json's "data"; `moe`: the probe record's routing figures, for a mixture of
    experts; `device`: where it was probed, "cpu" or "cuda")."""
    cell = Cell.of(config)
    grpo = recipe.objective == "grpo"
    quantized = {"quantization_config": Code("bnb_config")} if cell.quant != "none" else {}
    loading = {**model_loading(cell, recipe), **router_loading(moe)}
    head, tail = grpo_code(cell, recipe, device) if grpo else ([arguments_line(cell, recipe, lint, device)], [])
    lines = [
        *head,
        *quant_code(cell, recipe),
        "model = "
        + call_text(
            "AutoModelForCausalLM.from_pretrained",
            {"pretrained_model_name_or_path": checkpoint_name(recipe), **loading, **quantized},
        ),
        *prepare_code(cell, recipe),
        *router_code(moe, recipe),
        *tail,
    ]
    a = recipe.adapter
    if a.type != "none":
        lora = {
            "r": a.r,
            "lora_alpha": a.alpha,
            "target_modules": list(a.target_modules),
            "lora_dropout": a.dropout,
            "use_dora": a.type == "dora",
        }
        if a.modules_to_save:
            lora["modules_to_save"] = list(a.modules_to_save)
        lines.append("lora_config = " + call_text("LoraConfig", lora))
        lines.append(f"model = get_peft_model(model, lora_config, autocast_adapter_dtype={a.autocast_adapter_dtype})")
    if not grpo:  # a GRPO run samples its prompts' completions: no collator, and no Lightning trainer
        lines += data_code(recipe, lint)
        lines.append(call_text("lightning.Trainer", lightning_arguments(cell, recipe)))
    if cell.precision.tf32 and not grpo:
        lines.append('torch.set_float32_matmul_precision("high")  # TF32 matmuls, for Lightning')
    if cell.attention.sdpa_backend:
        lines.append(
            "sdpa_backend = torch.nn.attention.sdpa_kernel("
            f"torch.nn.attention.SDPBackend.{cell.attention.sdpa_backend})  # train under it: "
            "with sdpa_backend: trainer.train()"
        )
    lines += own_code(cell, recipe) + parallel_code(cell) + loss_code(recipe)
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "command": check_command(config, base, model_flags),
        "training_arguments": training_arguments(cell, recipe),
        "model_loading": loading,
        "lightning": lightning_arguments(cell, recipe),
        "accelerate": accelerate_config(cell, recipe),
        "data": data_settings(recipe),
        "training": training_settings(recipe),
        "quantization": quantization(cell, recipe),
        "grpo": grpo_settings(cell, recipe) if grpo else None,
        "python": lines,
    }
