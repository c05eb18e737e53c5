"""What every renderer says about how speed was measured: why the recommendation is the one (one short
line), how the ranking orders (with the margin it applied), whether speed decided the recommendation (and
the cells re-timed for it, for how many rounds), why the configurations it ties with are ties (with the
figures, said once), and how loaded the host was. A figure from the re-timing (short interleaved probes)
never stands in one column with the grid's own: every configuration shows its grid probe's tokens/s, and
a re-timed one its re-timed figure beside it, in a column of its own."""

from __future__ import annotations

from ..analysis.outcomes import ProbeOutcome, RunAnalysis, speed, speed_buckets
from ..analysis.ranking import MARGIN, ROUNDS, SpeedComparison, undecided
from ..analysis.speed import grid_throughput
from ..record import Throughput
from ..thresholds import THRESHOLDS


def _rate(x: float | None) -> str:
    return f"{x:,.0f}" if x else "-"


def _pct(x: float) -> str:
    return f"{100 * x:g}%"


def spread_text(t: Throughput | None) -> str:
    """'1,100-1,300' (the interquartile range of per-step tokens/s), or '-'."""
    if t is None or t.steps < 2:
        return "-"
    return f"{_rate(t.q1)}-{_rate(t.q3)}"


def grid_rate(o: ProbeOutcome) -> float | None:
    """A probe's tokens/s per device as its grid probe measured it, re-timed or not: the one figure every
    configuration has, so the one they are shown side by side on."""
    t = grid_throughput(o.record)
    return t.median if t else None


def grid_text(o: ProbeOutcome) -> str:
    """'1,436': the grid probe's tokens/s per device."""
    return _rate(grid_rate(o))


def retimed_text(o: ProbeOutcome, a: RunAnalysis) -> str:
    """'3,586 (4 rounds)': a re-timed probe's tokens/s per device over its interleaved rounds; '-' for a
    probe that was not re-timed."""
    if not o.retimed or not a.timing:
        return "-"
    rounds = sum(1 for p in a.timing["probes"] if p["of"] == o.probe_id and p["status"] == "ok")
    return f"{_rate(o.tokens_per_s)} ({rounds} rounds)"


def retimed_legend(a: RunAnalysis) -> str | None:
    """What the two tokens/s columns hold, when the run re-timed any configuration."""
    if not a.timing or not any(o.retimed for o in a.outcomes):
        return None
    t = a.timing
    steps = a.meta.steps if a.meta.steps is not None else "?"
    return (
        f"Grid tokens/s: each configuration's own {steps}-step grid probe. Re-timed tokens/s: {t['steps']}-step "
        f"probes, back to back and interleaved, {t['rounds']} rounds; short probes measure lower, so a re-timed figure "
        "compares only with another re-timed one."
    )


def per_device_legend(a: RunAnalysis) -> str | None:
    """What a parallel probe's tokens/s means, when the run has one."""
    if not any(o.devices > 1 for o in a.outcomes):
        return None
    return (
        "Tokens/s are per device: a parallel probe's tokens/s over its world size (its ranks' tokens counted "
        "together), so that it ranks against one-process cells on the work of one device."
    )


def _bucket(a: RunAnalysis) -> str:
    """What the ranking's first buckets hold: the rollout mismatch in an RL run, else fidelity."""
    return "mismatch" if any(o.mismatch is not None for o in a.ranking) else "fidelity"


def order_sentence(a: RunAnalysis) -> str:
    """How the ranking orders, with the speed margin this run's grid figures were compared with."""
    quiet = _pct(THRESHOLDS.speed_margin)
    margin = (
        f"{_pct(a.speed_margin)} (the host was loaded while probes were timed; {quiet} on a quiet host)"
        if a.loaded
        else quiet
    )
    t = THRESHOLDS
    first = (
        "Ordered by the rollout's mismatch (mean |dlogp| between the rollout's and the training path's log-probs, "
        f"in buckets of {t.rollout_bucket_nats:g} nats of the importance-ratio bound it gives a "
        f"{t.rollout_reference_tokens}-token completion)"
        if any(o.mismatch is not None for o in a.ranking)
        else "Ordered by fidelity to the fp32/eager reference (mean relative loss error, in "
        f"{_pct(t.fidelity_bucket)} buckets)"
    )
    return (
        f"{first}, then configurations no nandoctor rule flags, then tokens/s "
        "per device, where one is faster beyond the noise: re-timed configurations when they are faster by more "
        f"than {quiet} at the one-sided 95% lower bound of their per-round ratio, the others when their median "
        f"is higher by more than {margin} and beyond both interquartile ranges (otherwise they count as equally "
        "fast), then a fixed tie order (compile off first; fp32 master weights, no GradScaler, no fp8 first; sdpa, "
        "then eager, then a pinned SDPA backend or kernel package; the default optimizer first), then peak memory."
    )


