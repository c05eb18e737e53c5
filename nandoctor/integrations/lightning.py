"""nandoctor inside a Lightning `Trainer.fit()` run (extra `lightning`):

    trainer = L.Trainer(precision="bf16-mixed", callbacks=[NandoctorCallback()])

It watches the transformers model inside the LightningModule (the first submodule with a
`config.vocab_size`). Lightning calls `on_before_optimizer_step` after the GradScaler unscaled the
gradients (unless the optimizer unscales them in its own step) and before it clips them, so the
grad-norm is read there; the loss comes from `on_before_backward`, divided back by the loss scale.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import Callback

from ..cells import ALIASES, PRECISIONS, Cell
from ..device import DeviceFacts
from ..errors import NandoctorError
from ..measure.numerics import cuda_matmul_precision
from ..measure.trainer_step import local, supervised
from .live import LiveRun, recipe_of, special_ids
from .watch import Watch, guarded


def cell_from_lightning(precision: str, attn: str = "sdpa", matmul_precision: str | None = None) -> Cell:
    """The nandoctor cell a Lightning precision string runs (its unified form, as `trainer.precision`
    holds it), read from the cell table; float32 matmul precision (default: torch's current) tells
    fp32 ("highest") from tf32, which also trains under "32-true"."""
    dtype = ALIASES["dtype"].get(precision)
    if dtype is None:
        raise NandoctorError(
            f"Lightning precision {precision!r} has no nandoctor cell; valid: {', '.join(sorted(ALIASES['dtype']))}"
        )
    if (matmul_precision or cuda_matmul_precision()) != "highest":
        dtype = next((p.name for p in PRECISIONS.values() if p.lightning == precision and p.tf32), dtype)
    return Cell(dtype, attn)


def lightning_arguments(cell: Cell) -> dict:
    """A cell in Lightning terms: the Trainer's precision, and, where matmuls run in float32, the
    float32 matmul precision to set ("high" lets them run on TF32 tensor cores)."""
    p = cell.precision
    matmul = {"float32_matmul_precision": "high" if p.tf32 else "highest"} if p.compute == "float32" else {}
    return {"precision": p.lightning, **matmul}


def cell_of_trainer(trainer, model) -> Cell:
    """The cell a Lightning Trainer runs: the precision its strategy resolved (FSDP and DeepSpeed
    bring their own plugin) and the attention of the watched model."""
    return cell_from_lightning(trainer.strategy.precision_plugin.precision, model.config._attn_implementation or "sdpa")


def watched_model(module):
    """The transformers model inside a LightningModule (it may be the module itself)."""
    found = next((m for m in module.modules() if hasattr(getattr(m, "config", None), "vocab_size")), None)
    if found is None:
        raise NandoctorError(f"NandoctorCallback watches a transformers model; {type(module).__name__} holds none")
    return found


class _TrainingStep:
    """The replay trains through child/train.py's train(), which calls model(**batch).loss and hooks the model's
    modules and parameters: this runs the LightningModule's training_step on the watched model."""

    def __init__(self, module, watched):
        self.module = module
        self.named_modules, self.named_parameters, self.parameters = (
            watched.named_modules,
            watched.named_parameters,
            watched.parameters,
        )

    def __call__(self, batch, batch_idx):
        # the replay is not a training step: keep its values out of the user's logs
        self.module.log = self.module.log_dict = lambda *args, **kwargs: None
        try:
            out = self.module.training_step(batch, batch_idx)
        finally:
            del self.module.log, self.module.log_dict
        return SimpleNamespace(loss=out["loss"] if isinstance(out, dict) else out)


class NandoctorCallback(Callback):
    """Runs nandoctor's checks inside `Trainer.fit()`: the setup and step-0 checks at train start, the
    data and setup lint on the first batches of its train DataLoader (dict batches of input_ids), the
    probes' verdict rules at every `every`-th optimizer step, and on the first failure stops training,
    replays the step with forensics hooks and writes a report to `output_dir` (default: the Trainer's
    default_root_dir)/nandoctor. strict: a failed check raises instead of warning, and a run that does
    not learn is stopped. An error inside nandoctor is one line on stderr and switches the callback
    off; training goes on."""

    def __init__(
        self,
        every: int = 1,
        strict: bool = False,
        output_dir: str | None = None,
        device: DeviceFacts | dict | None = None,
    ):
        self.watch = Watch(every, strict, device)
        self.output_dir = output_dir
        self.step = None  # the checked step being accumulated: its first batch and micro-batch losses
        self.open = False
        self.global_step = 0  # the trainer's optimizer steps when the last one settled

    @guarded
    def on_train_start(self, trainer, pl_module):
        self.global_step = trainer.global_step  # a resumed fit starts past 0
        model = watched_model(pl_module)
        optimizer = trainer.optimizers[0]
        cell = cell_of_trainer(trainer, model)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # set by lightning.seed_everything
        # Lightning divides each micro-batch's loss by accumulate_grad_batches: weighted per micro-batch
        micro = trainer.accumulate_grad_batches
        recipe = recipe_of("lightning", model, optimizer, trainer.gradient_clip_val, seed, cell, micro, "micro_batch")
        loader = trainer.train_dataloader  # the user's DataLoader (a CombinedLoader's iterables otherwise)
        self.watch.start(
            LiveRun(
                "lightning",
                cell,
                recipe,
                model,
                optimizer,
                pl_module.device.type,
                Path(self.output_dir or trainer.default_root_dir),
                step_loss=_TrainingStep(pl_module, model),
                autocast=trainer.precision_plugin.train_step_context,
            ),
            loader,
            getattr(loader, "batch_size", None),
            *special_ids(getattr(pl_module, "tokenizer", None), model),
        )

    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.open:  # the first micro-batch of an optimizer step
            self.open = True
            checking = self.watch.checking(trainer.global_step)
            self.step = (
                SimpleNamespace(batch={"batch": batch, "batch_idx": batch_idx}, losses=[], micro_batches=[])
                if checking
                else None
            )
        if self.step is not None:
            self.step.micro_batches.append(batch)

    @guarded
    def on_before_backward(self, trainer, pl_module, loss):
        if self.step is not None:
            self.step.losses.append(loss.detach())  # divided by accumulate_grad_batches, times the loss scale

    @guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.step is None:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        loss = torch.stack(self.step.losses).float().sum() / (scale or 1.0)
        # Lightning unscales before this hook, except for an optimizer that unscales inside its own step
        # (a fused AdamW): its gradients are still loss-scaled here (plugins/precision/amp.py)
        still_scaled = scale is not None and getattr(optimizer, "_step_supports_amp_scaling", False)
        # FSDP2: this rank's shards; the whole gradient's norm would be a collective a rank whose watch
        # is off never joins
        grads = [local(p.grad) for _, p in self.watch.named if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads) / (scale if still_scaled else 1.0)
        self.watch.judge(
            trainer.global_step,
            loss.item(),
            grad_norm.item(),
            scale,
            self.step.batch,
            supervised(self.step.micro_batches),
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # not guarded: under DDP / FSDP every rank settles every step, its watch on or off (ranks.py)
        if trainer.global_step == self.global_step:  # a micro-batch that only accumulated gradients
            return
        step, self.global_step = self.global_step, trainer.global_step
        judged, self.step, self.open = self.step is not None, None, False
        if self.watch.settle(step, judged):
            trainer.should_stop = True

    @guarded
    def on_train_end(self, trainer, pl_module):
        self.watch.finish()

    def quiet(self):
        self.step = None
