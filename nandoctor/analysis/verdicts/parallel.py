"""A parallel probe's step-0 gradient against the one-process gradient of the same global batch: the
grad-mismatch verdict."""

from __future__ import annotations

import math

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .figures import _fmt, _num, _own
from .table import GRAD_MISMATCH, Verdict


def agreement_tolerance(dtypes, t: Thresholds = THRESHOLDS) -> tuple[float, str]:
    """(the largest step-0 relative gradient error the coarsest of `dtypes` explains, that dtype)."""
    bounds = dict(t.grad_agreement)
    coarsest = max((d for d in dtypes if d in bounds), key=lambda d: bounds[d], default="float32")
    return bounds[coarsest], coarsest


def parallel_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """A parallel probe whose reduced step-0 gradient is not the one-process gradient of the same
    global batch fails, whatever its loss curve does: AdamW and clipping hide a gradient scaled W-fold."""
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
    if not math.isfinite(err) or err > tol:
        return Verdict(
            GRAD_MISMATCH,
            f"step-0 gradients differ from the single-process ones by up to {_fmt(err)} "
            f"(relative, {got.get('worst_param')}), beyond the {tol:g} a {coarsest} "
            "computation and reduction explain" + _parallel_group_clause(facts, tol),
            0,
        )
    return None


def _parallel_group_clause(facts: dict, tol: float) -> str:
    """'; by group: router 0.9 (beyond ...)' for the tensor groups whose reduced gradient differs from
    the one-process one beyond `tol`, and the cause with its fix where the router's does and the model
    adds a balancing loss to a token-normalised loss that Trainer multiplies by the ranks
    (average_tokens_across_devices; huggingface/transformers#48690)."""
    got = facts.get("grad_agreement") or {}
    groups = got.get("groups") or {}
    bad = [g for g, err in groups.items() if err is None or not math.isfinite(err) or err > tol]
    if not bad:
        return ""
    bad.sort(key=lambda g: -_num(groups[g]) if math.isfinite(_num(groups[g])) else -math.inf)
    out = "; by tensor group: the " + ", the ".join(f"{_own(g)} gradient by {_fmt(_num(groups[g]))}" for g in bad)
    w = facts.get("world_size")
    if "router" in bad and facts.get("balancing_loss") and facts.get("loss_normalization") == "tokens":
        out += (
            f": the load-balancing loss (router_aux_loss_coef {_fmt(_num(facts['balancing_loss']))}) is in each "
            f"rank's token-normalised loss, which is multiplied by the world size ({w}), so it is counted {w} "
            f"times; fix: count it once, model.router_aux_loss_coef = model.config.router_aux_loss_coef / {w} "
            "(the data-parallel ranks) after from_pretrained"
        )
    return out
