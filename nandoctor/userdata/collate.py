"""Rows to one batch of tensors, the way the user's collator builds it.

- packing=none: rows padded to the longest of the batch on padding_side, with a 2-D attention mask
  (DataCollatorWithPadding / DataCollatorForLanguageModeling); rows that carry position_ids keep them.
- packing=position_ids: the batch's rows concatenated into one row of shape [1, total tokens], with
  position_ids restarting at 0 for each row and no attention mask, so that transformers builds the
  per-segment causal mask from the position_ids (DataCollatorWithFlattening). The first label of
  each segment is -100: it would be predicted from the previous segment's last token.
- packing=block_mask: the same row with an explicit 4-D block-diagonal causal mask [1, 1, T, T],
  additive (0 where a token attends, the dtype's lowest value where it does not), the form both the
  eager and the SDPA attention add to their scores (a boolean 4-D mask is read as 0/1 by eager).
- packing=position_ids_with_mask: the same row with the usual 2-D all-ones attention mask beside the
  position_ids, as a padding collator adds it to flattened rows. transformers then builds one causal
  mask over the whole row and the position_ids no longer separate the segments: each attends to the
  ones before it (huggingface/transformers PR #46634, huggingface/trl#3067). A setup to probe, not to use.

A row is a dict of lists: input_ids, labels, and optionally attention_mask (0 on positions the row
was pre-padded with) and position_ids (a row already packed by the user: several segments).
"""

from __future__ import annotations

from dataclasses import dataclass

from .encode import IGNORE, segments


@dataclass(frozen=True)
class Collation:
    padding_side: str  # config.PADDING_SIDES
    packing: str  # config.PACKINGS
    pad_id: int
    pad_label: int  # IGNORE, or the pad id itself when pad labels are kept (pad_token.mask_labels=false)


def collate(rows: list[dict], c: Collation, dense_mask: bool = True) -> dict:
    """One batch of torch tensors from rows: input_ids and labels, and attention_mask and / or
    position_ids as the packing needs them. dense_mask=False leaves out block_mask packing's [1, 1, T, T]
    mask (data.Batch builds it when its inputs are taken)."""
    return _pad(rows, c) if c.packing == "none" else _pack(rows, c, dense_mask)


def _pad(rows: list[dict], c: Collation) -> dict:
    import torch

    width = max(len(r["input_ids"]) for r in rows)

    def padded(values: list, fill) -> list:
        fills = [fill] * (width - len(values))
        return fills + list(values) if c.padding_side == "left" else list(values) + fills

    batch = {
        "input_ids": torch.tensor([padded(r["input_ids"], c.pad_id) for r in rows]),
        "attention_mask": torch.tensor([padded(r.get("attention_mask") or [1] * len(r["input_ids"]), 0) for r in rows]),
        "labels": torch.tensor([padded(r["labels"], c.pad_label) for r in rows]),
    }
    if any(r.get("position_ids") is not None for r in rows):
        batch["position_ids"] = torch.tensor(
            [padded(r.get("position_ids") or list(range(len(r["input_ids"]))), 0) for r in rows]
        )
    return batch


def _segments(row: dict) -> list[tuple[list, list, list]]:
    """(input_ids, labels, position_ids) of each sequence in a row: its unpadded tokens, split where a
    pre-packed row's position_ids restart at 0."""
    keep = [i for i, m in enumerate(row.get("attention_mask") or [1] * len(row["input_ids"])) if m]
    ids = [row["input_ids"][i] for i in keep]
    labels = [row["labels"][i] for i in keep]
    positions = [row["position_ids"][i] for i in keep] if row.get("position_ids") is not None else None
    if positions is None:  # an empty row is no segment: packed, it would add a label without a token
        return [(ids, labels, list(range(len(ids))))] if ids else []
    return [(ids[a:b], labels[a:b], positions[a:b]) for a, b in segments(positions)]


def _pack(rows: list[dict], c: Collation, dense_mask: bool = True) -> dict:
    import torch

    ids, labels, positions = [], [], []
    for row in rows:
        for seg_ids, seg_labels, seg_pos in _segments(row):
            ids += seg_ids
            labels += [IGNORE] + seg_labels[1:]
            positions += seg_pos
    batch = {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels]),
        "position_ids": torch.tensor([positions]),
    }
    return _packed_mask(batch, c) if dense_mask or c.packing != "block_mask" else batch


def _packed_mask(batch: dict, c: Collation) -> dict:
    """A packed row with the attention mask its packing passes beside the position_ids (none for position_ids)."""
    import torch

    if c.packing == "block_mask":
        batch["attention_mask"] = block_mask(batch["position_ids"][0])
    elif c.packing == "position_ids_with_mask":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def join(batches: list[dict], c: Collation) -> dict:
    """One batch holding the rows of several collated batches (a step's micro-batches), as `collate`
    makes it from all their rows: padded batches padded again to the widest of them and stacked,
    packed rows concatenated into one packed row. What an accumulated step stands for (the full batch)."""
    import torch

    if c.packing != "none":
        keys = ("input_ids", "labels", "position_ids")
        return _packed_mask({k: torch.cat([b[k] for b in batches], dim=1) for k in keys}, c)
    width = max(b["input_ids"].shape[1] for b in batches)
    fills = {"input_ids": c.pad_id, "attention_mask": 0, "labels": c.pad_label, "position_ids": 0}

    def widened(t, fill):
        pad = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype)
        return torch.cat([pad, t] if c.padding_side == "left" else [t, pad], dim=1)

    def positions(b):  # a batch collated without position_ids: each row's own, 0 on padding (as _pad makes them)
        mask = b["attention_mask"]
        return b.get("position_ids", (mask.cumsum(dim=1) - 1).clamp(min=0) * mask)

    keys = [k for k in fills if any(k in b for b in batches)]
    return {
        k: torch.cat([widened(positions(b) if k == "position_ids" else b[k], fills[k]) for b in batches]) for k in keys
    }


def block_mask(position_ids, dtype=None):
    """The additive 4-D block-diagonal causal mask [1, 1, T, T] of one packed row: token i attends to
    token j when j <= i and both belong to the same segment (position_ids restart at 0 per segment)."""
    import torch

    dtype = dtype or torch.float32
    n = len(position_ids)
    segment = torch.zeros(n, dtype=torch.long)
    for k, (a, b) in enumerate(segments(position_ids)):
        segment[a:b] = k
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def batch_figures(batch: dict) -> dict:
    """What a batch holds: its real tokens, its padded positions and its loss terms (labels other than
    -100 after the causal shift: the count num_items_in_batch normalises by)."""
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None and mask.dim() == 2 else batch["input_ids"].numel()
    return {
        "tokens": tokens,
        "padded": batch["input_ids"].numel() - tokens,
        "supervised": int((batch["labels"][..., 1:] != IGNORE).sum()),
    }
