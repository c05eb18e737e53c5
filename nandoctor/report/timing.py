"""What every renderer says about how speed was measured: how the ranking orders, whether speed
decided the recommendation (and the cells re-timed for it), and how loaded the host was."""

from __future__ import annotations

from ..analysis.run import ProbeOutcome, RunAnalysis, speed_decides
from ..config import THRESHOLDS
from ..record import Throughput


def _rate(x: float | None) -> str:
    return f"{x:,.0f}" if x else "-"


def spread_text(t: Throughput | None) -> str:
    """'1,100-1,300' (the interquartile range of per-step tokens/s), or '-'."""
    if t is None or t.steps < 2:
        return "-"
    return f"{_rate(t.q1)}-{_rate(t.q3)}"


def order_sentence() -> str:
    return (
        "Ordered by fidelity to the fp32/eager reference (mean relative loss error, in "
        f"{100 * THRESHOLDS.fidelity_bucket:g}% buckets), then configurations no nandoctor rule flags, then tokens/s "
        f"where one is faster by more than {100 * THRESHOLDS.speed_margin:g}% and beyond both interquartile ranges "
        "(otherwise they count as equally fast), then a fixed tie order (compile off first; fp32 master weights, "
        "no GradScaler, no fp8 first; sdpa, then eager, then a pinned SDPA backend or kernel package; "
        "the default optimizer first), then peak memory."
    )


def timing_note(o: ProbeOutcome, a: RunAnalysis) -> str:
    """How a ranked probe's tokens/s was measured, for its row."""
    if o.retimed:
        return f"re-timed, {a.timing['rounds']} interleaved rounds"
    t = o.throughput
    return f"{t.steps} steady steps" if t else "-"


def load_line(a: RunAnalysis) -> str | None:
    """One sentence when the host was busy with other work while probes were timed, else None."""
    load = a.load
    if not load or not load["significant"]:
        return None
    parts = []
    if load["other_cpu_cores_median"] is not None:
        parts.append(
            f"other processes kept {load['other_cpu_cores_median']:.1f} of {load['cpu_count']} CPU cores busy "
            f"(median over {load['probes']} timed probes, up to {load['other_cpu_cores_max']:.1f})"
        )
    if load["loadavg_max"] is not None:
        parts.append(f"load average up to {load['loadavg_max']:.1f}")
    if load["gpu_other_processes_max"]:
        parts.append(f"up to {load['gpu_other_processes_max']} other process(es) on a GPU")
    return (
        "The host was loaded while probes were timed: "
        + "; ".join(parts)
        + f". Tokens/s are noisier for it: one configuration counts as faster only by more than "
        f"{100 * THRESHOLDS.loaded_speed_margin:g}% (not {100 * THRESHOLDS.speed_margin:g}%) "
        "and beyond their measured spread."
    )


def speed_lines(a: RunAnalysis) -> list[str]:
    """Beside the recommendation: whether speed decided it, the cells re-timed for that, the speed ties
    (per kind of hardware: speeds on two kinds are never compared), and the load."""
    rec = a.recommended
    lines = []
    if rec is None or a.meta.get("kind") != "grid":
        return lines
    if a.timing:
        shown = "; ".join(
            f"{o.probe_id} {_rate(o.tokens_per_s)} tokens/s (IQR {spread_text(o.throughput)})"
            for o in a.ranking
            if o.retimed
        )
        timed, sharing = len(a.timing["cells"]), len(speed_decides(a, len(a.ranking)))
        how = (
            f"re-timed back to back, interleaved, {a.timing['rounds']} rounds of {a.timing['steps']} steps each "
            f"({a.timing['wall_s']:.0f} s): {shown}"
        )
        if sharing > timed:  # more than RETIME_MOST_CELLS: the rest rank after the re-timed ones (ranking.rank)
            rest = sharing - timed
            after = (
                "the other one ranks after them, on its grid probe"
                if rest == 1
                else f"the other {rest} rank after them, on their grid probes"
            )
            lines.append(
                f"{sharing} configurations share the top fidelity bucket, so speed decides between them: "
                f"the first {timed} of the grid's ranking were {how}; {after}."
            )
        else:
            lines.append(
                f"{timed} configurations share the top fidelity bucket, so speed decides between them: they were {how}."
            )
    elif (a.meta.get("recipe") or {}).get("retime_rounds") == 0:
        leaders = speed_decides(a, len(a.ranking))
        if leaders:
            lines.append(
                f"{len(leaders)} configurations share the top fidelity bucket, so speed decides between them; "
                "they were not re-timed back to back (retime_rounds=0): each speed is its own grid probe's, "
                "timed under whatever load there was then."
            )
    for hardware in a.hardware or [""]:
        ties = a.speed_ties_on(hardware)
        if ties:
            lead = f"On {hardware}, as fast as" if hardware else "As fast as"
            lines.append(
                f"{lead} {', '.join(o.probe_id for o in ties)} within their measured spread: "
                f"{a.recommended_on(hardware).probe_id} comes first in the fixed tie order "
                "(the plainest, most robust configuration)."
            )
    load = load_line(a)
    if load:
        lines.append(load)
    return lines


def retime_rows(a: RunAnalysis) -> list[dict]:
    """One row per re-timed cell: the grid probe's tokens/s and the interleaved rounds'."""
    if not a.timing:
        return []
    by_id = {o.probe_id: o for o in a.outcomes}
    rows = []
    for cell in a.timing["cells"]:
        o = by_id.get(cell)
        if o is None:
            continue
        grid = o.record.throughput or Throughput.of(o.record.steps)
        rounds = [p for p in a.timing["probes"] if p["of"] == cell]
        rows.append(
            {
                "config": cell,
                "grid probe tokens/s": _rate(grid.median if grid else None),
                "grid IQR": spread_text(grid),
                "re-timed tokens/s": _rate(o.tokens_per_s) if o.retimed else "-",
                "re-timed IQR": spread_text(o.throughput) if o.retimed else "-",
                "rounds ok": f"{sum(p['status'] == 'ok' for p in rounds)}/{len(rounds)}",
            }
        )
    return rows


def timing_summary(a: RunAnalysis) -> dict:
    """summary.json's `timing`: the re-timing (retime.json without the per-step curves), the speed ties
    of the recommendation (and of each kind's, with a hardware axis) and the host load."""
    retime = None
    if a.timing:
        retime = {
            **{k: v for k, v in a.timing.items() if k != "probes"},
            "probes": [{k: v for k, v in p.items() if k != "steps"} for p in a.timing["probes"]],
        }
    return {
        "retimed": retime,
        "speed_ties": [o.probe_id for o in a.speed_ties],
        "speed_ties_by_hardware": {h: [o.probe_id for o in a.speed_ties_on(h)] for h in a.hardware},
        "host_load": a.load,
        "loaded": bool(a.load and a.load["significant"]),
    }
