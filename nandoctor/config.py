"""Typed configuration: the recipe tree and narrow dotted overrides.

Foundation module: imports only errors, cells (what the axis values mean) and typed (how a value takes its
field's type). Every other stage reads these frozen dataclasses; YAML files and CLI flags are only ways to
fill them, and both go through typed.typed_value, driven by the field annotations below.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Any

from .cells import ATTENTIONS, GRAD_REDUCE_OPS, LOAD_DTYPES, parse_axis_values
from .errors import NandoctorError, did_you_mean
from .typed import field_types, typed_value

ADAPTER_TYPES = ("none", "lora", "dora")
DATA_SOURCES = ("synthetic", "file")
TRUNCATION_SIDES = ("right", "left")
PADDING_SIDES = ("right", "left")
# which positions get label -100: pad ids (DataCollatorForLanguageModeling), padding by the attention
# mask, or everything but the completion / the assistant turns (TRL's completion-only loss)
LABEL_MASKS = ("pad_id", "attention_mask", "completion_only")
# none: rows padded to the longest of their batch; position_ids: a batch's rows flattened into one row,
# position_ids restarting per row and no attention mask (DataCollatorWithFlattening); block_mask: the
# same row with an explicit 4-D block-diagonal causal mask; position_ids_with_mask: the same row with the
# usual 2-D all-ones mask beside the position_ids, which transformers then reads as one sequence
# (the segments attend to each other: huggingface/transformers PR #46634, huggingface/trl#3067)
PACKINGS = ("none", "position_ids", "block_mask", "position_ids_with_mask")
PAD_POLICIES = ("dedicated", "eos", "id0")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SCALES = ("auto", "probe", "full")
# how the loss of gradient_accumulation_steps micro-batches is averaged: per micro-batch then over the
# steps, or over the supervised tokens of the whole step (transformers' num_items_in_batch)
LOSS_NORMALIZATIONS = ("micro_batch", "tokens")
GRADIENT_CHECKPOINTING = ("off", "reentrant", "non_reentrant")  # torch.utils.checkpoint's use_reentrant
# Mixture-of-experts models (docs/moe.md). aux_loss: the load-balancing loss as the family's config
# says (transformers: output_router_logits, False by default), or switched on / off; router_dtype: the
# router's logits in the cell's compute dtype (as transformers runs it under autocast) or in fp32.
MOE_AUX_LOSS = ("family", "on", "off")
MOE_ROUTER_DTYPES = ("compute", "fp32")
# What a probe's step optimizes (docs/rl.md): the supervised loss of the data stream, or GRPO's policy
# gradient on completions the probe samples itself (child/rollout.py)
OBJECTIVES = ("sft", "grpo")
# the engine that samples a grpo probe's rollouts (child/vllm_engine.py): auto is vllm on a probe that runs
# on a CUDA GPU where vllm imports (and can hold the weights as trained), generate() otherwise, said in the record
ROLLOUT_ENGINES = ("auto", "generate", "vllm")
# the dtypes vLLM holds weights in; an autocast cell's engine holds its compute dtype (vLLM has no autocast)
VLLM_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    hub_id: str | None = None  # looked up in the local Hugging Face cache only, never downloaded
    path: str | None = None  # a local checkpoint directory (config.json + safetensors)
    arch: dict = field(default_factory=dict)  # config values for AutoConfig.for_model(model_type, **arch)
    # the dtype the base model is loaded in, the master weights of the -amp cells: "auto" is
    # from_pretrained's default since transformers 5, a checkpoint's saved dtype (load_dtype)
    dtype_on_load: str = "auto"
    scale: str = "auto"  # auto: full size when it fits this machine, else a probe-scale twin
    trust_remote_code: bool = False  # local checkpoints with their own modeling code


@dataclass(frozen=True)
class AdapterConfig:
    type: str = "none"
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()  # peft: modules trained in full beside the adapter, e.g. lm_head
    autocast_adapter_dtype: bool = True  # peft: adapter weights in fp32 under a bf16/fp16 base (its default)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # a schedule-free optimizer (sf-*): the run calls optimizer.eval() before it saves, so that the checkpoint
    # holds the weights evaluate() scores; what check --roundtrip saves (the Trainer's save_model() does not)
    eval_before_save: bool = False


@dataclass(frozen=True)
class DataConfig:
    """What the probes train on: the synthetic stream, or the user's rows (docs/data.md).

    A path makes the source `file`: JSONL / JSON / Parquet / CSV, a `datasets.save_to_disk` directory,
    or plain text, read through Hugging Face `datasets`; rows of `text`, `messages`, `prompt` +
    `completion`, or pre-tokenized `input_ids`. The tokenizer is `tokenizer` (a local directory), else
    the local checkpoint's own; nothing is downloaded."""

    source: str = "synthetic"  # synthetic: a deterministic, learnable token stream from the seed
    path: str | None = None  # the user's rows (source=file)
    batches: int = 4  # synthetic: distinct batches cycled through; file: the first batches, in order
    pad_fraction: float = 0.0  # synthetic only: fraction of each sequence's tail that is padding
    tokenizer: str | None = None  # a local tokenizer directory (--tokenizer); never downloaded
    max_length: int = 0  # tokens a row keeps after truncation; 0: seq_len
    truncation_side: str = "right"
    padding_side: str = "right"
    labels: str = "pad_id"  # LABEL_MASKS
    packing: str = "none"  # PACKINGS

    def __post_init__(self):
        if self.path and self.source == "synthetic":  # a path given is the user's data
            object.__setattr__(self, "source", "file")


