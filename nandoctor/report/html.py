"""report.html: one self-contained file (inline CSS and SVG, no scripts, no network) with the same
content as report.md plus the loss and grad-norm curve of every probe. The first screen answers
"what should I train with?" (the recommendation and the verdict matrix) and "why did the others
fail?" (one line per failure class); the tables and per-probe charts follow.

Jinja2 renders the page: autoescaping keeps exception text from probes from breaking the markup."""

from __future__ import annotations

import math

from jinja2 import Environment, PackageLoader, select_autoescape

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..analysis.verdicts import UNSUPPORTED
from ..device import DeviceFacts
from . import bisection, code, data, doctor, failures, forensics, formatting, matrix, moe, parallel, rl, savings, timing
from .charts import PALETTE, as_float, coincident_groups, line_chart

_env = Environment(loader=PackageLoader("nandoctor.report", "templates"), autoescape=select_autoescape(["html", "j2"]))
OVERVIEW_CURVES = len(PALETTE)


def _finite_points(pairs) -> int:
    return sum(1 for _, y in pairs if y is not None and math.isfinite(as_float(y)))


def probe_charts(o: ProbeOutcome) -> tuple[str, str]:
    """Loss and grad-norm against the fp32 reference; an empty string for a curve with fewer than
    two finite points (a probe that failed at step 1 has nothing to draw)."""
    steps = o.record.steps
    mark = o.verdict.step if o.verdict.failed else None
    ref = o.reference_steps or []
    charts = []
    for key, title, log_y, name in (
        ("loss", "loss", False, formatting.label(o)),
        ("grad_norm", "grad-norm", True, "grad-norm (before clipping)"),
    ):
        mine = [(s.step, getattr(s, key)) for s in steps]
        if _finite_points(mine) < 2:
            charts.append("")
            continue
        series = [{"label": name, "points": mine}]
        if ref:
            series.append(
                {
                    "label": "fp32 reference",
                    "points": [(s.step, getattr(s, key)) for s in ref],
                    "dashed": True,
                    "color": "#888",
                }
            )
        charts.append(line_chart(series, title, log_y=log_y, mark_step=mark, mark_label=o.verdict.name))
    return charts[0], charts[1]


def overview_chart(a: RunAnalysis) -> str:
    """The loss of every probe that ran, stable ones in rank order and failing ones up to their
    failing step; curves a reader could not tell apart are drawn once, labelled as a group."""
    ran = [o for o in a.outcomes if o.verdict.name != UNSUPPORTED]
    stable_ids = {id(o) for o in a.ranking}
    ordered = a.ranking + [o for o in ran if id(o) not in stable_ids]
    series = []
    for o in ordered:
        stop = o.verdict.step if o.verdict.failed else None
        points = [(s.step, s.loss) for s in o.record.steps if stop is None or s.step < stop]
        if stop is not None:
            points.append((stop, math.nan))  # keeps curves failing at different steps apart
        if _finite_points(points):
            series.append({"outcome": o, "points": points, "fail_step": stop})
    if not series:
        return ""
    ys = [as_float(y) for s in series for _, y in s["points"] if math.isfinite(as_float(y))]
    tolerance = (max(ys) / 2 - min(ys) / 2) / 100 or 1e-12  # under a pixel of a 260-px chart (halves: no overflow)
    by_verdict: dict[str, list[dict]] = {}
    for s in series:
        by_verdict.setdefault(s["outcome"].verdict.name, []).append(s)
    groups = [[same[i] for i in g] for same in by_verdict.values() for g in coincident_groups(same, tolerance)]
    groups.sort(key=lambda g: min(ordered.index(s["outcome"]) for s in g))
    cells = [o.record.cell for o in ran]
    drawn = []
    for g in groups[:OVERVIEW_CURVES]:
        o = g[0]["outcome"]
        name = formatting.cells_text([s["outcome"].record.cell for s in g], cells)
        if any(s["outcome"].record.overrides for s in g):
            name = ", ".join(formatting.label(s["outcome"]) for s in g)
        if o.verdict.failed:
            name += f": {o.verdict.name}" + (f" at step {o.verdict.step}" if o.verdict.step is not None else "")
        elif o is a.recommended:
            name += " (recommended)"
        drawn.append(
            {
                "label": name,
                "points": g[0]["points"],
                "fail_step": g[0]["fail_step"],
                "fail_label": name,
                "dashed": o.verdict.failed,
            }
        )
    hidden = len(groups) - len(drawn)
    title = "loss per step, every probe that ran" + (f" ({hidden} more curves not drawn)" if hidden else "")
    return line_chart(drawn, title, width=1060, height=260)


