"""nandoctor inside a transformers `Trainer` run (extra `hf`):

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[NandoctorCallback()])

The callback reads the step's real loss from the model's own output (a forward hook), so a NaN that
`logging_nan_inf_filter` replaces in the logs is still seen, and the pre-clip grad-norm from hooks
that fire as each parameter's gradient is accumulated (the Trainer clips before any callback runs).
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from ..cells import PRECISIONS, Cell
from ..device import DeviceFacts
from ..knowledge.facts import trainer_cell
from ..measure.trainer_step import StepMeter, supervised
from .live import LiveRun, autocast_of, recipe_of, special_ids
from .watch import Watch, guarded

# accelerate turns fp16=True into autocast and a GradScaler only on an accelerator; on a CPU the run
# stays in fp32 (accelerate/accelerator.py: native_amp is set for fp16 when device.type != "cpu"),
# unless the accelerator was given a GradScaler (then its optimizer carries it)
RUNS_ON_CPU_AS = {"fp16-amp": "fp32"}
MOOT_RULES = ("trainer-nan-inf-filter-hides-nan",)  # the callback reads the loss before that filter


def cell_from_training_args(args, model=None, scaled: bool = False) -> Cell:
    """The nandoctor cell a TrainingArguments setup runs: its precision flags (on this device) and
    torch_compile; with the model, its attention and whether half weights make it a pure cell (the
    row that hard-casts the weights to their dtype, when no autocast flag is set). scaled: the
    accelerator steps the optimizer through a GradScaler (fp16 autocast runs, on a CPU too)."""
    attn = model.config._attn_implementation if model is not None else "sdpa"
    # the optimizer is the one the Trainer built (on_train_begin reads it), whatever optim= names: an optim=
    # no optimizer row probes must not raise into the user's training
    cell = trainer_cell({k: v for k, v in args.to_dict().items() if k != "optim"}, attn or "sdpa")
    weights = str(next(model.parameters()).dtype).replace("torch.", "") if model is not None else "float32"
    pure = next((p.name for p in PRECISIONS.values() if p.weights == weights), None)
    dtype = pure if cell.dtype == "fp32" and pure else cell.dtype
    if args.device.type == "cpu" and not scaled:
        dtype = RUNS_ON_CPU_AS.get(dtype, dtype)
    return Cell(dtype, cell.attn, cell.compile)


def ranks_sharing_tokens(args) -> int:
    """Over how many processes' tokens the Trainer averages each micro-batch loss. With
    average_tokens_across_devices (the default) and a model that takes num_items_in_batch, each rank's
    model output is its summed token loss over the token count of every rank, and Trainer.compute_loss
    multiplies it by the process count (n_gpu under DataParallel) before backward, which DDP's gradient
    average then undoes. The callback reads the model's output, before that product: times this, it is
    the loss this rank's step trains on, its own tokens' mean."""
    if not getattr(args, "average_tokens_across_devices", False):
        return 1
    return args.n_gpu if args.n_gpu > 1 else max(1, int(args.world_size))


class NandoctorCallback(TrainerCallback):
    """Runs nandoctor's checks inside `Trainer.train()`: the setup and step-0 checks at train start, the
    data and setup lint on the trainer's own first batches (its dataset through its collator),
    the probes' verdict rules at every `every`-th step, and on the first failure stops training,
    replays the step with forensics hooks (with gradient accumulation: on its first micro-batch) and
    writes a report to `output_dir` (default: the TrainingArguments output_dir)/nandoctor.
    strict: a failed check raises instead of warning, and a run that does not learn is stopped.
    An error inside nandoctor is one line on stderr and switches the callback off; training goes on."""

    def __init__(
        self,
        every: int = 1,
        strict: bool = False,
        output_dir: str | None = None,
        device: DeviceFacts | dict | None = None,
    ):
        self.watch = Watch(every, strict, device)
        self.output_dir = output_dir
        self.meter = StepMeter()  # the hooks' figures of a step being judged
        self.judged = False
        self.handles = []

    @guarded
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        scaled = getattr(optimizer, "scaler", None) is not None
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        cell = cell_from_training_args(args, model, scaled)
        self.meter.share = ranks_sharing_tokens(args)
        recipe = recipe_of(
            "transformers", model, optimizer, args.max_grad_norm, args.seed, cell, args.gradient_accumulation_steps
        )
        run = LiveRun(
            "transformers",
            cell,
            recipe,
            model,
            optimizer,
            args.device.type,
            Path(self.output_dir or args.output_dir),
            step_loss=model,
            autocast=autocast_of(cell, args.device.type),
            trainer_args=args.to_dict(),
            moot_rules=MOOT_RULES,
        )
        loader, size = kwargs.get("train_dataloader"), args.per_device_train_batch_size
        self.watch.start(run, loader, size, *special_ids(kwargs.get("processing_class"), model))
        self.handles = [
            model.register_forward_pre_hook(self._inputs, with_kwargs=True),
            model.register_forward_hook(self._loss, with_kwargs=True),
        ]
        self.handles += [p.register_post_accumulate_grad_hook(self._grad) for _, p in self.watch.named]

    @guarded
    def _inputs(self, module, args, kwargs):
        self.meter.inputs(module, args, kwargs)

    @guarded
    def _loss(self, module, args, kwargs, output):
        self.meter.loss(module, args, kwargs, output)

    @guarded
    def _grad(self, p):
        self.meter.grad(p)

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.begin(self.watch.checking(state.global_step))

    @guarded
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        taken = self.meter.take(optimizer)  # the hooks go quiet: a check that raises leaves nothing collecting
        if taken is None:
            return
        self.judged = True
        self.watch.judge(
            state.global_step, taken.loss, taken.grad_norm, taken.scale, taken.batch, supervised(taken.micro_batches)
        )

    def on_step_end(self, args, state, control, **kwargs):
        # not guarded: under DDP / FSDP every rank settles every step, its watch on or off (ranks.py)
        judged, self.judged = self.judged, False
        if self.watch.settle(state.global_step - 1, judged):
            control.should_training_stop = True

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self.quiet()
        self.watch.finish()

    def quiet(self):
        """Unhook the model: nothing of nandoctor runs in the user's steps any more."""
        for h in self.handles:
            h.remove()
        self.handles, self.meter.step = [], None