def load_line(a: RunAnalysis) -> str | None:
    """One sentence when the host was busy with other work while probes were timed, else None."""
    load = a.load
    if not a.loaded:
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
        + ". Tokens/s are noisier for it: one configuration counts as faster on its grid probe only by more than "
        f"{_pct(a.speed_margin)} (not {_pct(THRESHOLDS.speed_margin)}: "
        f"{_pct(THRESHOLDS.loaded_speed_margin)} at least, or as much as the other processes' share of the "
        "cores, which two equal probes timed with and without them can differ by) and beyond their measured "
        "spread; re-timed ones are compared round by round, where the rounds' own swing is the noise."
    )


def _retimed_how(a: RunAnalysis) -> str:
    """'re-timed back to back, interleaved, 2 rounds of 5 steps each (3 s)' (the figures are in the ranked
    table and the Timing section)."""
    t = a.timing
    least = t.get("min_rounds", t["rounds"])
    extra = list(dict.fromkeys(p["of"] for p in t["probes"] if (p.get("round") or 0) > least))
    more = (
        f" ({least} of every cell, then {t['rounds'] - least} more of {', '.join(extra)} while the gap between "
        "them was neither proven nor within the margin)"
        if extra
        else ""
    )
    return (
        f"re-timed back to back, interleaved, {t['rounds']} rounds{more} of {t['steps']} steps each "
        f"({t['wall_s']:.0f} s)"
    )


def _chosen_text(a: RunAnalysis) -> str:
    """Which of the configurations sharing the top bucket were re-timed, and why those, in words: "the
    fastest on their grid probes" only where it is so (a retime.json that chose otherwise says no why)."""
    added = a.timing.get("tie_order_added") or []
    cells = ", ".join(a.timing["cells"])
    timed = [grid_rate(o) or 0.0 for o in a.ranking if o.retimed and o.probe_id not in added]
    rest = [grid_rate(o) or 0.0 for top in speed_buckets(a) for o in top if not o.retimed]
    if not timed or min(timed) < max(rest, default=0.0):
        return f"{cells} were"
    if not added:
        return f"{cells}, the fastest on their grid probes, were"
    return (
        f"{cells} (the fastest on their grid probes, and {', '.join(added)}: first in the tie order, the winner "
        "if they all tie) were"
    )


def budget_text(t: dict) -> str:
    """'1.4 s (15% of the grid's 9.3 s of training)', or the budget alone in a retime.json before the share."""
    if t.get("grid_train_s") is None:
        return f"{t.get('budget_s', 0):.0f} s"
    return f"{t['budget_s']:.1f} s ({100 * t['budget_share']:g}% of the grid's {t['grid_train_s']:.1f} s of training)"


def interval_text(c: SpeedComparison) -> str:
    i = c.interval
    per_round = ", ".join(f"{r:.2f}x" for r in i.ratios)
    return (
        f"{i.ratio:.2f}x over {len(i.ratios)} interleaved rounds (per round {per_round}; 95% bounds "
        f"{i.low:.2f}x-{i.high:.2f}x)"
    )


def as_fast(c: SpeedComparison) -> bool:
    """Whether a tie is one of equal speeds, not one the measurements leave open: re-timing rounds whose
    upper bound is within the margin, or grid medians within the quiet margin."""
    if c.rule == ROUNDS:
        return c.interval.high <= 1 + c.margin
    return c.rule == MARGIN and c.gain <= 1 + THRESHOLDS.speed_margin


def tie_reason(lead: ProbeOutcome, other: ProbeOutcome, c: SpeedComparison, loaded: bool) -> str:
    """Why `lead` (the fastest of a speed class) does not count as faster than `other`, with the figures."""
    pair = f"{lead.probe_id} against {other.probe_id}"
    if c.rule == ROUNDS:
        if c.interval.high <= 1 + c.margin:
            return f"{pair}: {interval_text(c)}, within the {_pct(c.margin)} margin at the upper bound"
        return (
            f"{pair}: {interval_text(c)}: unresolved, neither faster by more than the {_pct(c.margin)} margin at "
            "the lower bound nor within it at the upper bound; the rounds cannot tell them apart, so the tie "
            "order decides"
        )
    figures = f"{_rate(c.a[0])} against {_rate(c.b[0])} tokens/s per device"
    if c.rule == MARGIN:
        where = " applied on a loaded host" if loaded and c.margin > THRESHOLDS.speed_margin else ""
        return f"{pair}: {figures} ({100 * (c.gain - 1):+.0f}%), within the {_pct(c.margin)} margin{where}"
    return (
        f"{pair}: {figures} ({100 * (c.gain - 1):+.0f}%), but their interquartile ranges overlap "
        f"({_rate(c.a[1])}-{_rate(c.a[2])} and {_rate(c.b[1])}-{_rate(c.b[2])})"
    )