@dataclass(frozen=True)
class PadTokenConfig:
    policy: str = (
        "dedicated"  # dedicated: the tokenizer's pad token (userdata/tokenizer.py); eos: the eos id; id0: id 0
    )
    mask_labels: bool = True  # pad positions get label -100


@dataclass(frozen=True)
class Fp8Config:
    """Delayed scaling of the fp8-te-* cells: each fp8 tensor's scale comes from the largest ('max') or
    the latest ('most_recent') amax of its last amax_history_len steps. The defaults are Transformer
    Engine's DelayedScaling defaults (transformer_engine.common.recipe); torchao's dynamic recipes
    scale from the current tensor and read neither."""

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"


# -- quantized bases (issue 36) --------------------------------------------------------------------------
QUANT_STORAGES = ("uint8", "bf16", "fp16", "fp32")  # bnb_4bit_quant_storage: the dtype the packed 4-bit weights sit in
STORAGE_DTYPES = {"uint8": "uint8", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class QuantConfig:
    """How a `quant` cell's base is quantized (bitsandbytes' BitsAndBytesConfig) and prepared. Only the
    cells with a quant value read it; the compute dtype is the cell's (its dtype row's compute)."""

    double_quant: bool = False  # bnb_4bit_use_double_quant: the block scales quantized again (8-bit)
    storage: str = "uint8"  # QUANT_STORAGES; FSDP shards it with the other weights only when it is their dtype
    # peft's prepare_model_for_kbit_training before the adapter: upcasts every non-quantized weight to
    # fp32, freezes the base and makes the inputs require a gradient (the probe passes it the recipe's
    # gradient_checkpointing; left to its default it switches checkpointing on)
    prepare: bool = True


@dataclass(frozen=True)
class MoeConfig:
    """What a mixture-of-experts model trains with; a dense model reads neither field."""

    aux_loss: str = "family"  # MOE_AUX_LOSS; on: output_router_logits=True, weighted by router_aux_loss_coef
    router_dtype: str = "compute"  # MOE_ROUTER_DTYPES


@dataclass(frozen=True)
class RolloutConfig:
    """How an objective=grpo probe samples each step's completions (docs/rl.md): `prompts` prompts of
    the data stream's rows, their first `prompt_len` tokens each, `num_generations` completions of
    `max_new_tokens` tokens per prompt, sampled by generate() with a KV cache. top_k 0 and top_p 1.0
    leave the distribution whole. attn is the attention kernel the rollout engine samples with (an `attn`
    axis value), whatever the cell trains with. lm_head_fp32 computes the output head in fp32 for the
    rollout and the training path alike. An sft probe reads none of it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    num_generations: int = 4  # the group GRPO normalises each prompt's rewards over
    prompts: int = 2
    prompt_len: int = 8
    # the engine's own kernel, not the trainer's: generate()'s default attn_implementation (transformers
    # 5), SDPA with its usual dispatch. A cell that trains with another kernel is scored by a different
    # computation of the same policy, as a trainer beside vLLM's kernels is
    attn: str = "sdpa"
    # the output head's weights, input and matmul in fp32 in both paths (TRL's cast_lm_head_to_fp32,
    # prime-rl PR #2438): the log-probs then carry no half-precision rounding of the head
    lm_head_fp32: bool = False
    engine: str = "auto"  # ROLLOUT_ENGINES
    # vLLM's attention backend by its name in vLLM (TRITON_ATTN, FLASH_ATTN, FLEX_ATTENTION, ...); auto:
    # the one vLLM picks for the GPU and dtype. generate() reads `attn` instead
    vllm_attention: str = "auto"


@dataclass(frozen=True)
class Recipe:
    name: str = "tiny-llama"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pad_token: PadTokenConfig = field(default_factory=PadTokenConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    quant: QuantConfig = field(default_factory=QuantConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    objective: str = "sft"  # OBJECTIVES
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # objective=grpo only
    grad_clip: float = 1.0  # 0 disables clipping; the grad-norm is recorded before clipping either way
    batch_size: int = 4
    seq_len: int = 64
    gradient_accumulation_steps: int = 1  # micro-batches of batch_size rows per optimizer step
    loss_normalization: str = "tokens"  # LOSS_NORMALIZATIONS
    gradient_checkpointing: str = "off"  # GRADIENT_CHECKPOINTING
    steps: int = 24
    seed: int = 0
    timeout_s: float = 600.0  # the timed steps' budget, counted from the end of the build
    # the build's budget: imports, model load or build, wrapping; until the probe writes BUILT_FILE
    build_timeout_s: float = 600.0
    # steps replayed with hooks after the timed ones (a failing probe: up to its failure); 0: off
    forensics_steps: int = 4
    # The replay's own budget, counted from the timed result: an overrun is noted on the record, and the
    # verdict stays the timed steps' (timeout_s covers the timed steps only).
    forensics_timeout_s: float = 300.0
    # The replay stops starting hooked steps once it has taken this many times the timed steps' own
    # training time (its first step always runs): on a CPU that emulates the cell's dtype a replay to the
    # failure cost as much again as the probe, and a compiled cell's eager replay can cost more.
    forensics_share: float = 1.0
    # ... but may always take this long: a tiny probe's replay costs more in fixed work (restoring the
    # weights, hooking every module) than its steps trained (0.17 s), and a share of those alone stopped it
    # before its failure on a loaded host
    forensics_min_s: float = 10.0
    # A grid re-times the cells speed decides between, back to back and interleaved (retime.py), in this
    # many rounds; 0: off (a CI run where speed is not the question), speed then comes from each cell's
    # own grid probe, and the report says so.
    retime_rounds: int = 2
    axes: dict = field(default_factory=dict)  # default axis values for this recipe, e.g. {"compile": ["off"]}
    # Parallel cells (the `parallel` axis): W ranks, each training its batch_size / W rows of the same
    # global batch of batch_size, so that the parallel=none probe is their exact reference.
    world_size: int = 2
    # "sum": the ranks' gradients are summed, not averaged (a broken reduction, pytorch#162338)
    grad_reduce: str = "avg"

    def validate(self) -> Recipe:
        checks = [
            ("adapter.type", self.adapter.type, ADAPTER_TYPES),
            ("data.source", self.data.source, DATA_SOURCES),
            ("data.truncation_side", self.data.truncation_side, TRUNCATION_SIDES),
            ("data.padding_side", self.data.padding_side, PADDING_SIDES),
            ("data.labels", self.data.labels, LABEL_MASKS),
            ("data.packing", self.data.packing, PACKINGS),
            ("pad_token.policy", self.pad_token.policy, PAD_POLICIES),
            ("model.dtype_on_load", self.model.dtype_on_load, (*LOAD_DTYPES, "auto")),
            ("model.scale", self.model.scale, SCALES),
            ("fp8.amax_compute_algo", self.fp8.amax_compute_algo, AMAX_COMPUTE_ALGOS),
            ("grad_reduce", self.grad_reduce, GRAD_REDUCE_OPS),
            ("loss_normalization", self.loss_normalization, LOSS_NORMALIZATIONS),
            ("gradient_checkpointing", self.gradient_checkpointing, GRADIENT_CHECKPOINTING),
            ("quant.storage", self.quant.storage, QUANT_STORAGES),
            ("moe.aux_loss", self.moe.aux_loss, MOE_AUX_LOSS),
            ("moe.router_dtype", self.moe.router_dtype, MOE_ROUTER_DTYPES),
            ("objective", self.objective, OBJECTIVES),
            ("rollout.attn", self.rollout.attn, tuple(ATTENTIONS)),
            ("rollout.engine", self.rollout.engine, ROLLOUT_ENGINES),
        ]
        for key, value, valid in checks:
            if value not in valid:
                raise NandoctorError(
                    f"recipe {self.name!r}: {key}={value!r} is not valid;{did_you_mean(value, valid)} "
                    f"valid: {', '.join(valid)}"
                )
        positive = {
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "steps": self.steps,
            "timeout_s": self.timeout_s,
            "build_timeout_s": self.build_timeout_s,
            "forensics_timeout_s": self.forensics_timeout_s,
            "forensics_share": self.forensics_share,
            "optimizer.lr": self.optimizer.lr,
            "data.batches": self.data.batches,
            "fp8.amax_history_len": self.fp8.amax_history_len,
            "world_size": self.world_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "rollout.temperature": self.rollout.temperature,
            "rollout.max_new_tokens": self.rollout.max_new_tokens,
            "rollout.num_generations": self.rollout.num_generations,
            "rollout.prompts": self.rollout.prompts,
            "rollout.prompt_len": self.rollout.prompt_len,
        }
        for key, value in positive.items():
            if not value > 0:
                raise NandoctorError(f"recipe {self.name!r}: {key} must be > 0, got {value!r}")
        if self.retime_rounds < 0:
            raise NandoctorError(
                f"recipe {self.name!r}: retime_rounds must be >= 0 (0: off), got {self.retime_rounds!r}"
            )
        if self.forensics_steps < 0:
            raise NandoctorError(f"recipe {self.name!r}: forensics_steps must be >= 0, got {self.forensics_steps!r}")
        if not self.forensics_min_s >= 0:
            raise NandoctorError(f"recipe {self.name!r}: forensics_min_s must be >= 0, got {self.forensics_min_s!r}")
        self._validate_rollout()
        if not 0.0 <= self.data.pad_fraction < 1.0:
            raise NandoctorError(
                f"recipe {self.name!r}: data.pad_fraction must be in [0, 1), got {self.data.pad_fraction!r}"
            )
        if self.data.source == "file" and not self.data.path:
            raise NandoctorError(f"recipe {self.name!r}: data.source=file needs data.path")
        if self.data.max_length < 0:
            raise NandoctorError(
                f"recipe {self.name!r}: data.max_length must be >= 0 (0: seq_len), got {self.data.max_length!r}"
            )
        if self.data.source == "file" and self.data.pad_fraction:
            raise NandoctorError(
                f"recipe {self.name!r}: data.pad_fraction shapes the synthetic stream only; "
                "the rows of data.path are padded to the longest row of their batch"
            )
        if self.data.source == "synthetic" and self.data.labels == "completion_only":
            raise NandoctorError(
                f"recipe {self.name!r}: data.labels=completion_only needs rows with a completion "
                "(prompt + completion, or messages): pass data.path"
            )
        for axis, values in self.axes.items():
            parse_axis_values(axis, values)
        return self

    def _validate_rollout(self) -> None:
        r = self.rollout
        if not 0.0 < r.top_p <= 1.0:
            raise NandoctorError(f"recipe {self.name!r}: rollout.top_p must be in (0, 1], got {r.top_p!r}")
        if r.vllm_attention != "auto" and not re.fullmatch(r"[A-Z][A-Z0-9_]*", r.vllm_attention):
            raise NandoctorError(
                f"recipe {self.name!r}: rollout.vllm_attention={r.vllm_attention!r} is not valid; valid: auto, "
                "or a vLLM attention backend's name (TRITON_ATTN, FLASH_ATTN, FLEX_ATTENTION, ...)"
            )
        if r.top_k < 0:
            raise NandoctorError(f"recipe {self.name!r}: rollout.top_k must be >= 0 (0: off), got {r.top_k!r}")
        if self.objective == "grpo" and r.prompt_len > self.seq_len:
            raise NandoctorError(
                f"recipe {self.name!r}: rollout.prompt_len ({r.prompt_len}) is longer than the rows the "
                f"prompts are cut from (seq_len {self.seq_len})"
            )
        if self.objective == "grpo" and r.num_generations < 2:
            raise NandoctorError(
                f"recipe {self.name!r}: rollout.num_generations must be >= 2 (GRPO's advantage is a reward "
                f"against its group's mean), got {r.num_generations}"
            )
        if self.objective == "grpo" and self.gradient_accumulation_steps != 1:
            raise NandoctorError(
                f"recipe {self.name!r}: objective=grpo trains each step's completions as one batch; "
                f"gradient_accumulation_steps must be 1, got {self.gradient_accumulation_steps}"
            )


def dotted_fields(obj=None, prefix: str = "") -> list[str]:
    """Every settable dotted path of a Recipe ('optimizer.eps', 'grad_clip', ...)."""
    obj = obj if obj is not None else Recipe()
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += dotted_fields(value, prefix + f.name + ".")
        elif f.name != "name":
            out.append(prefix + f.name)
    return out


def get_field(recipe: Recipe, key: str):
    obj = recipe
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or not any(f.name == part for f in dataclasses.fields(obj)):
            valid = dotted_fields()
            raise NandoctorError(f"unknown recipe field {key!r};{did_you_mean(key, valid)} valid: {', '.join(valid)}")
        obj = getattr(obj, part)
    return obj


def trainer_arguments(recipe: Recipe) -> dict:
    """The TrainingArguments / SFTConfig fields the recipe holds: what --trainer-args sets on the recipe
    (knowledge.facts.with_trainer_args) and what a probe under the user's trainer gives back to it
    (child/trainer.py), so that a --set or a bisect factor on these fields reaches the trainer."""
    o = recipe.optimizer
    return {
        "learning_rate": o.lr,
        "adam_beta1": o.betas[0],
        "adam_beta2": o.betas[1],
        "adam_epsilon": o.eps,
        "weight_decay": o.weight_decay,
        "max_grad_norm": recipe.grad_clip,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
    }


@functools.cache
def _hints(cls) -> dict:
    return field_types(cls)


PATH_FIELDS = ("model.path", "data.path", "data.tokenizer")  # local files a probe opens, wherever it runs


def with_paths_resolved(recipe: Recipe, base) -> Recipe:
    """The recipe with each relative PATH_FIELDS value (after ~) made absolute against `base`: the
    directory of the recipe file that named it, or the working directory for --set. A probe runs in
    another working directory (a warm worker's, a node's), and run.json must name the same file from
    wherever --resume is run."""
    import os.path

    for key in PATH_FIELDS:
        value = get_field(recipe, key)
        if value:
            full = os.path.expanduser(value)
            if not os.path.isabs(full):
                recipe = set_field(recipe, key, os.path.normpath(os.path.join(os.path.abspath(base), full)))
            elif full != value:
                recipe = set_field(recipe, key, full)
    return recipe


def set_field(recipe: Recipe, key: str, value) -> Recipe:
    """A copy of recipe with the dotted field set. value: typed data, or the text of a `--set KEY=VALUE`
    (read as YAML); either is typed by the field's annotation (typed.typed_value). An unknown key or a
    value of the wrong type is one NandoctorError naming the field. `model.arch.KEY` sets one key the
    recipe's arch already has (a smaller vocab_size for a quick probe), typed like the value it replaces."""
    if key.startswith("model.arch."):
        return _set_arch(recipe, key, value)
    current = get_field(recipe, key)
    if dataclasses.is_dataclass(current):
        raise NandoctorError(
            f"{key!r} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(current)[0].name}"
        )
    return _set_at(recipe, key.split("."), key, value)


def _set_arch(recipe: Recipe, key: str, value) -> Recipe:
    name, arch = key.removeprefix("model.arch."), dict(recipe.model.arch)
    if name not in arch:
        raise NandoctorError(
            f"recipe {recipe.name!r} has no {key!r};{did_you_mean(name, list(arch))} "
            f"its arch keys: {', '.join(arch) or 'none (a local checkpoint: its config.json decides)'}"
        )
    old = arch[name]
    if isinstance(old, (bool, int, float, str)):
        arch[name] = typed_value(key, value, type(old), text=isinstance(value, str))
    else:  # a mapping or a list (rope_parameters): the YAML value as written
        arch[name] = typed_value(key, value, dict, text=isinstance(value, str)) if isinstance(old, dict) else value
    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, arch=arch))


