"""The data a probe trains on: a deterministic stream of batches from the recipe and the seed.

Runs in the probe child (training) and in the parent (the doctor counts fully masked batches).
Imports only config; torch is imported where a batch is made.
"""

from __future__ import annotations

import math
from pathlib import Path

from .config import Recipe
from .errors import NandoctorError


def pad_id(recipe: Recipe, config) -> int:
    policy = recipe.pad_token.policy
    if policy == "id0":
        return 0
    if policy == "eos":
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return eos if eos is not None else config.vocab_size - 2
    return config.vocab_size - 1  # dedicated: an id the content never uses


def batches(recipe: Recipe, config, seed: int):
    """An endless, deterministic stream of training batches, cycling through `data.batches` of them.

    Synthetic rows repeat a random 8-token motif, so a model that learns to copy drives the loss down
    quickly: a probe that stops learning is visible within a few dozen steps."""
    import torch

    vocab = config.vocab_size
    pad = pad_id(recipe, config)
    B, T = recipe.batch_size, recipe.seq_len
    if recipe.data.source == "file":
        raw = Path(recipe.data.path).read_bytes()
        if len(raw) < T + 1:
            raise NandoctorError(f"data file {recipe.data.path!r} is shorter than seq_len={T} bytes")
        tokens = torch.tensor(list(raw), dtype=torch.long) % (vocab - 1)
    fixed = []
    for i in range(recipe.data.batches):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        if recipe.data.source == "file":
            starts = torch.randint(0, len(tokens) - T, (B,), generator=g)
            ids = torch.stack([tokens[s : s + T] for s in starts.tolist()])
        else:
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
            labels[ids == pad] = -100
        fixed.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    step = 0
    while True:
        yield fixed[step % len(fixed)]
        step += 1


def all_masked_batches(recipe: Recipe, config) -> int:
    """How many of the recipe's distinct batches have every label -100 (their mean loss is 0/0)."""
    stream = batches(recipe, config, recipe.seed)
    return sum(bool((next(stream)["labels"] == -100).all()) for _ in range(recipe.data.batches))
