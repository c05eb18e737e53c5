"""The probe body where the user names a trainer (`--trainer-args`): their own trainer class trains the
probe's model for the probe's steps, with their arguments, so that what the Trainer does (its optimizer
and schedule from `optim=` and `lr_scheduler_type`, its loss scaling over accumulated micro-batches,
accelerate's autocast) is what the probe measures, not an emulation of it.

The recipe's optimizer, clipping and accumulation fields (config.trainer_arguments: read from the file,
then as a --set or a bisect factor leaves them) are set on the arguments. The cell is mapped onto the
arguments through the cell table: the precision row's `training_args`
(bf16 / fp16 / tf32; a pure cell's model is already held in its dtype by build.py and sets none), the
compile row's backend (torch_compile), the optimizer row's `optim=`; attention is the model's
attn_implementation (build.py), with the SDPA backend pinned around train(). What a probe needs and
the user's file cannot say is set here: max_steps (the probe's steps), a temporary output_dir,
report_to none, no saving, no evaluation, no progress bar. The data is the probe's own stream: for the
Trainer each item one micro-batch as the own loop trains it, in its order (an iterable dataset: the
Trainer does not shuffle it), so per_device_train_batch_size is 1 item and the recipe's batch_size rows
are in it; for trl.SFTTrainer (an SFTConfig) the same rows as a `datasets.Dataset` (child/sft.py).

Each step is measured by the hooks the training callback uses (measure/trainer_step.py) and handed to
the probe's step log as a record.Step; the log stops the Trainer at an unrecoverable step. A step whose
loss or grad-norm is not finite has the weights and optimizer state it started from kept (before its
optimizer step), so that an unrecoverable one is replayed after training with the forensics hooks, as
the training callback replays a live run's (failing_step.py): nandoctor's own loop from the initial
snapshot would not retrace the steps the trainer took (its schedule, its loss scaling).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
import traceback
from dataclasses import dataclass

from ..cells import PRECISIONS, Cell
from ..config import Recipe, trainer_arguments
from ..measure.trainer_step import StepMeter, supervised
from ..record import ProbeSpec, Step
from .build import Setup
from .failing_step import Failure, parameter_extremes, replay, state_copy
from .train import step_tokens
from .update_loss import step0_updates, update_figures

# What each --trainer kind runs: (module, class, its arguments class)
TRAINERS = {
    "hf": ("transformers", "Trainer", "TrainingArguments"),
    "sft": ("trl", "SFTTrainer", "SFTConfig"),
    "grpo": ("trl", "GRPOTrainer", "GRPOConfig"),
}
# Set for every probe whatever the file says: the probe's own run, not the user's outputs
PROBE_ARGS = {
    "report_to": "none",
    "save_strategy": "no",
    "eval_strategy": "no",
    "load_best_model_at_end": False,
    "push_to_hub": False,
    "disable_tqdm": True,
    "logging_strategy": "no",
    "remove_unused_columns": False,
    "dataloader_num_workers": 0,
    "resume_from_checkpoint": None,
}
# ... and per kind: SFTTrainer's dataset is rows (child/sft.py), to be drawn in the probe's order; GRPOTrainer's
# is prompts, sampled in the probe's order by generate() (child/grpo.py: vLLM is not wired as a probe's engine)
KIND_ARGS = {
    "hf": {},
    "sft": {"train_sampling_strategy": "sequential", "shuffle_dataset": False},
    "grpo": {
        "shuffle_dataset": False,
        "use_vllm": False,
        "use_transformers_continuous_batching": False,
        "log_completions": False,
    },
}
PRECISION_FLAGS = sorted({k for p in PRECISIONS.values() for k in p.training_args})


def versions(kind: str) -> dict:
    """{"class": the trainer's dotted name, "transformers": version, "trl": version or None}."""
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    module, name, _ = TRAINERS[kind]
    return {"class": f"{module}.{name}", "transformers": transformers.__version__, "trl": trl_version}


def arguments(spec: ProbeSpec, output_dir: str):
    """The user's arguments with the cell mapped onto them and the probe's own settings; an instance of
    the kind's arguments class. Fields the class does not take (a newer or older version's) are left out."""
    import importlib

    module, _, args_class = TRAINERS[spec.trainer["kind"]]
    cls = getattr(importlib.import_module(module), args_class)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    given = {k: v for k, v in spec.trainer["args"].items() if k in fields}
    # the recipe read these from the file; a --set or a bisect factor on them is the recipe's
    given.update({k: v for k, v in trainer_arguments(spec.recipe).items() if k in fields})
    cell = spec.cell
    given.update({k: None if k == "tf32" else False for k in PRECISION_FLAGS})
    given.update(cell.precision.training_args)
    given["torch_compile"] = cell.compilation.backend is not None
    if cell.compilation.backend is not None:
        given["torch_compile_backend"] = cell.compilation.backend
    optim = cell.optimizer_row.transformers_optim
    if not optim:
        raise RuntimeError(f"the Trainer has no optim= for the {cell.optimizer} optimizer (it takes optimizers=)")
    if given.get("optim") not in optim:
        given["optim"] = optim[0]
    given.update(PROBE_ARGS, output_dir=output_dir, max_steps=spec.steps, use_cpu=spec.device == "cpu")
    kind = spec.trainer["kind"]
    given.update(KIND_ARGS[kind])
    # one item of the dataset: one of the probe's micro-batches (hf), one row of one (sft); a GRPOConfig's
    # batch counts completions, and is the user's
    if kind != "grpo":
        given["per_device_train_batch_size"] = 1 if kind == "hf" else spec.recipe.batch_size
    elif given.get("generation_batch_size") and given.get("steps_per_generation"):
        # to_json_string() writes both as __post_init__ derived them, and GRPOConfig takes one
        given.pop("generation_batch_size")
    return cls(**given)


def micro_batches(spec: ProbeSpec, s: Setup):
    """The probe's micro-batches in the own loop's order, as an iterable dataset, and the collator that
    hands each one to the model as the own loop does: a floating mask (block_mask packing) in the cell's
    compute dtype."""
    import torch

    dtype = getattr(torch, spec.cell.precision.compute)

    def collate(items: list) -> dict:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in items[0].items()}

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (b.inputs for b in s.stream)

    return Stream(), collate