def unresolved_line(a: RunAnalysis) -> str | None:
    """When the adaptive re-timing spent its budget with a gap neither proven nor within the margin: which
    (their per-round figures are in the tie line, said once)."""
    t = a.timing
    if not t or t.get("stopped") not in ("budget", "out of reach"):
        return None
    timed = [o for o in a.ranking if o.retimed]
    if len(timed) < 2:
        return None
    lead = max(timed, key=lambda o: speed(o)[0])
    open_ = [o for o in timed if o.probe_id in undecided(a.rounds, lead.probe_id)]
    if not open_:
        return None
    said = ", ".join(o.probe_id for o in open_)
    return (
        f"The re-timing could not tell {lead.probe_id} from {said} within its budget ({budget_text(t)}, "
        f"{t['rounds']} rounds): a gain counts only above {1 + THRESHOLDS.speed_margin:.2f}x at the 95% lower bound, "
        "so they count as equally fast here, unresolved. A quieter host, or more steps per probe, can tell."
    )


def sharing(a: RunAnalysis) -> int:
    """How many ranked configurations share the recommendations' fidelity buckets and flag status, where
    speed decides between two or more (analysis.outcomes.speed_buckets); 0 where it decides nothing."""
    return sum(len(top) for top in speed_buckets(a))


def _how_measured(a: RunAnalysis, rec: ProbeOutcome) -> str:
    """How the speeds that decided the recommendation were measured, in a few words."""
    t = a.timing or {}
    if rec.retimed:
        return f"re-timed back to back, {t['rounds']} interleaved rounds"
    if t.get("stopped") == "over budget":
        return "on their grid probes: re-timing was over budget"
    if (a.meta.recipe or {}).get("retime_rounds") == 0:
        return "on their grid probes: re-timing off"
    return "on their grid probes"


def why_line(a: RunAnalysis) -> str | None:
    """The one short line under a grid's recommendation: why it is the one. The figures that back it are
    in the details (speed_lines) and report.md's Timing section, not here. None with a hardware axis (each
    kind's recommendation has its own tie line)."""
    rec = a.recommended
    if rec is None or a.meta.kind != "grid" or a.hardware:
        return None
    others = len(a.ranking) - 1
    if not others:
        return "Why: the only stable configuration."
    shared = sharing(a)
    if not shared:
        return (
            f"Why: the {others} other stable configuration{'s are' if others > 1 else ' is'} further from the "
            "fp32/eager reference or flagged by a nandoctor rule; speed did not decide."
        )
    ties, how = a.speed_ties, _how_measured(a, rec)
    if not ties:
        return (
            f"Why: {shared} configurations share the top {_bucket(a)} bucket; it is the fastest beyond the noise "
            f"({how})."
        )
    words = (
        "as fast as"
        if all(as_fast(c) for *_, c in a.tie_reasons_on(rec.record.cell.hardware))
        else "not told apart from"
    )
    names = [o.probe_id for o in ties]
    who = ", ".join(names) if len(names) <= 2 else f"{names[0]}, {names[1]} and {len(names) - 2} more"
    return (
        f"Why: {shared} configurations share the top {_bucket(a)} bucket; it is {words} {who} ({how}) "
        "and first in the fixed tie order."
    )


def load_short(a: RunAnalysis) -> str | None:
    """load_line in one short sentence, for the terminal."""
    load = a.load
    if not a.loaded:
        return None
    busy = (
        f": other processes kept up to {load['other_cpu_cores_max']:.1f} of {load['cpu_count']} CPU cores busy"
        if load.get("other_cpu_cores_max") is not None
        else ""
    )
    return f"The host was loaded while probes were timed{busy}; report.md says how that widened the speed margin."


