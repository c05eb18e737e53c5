"""The comparison of a run with its baseline (analysis/diff.py) as rows and sentences every renderer
shares, then the terminal, Markdown, HTML and JSON renderings. The first lines answer "did anything
regress, and what changed around it?"; the numbers of cells stable in both follow."""

from __future__ import annotations

import math

from jinja2 import Environment, PackageLoader, select_autoescape
from tabulate import tabulate

from ..analysis.diff import BIT_IDENTICAL, PARTED, SAME, CellChange, RunDiff
from . import failures
from .charts import line_chart
from .formatting import fmt_bytes, fmt_fidelity, fmt_rate
from .matrix import VERDICT_COLORS

_env = Environment(loader=PackageLoader("nandoctor.report", "templates"), autoescape=select_autoescape(["html", "j2"]))
CURVES_DRAWN = 8  # overlay charts of parted loss curves in the HTML


def run_name(a) -> str:
    return a.meta.run_dir or a.meta.run_id or "?"


def headline(d: RunDiff) -> list[str]:
    """The sentences read first: the outcome, then what differs around it."""
    n = len(d.cells)
    regressed = d.regressions
    if regressed:
        lines = [
            f"Regressed: {len(regressed)} of {n} cell(s): "
            + "; ".join(f"{c.probe_id} ({c.verdicts})" for c in regressed)
        ]
    elif d.unchanged and not d.moved:
        lines = [f"No change: {n} cell(s), same verdicts, every loss curve bit-identical."]
    elif d.unchanged:  # the numerics are the same; speed or memory moved (Beyond noise, below)
        lines = [f"No regression: {n} cell(s), same verdicts, every loss curve bit-identical."]
    else:
        lines = [f"No regression: {n} cell(s) compared."]
    changed = [c for c in d.cells if c.change != SAME and not c.regressed]
    if changed:
        lines.append("Verdict changes: " + "; ".join(f"{c.probe_id} {c.change} ({c.verdicts})" for c in changed))
    if d.moved:
        lines.append("Beyond noise: " + "; ".join(moved_text(c) for c in d.moved))
    if d.environment:
        lines.append("Environment: " + "; ".join(f"{e.name} {e.before} -> {e.after}" for e in d.environment))
    if d.settings:
        lines.append("Settings: " + "; ".join(f"{s.name} {s.before} -> {s.after}" for s in d.settings))
    before, after = d.recommendation
    if before != after:
        tie = " (a tie broken by timing: same fidelity bucket, tokens/s within noise)" if d.recommendation_tie() else ""
        lines.append(f"Recommendation: {before or 'none'} -> {after or 'none'}{tie}")
    curves = [c.curve.status for c in d.cells if c.curve]
    if curves and not d.unchanged:
        counts = {s: curves.count(s) for s in dict.fromkeys(curves)}
        lines.append("Loss curves: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return lines


def environment_rows(d: RunDiff) -> list[dict]:
    return [{"fact": e.name, "baseline": e.before, "this run": e.after} for e in d.environment]


def settings_rows(d: RunDiff) -> list[dict]:
    return [{"setting": s.name, "baseline": s.before, "this run": s.after} for s in d.settings]


def _failure_class(c: CellChange, classes: list[dict]) -> str:
    """Where the new failure started and its fix, as the run's report words them (its verdict's reason
    is the row's `why`)."""
    if not c.after or not c.after.verdict.failed:
        return "-"
    mine = next((k for k in classes if c.probe_id in k["probes"]), None)
    if mine is None:
        return "-"
    where = [f"Where: {mine['where']}."] if mine["where"] else []
    fix = [f"Fix ({mine['fix_source']}): {mine['fix']}"] if mine["fix"] else []
    return " ".join(where + fix) or "-"


def verdict_rows(d: RunDiff) -> list[dict]:
    """Every cell whose verdict changed (or, in a check, whose step-0 values moved), regressions first."""
    classes = failures.failure_classes(d.current)
    return [
        {
            "cell": c.probe_id,
            "change": c.change,
            "verdict": c.verdicts,
            "why": c.why,
            "where and fix": _failure_class(c, classes),
        }
        for c in d.cells
        if c.change != SAME
    ]


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


MEASURED_NAMES = ("fidelity", "tokens/s", "peak memory")


def moved_text(c: CellChange) -> str:
    """'fp32/sdpa/off tokens/s 9,032 -> 7,969 (-11.8%, noise ±3%)': the numbers of a cell stable in both
    runs that moved beyond their noise band."""
    fmt = (fmt_fidelity, fmt_rate, fmt_bytes)
    parts = []
    for name, show, m in zip(MEASURED_NAMES, fmt, c.measured):
        if m is None or not m.moved:
            continue
        change = f"{100 * m.change:+.3f} points" if m.absolute else _percent(m.change)
        band = f"±{100 * m.band:.3g} points" if m.absolute else f"±{100 * m.band:.2g}%"
        parts.append(f"{name} {show(m.before)} -> {show(m.after)} ({change}, noise {band})")
    return f"{c.probe_id} " + ", ".join(parts)


def _moved(text: str, m) -> str:
    return f"{text} (beyond noise)" if m.moved else text


def curve_text(c: CellChange) -> str:
    k = c.curve
    if k is None:
        return "-"
    if k.status == BIT_IDENTICAL:
        return f"bit-identical over {k.steps} steps"
    threads = f"; trained on {c.threads[0]} -> {c.threads[1]} CPU threads" if c.threads else ""
    if k.status == PARTED:
        return f"parted at step {k.parted_at} (tolerance ±{k.tolerance:.3g}, largest {k.largest:.3g}{threads})"
    return f"within ±{k.tolerance:.3g} (first differs at step {k.first_difference}, largest {k.largest:.3g}{threads})"


def stable_rows(d: RunDiff) -> list[dict]:
    """Cells stable in both runs: fidelity, tokens/s and peak memory before -> after, and the loss curves."""
    rows = []
    for c in d.cells:
        if c.tokens_per_s is None:
            continue
        f, r, m = c.fidelity, c.tokens_per_s, c.peak_memory
        fid = f"{fmt_fidelity(f.before)} -> {fmt_fidelity(f.after)}"
        rate = f"{fmt_rate(r.before)} -> {fmt_rate(r.after)} ({_percent(r.change)}, noise ±{100 * r.band:.2g}%)"
        memory = f"{fmt_bytes(m.before)} -> {fmt_bytes(m.after)} ({_percent(m.change)})"
        rows.append(
            {
                "cell": c.probe_id,
                "fidelity vs fp32": _moved(fid, f),
                "tokens/s": _moved(rate, r),
                "peak memory": _moved(memory, m),
                "loss curves": curve_text(c),
            }
        )
    return rows


def _fmt_value(x: float) -> str:
    return repr(x) if not math.isfinite(x) else f"{x:.8g}"


def golden_rows(d: RunDiff) -> list[dict]:
    """A check's step-0 values against the baseline's, with the tolerance of the cell's matmul dtype."""
    return [
        {
            "cell": c.probe_id,
            "value": g.name,
            "baseline": _fmt_value(g.before),
            "this run": _fmt_value(g.after),
            "change": f"{g.change:.3g}",
            "tolerance": f"±{g.tolerance:.3g}",
            "result": "ok" if g.passed else "MOVED",
        }
        for c in d.cells
        for g in c.golden
    ]


def sections(d: RunDiff) -> list[tuple[str, list[dict], str]]:
    """(title, rows, what an empty table means) in the order every renderer shows them."""
    return [
        ("Environment differences", environment_rows(d), "none"),
        ("Settings differences", settings_rows(d), "none"),
        ("Verdict changes", verdict_rows(d), "none"),
        ("Step-0 golden values", golden_rows(d), ""),
        ("Cells stable in both", stable_rows(d), "none"),
    ]


def _intro(d: RunDiff) -> str:
    return f"Baseline `{run_name(d.baseline)}` against `{run_name(d.current)}`."


def render_diff_terminal(d: RunDiff) -> str:
    out = [f"baseline: {run_name(d.baseline)}", f"this run: {run_name(d.current)}"]
    for title, rows, empty in sections(d):
        if rows or empty:
            out += [
                "",
                f"{title}:",
                tabulate(rows, headers="keys", maxcolwidths=60, disable_numparse=True) if rows else f"  {empty}",
            ]
    return "\n".join(out + [""] + headline(d))


def render_diff_markdown(d: RunDiff) -> str:
    head = headline(d)
    parts = [f"# nandoctor diff: {d.current.meta.recipe['name']}", "", _intro(d), "", f"**{head[0]}**", ""]
    parts += [f"- {line}" for line in head[1:]] + [""]
    for title, rows, empty in sections(d):
        if rows or empty:
            body = tabulate(rows, headers="keys", tablefmt="github", disable_numparse=True) if rows else f"_{empty}_"
            parts += [f"## {title}", "", body, ""]
    if d.unrecorded:
        parts += [f"Facts only one of the runs recorded (older versions record fewer): {', '.join(d.unrecorded)}.", ""]
    return "\n".join(parts)


def curve_charts(d: RunDiff) -> list[str]:
    """The baseline's and this run's loss curves of each cell whose curves parted or changed verdict."""
    charts = []
    for c in d.cells:
        if c.before is None or c.after is None or (c.curve and c.curve.status == BIT_IDENTICAL and c.change == SAME):
            continue
        series = [
            {
                "label": f"baseline: {c.before.verdict.name}",
                "points": [(s.step, s.loss) for s in c.before.record.steps],
                "dashed": True,
                "color": "#888",
            },
            {"label": f"this run: {c.after.verdict.name}", "points": [(s.step, s.loss) for s in c.after.record.steps]},
        ]
        mark = c.curve.parted_at if c.curve else None
        charts.append(
            line_chart(series, f"{c.probe_id}: loss", mark_step=mark, mark_label="parted" if mark is not None else "")
        )
        if len(charts) == CURVES_DRAWN:
            break
    return charts


def render_diff_html(d: RunDiff) -> str:
    return _env.get_template("diff.html.j2").render(
        title=f"nandoctor diff: {d.current.meta.recipe['name']}",
        baseline=run_name(d.baseline),
        current=run_name(d.current),
        headline=headline(d),
        sections=sections(d),
        colors=VERDICT_COLORS,
        unrecorded=d.unrecorded,
        charts=curve_charts(d),
    )


def _measured(m) -> dict | None:
    return (
        None
        if m is None
        else {"before": m.before, "after": m.after, "change": m.change, "band": m.band, "moved": m.moved}
    )


def render_diff_summary(d: RunDiff) -> dict:
    """diff.json: the comparison as data, for scripts that gate on it."""

    def cell(c: CellChange) -> dict:
        k = c.curve
        return {
            "probe_id": c.probe_id,
            "change": c.change,
            "why": c.why,
            "before": c.before.verdict.name if c.before else None,
            "after": c.after.verdict.name if c.after else None,
            "curve": None
            if k is None
            else {
                "status": k.status,
                "steps": k.steps,
                "tolerance": k.tolerance,
                "first_difference": k.first_difference,
                "parted_at": k.parted_at,
                "largest": k.largest,
            },
            "fidelity": _measured(c.fidelity),
            "tokens_per_s": _measured(c.tokens_per_s),
            "peak_memory_bytes": _measured(c.peak_memory),
            "golden": [
                {
                    "name": g.name,
                    "before": g.before,
                    "after": g.after,
                    "change": g.change,
                    "tolerance": g.tolerance,
                    "passed": g.passed,
                }
                for g in c.golden
            ],
        }

    before, after = d.recommendation
    return {
        "baseline": run_name(d.baseline),
        "current": run_name(d.current),
        "exit_code": d.exit_code,
        "unchanged": d.unchanged,
        "moved": [c.probe_id for c in d.moved],
        "regressed": [c.probe_id for c in d.regressions],
        "headline": headline(d),
        "environment": [vars(e) for e in d.environment],
        "settings": [vars(s) for s in d.settings],
        "unrecorded": d.unrecorded,
        "recommendation": {"before": before, "after": after},
        "cells": [cell(c) for c in d.cells],
    }
