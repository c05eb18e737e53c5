"""The probe's own setup, checked at step 0 (record.setup_checks, the data lint's and the callbacks'
figures alike): whether packed segments leak and accumulated micro-batches are misweighted, decided once
(setup_judged), and the misconfigured verdict."""

from __future__ import annotations

from ...record import ProbeRecord
from ...thresholds import THRESHOLDS, Thresholds
from .figures import _fmt, _num, _own
from .table import MISCONFIGURED, Verdict


def setup_failures(checks: dict | None, t: Thresholds = THRESHOLDS) -> list[str]:
    """The step-0 setup checks (record.setup_checks, or the live lint's figures) that failed, each as one
    clause naming the check and its figure; [] when none failed or none was measured."""
    c = checks or {}
    judged = setup_judged(c, t)
    out = []
    if judged["packing_leaks"]:
        floor = c.get("packing_floor")
        out.append(
            f"packing: one packed forward of {c.get('packing_segments', '?')} segments differs from each segment "
            f"run alone by {_fmt(c['packing_max_logit_diff'])} max logit ({c.get('packing_cause') or 'as collated'}), "
            f"beyond {t.packing_bound(floor):.2g}"
            + (f" (the segments alone move by {_fmt(_num(floor))} against fp32)" if floor is not None else "")
            + (
                f"; in fp32 the packed forward differs by {_fmt(_num(c['packing_fp32_diff']))}, beyond "
                f"{t.packing_leak_abs:.2g}"
                if t.packing_leaks(None, None, c.get("packing_fp32_diff"))
                else ""
            )
            + _leaking_layer_clause(t.leaking_layer(c.get("packing_layers"), c.get("packing_max_logit_diff")))
        )
    if judged["accumulation_misweighted"]:
        out.append(_accumulation_failure(c, t))
    return out


def groups_beyond_floor(groups: dict, t: Thresholds = THRESHOLDS) -> list[str]:
    """The tensor groups of {group: {"error", "floor"}} whose own gradient differs from its reference
    beyond accumulation_bound of its own fp32 floor, in the order measured: the one rule of the
    accumulation check (accumulation_groups) and the parallel-equivalence check (grad_agreement's groups)."""
    return [g for g, f in groups.items() if t.accumulation_misweighted(f.get("error"), f.get("floor"))]


def group_clauses(groups: dict, bad: list[str], t: Thresholds = THRESHOLDS) -> list[str]:
    """'the router's own gradient by 0.244 (beyond 0.001)' for each of the groups `bad`, the largest first."""
    order = sorted(bad, key=lambda g: -groups[g]["error"])  # finite: a group beyond its bound has a figure
    return [
        f"the {_own(g)} gradient by {_fmt(_num(groups[g].get('error')))} "
        f"(beyond {t.accumulation_bound(groups[g].get('floor')):.2g})"
        for g in order
    ]


def misweighted_groups(checks: dict, t: Thresholds = THRESHOLDS) -> list[str]:
    """The tensor groups (measure/accumulation.py accumulation_groups: router, experts, embeddings,
    adapter, ...) whose own accumulated gradient differs from the full batch's beyond the bound of their
    own fp32 floor, in the order measured."""
    return groups_beyond_floor(checks.get("accumulation_groups") or {}, t)


def accumulation_cause(checks: dict, t: Thresholds = THRESHOLDS) -> str | None:
    """Why a step's accumulated gradient is misweighted: "balancing_loss" where the router's is and the
    model adds its load-balancing loss to every micro-batch's loss under token normalisation (the
    Trainer divides none of them by the steps: it is counted once per micro-batch), "normalisation"
    for any other misweighted step; None where none is."""
    bad = misweighted_groups(checks, t)
    if "router" in bad and checks.get("accumulation_balancing_loss") and checks.get("loss_normalization") == "tokens":
        return "balancing_loss"
    whole = t.accumulation_misweighted(checks.get("accumulation_error"), checks.get("accumulation_floor"))
    return "normalisation" if bad or whole else None