def speed_lines(a: RunAnalysis) -> list[str]:
    """Beside the recommendation: whether speed decided it, the cells re-timed for that, the speed ties
    with why each is a tie (per kind of hardware: speeds on two kinds are never compared), what the marks
    on the figures mean, and the load."""
    rec = a.recommended
    lines = []
    if rec is None or a.meta.kind != "grid":
        return lines
    if a.timing and a.timing.get("stopped") == "over budget":
        t = a.timing
        lines.append(
            f"{sharing(a)} configurations share the top {_bucket(a)} bucket, so speed decides "
            f"between them; {', '.join(t['cells'])} were not re-timed back to back: {t['min_rounds']} interleaved "
            f"rounds would take about {t['estimate_s']:.1f} s, more than the re-timing's budget of {budget_text(t)}. "
            "Each speed is its own grid probe's."
        )
    elif a.timing:
        timed, shared = len(a.timing["cells"]), sharing(a)
        how = _retimed_how(a)
        if shared > timed:  # the rest rank after the re-timed ones (ranking.rank), on their grid probes
            rest = shared - timed
            after = (
                "the other one ranks after them, on its grid probe"
                if rest == 1
                else f"the other {rest} rank after them, on their grid probes"
            )
            lines.append(
                f"{shared} configurations share the top {_bucket(a)} bucket, so speed decides between them: "
                f"{_chosen_text(a)} {how}; {after}."
            )
        else:
            lines.append(
                f"{timed} configurations share the top {_bucket(a)} bucket, so speed decides between them: "
                f"they were {how}."
            )
        unresolved = unresolved_line(a)
        if unresolved:
            lines.append(unresolved)
    elif (a.meta.recipe or {}).get("retime_rounds") == 0:
        if sharing(a):
            lines.append(
                f"{sharing(a)} configurations share the top {_bucket(a)} bucket, so speed decides between them; "
                "they were not re-timed back to back (retime_rounds=0): each speed is its own grid probe's, "
                "timed under whatever load there was then."
            )
    for hardware in a.hardware or [""]:
        ties = a.speed_ties_on(hardware)
        if ties:
            why = a.tie_reasons_on(hardware)
            reasons = "; ".join(tie_reason(*r, a.loaded) for r in why)
            if all(as_fast(c) for *_, c in why):
                lead, noise = "as fast as", "within their measured noise"
            else:
                lead, noise = "not told apart from", "by what was measured"
            lead = f"On {hardware}, {lead}" if hardware else lead[0].upper() + lead[1:]
            lines.append(
                f"{lead} {', '.join(o.probe_id for o in ties)} {noise}: "
                f"{a.recommended_on(hardware).probe_id} comes first in the fixed tie order "
                f"(the plainest, most robust configuration). Why each is a tie: {reasons}."
            )
    lines += [line for line in (retimed_legend(a), per_device_legend(a), load_line(a)) if line]
    return lines


def retime_intro(a: RunAnalysis) -> str:
    """The Timing section's first sentence: how the re-timing ran and how its figures are used."""
    t = a.timing
    stopped = {
        "decided": "every gap to the fastest was proven at its lower bound or within the margin on average",
        "settled": "more rounds could no longer change the recommended configuration (the gaps still open are "
        "between configurations it does not hinge on)",
        "budget": f"its budget of {budget_text(t)} was spent",
        "out of reach": "the rounds left in its budget could not have proven the gaps still open at the swing its "
        "rounds showed",
    }.get(t.get("stopped"))
    return (
        "Speed decided the recommendation, so the configurations of equal fidelity were re-timed back to back, "
        f"interleaved ({t['rounds']} rounds of {t['steps']} steps, run order: {', '.join(t['order'])}; "
        f"{t['wall_s']:.0f} s" + (f"; stopped when {stopped}" if stopped else "") + "). Their figures are the "
        "rounds' steady steps pooled, and two of them are compared round by round (the ratio of their tokens/s in "
        "each round, and its one-sided 95% lower bound)."
    )


def retime_rows(a: RunAnalysis) -> list[dict]:
    """One row per re-timed cell: the grid probe's tokens/s and the interleaved rounds', per device."""
    if not a.timing:
        return []
    by_id = {o.probe_id: o for o in a.outcomes}
    rows = []
    for cell in dict.fromkeys(p["of"] for p in a.timing["probes"]):
        o = by_id.get(cell)
        if o is None:
            continue
        grid = grid_throughput(o.record)
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
    of the recommendation (and of each kind's, with a hardware axis) with why each is a tie, and the host
    load."""
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
        "tie_reasons": [
            {"faster": lead.probe_id, "than": o.probe_id, "rule": c.rule, "gain": c.gain, "margin": c.margin}
            | ({"ratio_low": c.interval.low, "ratios": list(c.interval.ratios)} if c.interval else {})
            for h in a.hardware or [""]
            for lead, o, c in a.tie_reasons_on(h)
        ],
        "host_load": a.load,
        "loaded": a.loaded,
    }
