"""report.html: one self-contained file (inline CSS and SVG, no scripts, no network) with the same
content as report.md plus the loss and grad-norm curve of every probe.

Jinja2 renders the page: autoescaping keeps exception text from probes from breaking the markup."""
from __future__ import annotations

from jinja2 import Environment, PackageLoader, select_autoescape

from ..analysis.run import ProbeOutcome, RunAnalysis
from ..config import THRESHOLDS
from . import bisection, common, doctor, forensics, savings
from .charts import line_chart

_env = Environment(loader=PackageLoader("nandoctor.report", "templates"), autoescape=select_autoescape(["html", "j2"]))


def probe_charts(o: ProbeOutcome) -> tuple[str, str]:
    steps = o.record.steps
    mark = o.verdict.step if o.verdict.failed else None
    ref = o.reference_steps or []
    loss = [{"label": common.label(o), "points": [(s.step, s.loss) for s in steps]}]
    gn = [{"label": "grad-norm (before clipping)", "points": [(s.step, s.grad_norm) for s in steps]}]
    if ref:
        loss.append({"label": "fp32 reference", "points": [(s.step, s.loss) for s in ref], "dashed": True, "color": "#888"})
        gn.append({"label": "fp32 reference", "points": [(s.step, s.grad_norm) for s in ref], "dashed": True, "color": "#888"})
    return (line_chart(loss, "loss", mark_step=mark, mark_label=o.verdict.name),
            line_chart(gn, "grad-norm", log_y=True, mark_step=mark, mark_label=o.verdict.name))


def render_html(a: RunAnalysis) -> str:
    probed, why = common.model_line(a)
    overview = [{"label": common.label(o), "points": [(s.step, s.loss) for s in o.record.steps]}
                for o in a.ranking[:8]]
    cards = []
    for o in a.outcomes:
        if o.verdict.name == "unsupported":
            continue
        loss_svg, gn_svg = probe_charts(o)
        cards.append({"label": common.label(o), "verdict": o.verdict, "loss_svg": loss_svg, "gn_svg": gn_svg,
                      "fidelity": common.fmt_fidelity(o.fidelity), "rate": common.fmt_rate(o.tokens_per_s),
                      "memory": common.fmt_bytes(o.peak_memory_bytes), "log_tail": o.record.log_tail,
                      "fidelity_svg": forensics.fidelity_chart(o), "explain": forensics.explain_text(o)})
    return _env.get_template("report.html.j2").render(
        meta=a.meta, headline=common.headline(a), probed=probed, why=why,
        ranking=common.ranking_rows(a), failures=common.failure_rows(a), unsupported=common.unsupported_rows(a),
        environment=common.environment_rows(a) + doctor.stack_facts(a.meta.get("env", {})), findings=doctor.finding_rows(a.findings),
        capabilities=doctor.capability_rows(a.meta.get("env", {})), bucket=100 * THRESHOLDS.fidelity_bucket,
        overview_svg=line_chart(overview, "loss of the top-ranked stable configurations", width=860, height=260) if overview else "",
        cards=cards, bisect=bisection_context(a.bisection) if a.meta["kind"] == "bisect" and a.bisection else None,
        forensics=[forensics.summary_row(o) for o in forensics.probes_with_forensics(a)],
        headroom=forensics.headroom_sections(a), savings=savings.section(a))


def bisection_context(b: dict) -> dict:
    return {"message": b["message"], "factors": bisection.factor_rows(b), "culprits": bisection.culprit_rows(b),
            "recommendation": bisection.recommendation_lines(b), "path": bisection.path_rows(b)}
