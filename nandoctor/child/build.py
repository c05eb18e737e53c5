"""What one probe trains with, built from its spec inside the probe process: the model (loaded in
model.dtype_on_load, the adapter applied as peft applies it, gradient checkpointing enabled as the
Trainer enables it), the data stream (data.stream: the synthetic stream or the user's rows, in
optimizer steps of gradient_accumulation_steps micro-batches), the optimizer, and the cell's numerics
(autocast, fp8 conversion, GradScaler, SDPA backend pin). The timed run and the benchmarks start from
`setup`; the forensics replay keeps its model and takes a fresh optimizer, GradScaler and data stream
from `restart`, so they train the same thing. docs/training-options.md says what each option does."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..cells import LOAD_DTYPES, Cell, weight_dtype
from ..config import Recipe, load_dtype
from ..data import DataStream, stream
from ..measure.accumulation import normalized
from ..measure.numerics import sdpa_pin, set_tf32
from ..models import apply_adapter, apply_moe, checkpointing, model_config, probe_scale
from ..record import ModelPlan, ProbeSpec
from .optimizers import eager_reason, optimizer_for, step_eagerly
from .quant import load_quantized, prepare


def build_model(plan: ModelPlan, recipe: Recipe, cell: Cell, seed: int, device: str = "cpu"):
    """The model for one probe, built on `device`, in training mode, adapter applied, weights in their
    dtype. A twin is created and initialised there and local weights load straight onto it: an 8B
    model random-initialised on the CPU and then moved cost ~90 s of an H100 probe (issue 10)."""
    import torch
    from transformers import AutoModelForCausalLM

    on_load = getattr(torch, LOAD_DTYPES[load_dtype(recipe)])
    attn = cell.attention.implementation
    remote = recipe.model.trust_remote_code
    torch.manual_seed(seed)  # seeds the CUDA generators too: every probe of a run starts from the same weights
    weights = getattr(torch, weight_dtype(cell, load_dtype(recipe)))

    def twin():
        config = model_config(recipe)
        config = probe_scale(config) if plan.scale == "probe" else config
        return AutoModelForCausalLM.from_config(
            config, dtype=on_load, attn_implementation=attn, trust_remote_code=remote
        )

    with torch.device(device):  # transformers builds and initialises under the ambient device
        if cell.quant != "none":  # quantized as it loads, what stays unquantized in the cell's weight dtype
            model = load_quantized(plan, recipe, cell, weights, attn, device, twin)
        elif plan.source == "local-weights":
            model = AutoModelForCausalLM.from_pretrained(
                plan.path, dtype=on_load, attn_implementation=attn, trust_remote_code=remote, device_map=device
            )
        else:
            model = twin()
        # Trainer sets the config's use_cache from TrainingArguments.use_cache, False by default
        # (transformers 5.24 trainer.py): no cache is built in training, packed or not (docs/data.md)
        model.config.use_cache = False
        if cell.quant != "none" and recipe.quant.prepare:
            model = prepare(model)
        apply_moe(model, recipe)  # moe.aux_loss: whether the load-balancing loss is in the loss the model returns
        model = apply_adapter(model, recipe)  # peft creates its adapter weights on the ambient device
    checkpointing(model, recipe.gradient_checkpointing)
    # a pure cell hard-casts every weight, the adapter's too, and an fp32 cell over a 16-bit load casts to fp32
    if weights != on_load and cell.quant == "none":
        cast_as_loaded(model, weights)
    elif weights != on_load:  # transformers refuses to cast a quantized model: the adapter is cast alone
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(weights)
    if recipe.moe.router_dtype == "fp32":
        from .moe import pin_router_fp32

        pin_router_fp32(model, device)
    if recipe.objective == "grpo" and recipe.rollout.lm_head_fp32:
        from .rollout import pin_head_fp32

        pin_head_fp32(model, device)
    model.train()
    return model


def cast_as_loaded(model, dtype) -> None:
    """Cast a model as from_pretrained(dtype=...) loads one (transformers 5.24 _get_dtype_plan): every
    parameter and every buffer a checkpoint holds to `dtype`, but the modules transformers keeps in fp32
    (_keep_in_fp32_modules under fp16, _keep_in_fp32_modules_strict under fp16 and bf16). Buffers computed
    at init and never saved keep their dtype: RoPE's inv_freq stays fp32, where model.to(bf16) rounds it
    and turns the rotation of far positions (cosine error up to 1.99 by position 16k)."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    keep = set(getattr(base, "_keep_in_fp32_modules_strict", None) or ()) if dtype != torch.float32 else set()
    if dtype == torch.float16:
        keep |= set(getattr(base, "_keep_in_fp32_modules", None) or ())
    saved = set(model.state_dict())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and name in saved and not any(re.search(k, name) for k in keep):
            t.data = t.data.to(dtype)