@dataclass
class TrainerRun:
    """A probe's run under the user's trainer, as failing_step.replay reads it."""

    cell: Cell
    recipe: Recipe
    model: object
    optimizer: object  # the torch optimizer the trainer steps (accelerate's wrapper taken off)
    device: str
    autocast: object  # the cell's autocast context factory, as the own loop's

    @property
    def step_loss(self):
        return self.model  # the eager module: a torch_compile cell's replay runs without compiling


@dataclass
class FailingStep:
    """A probe's first unrecoverable step under the user's trainer, kept for its replay: the run, its
    trainable (name, parameter) pairs, the failure (the batch and the state the step started from)."""

    run: TrainerRun
    named: list
    failure: Failure

    def forensics(self, attend) -> dict:
        """The step replayed with the forensics hooks (failing_step.replay), under `attend` (the probe's
        SDPA pin); a failure of the replay is recorded, never turned into the probe's."""
        try:
            with attend():
                return replay(self.run, self.named, self.failure, self.failure.verdict, 1)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}


def probe_callback(spec: ProbeSpec, s: Setup, groups: dict, on_step):
    """A TrainerCallback that measures each step with the training callback's hooks and hands it to
    `on_step` (record.Step -> False to stop), with its time, tokens, batch kind and group norms. Its
    `meter` takes the losses from the model's output, or where the model computes none (a GRPO probe,
    `s.rollouts` set) from the trainer's training_step (child/grpo.py), and the batch kind is then the
    rollouts' to say. With forensics on (forensics_steps), its `failing` is the first unrecoverable
    step, kept for its replay (not a GRPO step's), and its `updates` step 0's update loss as a probe's
    forensics hold it (update_loss.update_figures; None where it measured none), counted over every
    element as the own loop counts it."""
    from transformers import TrainerCallback

    meter = StepMeter()
    losses_from_model = s.rollouts is None
    accumulation = spec.recipe.gradient_accumulation_steps
    named_groups = {g: [p for _, p in params] for g, params in groups.items()}
    # a GRPO step's batch is its rollouts', which the replay cannot take again: no replay there
    forensics = spec.recipe.forensics_steps > 0 and losses_from_model
    measures_updates = spec.recipe.forensics_steps > 0

    class ProbeSteps(TrainerCallback):
        def __init__(self):
            self.handles, self.t0, self.taken, self.meter = [], 0.0, None, meter
            self.run, self.named, self.kept = None, [], None
            self.entering = self.earlier = None  # parameter_extremes() at this step's start, and one before
            self.failing: FailingStep | None = None
            self.watch = None  # the update-loss hooks until step 0's optimizer step is measured
            self.updates: dict | None = None

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if losses_from_model:
                self.handles = [
                    model.register_forward_pre_hook(meter.inputs, with_kwargs=True),
                    model.register_forward_hook(meter.loss, with_kwargs=True),
                ]
            self.handles += [
                p.register_post_accumulate_grad_hook(meter.grad) for p in model.parameters() if p.requires_grad
            ]
            torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper taken off
            if measures_updates:
                self.watch = step0_updates(s.model, torch_optimizer, elements=None)
            if forensics:
                self.run = TrainerRun(spec.cell, spec.recipe, s.model, torch_optimizer, spec.device, s.autocast)
                self.named = [(n, p) for n, p in s.model.named_parameters() if p.requires_grad]
                self.entering = self.earlier = parameter_extremes(self.named)

        def on_step_begin(self, args, state, control, **kwargs):
            meter.begin()
            s.sync()  # the last step's parameter_extremes are not this step's time
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.taken = (meter.take(optimizer), getattr(optimizer, "scaler", None))
            taken = self.taken[0]
            if forensics and taken and not (math.isfinite(taken.loss) and math.isfinite(taken.grad_norm)):
                # may be unrecoverable: keep what the step started from before its optimizer step changes it
                before = state_copy(self.named, self.run.optimizer)
                self.kept = Failure(None, taken.batch, before, self.entering, self.earlier, taken.scale)

        def on_step_end(self, args, state, control, **kwargs):
            s.sync()
            seconds = time.perf_counter() - self.t0
            watch, self.watch = self.watch, None
            if watch is not None:  # after step 0's optimizer step, outside its time
                self.updates = update_figures(watch, state.global_step - 1)
            (taken, scaler), self.taken = self.taken or (None, None), None
            if taken is None:
                return
            index = state.global_step - 1
            given = taken.micro_batches  # as the trainer collated them (SFTTrainer re-pads, may pack)
            tokens = step_tokens(list(given))
            skipped = taken.scale is not None and scaler.get_scale() < taken.scale
            step = Step(
                index,
                taken.loss,
                taken.grad_norm,
                skipped,
                taken.scale,
                seconds,
                tokens,
                tokens / seconds if tokens is not None and seconds > 0 else None,
            )
            step.groups = group_norms(taken.norms, named_groups, taken.scale)
            if losses_from_model:  # a GRPO step's are its rollouts' (Setup.rollouts.annotate)
                step.supervised = supervised(given)
                step.batch = "+".join(b.kind for b in s.stream.step_batches(index, accumulation))
            kept, self.kept = self.kept, None
            if not on_step(step):
                control.should_training_stop = True
                if kept is not None and step.unrecoverable() and self.failing is None:
                    self.failing = FailingStep(self.run, self.named, dataclasses.replace(kept, verdict=step))
            elif forensics:
                self.earlier, self.entering = self.entering, parameter_extremes(self.named)

        def on_train_end(self, args, state, control, **kwargs):
            for h in self.handles:
                h.remove()
            if self.watch is not None:
                self.watch.remove()

    return ProbeSteps()


