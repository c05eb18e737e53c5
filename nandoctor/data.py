"""The data a probe trains on: `stream(recipe, model_config, seed)`, the one entry point.

Two sources stand behind it. With no data given, the synthetic stream: a deterministic, learnable
token stream from the recipe and the seed. With data.path, the user's rows (userdata/): read through
Hugging Face `datasets`, tokenized with their tokenizer and chat template, labelled and collated as
their options say, and the batches chosen from a scan of every row (the first ones, then the worst).

Each batch is a `Batch`: the model's inputs plus which rows it holds and its loss terms, so that a
step of several micro-batches can normalise by their token count (`DataStream.steps`).

Runs in the probe child (training) and in the parent (the doctor, the lint). Imports only config and
userdata; torch is imported where a batch is made.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .config import Recipe
from .userdata.collate import Collation, batch_figures, block_mask, collate, join
from .userdata.tokenizer import pad_id as policy_pad_id


@dataclass(frozen=True)
class Batch:
    """One micro-batch. inputs: the tensors the model takes (input_ids, labels, and attention_mask
    and / or position_ids as the collator builds them). rows: the data set's row indices it holds
    (empty for the synthetic stream). kind: first, longest, most_padded, fewest_supervised (select.py)
    or synthetic. supervised: its loss terms, labels other than -100 after the causal shift; the sum
    over a step's micro-batches is transformers' num_items_in_batch.

    Under block_mask packing the dense [1, 1, T, T] mask is not kept: 4 bytes per token pair, 1 GiB for
    a packed row of 8 x 2048 tokens, for every batch a probe cycles through. `tensors` holds the rest,
    and `inputs` / `to` build the mask from the position_ids when they are asked for it."""

    tensors: dict
    rows: tuple = ()
    kind: str = "synthetic"
    tokens: int = 0
    padded: int = 0
    supervised: int = 0
    packing: str = "none"

    @property
    def inputs(self) -> dict:
        return self._with_mask(None)

    def _with_mask(self, dtype) -> dict:
        if self.packing != "block_mask" or "attention_mask" in self.tensors:
            return dict(self.tensors)
        return {**self.tensors, "attention_mask": block_mask(self.tensors["position_ids"][0], dtype)}

    def to(self, device, float_dtype=None) -> dict:
        """The inputs on `device`; a floating mask (block_mask packing) in `float_dtype` when given,
        since SDPA wants its additive mask in the query's dtype."""
        return {
            k: v.to(device, float_dtype) if float_dtype is not None and v.is_floating_point() else v.to(device)
            for k, v in self._with_mask(float_dtype).items()
        }

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "rows": list(self.rows),
            "tokens": self.tokens,
            "padded": self.padded,
            "supervised": self.supervised,
        }


def make_batch(inputs: dict, rows: tuple = (), kind: str = "synthetic", packing: str = "none") -> Batch:
    """A Batch of collated inputs (under block_mask packing, collated without the dense mask: Batch builds it)."""
    return Batch(inputs, tuple(rows), kind, **batch_figures(inputs), packing=packing)


@dataclass
class DataStream:
    """The distinct batches a probe cycles through, and where they came from (`source`: the
    synthetic stream's parameters, or the user's file and options); `collation`: how they were
    collated, so that several of them can be collated again as one (`joined`)."""

    batches: list
    source: dict = field(default_factory=dict)
    collation: Collation | None = None

    def __iter__(self) -> Iterator[Batch]:
        return itertools.cycle(self.batches)

    def steps(self, micro_batches: int = 1) -> Iterator[tuple[list, int]]:
        """Endless optimizer steps: (the step's micro-batches, their loss terms together). A loss
        normalised by tokens divides each micro-batch's summed loss by that count
        (num_items_in_batch); one normalised per micro-batch divides by its own and by the steps."""
        cycle = iter(self)
        while True:
            group = [next(cycle) for _ in range(micro_batches)]
            yield group, sum(b.supervised for b in group)

    def step_batches(self, index: int, micro_batches: int = 1) -> list:
        """The batches optimizer step `index` of `steps(micro_batches)` trains (the stream cycles)."""
        n = len(self.batches)
        return [self.batches[(index * micro_batches + j) % n] for j in range(micro_batches)]

    def joined(self, batches: list) -> dict:
        """The model inputs of one batch holding every row of `batches` (a step's micro-batches), collated
        as the stream collates: the full batch an accumulated step stands for."""
        return join([b.tensors for b in batches], self.collation)

    def describe(self) -> dict:
        return {**self.source, "batches": [b.describe() for b in self.batches]}


