"""summary.json: the analysis as data, for scripts that gate on it. Strict JSON: a non-finite float
(a diverged loss, an overflowed activation) is written as the string float() reads back: "NaN",
"Infinity" or "-Infinity"."""

from __future__ import annotations

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..analysis.verdicts import starved_groups
from ..jsonio import json_safe
from .code import grid_recommendations
from .failures import failure_classes
from .forensics import forensics_summary
from .moe import moe_facts
from .parallel import parallel_facts
from .savings import savings_summary
from .timing import timing_summary


def _probe(o: ProbeOutcome) -> dict:
    return {
        "probe_id": o.probe_id,
        "cell": o.record.cell.to_dict(),
        "overrides": o.record.overrides,
        "hardware": o.record.cell.hardware or None,
        "node": o.record.node,
        "gpu": o.record.gpu,
        "verdict": o.verdict.name,
        "reason": o.verdict.reason,
        "step": o.verdict.step,
        "fidelity": o.fidelity,
        "reference": o.reference,
        "tokens_per_s": o.tokens_per_s,
        "world_size": o.devices,
        "tokens_per_s_all_devices": o.tokens_per_s_all_devices,
        "throughput": o.throughput.to_dict() if o.throughput else None,
        "retimed": o.retimed,
        "host_load": o.record.host_load,
        "peak_memory_bytes": o.peak_memory_bytes,
        "optimizer_state_bytes": o.record.optimizer_state_bytes,
        "steps_run": len(o.record.steps),
        "forensics": forensics_summary(o),
        "parallel": parallel_facts(o) if o.record.cell.parallel != "none" else None,
        "setup_checks": o.record.setup_checks,
        "moe": moe_facts(o),
        "rollout_mismatch": o.record.rollout_mismatch,  # objective=grpo: the figures as the probe measured them
        "groups_without_gradient": starved_groups(o.record.steps),
        "trained_rows": [
            {"kind": b.get("kind"), "rows": b.get("rows")} for b in (o.record.data or {}).get("batches") or []
        ]
        or None,
    }


def _recommendations(a: RunAnalysis) -> list[dict]:
    """The recommendation as code and data (recommend.recommendation): a grid's per kind of hardware, a
    bisection's from bisect.json."""
    if a.meta.kind == "bisect":
        rec = (a.bisection or {}).get("recommendation")
        return [{"hardware": None, **rec}] if rec else []
    return [{"hardware": h or None, **rec} for h, rec in grid_recommendations(a)]


def render_summary(a: RunAnalysis) -> dict:
    return json_safe(
        {
            "run_id": a.meta.run_id,
            "kind": a.meta.kind,
            "recipe": a.meta.recipe["name"],
            "model": a.meta.model_plan,
            "planned": a.expected,
            "finished": len(a.outcomes),
            # drift: whether every probe's drift was judged against a stable fp32 probe, and the recipe
            # variants whose reference was another fp32 probe (stands_in) or none (reference null)
            "drift_judged": not a.unjudged,
            "references": [
                {
                    "hardware": r.hardware or None,
                    "reference": r.probe_id,
                    "stands_in": r.stands_in,
                    "why": r.why,
                    "sentence": r.sentence(),
                }
                for r in a.references
            ],
            "recommended": a.recommended.probe_id if a.recommended else None,
            "fastest_stable": a.fastest.probe_id if a.fastest else None,
            "recommended_by_hardware": {
                h: (o.probe_id if o else None) for h, o in ((h, a.recommended_on(h)) for h in a.hardware)
            },
            "fastest_by_hardware": {
                h: (o.probe_id if o else None) for h, o in ((h, a.fastest_on(h)) for h in a.hardware)
            },
            "ranking": [o.probe_id for o in a.ranking],
            "recommendation": _recommendations(a),
            "timing": timing_summary(a),
            "exit_code": a.exit_code,
            "failure_classes": failure_classes(a),
            "probes": [_probe(o) for o in a.outcomes],
            "env": a.meta.env.to_dict() if a.meta.env is not None else None,
            "doctor": {**(a.meta.doctor or {}), "findings": a.findings},
            "savings": savings_summary(a),
        }
    )