def group_norms(norms: dict, groups: dict, scale: float | None) -> dict:
    """{group: the unscaled 2-norm of its parameters' gradients, or None where none got one}."""
    import torch

    out = {}
    for g, params in groups.items():
        seen = [norms[p] for p in params if p in norms]
        out[g] = (torch.linalg.vector_norm(torch.stack(seen)) / (scale or 1.0)).item() if seen else None
    return out


def train_with_trainer(
    spec: ProbeSpec, s: Setup, groups: dict, on_step
) -> tuple[dict, FailingStep | None, dict | None]:
    """Train `s.model` for spec.steps with the user's trainer class (spec.trainer: {"kind", "args"}),
    each step to `on_step`; returns what the record says of the trainer (`versions`, and for
    SFTTrainer and GRPOTrainer what it trains differently from the own loop: sft.sft_trains,
    grpo.grpo_trains), the first unrecoverable step kept for its replay (None: none, or forensics
    off) and step 0's update loss (probe_callback's `updates`)."""
    import importlib

    kind = spec.trainer["kind"]
    module, name, _ = TRAINERS[kind]
    trainer_class = getattr(importlib.import_module(module), name)
    with tempfile.TemporaryDirectory(prefix="nandoctor-trainer-") as out:
        args = arguments(spec, out)
        steps = probe_callback(spec, s, groups, on_step)
        callbacks = [steps]
        said = {}
        if kind == "sft":
            from .sft import sft_trainer

            trainer, trains = sft_trainer(trainer_class, spec, s, args, callbacks)
            said["sft_trains"] = trains
        elif kind == "grpo":
            from .grpo import grpo_trainer

            trainer, trains = grpo_trainer(trainer_class, spec, s, args, callbacks)
            said["grpo_trains"] = trains
        else:
            data, collate = micro_batches(spec, s)
            trainer = trainer_class(
                model=s.model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks
            )
        try:
            with s.attend():
                trainer.train()
        finally:
            if s.rollouts is not None:
                s.rollouts.remove()
    return {**versions(kind), **said}, steps.failing, steps.updates
