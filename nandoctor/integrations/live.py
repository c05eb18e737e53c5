"""A framework's training run in nandoctor's terms: what its adapter reads at train start (`LiveRun`),
the recipe the run amounts to, and this rank's view of its parameters.

Importing this module needs torch, not a framework.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..cells import SHORT_DTYPES, Cell
from ..child.build import precision
from ..config import ModelConfig, OptimizerConfig, Recipe

# config.json keys about the file, not the architecture; AutoConfig.for_model takes the rest
ARCH_NOT_SETTINGS = ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "auto_map")


@dataclass
class LiveRun:
    """A framework's training run in nandoctor's terms, read by its adapter at train start."""

    framework: str  # "transformers" or "lightning"
    cell: Cell
    recipe: Recipe  # the recipe the run amounts to (optimizer, clipping, shapes, model)
    model: object  # the transformers model the hooks watch
    optimizer: object  # the torch optimizer the framework steps
    device: str  # "cpu" or "cuda"
    output_dir: Path
    step_loss: object  # what the replay trains: step_loss(**batch).loss, plus the model's parameters
    autocast: object  # context factory the replay's forward runs in
    trainer_args: dict | None = None  # TrainingArguments.to_dict(), for the knowledge rules
    moot_rules: tuple = ()  # knowledge rules the watch itself answers

    @property
    def vocab(self) -> int:
        return self.model.config.vocab_size

    @property
    def random_init(self) -> bool:
        """A model built with from_config has no name_or_path; from_pretrained sets it."""
        return not getattr(self.model, "name_or_path", "")


def autocast_of(cell: Cell, device: str):
    """The autocast context factory the probes use for a cell."""
    return precision(cell, device)[0]


def recipe_of(
    framework: str,
    model,
    optimizer,
    grad_clip: float,
    seed: int,
    cell: Cell,
    accumulation: int = 1,
    normalization: str = "tokens",
) -> Recipe:
    """The recipe a live run amounts to: its model (local checkpoint, hub id or config), the AdamW
    settings of its first parameter group, clipping and seed (the batch shape comes with a batch), its
    micro-batches per optimizer step (`accumulation`) and how the framework weights their losses
    (`normalization`: "tokens" where the framework passes num_items_in_batch to a model that takes it)."""
    source = getattr(model, "name_or_path", "") or ""
    arch = {} if source else {k: v for k, v in model.config.to_diff_dict().items() if k not in ARCH_NOT_SETTINGS}
    weights = SHORT_DTYPES.get(str(next(model.parameters()).dtype).replace("torch.", ""), "fp32")
    on_load = "fp32" if cell.precision.weights else weights  # the pure cells cast the weights themselves
    local = source and Path(source).is_dir()
    group = optimizer.param_groups[0]
    return Recipe(
        name=f"{framework}-run",
        description=f"read from a live {framework} run",
        model=ModelConfig(
            path=source if local else None,
            hub_id=None if local or not source else source,
            arch=arch,
            dtype_on_load=on_load,
            scale="full",
        ),
        optimizer=OptimizerConfig(
            lr=group.get("initial_lr", group["lr"]),
            betas=tuple(group.get("betas", (0.9, 0.999))),
            eps=group.get("eps", 1e-8),
            weight_decay=group.get("weight_decay", 0.0),
        ),
        grad_clip=grad_clip or 0.0,
        seed=seed,
        gradient_accumulation_steps=max(1, int(accumulation or 1)),
        loss_normalization=normalization,
    ).validate()


def token_shape(batch) -> tuple[int, int] | None:
    """(batch size, sequence length) of the first 2-D integer tensor in a batch (its token ids)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return tuple(batch.shape) if batch.ndim == 2 and not batch.is_floating_point() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return next((shape for shape in map(token_shape, values) if shape), None)


def recipe_at(recipe: Recipe, step: int, batch) -> Recipe:
    """The run's recipe made to reach a failing `step` with the shape of its `batch`: what probes need
    to train into the same failure."""
    recipe = dataclasses.replace(recipe, steps=max(recipe.steps, step + 1))
    shape = token_shape(batch)
    return dataclasses.replace(recipe, batch_size=shape[0], seq_len=shape[1]) if shape else recipe


def special_ids(tokenizer, model) -> tuple[int | None, int | None]:
    """(pad id, EOS id) of a live run: the tokenizer's, else the model config's (an int; a config's list
    of EOS ids names none)."""

    def first(*values):
        return next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)

    config = getattr(model, "config", None)
    return (
        first(getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None)),
        first(getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)),
    )