def _accumulation_failure(c: dict, t: Thresholds) -> str:
    """The failed accumulation check in one clause: the whole gradient's figure, each misweighted tensor
    group's, and the cause with its fix where it is a balancing loss counted per micro-batch."""
    norm = c.get("loss_normalization") or "?"
    bound = t.accumulation_bound(c.get("accumulation_floor"))
    whole = t.accumulation_misweighted(c.get("accumulation_error"), c.get("accumulation_floor"))
    out = (
        f"accumulation: step 0's gradient over {c.get('accumulation_steps', '?')} micro-batches "
        f"({c.get('accumulation_targets', '?')} loss terms each), loss_normalization={norm}, differs from "
        f"the full batch's by {_fmt(_num(c.get('accumulation_error')))} (relative; cosine "
        f"{_fmt(_num(c.get('accumulation_cosine')))}, norm ratio {_fmt(_num(c.get('accumulation_norm_ratio')))}), "
        + (f"beyond {bound:.2g}" if whole else f"within {bound:.2g} as a whole")
    )
    said = group_clauses(c.get("accumulation_groups") or {}, misweighted_groups(c, t), t)
    if said:
        out += f"{'; so does' if whole else ', but'} {', '.join(said)}"
    if accumulation_cause(c, t) == "balancing_loss":
        steps = c.get("accumulation_steps", "k")
        out += (
            f": the load-balancing loss (router_aux_loss_coef {_fmt(_num(c.get('accumulation_balancing_loss')))}) is "
            f"added to each of the {steps} micro-batches' token-normalised losses, counted {steps} times a step; "
            f"fix: count it once a step, model.router_aux_loss_coef = model.config.router_aux_loss_coef / {steps} "
            "(gradient_accumulation_steps) after from_pretrained"
        )
    return out


def _leaking_layer_clause(leak: dict | None) -> str:
    """'; the segments first mix at layer N (kind) ...' for the first layer of a packed forward that mixes
    its segments (Thresholds.leaking_layer), '' when none was found."""
    if not leak:
        return ""
    return (
        f"; the segments first mix at layer {leak['layer']} ({leak['kind']}): its output past the first segment "
        f"differs from the segments run alone by {_fmt(leak['later_segments'])}, on the first segment by "
        f"{_fmt(leak['first_segment'])}"
    )


def setup_judged(checks: dict | None, t: Thresholds = THRESHOLDS) -> dict:
    """Whether each measured setup check failed: packing_leaks, accumulation_misweighted (None where the
    check was not measured), and the bound each applied (packing_bound, accumulation_bound). The one
    rule each, for the probes, the data lint and the callbacks."""
    c = checks or {}
    return {
        "packing_leaks": t.packing_leaks(
            c.get("packing_max_logit_diff"), c.get("packing_floor"), c.get("packing_fp32_diff")
        )
        if "packing_max_logit_diff" in c
        else None,
        "accumulation_misweighted": (
            t.accumulation_misweighted(c.get("accumulation_error"), c.get("accumulation_floor"))
            or bool(misweighted_groups(c, t))
        )
        if "accumulation_error" in c
        else None,
        "accumulation_cause": accumulation_cause(c, t),
        # the bounds those decisions applied, for the reports to show beside the figures
        "packing_bound": t.packing_bound(c.get("packing_floor")) if "packing_max_logit_diff" in c else None,
        "accumulation_bound": t.accumulation_bound(c.get("accumulation_floor")) if "accumulation_error" in c else None,
    }


def setup_passed(checks: dict, t: Thresholds = THRESHOLDS) -> str:
    """The figures of setup checks that passed, in a few words: what was measured and its bound."""
    said = []
    if "packing_max_logit_diff" in checks:
        said.append(
            f"packed segments isolated (max logit difference {_fmt(_num(checks['packing_max_logit_diff']))} "
            f"to each segment alone, bound {t.packing_bound(checks.get('packing_floor')):.2g})"
        )
    if "accumulation_error" in checks:
        said.append(
            "accumulated gradient is the full batch's (relative difference "
            f"{_fmt(_num(checks['accumulation_error']))}, "
            f"bound {t.accumulation_bound(checks.get('accumulation_floor')):.2g}; cosine "
            f"{_fmt(_num(checks.get('accumulation_cosine')))})" + _groups_passed(checks)
        )
    return "; ".join(said) or "nothing measured"


def _groups_passed(checks: dict) -> str:
    """', and each tensor group's own (router, experts, ...)' where the check compared them one by one."""
    groups = list(checks.get("accumulation_groups") or {})
    return f", and each tensor group's own ({', '.join(groups)})" if groups else ""


def setup_verdict(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> Verdict | None:
    """`misconfigured` when a step-0 setup check of the probe failed (setup_failures), else None."""
    failed = setup_failures(record.setup_checks, t)
    return Verdict(MISCONFIGURED, "; ".join(failed), 0) if failed else None
