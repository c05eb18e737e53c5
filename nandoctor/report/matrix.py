"""The verdict matrix at the top of report.html and report.md: one panel per compile value (and per
optimizer, parallel setup and kind of hardware, when a run probes several), a row per dtype and a column
per attention. Rows, columns and panels are the axis values present in the run, in cells.AXES order, so
a new dtype or attention value gets its row or column without a change here.

A cell holds the probe of the run's own recipe and seed; probes with recipe overrides or other seeds
(bisect runs, --data-seeds) have no place in a dtype x attention grid and are listed beside it."""

from __future__ import annotations

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..analysis.verdicts import STABLE, UNSUPPORTED, VERDICTS
from ..cells import AXES, HARDWARE_AXES, Cell
from .forensics import forensics_of, headroom_applies, tightest_line
from .formatting import fmt_fidelity, fmt_mismatch, label, recommended_ids
from .timing import grid_text

PENDING = "pending"  # planned, but the run was interrupted before it ran
# Background and text colour per verdict (the verdict table), for the HTML matrix (and the screenshot test that
# looks for them).
VERDICT_COLORS = {**{v.name: v.color for v in VERDICTS}, PENDING: ("#ffffff", "#777777")}


def _in_grid(a: RunAnalysis, o: ProbeOutcome) -> bool:
    return not o.record.overrides and o.record.seed == (a.meta.seed if a.meta.seed is not None else o.record.seed)


def _planned_cells(a: RunAnalysis) -> list[Cell]:
    """The cells a grid planned to probe (run.json), so an interrupted grid shows what it did not reach."""
    if a.meta.kind != "grid":
        return []
    return [Cell.parse(c) for c in ((a.meta.doctor or {}).get("setup") or {}).get("cells", [])]


def _representative(probes: list[ProbeOutcome]) -> ProbeOutcome:
    """Reruns of one cell: show the first that failed (a verdict that changes on a rerun is a failure)."""
    return next((o for o in probes if o.verdict.failed), probes[0])


def fastest_ids(a: RunAnalysis) -> set[str]:
    """The probes marked fastest: on each kind of hardware (the whole grid without a hardware axis), the
    stable one clearly faster than that kind's recommendation, if any; none in a bisect run."""
    if a.meta.kind == "bisect":
        return set()
    kinds = a.hardware or [""]
    return {fast.probe_id for fast, rec in ((a.fastest_on(h), a.recommended_on(h)) for h in kinds) if fast is not rec}


def _cell(a: RunAnalysis, probes: list[ProbeOutcome], recommended: set[str], fastest: set[str]) -> dict:
    o = _representative(probes)
    v = o.verdict
    if v.name == STABLE:
        shown = f"|dlogp| {fmt_mismatch(o.mismatch)}" if o.mismatch is not None else fmt_fidelity(o.fidelity)
        lines = [shown, f"{grid_text(o)} tok/s" + ("/device" if o.devices > 1 else "")]
    elif v.name == UNSUPPORTED:
        lines = ["not run here"]
    else:
        lines = [v.name] + ([f"at step {v.step}"] if v.step is not None else [])
    if len(probes) > 1:
        lines.append(f"{len(probes)} probes: " + "/".join(sorted({p.verdict.name for p in probes})))
    title = [f"{label(p)}: {p.verdict.name}: {p.verdict.reason}" for p in probes]
    if forensics_of(o) and headroom_applies(forensics_of(o)):
        title.append(tightest_line(o))
    return {
        "probe_id": o.probe_id,
        "verdict": v.name,
        "lines": lines,
        "title": "\n".join(title),
        "recommended": o.probe_id in recommended,
        "fastest": o.probe_id in fastest,
    }


