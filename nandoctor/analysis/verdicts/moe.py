"""A mixture of experts' routing: the expert-collapse verdict, a collapse that could not be judged, and a
drift traced to step 0's expert choices."""

from __future__ import annotations

import math

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .table import DRIFT, EXPERT_COLLAPSE, Verdict


def collapsed_layers(moe: dict | None, t: Thresholds = THRESHOLDS) -> list[str]:
    """One clause per router layer whose step (the last one measured, else step 0) left
    t.expert_dead_fraction of its experts without a token, or gave one expert t.expert_token_share of
    its tokens, naming the layer and the counts; [] for a dense model or a router that still spreads."""
    if not moe:
        return []
    experts, k = moe.get("experts") or 0, moe.get("top_k") or 1
    out = []
    for layer in moe.get("layers") or []:
        for key in ("step_last", "step_0"):
            at = layer.get(key) or {}
            rows, tokens = at.get("rows") or 0, at.get("tokens") or []
            if not rows or not experts or rows * k / experts < t.expert_min_load:
                continue
            dead, top = at.get("no_token") or 0, max(tokens)
            share = top / rows
            if dead >= t.expert_dead_fraction * experts or (
                k / experts <= t.expert_share_even_max and share >= t.expert_token_share
            ):
                out.append(
                    f"layer {layer['layer']} ({layer.get('module', '?')}): {dead} of {experts} experts got no token "
                    f"at step {at.get('step', '?')}, expert {tokens.index(top)} took {share:.0%} of its {rows} "
                    f"tokens (top-{k}; an even router gives each {k / experts:.0%})"
                )
                break
    return out


def collapse_unjudged(moe: dict | None, t: Thresholds = THRESHOLDS) -> str | None:
    """Why a mixture of experts' collapse was not judged, when no router layer had the load that judging
    needs (tokens x top-k / experts below expert_min_load at its last and first step measured): said with
    the verdict, so that a stable one does not read as a router that spreads. None for a dense model or
    where a layer was judged."""
    if not moe:
        return None
    experts, k = moe.get("experts") or 0, moe.get("top_k") or 1
    seen = [
        at.get("rows") or 0
        for layer in moe.get("layers") or []
        for at in (layer.get("step_last") or {}, layer.get("step_0") or {})
        if at.get("rows")
    ]
    if not experts or not seen or any(rows * k / experts >= t.expert_min_load for rows in seen):
        return None
    rows = max(seen)
    return (
        f"expert collapse not judged: {rows} tokens x top-{k} over {experts} experts is {rows * k / experts:.2g} "
        f"assignments per expert, under the {t.expert_min_load:g} an even router must give each before an idle "
        f"expert means collapse; a batch of {math.ceil(t.expert_min_load * experts / k)} tokens or more judges it"
    )


def router_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """`expert-collapse` when a router layer collapsed (collapsed_layers), else None."""
    layers = collapsed_layers(record.moe, t)
    return Verdict(EXPERT_COLLAPSE, "router collapse: " + "; ".join(layers), 0) if layers else None


def route_flips(choices: list | None, reference: list | None) -> float | None:
    """The share of step 0's (token, slot) expert choices that differ from the reference's, over every
    router layer and the tokens both kept (record.moe step0_choices); None when either is missing."""
    if not choices or not reference:
        return None
    differ = total = 0
    for mine, theirs in zip(choices, reference):
        for a, b in zip(mine, theirs):
            differ += len(a) - len(set(a) & set(b))
            total += len(a)
    return differ / total if total else None


def routing_cause(verdict: Verdict, flips: float | None, t: Thresholds = THRESHOLDS) -> Verdict:
    """A drift whose step-0 routing differs from the fp32 reference's by more than t.route_flip_share,
    with the routing named as its cause; any other verdict as it is."""
    if verdict.name != DRIFT or flips is None or flips <= t.route_flip_share:
        return verdict
    return Verdict(
        DRIFT,
        f"{verdict.reason}; caused by the routing: {flips:.1%} of step 0's token -> expert choices differ from "
        f"the fp32 reference's (over {t.route_flip_share:.0%}), the same weights and batch choose other experts "
        "in this precision (moe.router_dtype=fp32 keeps the router's logits in fp32)",
        verdict.step,
    )