def pad_id(recipe: Recipe, config) -> int:
    """The synthetic stream's pad id under pad_token.policy."""
    return policy_pad_id(recipe.pad_token.policy, config=config, config_pad=False)[0]


def synthetic_batches(recipe: Recipe, config, seed: int) -> list[dict]:
    """The synthetic stream's `data.batches` distinct batches.

    Rows repeat a random 8-token motif, so a model that learns to copy drives the loss down quickly:
    a probe that stops learning is visible within a few dozen steps."""
    import torch

    vocab = config.vocab_size
    pad = pad_id(recipe, config)
    B, T = recipe.batch_size, recipe.seq_len
    fixed = []
    for i in range(recipe.data.batches):
        g = torch.Generator().manual_seed(seed * 1000 + i)
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
            labels[(mask == 0) if recipe.data.labels == "attention_mask" else (ids == pad)] = -100
        fixed.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return fixed


def synthetic_collation(recipe: Recipe, pad: int) -> Collation:
    """How the synthetic stream's batches are collated: padded on the right (a pad label of -100, or the
    pad id itself when pad_token.mask_labels is off), or packed under data.packing."""
    return Collation("right", recipe.data.packing, pad, -100 if recipe.pad_token.mask_labels else pad)


def _repacked(batch: dict, c: Collation) -> dict:
    """A synthetic batch collated again under data.packing (its rows without their padding)."""
    rows = [
        {"input_ids": ids[m.bool()].tolist(), "labels": y[m.bool()].tolist()}
        for ids, m, y in zip(batch["input_ids"], batch["attention_mask"], batch["labels"])
    ]
    return collate(rows, c, dense_mask=False)  # Batch builds block_mask's mask when it is asked for


def stream(recipe: Recipe, model_config, seed: int, tokenizer=None) -> DataStream:
    """The probe's data: the synthetic stream, or the user's rows when data.path is given (tokenized
    with `tokenizer`, else the one data.tokenizer or the local checkpoint names). The user's rows
    give data.batches batches in order, then the worst ones the scan finds, each with its rows."""
    if recipe.data.source == "file":
        from .userdata.rows import encoded_rows, user_batches

        encoded = encoded_rows(recipe, model_config, tokenizer)
        chosen = user_batches(encoded, recipe.batch_size, recipe.data.batches, seed)
        packing = encoded.collation.packing
        batches = [make_batch(t, rows, kind, packing) for kind, rows, t in chosen]
        return DataStream(batches, encoded.describe(), encoded.collation)
    fixed = synthetic_batches(recipe, model_config, seed)
    collation = synthetic_collation(recipe, pad_id(recipe, model_config))
    if recipe.data.packing != "none":
        fixed = [_repacked(b, collation) for b in fixed]
    source = {"source": "synthetic", "batches_cycled": recipe.data.batches, "pad_fraction": recipe.data.pad_fraction}
    batches = [make_batch(b, packing=recipe.data.packing) for b in fixed]
    return DataStream(batches, {**source, "packing": recipe.data.packing}, collation)


def batches(recipe: Recipe, config, seed: int):
    """An endless, deterministic stream of the model inputs of `stream`'s batches, cycled."""
    return (b.inputs for b in stream(recipe, config, seed))


def all_masked_batches(recipe: Recipe, config) -> int:
    """How many of the stream's distinct batches have no loss term (their mean loss is 0/0)."""
    return sum(b.supervised == 0 for b in stream(recipe, config, recipe.seed).batches)