def probe_card(o: ProbeOutcome) -> dict:
    loss_svg, gn_svg = probe_charts(o)
    rate = formatting.shown_rate(o)
    facts = (
        ([f"fidelity {formatting.fmt_fidelity(o.fidelity)}"] if o.fidelity is not None else [])
        + ([f"rollout mean |dlogp| {formatting.fmt_mismatch(o.mismatch)}"] if o.mismatch is not None else [])
        + ([f"{formatting.fmt_rate(rate)} tokens/s"] if rate else [])
        + [f"peak {formatting.fmt_bytes(o.peak_memory_bytes)}"]
    )
    no_curve = (
        "" if loss_svg else (f"No loss curve: {len(o.record.steps)} step(s) ran and fewer than two losses are finite.")
    )
    return {
        "label": formatting.label(o),
        "verdict": o.verdict,
        "loss_svg": loss_svg,
        "gn_svg": gn_svg,
        "facts": " · ".join(facts),
        "no_curve": no_curve,
        "log_tail": o.record.log_tail,
        "fidelity_svg": forensics.fidelity_chart(o),
        "explain": forensics.explain_text(o),
    }


def render_html(a: RunAnalysis) -> str:
    probed, why = formatting.model_line(a)
    panels = matrix.matrix_panels(a)
    env = a.meta.env or DeviceFacts.from_dict({})
    # the box answers first (recommended, fastest, verdicts); how speed decided is folded below it
    speed = [] if a.meta.kind == "bisect" else timing.speed_lines(a)
    return _env.get_template("report.html.j2").render(
        meta=a.meta,
        headline=[line for line in formatting.headline(a) if line not in speed],
        speed=speed,
        probed=probed,
        why=why,
        stand_in=formatting.stand_in_line(a),
        twin=formatting.twin_caveat_line(a),
        data=data.data_html(a.meta, a.outcomes),
        panels=panels,
        key=matrix.verdicts_shown(panels),
        off_grid=matrix.off_grid_rows(a),
        colors=matrix.VERDICT_COLORS,
        classes=[{**c, "line": failures.failure_line(c)} for c in failures.failure_classes(a)],
        unsupported_classes=failures.unsupported_classes(a),
        code=[(code.title(h), code.code_lines(rec)) for h, rec in code.grid_recommendations(a)],
        ranking=formatting.ranking_rows(a),
        failures=formatting.failure_rows(a),
        environment=formatting.environment_rows(a) + doctor.stack_facts(env),
        findings=doctor.finding_rows(a.findings),
        capabilities=doctor.capability_rows(env),
        order=timing.order_sentence(a),
        ranking_note=formatting.ranking_note(a),
        retime=timing.retime_rows(a),
        retime_intro=timing.retime_intro(a) if a.timing else None,
        load=timing.load_line(a),
        overview_svg=overview_chart(a),
        cards=[probe_card(o) for o in a.outcomes if o.verdict.name != UNSUPPORTED],
        bisect=bisection_context(a.bisection) if a.meta.kind == "bisect" and a.bisection else None,
        forensics=[forensics.summary_row(o) for o in forensics.probes_with_forensics(a)],
        headroom=forensics.headroom_sections(a),
        savings=savings.section(a),
        parallel={"intro": parallel.INTRO.replace("`", ""), "rows": parallel.parallel_rows(a)},
        moe=moe.moe_context(a),
        rl=rl.rl_html(a),
    )


def bisection_context(b: dict) -> dict:
    return {
        "message": b["message"],
        "factors": bisection.factor_rows(b),
        "culprits": bisection.culprit_rows(b),
        "recommendation": bisection.recommendation_lines(b),
        "path": bisection.path_rows(b),
    }