def _set_at(obj, parts: list[str], key: str, value):
    head, rest = parts[0], parts[1:]
    if rest:
        return dataclasses.replace(obj, **{head: _set_at(getattr(obj, head), rest, key, value)})
    typed = typed_value(key, value, _hints(type(obj))[head], text=isinstance(value, str))
    return dataclasses.replace(obj, **{head: typed})


def load_dtype(recipe: Recipe) -> str:
    """The dtype (a LOAD_DTYPES key) the recipe's base model is loaded in: model.dtype_on_load, or for
    "auto" what from_pretrained loads by default (transformers 5: dtype="auto"), a local checkpoint's
    saved dtype, or the dtype a recipe's arch names (from_config builds in it); fp32 where neither says,
    a hub id included."""
    m = recipe.model
    return _resolved(m.dtype_on_load, m.path, m.arch)


def with_load_dtype_resolved(recipe: dict) -> dict:
    """A recipe as data (recipe_to_dict, a record's) with model.dtype_on_load "auto" replaced by the dtype
    it loads (load_dtype): what a probe trains with, so that a recipe that says "auto" and one written
    before "auto" was the default (fp32) compare equal where they load alike."""
    model = recipe.get("model")
    if not isinstance(model, dict) or model.get("dtype_on_load") != "auto":
        return recipe
    resolved = _resolved("auto", model.get("path"), model.get("arch") or {})
    return {**recipe, "model": {**model, "dtype_on_load": resolved}}


