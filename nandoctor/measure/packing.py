"""Packing isolation: whether the segments of a packed row see only themselves.

The figure is the largest logit difference between one packed forward, as the batch is collated and
as the model is configured, and each segment run alone in the same precision: a segment alone cannot
attend to another, so the baseline cannot share a leak. The floor is what the model's own rounding
moves a logit by: the segments alone in this precision against the segments alone in fp32
(numerics.in_fp32). Neither forward of the floor is the packed one, so a model that leaks (a 2-D mask
beside the position_ids, a cache in training, a model that ignores position_ids) cannot raise it.
"""

from __future__ import annotations

from ..userdata.encode import segments
from .numerics import in_fp32, without_dropout


def packing_isolation(model, inputs: dict) -> dict:
    """The figures of one packed row (row 0 of `inputs`, as collated): packing_segments,
    packing_max_logit_diff (packed against the segments alone), packing_floor (the segments alone in
    this precision against fp32), packing_cause (what the collator passed beside the position_ids)."""
    import torch

    ids, positions = inputs["input_ids"][:1], inputs["position_ids"][:1]
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        keep = mask[0].bool()
    else:
        keep = torch.ones(ids.shape[1], dtype=torch.bool, device=ids.device)
    spans = segments(positions[0][keep])
    given = {"input_ids": ids, "position_ids": positions}
    if mask is not None:
        given["attention_mask"] = mask[:1]
    flat = ids[0][keep]

    def alone():
        return torch.cat([model(input_ids=flat[a:b][None], use_cache=False).logits[0].float() for a, b in spans])

    with torch.no_grad(), without_dropout(model):
        packed = model(**given).logits[0][keep].float()
        own = alone()
        with in_fp32(model):
            reference = alone()
    if mask is not None and mask.dim() == 2:
        cause = "a 2-D attention mask is passed beside the position_ids"
    elif getattr(model.config, "use_cache", False):
        cause = "config.use_cache=True: a cache is built in training, and beside a cache position_ids are not packing"
    else:
        cause = "position_ids alone, as collated"
    return {
        "packing_segments": len(spans),
        "packing_max_logit_diff": float((packed - own).abs().max()),
        "packing_floor": float((own - reference).abs().max()),
        "packing_cause": cause,
    }
