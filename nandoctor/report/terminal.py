"""What the terminal shows: a line per probe as it finishes, then the ranked table."""

from __future__ import annotations

from tabulate import tabulate

from ..analysis.outcomes import RunAnalysis
from ..analysis.verdicts import MISCONFIGURED, setup_passed
from ..cells import AXES, Cell
from ..record import ProbeRecord
from . import bisection, code, formatting, timing
from .moe import probe_rows
from .rl import rl_lines


def progress_line(done: int, total: int, record: ProbeRecord, verdict) -> str:
    """One finished probe: its verdict and reason, and the figures of the step-0 setup checks it passed
    (what was measured, so that a check that passes is seen to have run)."""
    wall = record.wall_s
    took = f"{wall:6.1f}s" if wall is not None else "      -"
    took = " cached" if record.cached_from else took
    checked = record.setup_checks and verdict.name != MISCONFIGURED
    setup = f"; setup: {setup_passed(record.setup_checks)}" if checked else ""
    return f"[{done:>3}/{total or '?'}] {record.probe_id:<32} {verdict.name:<11} {took}  {verdict.reason}{setup}"


def _shared_values(cells: list[Cell], every: list[Cell]) -> str:
    """The axis values all these cells share that not every unsupported cell shares: 'tf32', 'sdpa:cudnn'
    ('' when there is none to tell them apart)."""
    shared = [
        getattr(cells[0], axis)
        for axis in AXES
        if len({getattr(c, axis) for c in cells}) == 1 and len({getattr(c, axis) for c in every}) > 1
    ]
    return "/".join(shared)


def _cuda_only(cell: Cell, reason: str) -> bool:
    return reason in {row.cuda_only for row in (cell.precision, cell.attention, cell.optimizer_row)}


def unsupported_line(done: int, total: int, records: list[ProbeRecord]) -> str:
    """One line for the cells the device cannot run, recorded before any probe ran (the default grid on a
    CPU has 22 CUDA-only ones): how many, which axis values, why in short; the reports list each reason."""
    groups: dict[str, list[Cell]] = {}
    for r in records:
        groups.setdefault(r.reason or "", []).append(r.cell)
    every = [c for cells in groups.values() for c in cells]
    if all(_cuda_only(cells[0], reason) for reason, cells in groups.items()):
        values = ", ".join(filter(None, (_shared_values(cells, every) for cells in groups.values())))
        why = f"{values}: CUDA only" if values else "CUDA only"
    else:
        why = "; ".join(
            ": ".join(filter(None, (_shared_values(cells, every), reason.split(";")[0])))
            for reason, cells in groups.items()
        )
    return (
        f"[{done:>3}/{total or '?'}] {len(records)} cells not run, unsupported here ({why}); "
        "report.md lists each with its reason"
    )


def render_terminal(a: RunAnalysis, run_dir) -> str:
    probed, why = formatting.model_line(a)
    stand_in = formatting.stand_in_line(a)
    twin = formatting.twin_caveat_line(a)
    out = [f"model: {probed}", f"       {why}", *([f"       stand-in: {stand_in}"] if stand_in else [])]
    out.append("")
    out += [*formatting.reference_lines(a), ""] if a.references else []  # first after the model: what drift means
    out += [f"twin: {twin}", ""] if twin else []
    rows = formatting.ranking_rows(a)
    out.append(tabulate(rows, headers="keys") if rows else "no stable configuration")
    note = formatting.ranking_note(a)
    if note:
        out += ["", note]
    out += rl_lines(a)
    fails = formatting.failure_rows(a)
    if fails:
        out += [
            "",
            tabulate(
                [{k: r[k] for k in ("config", "verdict", "step", "reason")} for r in fails],
                headers="keys",
                maxcolwidths=[None, None, None, 70],
            ),
        ]
    routers = probe_rows(a)
    if routers:
        out += ["", "Mixture of experts, the router per probe (report.md has the load per layer and step):"]
        out.append(tabulate([{k: v for k, v in r.items() if k != "verdict"} for r in routers], headers="keys"))
    if a.meta.kind == "bisect" and a.bisection:
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
    return "\n".join(out + [""] + closing_lines(a, run_dir))


def closing_lines(a: RunAnalysis, run_dir) -> list[str]:
    """The end of a grid's output: the answer in at most three short lines (the recommendation, one per kind
    of hardware; why; where the reports are), then the details. How speed decided, with its per-round
    figures, is said once, in report.md, not here; the reference lines are said at the top already. A
    bisection's headline is its own (bisection.headline_lines)."""
    head = formatting.headline(a)
    speed = timing.speed_lines(a)
    told = " (how speed decided, with the figures)" if speed else ""
    reports = f"reports: {run_dir}/report.md{told}, report.html, junit.xml, summary.json"
    if a.meta.kind == "bisect":
        return [*head, reports]
    why = timing.why_line(a)
    answer = [line for line in head if line.startswith(("Recommended", "No stable configuration"))]
    answer += [why] if why else []
    said = {*answer, *speed, *formatting.reference_lines(a)}
    details = [line for line in head if line not in said] + [line for line in [timing.load_short(a)] if line]
    return [*answer, reports] + ([""] + details if details else [])
