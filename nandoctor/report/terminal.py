"""What the terminal shows: a line per probe as it finishes, then the ranked table."""

from __future__ import annotations

from tabulate import tabulate

from ..analysis.run import RunAnalysis
from ..record import ProbeRecord
from . import bisection, code, common


def progress_line(done: int, total: int, record: ProbeRecord, verdict) -> str:
    wall = record.wall_s
    took = f"{wall:6.1f}s" if wall is not None else "      -"
    took = " cached" if record.cached_from else took
    return f"[{done:>3}/{total or '?'}] {record.probe_id:<32} {verdict.name:<11} {took}  {verdict.reason}"


def render_terminal(a: RunAnalysis, run_dir) -> str:
    probed, why = common.model_line(a)
    out = [f"model: {probed}", f"       {why}", ""]
    rows = common.ranking_rows(a)
    out.append(tabulate(rows, headers="keys") if rows else "no stable configuration")
    note = common.ranking_note(a)
    if note:
        out += ["", note]
    fails = common.failure_rows(a)
    if fails:
        out += [
            "",
            tabulate(
                [{k: r[k] for k in ("config", "verdict", "step", "reason")} for r in fails],
                headers="keys",
                maxcolwidths=[None, None, None, 70],
            ),
        ]
    if a.meta["kind"] == "bisect" and a.bisection:
        out += [
            "",
            tabulate(bisection.culprit_rows(a.bisection), headers="keys")
            if a.bisection["culprits"]
            else "no culprits isolated",
        ]
        out += ["", "Recommended configuration:"] + [
            f"  {line}" for line in bisection.recommendation_lines(a.bisection)
        ]
    for hardware, rec in code.grid_recommendations(a):
        out += ["", f"{code.title(hardware)}:"] + [f"  {line}" for line in code.code_lines(rec)]
    out += [""] + common.headline(a)
    out.append(f"reports: {run_dir}/report.md, report.html, junit.xml, summary.json")
    return "\n".join(out)
