"""report.md: in the order of report.html — the recommendation, the verdict matrix, one line per
failure class — then the ranked table, the failures, forensics, doctor and environment. Plain
GitHub-flavoured Markdown: tables and lists, no HTML."""

from __future__ import annotations

from tabulate import tabulate

from ..analysis.outcomes import RunAnalysis
from ..analysis.verdicts import VERDICTS
from ..device import DeviceFacts
from . import bisection, code, failures, formatting, matrix, timing
from .data import data_markdown
from .doctor import doctor_markdown
from .forensics import forensics_markdown
from .moe import moe_markdown
from .parallel import parallel_markdown
from .rl import rl_markdown
from .savings import savings_markdown


def _table(rows: list[dict]) -> str:
    return tabulate(rows, headers="keys", tablefmt="github") if rows else "_none_"


def render_markdown(a: RunAnalysis) -> str:
    m = a.meta
    probed, why = formatting.model_line(a)
    stand_in = formatting.stand_in_line(a)
    twin = formatting.twin_caveat_line(a)
    parts = [
        f"# nandoctor {m.kind}: {m.recipe['name']}",
        "",
        f"Run `{m.run_id}` started {m.created}; {m.steps} steps per probe, seed {m.seed}.",
        "",
        *([f"Stand-in: {stand_in}.", ""] if stand_in else []),
    ]
    head = formatting.headline(a)
    first = len(a.hardware) if a.hardware and a.meta.kind != "bisect" else 1  # a recommendation per kind of hardware
    parts += [f"**{line}**" for line in head[:first]] + [""] + [f"- {line}" for line in head[first:]] + [""]
    parts += matrix_section(a) + failure_section(a) + code_section(a)
    parts += (
        ["## Model", "", f"Probed: {probed}.", "", f"Why: {why}.", ""]
        + ([f"Stand-in: {stand_in}.", ""] if stand_in else [])
        + ([f"Twin: {twin}.", ""] if twin else [])
    )
    if m.kind == "bisect" and a.bisection:
        parts += bisection_section(a.bisection)
    parts += data_markdown(m, a.outcomes, _table)
    note = formatting.ranking_note(a)
    parts += ["## Stable configurations, ranked", "", timing.order_sentence(a), ""] + ([note, ""] if note else [])
    parts += [_table(formatting.ranking_rows(a)), ""]
    parts += rl_markdown(a)
    parts += timing_section(a)
    parts += ["## Failures", "", _table(formatting.failure_rows(a)), ""]
    parts += parallel_markdown(a, _table)
    parts += moe_markdown(a, _table)
    parts += forensics_markdown(a, _table)
    parts += savings_markdown(a, _table)
    parts += doctor_markdown(m.env or DeviceFacts.from_dict({}), a.findings)
    parts += ["## Environment", "", _table(formatting.environment_rows(a)), ""]
    parts += [f"Command: `{m.command or ''}`", ""]
    return "\n".join(parts)


def code_section(a: RunAnalysis) -> list[str]:
    """A grid's recommendation as code to paste (a bisection's is in its own section)."""
    parts = []
    for hardware, rec in code.grid_recommendations(a):
        parts += [f"## {code.title(hardware)}", "", "```", *code.code_lines(rec), "```", ""]
    return parts


def timing_section(a: RunAnalysis) -> list[str]:
    """The re-timing of the leading cells and the host's load, when there is either to tell."""
    rows, load = timing.retime_rows(a), timing.load_line(a)
    if not rows and not load:
        return []
    parts = ["## Timing", ""]
    if rows:
        parts += [
            timing.retime_intro(a),
            "",
            _table(rows),
            "",
        ]
    if load:
        parts += [load, ""]
    return parts


def bisection_section(b: dict) -> list[str]:
    parts = [
        "## Bisection",
        "",
        b["message"][0].upper() + b["message"][1:] + ".",
        "",
        _table(bisection.factor_rows(b)),
        "",
        "### Culprits",
        "",
        _table(bisection.culprit_rows(b)),
        "",
    ]
    lines = bisection.recommendation_lines(b)
    if lines:
        parts += ["### Recommended configuration", "", "```", *lines, "```", ""]
    parts += ["### Bisection path, probe by probe", "", _table(bisection.path_rows(b)), ""]
    return parts


MARK = {**{v.name: v.mark for v in VERDICTS}, matrix.PENDING: "not reached"}  # the verdict table's marks


def _md_cell(c: dict | None) -> str:
    if c is None:
        return ""
    if c["verdict"] in ("unsupported", matrix.PENDING):
        return MARK[c["verdict"]]
    sep = " · " if c["verdict"] == "stable" else " "
    text = f"{MARK[c['verdict']]} {sep.join(c['lines'])}".replace("|", "\\|")
    return f"**★ {text}**" if c["recommended"] else text


def matrix_section(a: RunAnalysis) -> list[str]:
    """The verdict matrix as one Markdown table per panel (compile value, and optimizer when several)."""
    panels, off_grid = matrix.matrix_panels(a), matrix.off_grid_rows(a)
    if not panels and not off_grid:
        return []
    parts = ["## Verdict per configuration", ""]
    for p in panels:
        rows = [
            {"dtype \\ attention": r["dtype"], **{col: _md_cell(c) for col, c in zip(p["columns"], r["cells"])}}
            for r in p["rows"]
        ]
        parts += [f"{p['caption']}:", "", _table(rows), ""]
    if panels:
        parts += [
            f"★ recommended · ✅ stable: {formatting.closeness_column(a)}, tokens/s · ❌ failed: verdict and step "
            "· – not run on this device",
            "",
        ]
    if off_grid:
        parts += [
            "Probes with recipe overrides or other seeds (not in the matrix): "
            + "; ".join(
                ("★ " if r["recommended"] else "")
                + f"`{r['config']}` {r['verdict']}"
                + ("" if r["step"] == "-" else f" at step {r['step']}")
                for r in off_grid
            ),
            "",
        ]
    return parts


def failure_section(a: RunAnalysis) -> list[str]:
    classes, unsupported = failures.failure_classes(a), failures.unsupported_classes(a)
    parts = []
    if classes:
        parts += ["## Why the others failed", ""] + [f"- {failures.failure_line(c)}" for c in classes] + [""]
    if unsupported:
        parts += ["Not run on this device:", ""] + [f"- {u['subject']}: {u['reason']}" for u in unsupported] + [""]
    return parts
