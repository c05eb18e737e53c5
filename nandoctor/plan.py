"""Recipe + axes -> the list of probes to run. Cells the device cannot run are planned as
`unsupported` with the reason and never spawned. The fp32 reference cell always comes first."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from .capabilities import cell_support
from .config import AXES, REFERENCE_CELL, Cell, Recipe, parse_axis_values

CPU_DEFAULT_COMPILE = ["off"]  # the first inductor step costs ~36 s on a 2-core CPU: opt in with --axis


@dataclass(frozen=True)
class PlannedProbe:
    probe_id: str
    cell: Cell
    unsupported: str | None = None
    reference: bool = False
    overrides: dict = field(default_factory=dict)  # dotted recipe fields set for this probe (bisect)
    seed_offset: int = 0
    recipe: Recipe | None = None  # this probe's recipe variant (the overrides applied); None: the run's


def default_axes(recipe: Recipe, device: dict) -> dict[str, list[str]]:
    axes = {name: list(values) for name, values in AXES.items()}
    if device.get("device") != "cuda":
        axes["compile"] = list(CPU_DEFAULT_COMPILE)
    for name, values in recipe.axes.items():
        axes[name] = parse_axis_values(name, values)
    return axes


def plan_grid(recipe: Recipe, device: dict, axes: dict[str, list[str]] | None = None) -> list[PlannedProbe]:
    """Cross product of the axes (defaults filled in from the recipe and device), reference first."""
    chosen = default_axes(recipe, device)
    for name, values in (axes or {}).items():
        chosen[name] = parse_axis_values(name, values)
    cells = [Cell(d, a, c) for d, a, c in itertools.product(chosen["dtype"], chosen["attn"], chosen["compile"])]
    ordered = [REFERENCE_CELL] + [c for c in cells if c != REFERENCE_CELL]
    return [PlannedProbe(probe_id=c.id, cell=c, unsupported=cell_support(c, device), reference=c == REFERENCE_CELL)
            for c in ordered]
