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
    this precision against fp32), packing_fp32_diff (packed against the segments alone, both in fp32),
    packing_cause (what the collator passed beside the position_ids), packing_layers (where the packed
    forward departs from the segments alone, layer by layer: _layer_diffs)."""
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

    def alone(hidden=False):
        outs = [model(input_ids=flat[a:b][None], use_cache=False, output_hidden_states=hidden) for a, b in spans]
        return torch.cat([o.logits[0].float() for o in outs]), [o.hidden_states for o in outs]

    with torch.no_grad(), without_dropout(model):
        packed_out = model(**given, output_hidden_states=True)
        packed = packed_out.logits[0][keep].float()
        own, own_hidden = alone(hidden=True)
        with in_fp32(model):
            reference, _ = alone()
            as_fp32 = {k: v.float() if v.is_floating_point() else v for k, v in given.items()}
            packed_fp32 = model(**as_fp32).logits[0][keep].float()
        layers = _layer_diffs(model, packed_out.hidden_states, own_hidden, spans, keep)
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
        # the same comparison in fp32, whatever the cell: isolation is the collation's and the mask's, and a
        # leak as large as fp32's must not hide under a half-precision cell's own rounding
        "packing_fp32_diff": float((packed_fp32 - reference).abs().max()),
        "packing_cause": cause,
        "packing_layers": layers,
    }


def _layer_diffs(model, packed: tuple | None, alone: list, spans: list[tuple[int, int]], keep) -> list[dict] | None:
    """Per decoder layer of the packed forward: its kind (config.layer_types: linear_attention,
    sliding_attention, ...; "attention" where the config names none) and its output's largest difference
    to the segments run alone, on the first segment (which no other segment precedes in a causal model:
    the model's own rounding) and on the later ones (rounding, or a layer that mixes the segments, such as
    a linear-attention fallback that ignores position_ids, huggingface/transformers#46333). None without
    hidden states or with one segment."""
    import torch

    if not packed or len(spans) < 2 or any(h is None for h in alone):
        return None
    kinds = list(getattr(model.config, "layer_types", None) or [])
    first = spans[0][1] - spans[0][0]
    out = []
    for i in range(1, len(packed)):
        diff = (packed[i][0][keep].float() - torch.cat([h[i][0].float() for h in alone])).abs()
        out.append(
            {
                "layer": i - 1,
                "kind": kinds[i - 1] if i - 1 < len(kinds) else "attention",
                "first_segment": float(diff[:first].max()),
                "later_segments": float(diff[first:].max()),
            }
        )
    return out
