"""A parallel probe's step-0 gradient against the one-process gradient of the same global batch: the
grad-mismatch verdict."""

from __future__ import annotations

import math

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .figures import _fmt, _num
from .setup import group_clauses, groups_beyond_floor
from .table import GRAD_MISMATCH, Verdict


def agreement_tolerance(dtypes, t: Thresholds = THRESHOLDS) -> tuple[float, str]:
    """(the largest step-0 relative gradient error the coarsest of `dtypes` explains, that dtype)."""
    bounds = dict(t.grad_agreement)
    coarsest = max((d for d in dtypes if d in bounds), key=lambda d: bounds[d], default="float32")
    return bounds[coarsest], coarsest


def parallel_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """A parallel probe whose reduced step-0 gradient is not the one-process gradient of the same
    global batch fails, whatever its loss curve does: AdamW and clipping hide a gradient scaled W-fold.
    Judged as a whole (the largest parameter's error against the tolerance of the coarsest dtype its
    gradients pass through) and per tensor group (each group's error against the bound of its own fp32
    floor, the accumulation check's rule): a router's gradient can be off while the rest agree."""
    facts = record.parallel or {}
    got = facts.get("grad_agreement")
    if not got or got.get("norm_ratio") is None:
        return None
    w, ratio, err = facts["world_size"], got["norm_ratio"], got["max_rel_error"]
    if w > 1 and abs(ratio / w - 1) <= t.grad_ratio_rel:
        return Verdict(
            GRAD_MISMATCH,
            f"gradients are {ratio:.2f}x the single-process ones: the reduction sums "
            f"instead of averaging (world size {w})",
            0,
        )
    if w > 1 and abs(ratio * w - 1) <= t.grad_ratio_rel:
        return Verdict(
            GRAD_MISMATCH,
            f"gradients are {ratio:.2f}x the single-process ones: the reduction divides by the world size ({w}) twice",
            0,
        )
    tol, coarsest = agreement_tolerance([record.cell.precision.compute, *(facts.get("reduce_dtype") or [])], t)
    whole = not math.isfinite(err) or err > tol
    groups = got.get("groups") or {}
    bad = groups_beyond_floor(groups, t)
    if not (whole or bad):
        return None
    said = group_clauses(groups, bad, t)
    return Verdict(
        GRAD_MISMATCH,
        f"step-0 gradients differ from the single-process ones by up to {_fmt(err)} "
        f"(relative, {got.get('worst_param')}{_of_group(got.get('worst_group'))}), "
        + (
            f"beyond the {tol:g} a {coarsest} computation and reduction explain"
            if whole
            else f"within {tol:g} per parameter"
        )
        + (f"{'; so does' if whole else ', but'} {', '.join(said)}" if said else "")
        # the worst parameter's group counts too: a router whose own floor is wide (bf16) fails as a whole
        + _balancing_clause(facts, bad + ([got.get("worst_group")] if whole else [])),
        0,
    )


def _of_group(group: str | None) -> str:
    return f", in the {group}" if group else ""


def _balancing_clause(facts: dict, bad: list) -> str:
    """The cause and its fix where the router's gradient differs (`bad`: the groups that do) and the
    model adds a balancing loss to a token-normalised loss that Trainer multiplies by the ranks
    (average_tokens_across_devices; huggingface/transformers#48690): it is counted W times a step."""
    if not ("router" in bad and facts.get("balancing_loss") and facts.get("loss_normalization") == "tokens"):
        return ""
    w = facts.get("world_size")
    return (
        f": the load-balancing loss (router_aux_loss_coef {_fmt(_num(facts['balancing_loss']))}) is in each "
        f"rank's token-normalised loss, which is multiplied by the world size ({w}), so it is counted {w} "
        f"times; fix: count it once, model.router_aux_loss_coef = model.config.router_aux_loss_coef / {w} "
        "(the data-parallel ranks) after from_pretrained"
    )
