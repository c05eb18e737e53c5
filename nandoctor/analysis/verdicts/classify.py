"""The probe's verdict: the rules in order (classify), and the facts the knowledge rules read from what they
decided (judged_facts)."""

from __future__ import annotations

from ...record import ProbeRecord, Step
from ...thresholds import THRESHOLDS, Thresholds
from .curve import _adapter, _untargeted, never_stepped, numeric_verdict, stall_verdict, starved_groups, untargeted_rows
from .harness import harness_verdict
from .moe import collapse_unjudged, collapsed_layers, route_flips, router_verdict, routing_cause
from .parallel import parallel_verdict
from .rl import objective, rollout_verdict
from .setup import setup_judged, setup_verdict
from .table import DIVERGED, NO_TARGET, NONFINITE, STABLE, ZERO_LOSS, Verdict


def judged_facts(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> dict:
    """Facts for the knowledge rules from what the verdicts judge on the probe's own setup: whether its
    packing leaked, its accumulation misweighted the micro-batches, how many trainable groups got no
    gradient, and how many steps trained on a batch with no target (knowledge/rules.yaml: the failure
    classes' known fix)."""
    c, judged = record.setup_checks or {}, setup_judged(record.setup_checks, t)
    # the kind of the first layer that mixes segments packed by position_ids alone (a 2-D mask beside them
    # is its own cause, with its own rule)
    alone = str(c.get("packing_cause", "")).startswith("position_ids alone")
    leak = (
        t.leaking_layer(c.get("packing_layers"), c.get("packing_max_logit_diff")) if judged["packing_leaks"] else None
    )
    return {
        **judged,
        "groups_without_gradient": len(starved_groups(record.steps)),
        # steps whose batch had no target and whose loss was 0/0 (or 0.0): the no-target verdict
        "all_masked_batches": sum(_untargeted(s) for s in record.steps) or None,
        "experts_collapsed": bool(collapsed_layers(record.moe, t)) if record.moe else None,
        "packing_layer_leaks": leak["kind"] if leak and alone else None,
    }


def classify(
    record: ProbeRecord,
    reference: list[Step] | None = None,
    t: Thresholds = THRESHOLDS,
    against: str = "",
    routes: list | None = None,
) -> Verdict:
    """The probe's verdict: what stopped it, its ranks' agreement, its setup, then its curve against the
    reference curve (`against` names the reference when it stands in for fp32/eager). A mixture of experts
    whose curve is finite and not diverged is judged on its routing (router_verdict), and a drift is traced
    to it when step 0's choices differ from the reference's (`routes`: its record.moe step0_choices;
    routing_cause)."""
    first = harness_verdict(record) or parallel_verdict(record, t) or setup_verdict(record, t)
    if first:
        return first
    if objective(record) != "sft":  # a GRPO loss is no fidelity figure: the rollout mismatch is judged instead
        reference = None
    v = numeric_verdict(
        record.steps,
        reference,
        t,
        trainable=record.trainable_groups,
        adapter=_adapter(record),
        against=against,
        objective=objective(record),
    )
    if v.name == NO_TARGET:
        return Verdict(v.name, v.reason + untargeted_rows(record, v.step), v.step)
    if v.name in (NONFINITE, ZERO_LOSS):
        return v
    stuck = never_stepped(record.steps, t)
    if stuck or v.name == DIVERGED:
        return stuck or v
    v = stall_verdict(record, v, t)
    flips = route_flips((record.moe or {}).get("step0_choices"), routes)
    v = router_verdict(record, t) or routing_cause(v, flips, t)
    if v.name == STABLE:
        v = rollout_verdict(record, t) or v
    unjudged = collapse_unjudged(record.moe, t) if v.name == STABLE else None
    return Verdict(v.name, f"{v.reason}; {unjudged}", v.step) if unjudged else v
