"""The parallel probes' section: per W-rank probe, the master weights' and the reduction's real
dtypes, the step-0 gradient agreement with the one-process gradient of the same global batch, the loss
against that one-process probe (its exact reference) and against fp32, and each rank's peak memory.
Rows shared by every renderer."""

from __future__ import annotations

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from .formatting import fmt_bytes, fmt_fidelity, label


def _dtypes(values) -> str:
    return ",".join(values or []) or "-"


def _number(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def parallel_outcomes(a: RunAnalysis) -> list[ProbeOutcome]:
    return [o for o in a.outcomes if o.record.cell.parallel != "none" and o.record.status != "unsupported"]


def parallel_facts(o: ProbeOutcome) -> dict:
    """One parallel probe's facts as data (summary.json)."""
    facts = o.record.parallel or {}
    return {**facts, "exact_fidelity": o.exact_fidelity, "failed_rank": o.record.failed_rank, "ranks": o.record.ranks}


def parallel_rows(a: RunAnalysis) -> list[dict]:
    rows = []
    for o in parallel_outcomes(a):
        facts = o.record.parallel or {}
        got = facts.get("grad_agreement") or {}
        peaks = [fmt_bytes(r.get("peak_memory_bytes")) for r in o.record.ranks or []]
        failed = o.record.failed_rank
        rows.append(
            {
                "config": label(o),
                "ranks": facts.get("world_size", len(o.record.ranks or []) or "-"),
                "verdict": o.verdict.name + (f" (rank {failed})" if failed is not None else ""),
                "master weights": _dtypes(facts.get("master_dtype")),
                "reduce dtype": _dtypes(facts.get("reduce_dtype")),
                "step-0 grad rel. error": _number(got.get("max_rel_error")),
                "grad norm ratio": _number(got.get("norm_ratio"), 4),
                "loss vs 1-process": fmt_fidelity(o.exact_fidelity),
                "loss vs fp32": fmt_fidelity(o.fidelity),
                "peak memory per rank": " / ".join(peaks) or "-",
            }
        )
    return rows


INTRO = (
    "Each parallel probe trains the same global batch as the one-process probe of its cell, split over its "
    "ranks: that probe is its exact reference (`loss vs 1-process`, mean relative loss error). The step-0 "
    "gradient after the reduction is compared with the one-process gradient of the first batch (largest "
    "relative error of a parameter's gradient, and the ratio of the norms: 1.0 when the reduction averages; "
    "each tensor group's own error against 10x its fp32 floor in summary.json)."
)


def parallel_markdown(a: RunAnalysis, table) -> list[str]:
    rows = parallel_rows(a)
    return ["## Parallel probes", "", INTRO, "", table(rows), ""] if rows else []