def _resolved(on_load: str, path: str | None, arch: dict) -> str:
    if on_load != "auto":
        return on_load
    if path:
        return saved_dtype(path) or "fp32"
    named = arch.get("dtype") or arch.get("torch_dtype")
    return _SAVED_DTYPES.get(str(named).removeprefix("torch."), "fp32")


_SAVED_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def saved_dtype(path: str) -> str | None:
    """A checkpoint directory's saved floating dtype as from_pretrained(dtype="auto") reads it: its
    config.json `dtype` (`torch_dtype` before transformers 5), else the first floating tensor of its
    first safetensors file; None when neither says (or names a dtype nandoctor does not load)."""
    import json
    import struct
    from pathlib import Path

    root = Path(path)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    named = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    if named:
        return _SAVED_DTYPES.get(str(named).removeprefix("torch."))
    for file in sorted(root.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and entry.get("dtype") in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[entry["dtype"]]
    return None


def recipe_from_dict(data: dict, name: str) -> Recipe:
    """Build a Recipe from plain data (a YAML file, run.json), each value typed by its field's annotation;
    an unknown key (with the closest valid one) or a value of the wrong type is one NandoctorError."""
    if not isinstance(data, dict):
        raise NandoctorError(f"recipe {name!r}: expected a mapping at the top level")
    return _build(Recipe, {"name": name, **data}, name, "").validate()


def _build(cls, data: dict, name: str, prefix: str):
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            valid = [prefix + k for k in hints]
            raise NandoctorError(
                f"recipe {name!r}: unknown key {prefix + key!r};{did_you_mean(prefix + key, valid)} "
                f"valid: {', '.join(valid)}"
            )
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise NandoctorError(f"recipe {name!r}: {prefix + key} must be a mapping")
            kwargs[key] = _build(hints[key], value, name, prefix + key + ".")
            continue
        try:
            kwargs[key] = typed_value(prefix + key, value, hints[key])
        except NandoctorError as e:
            raise NandoctorError(f"recipe {name!r}: {e}") from None
    return cls(**kwargs)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)