def kept_dtypes(model, weights: str) -> dict:
    """{name: dtype} of the model's floating parameters and buffers not in the `weights` dtype."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: str(t.dtype).replace("torch.", "")
        for n, t in tensors
        if t.is_floating_point() and str(t.dtype) != f"torch.{weights}"
    }


def precision(cell: Cell, device: str):
    """(autocast context factory, GradScaler) for a cell; the scaler is live only where the cell's row
    says so (fp16-amp)."""
    import torch

    p = cell.precision
    if device == "cuda":
        set_tf32(p.tf32)
    scaler = torch.amp.GradScaler(device, enabled=p.scaler)
    if p.autocast:
        dtype = getattr(torch, p.autocast)
        return (lambda: torch.autocast(device, dtype=dtype)), scaler
    return contextlib.nullcontext, scaler


def attention(cell: Cell):
    """A context that pins the SDPA backend for the sdpa:* cells; the others dispatch as usual."""
    return sdpa_pin(cell.attention)


def within(outer: Callable, inner: Callable) -> Callable:
    """A context factory that enters `outer`, then `inner` (TE's fp8 autocast inside the bf16 one)."""

    @contextlib.contextmanager
    def both():
        with outer(), inner():
            yield

    return both


def whole(batch: dict) -> dict:
    """Every row of a global batch: the share of a one-process probe."""
    return batch


@dataclass
class Setup:
    """Everything `train.train` needs for one probe."""

    model: Any
    # an endless iterator of optimizer steps: (this process's rows of each of the step's micro-batches, on
    # the device; the step's loss terms over every rank, a tensor on the device, or None: see train.micro_loss)
    data: Any
    optimizer: Any
    autocast: Callable
    scaler: Any
    attend: Callable
    sync: Callable  # waits for the device, so that step times are real
    fp8_excluded: dict = field(default_factory=dict)  # fp8 cells: {linear left in high precision: why}
    optimizer_eager: str | None = None  # why the optimizer step runs eagerly here, when it does
    build_s: float = 0.0  # constructing the model on its device (init or weight load)
    # this process's rows of one global batch (its model inputs): all of them, or a rank's shard
    # (parallel.shard); `data` and `restart`'s stream apply it, so the replay trains the timed steps' rows
    rows: Callable[[dict], dict] = whole
    stream: DataStream | None = None  # the batches `data` cycles through, and where they came from
    normalization: str = (
        "micro_batch"  # config.LOSS_NORMALIZATIONS, as measure.accumulation.normalized applies it to this model
    )
    world_size: int = 1  # the ranks sharing each micro-batch (train.micro_loss)
    # objective=grpo: samples each step's completions (`data`) and computes its loss (rollout.py); None: sft
    rollouts: Any = None


def _steps(spec: ProbeSpec, batches: DataStream, rows: Callable[[dict], dict] = whole):
    """The optimizer steps the training loop draws: (this process's rows of each of the step's
    gradient_accumulation_steps micro-batches, on the device, a floating mask in the compute dtype;
    the step's loss terms over all its rows, num_items_in_batch as Trainer counts it, on the device).
    `rows` takes this process's share of each micro-batch whatever it holds."""
    import torch

    dtype = getattr(torch, spec.cell.precision.compute)
    for group, items in batches.steps(spec.recipe.gradient_accumulation_steps):
        yield [rows(b.to(spec.device, dtype)) for b in group], torch.tensor(items, device=spec.device)


def first_step(spec: ProbeSpec, s: Setup) -> tuple[list, Any]:
    """The probe's first optimizer step, every row of it, on its device: what one process trains at
    step 0 (the step-0 gradient agreement's reference, the replay's gradient underflow, the setup checks)."""
    return next(_steps(spec, s.stream))


def _optimizer(spec: ProbeSpec, model):
    """The cell's optimizer over the trainable parameters, grouped for weight decay as the Trainer groups
    them; (optimizer, why it steps eagerly or None)."""
    o = spec.recipe.optimizer
    optimizer = optimizer_for(spec.cell.optimizer, model, o)
    eager = eager_reason(spec.cell.optimizer, spec.device)
    if eager:
        step_eagerly(optimizer)
    return optimizer, eager


def setup(spec: ProbeSpec) -> Setup:
    """Build the probe's model, data, optimizer and numerics on its device, seeded by the spec. An fp8
    cell converts its linears before the optimizer is built over the parameters."""
    import torch

    device, cell = spec.device, spec.cell
    t0 = time.perf_counter()
    model = build_model(spec.plan, spec.recipe, cell, spec.seed, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    build_s = time.perf_counter() - t0
    autocast, scaler = precision(cell, device)
    fp8_excluded = {}
    if cell.precision.fp8:
        from .fp8 import prepare_fp8

        fp8_context, fp8_excluded = prepare_fp8(model, cell.precision.fp8, spec.recipe.fp8)
        autocast = within(autocast, fp8_context)
    optimizer, eager = _optimizer(spec, model)
    batches = stream(spec.recipe, model.config, spec.seed)
    rollouts = None
    if spec.recipe.objective == "grpo" and spec.trainer:  # trl.GRPOTrainer samples and trains (child/grpo.py)
        from .trainer_rollouts import TrainerRollouts

        rollouts = TrainerRollouts(spec.recipe, batches, cell.attn)
    elif spec.recipe.objective == "grpo":
        from .rollout import Rollouts

        rollouts = Rollouts(spec.recipe, model, batches, autocast, device, spec.seed, cell.precision.compute)
    return Setup(
        model,
        rollouts.steps() if rollouts and not spec.trainer else _steps(spec, batches),
        optimizer,
        autocast,
        scaler,
        attention(cell),
        sync,
        fp8_excluded,
        eager,
        build_s,
        stream=batches,
        normalization=normalized(spec.recipe, model),
        rollouts=rollouts,
    )


def restart(spec: ProbeSpec, s: Setup) -> Setup:
    """The same model (its weights restored by the caller) with a fresh optimizer, GradScaler and data
    stream of `s.rows`: what the replay trains, without building the model a second time."""
    s.optimizer = None  # free the timed run's optimizer state before the fresh one is made
    _, scaler = precision(spec.cell, spec.device)
    optimizer, _ = _optimizer(spec, s.model)
    data = s.rollouts.steps() if s.rollouts else _steps(spec, s.stream, s.rows)
    return replace(s, data=data, optimizer=optimizer, scaler=scaler)