def matrix_panels(a: RunAnalysis) -> list[dict]:
    """[{'compile', 'optimizer', 'caption', 'columns': [attn], 'rows': [{'dtype', 'cells': [cell dict or None]}]}];
    a cell dict has 'verdict' (a verdict name, or 'pending'), 'lines' (what the cell shows), 'title' (the
    hover text: every probe's reason) and 'recommended' / 'fastest'. Empty when no probe fits the grid."""
    by_cell: dict[Cell, list[ProbeOutcome]] = {}
    for o in a.outcomes:
        if _in_grid(a, o):
            by_cell.setdefault(o.record.cell, []).append(o)
    planned = [c for c in _planned_cells(a) if c not in by_cell]
    cells = list(by_cell) + planned
    if not by_cell:
        return []
    recommended, fastest = recommended_ids(a), fastest_ids(a)
    values = {axis: [v for v in AXES[axis] if any(getattr(c, axis) == v for c in cells)] for axis in AXES}
    kinds = list(dict.fromkeys(c.hardware for c in cells))
    pending = {
        "verdict": PENDING,
        "lines": ["not reached"],
        "title": "the run was interrupted before this cell ran",
        "recommended": False,
        "fastest": False,
    }
    panels = []
    for hw, comp, opt, par, quant in (
        (h, c, o, p, q)
        for h in kinds
        for c in values["compile"]
        for o in values["optimizer"]
        for p in values["parallel"]
        for q in values["quant"]
    ):
        rows = []
        for dtype in values["dtype"]:
            row = []
            for attn in values["attn"]:
                cell = Cell(dtype, attn, comp, opt, par, hw, quant)
                row.append(
                    _cell(a, by_cell[cell], recommended, fastest)
                    if cell in by_cell
                    else {**pending, "probe_id": cell.id}
                    if cell in planned
                    else None
                )
            if any(row):
                rows.append({"dtype": dtype, "cells": row})
        caption = (
            (f"{hardware_name(a)}={hw}{ran_on(a, hw)}, " if hw else "")
            + f"compile={comp}"
            + (f", optimizer={opt}" if len(values["optimizer"]) > 1 else "")
            + (f", parallel={par}" if len(values["parallel"]) > 1 else "")
            + (f", quant={quant}" if len(values["quant"]) > 1 else "")
        )
        panels.append(
            {
                "hardware": hw,
                "compile": comp,
                "optimizer": opt,
                "parallel": par,
                "quant": quant,
                "caption": caption,
                "columns": values["attn"],
                "rows": rows,
            }
        )
    return panels


def hardware_name(a: RunAnalysis) -> str:
    """The run's hardware axis as the user named it (partition, node_type)."""
    return next((axis for axis in (a.meta.axes or {}) if axis in HARDWARE_AXES), "hardware")


def ran_on(a: RunAnalysis, hardware: str) -> str:
    """' (ran on node1: NVIDIA H100 80GB HBM3)': the hosts and GPUs the probes of one hardware kind
    measured on their node (the record's node and gpu), so a mislabelled partition shows."""
    seen = sorted(
        {
            f"{o.record.node}: {o.record.gpu}" if o.record.gpu else o.record.node
            for o in a.outcomes
            if o.record.cell.hardware == hardware and o.record.node
        }
    )
    return f" (ran on {'; '.join(seen[:3])}{'; ...' if len(seen) > 3 else ''})" if seen else ""


def verdicts_shown(panels: list[dict]) -> list[str]:
    """The verdicts the matrix shows, in VERDICT_COLORS order: its colour key."""
    shown = {c["verdict"] for p in panels for r in p["rows"] for c in r["cells"] if c}
    return [v for v in VERDICT_COLORS if v in shown]


def off_grid_rows(a: RunAnalysis) -> list[dict]:
    """The probes the matrix has no place for: recipe overrides (a bisection's factors) or other seeds."""
    recommended = recommended_ids(a)
    return [
        {
            "config": label(o) + ("" if o.record.seed == a.meta.seed else f" seed={o.record.seed}"),
            "verdict": o.verdict.name,
            "step": "-" if o.verdict.step is None else o.verdict.step,
            "recommended": o.probe_id in recommended,
        }
        for o in a.outcomes
        if not _in_grid(a, o)
    ]
