"""Before a grid names a winner on speed, time the cells that speed decides between again, back to back
and interleaved, the way careful benchmarks compare two programs: a few short probes per cell, in
rounds A B C, then C B A, on one slot, so that whatever else the host does in those seconds weighs
on every cell alike. The grid's own probes ran minutes apart, each under whatever load there was then.

Which cells: analysis.run.speed_decides (the recommended one's fidelity bucket, at most
RETIME_MOST_CELLS). What is kept: retime.json beside results.jsonl (the probes' folders under retime/),
every round's steps, throughput and host load; the analysis then ranks those cells on their pooled
rounds (analysis.run.retimed_throughput). Runs probes, so it sits with the API, not in the analysis.
"""

from __future__ import annotations

import dataclasses
import time

from .analysis.run import analyze, speed_decides
from .config import Recipe
from .plan import PlannedProbe
from .run.session import Session
from .run.store import RETIME_FILE

# Rounds: the recipe's retime_rounds, default 2: A B then B A, so a load that rises or falls across the
# rounds weighs on each cell alike. 0 turns the re-timing off.
RETIME_STEPS = 5  # per round: the warm-up step and 4 steady ones, ~0.3 s of a tiny model on a quiet CPU
RETIME_MOST_CELLS = 3  # bounds the cost: 6 short probes at most


def interleaved(cells: list[str], rounds: int) -> list[tuple[str, int]]:
    """(probe id, round) in run order: round 1 in rank order, round 2 reversed, and so on (A B, B A, A B),
    so that load rising or falling across the rounds favours no cell."""
    return [(cell, r) for r in range(1, rounds + 1) for cell in (cells if r % 2 else cells[::-1])]


def retime_leaders(session: Session, recipe: Recipe, on_start=None) -> dict | None:
    """Re-time the grid's leading cells (see the module docstring) and write retime.json; returns what
    it wrote, or None when speed decides nothing (one cell in the top bucket), the recipe turned it off
    (retime_rounds=0) or it was done already.
    on_start(cells, rounds, steps) is called before the first probe."""
    rounds = recipe.retime_rounds
    if not rounds or session.store.read_json(RETIME_FILE) is not None:
        return None
    leaders = speed_decides(analyze(session.dir), RETIME_MOST_CELLS)
    if not leaders:
        return None
    cells = [o.probe_id for o in leaders]
    if on_start:
        on_start(cells, rounds, RETIME_STEPS)
    of = {o.probe_id: o for o in leaders}
    timing_recipe = dataclasses.replace(recipe, forensics_steps=0)  # the replay times nothing
    order = interleaved(cells, rounds)
    probes = [
        PlannedProbe(f"{cell} retime{r}", of[cell].record.cell, seed_offset=of[cell].record.seed - recipe.seed)
        for cell, r in order
    ]
    t0 = time.monotonic()
    records = session.time_only(timing_recipe, probes, RETIME_STEPS)
    timing = {
        "cells": cells,
        "rounds": rounds,
        "steps": RETIME_STEPS,
        "order": [p.probe_id for p in probes],
        "wall_s": time.monotonic() - t0,
        "probes": [
            {
                "probe_id": r.probe_id,
                "of": cell,
                "round": n,
                "status": r.status,
                "steps": [s.to_dict() for s in r.steps],
                "throughput": r.throughput.to_dict() if r.throughput else None,
                "host_load": r.host_load,
                "wall_s": r.wall_s,
            }
            for r, (cell, n) in zip(records, order)
        ],
    }
    session.store.write_json(RETIME_FILE, timing)
    return timing
