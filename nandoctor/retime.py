"""Before a grid names a winner on speed, time the cells that speed decides between again, back to back
and interleaved, the way careful benchmarks compare two programs: a few short probes per cell, in
rounds A B C, then C B A, on one slot, so that whatever else the host does in those seconds weighs
on every cell alike. The grid's own probes ran minutes apart, each under whatever load there was then.

Which cells: analysis.run.speed_decides (the recommended one's fidelity bucket, at most
RETIME_MOST_CELLS, always with the one the tie order puts first). How many rounds: the recipe's
retime_rounds at least; then, as pyperf calibrates its runs, two more at a time for as long as the
fastest cell's gain over another is above the speed margin on average but not yet at the one-sided 95%
lower bound of its per-round ratio (analysis.ranking.undecided), and another two rounds still fit in
RETIME_BUDGET_S. A busy host swings the per-round ratios, so it takes more rounds to tell a real gap
from the swing; a quiet one seldom needs more than the first. The budget is a constant here, not a
recipe field: the recipe's retime_rounds stays the minimum (0 turns the re-timing off).

What is kept: retime.json beside results.jsonl (the probes' folders under retime/), every round's
steps, throughput and host load, the rounds run and why the re-timing stopped ("decided" or "budget");
the analysis then ranks those cells on their pooled rounds and compares them round by round
(analysis.speed). Runs probes, so it sits with the API, not in the analysis.
"""

from __future__ import annotations

import dataclasses
import time

from .analysis.ranking import undecided
from .analysis.run import analyze, speed_decides, tie_order_added
from .analysis.speed import devices, retimed_throughput, round_medians
from .config import Recipe
from .plan import PlannedProbe
from .record import ProbeRecord
from .run.session import Session
from .run.store import RETIME_FILE

RETIME_STEPS = 5  # per round: the warm-up step and 4 steady ones, ~0.3 s of a tiny model on a quiet CPU
RETIME_MOST_CELLS = 3  # bounds the cost of the first rounds: 6 short probes at most
# The whole re-timing's wall time, extra rounds included: a tiny model's round of 3 cells takes ~2 s on
# a quiet 2-core CPU and ~10 s with a busy loop on each core (bench/RESULTS.md), so a loaded host gets
# about a dozen rounds; a large model's first rounds may use it all, and then no round is added.
RETIME_BUDGET_S = 120.0
DECIDED, BUDGET = "decided", "budget"  # why the re-timing stopped


def interleaved(cells: list[str], rounds: int, first: int = 1) -> list[tuple[str, int]]:
    """(probe id, round) in run order for rounds first..first+rounds-1: odd rounds in rank order, even
    ones reversed (A B, B A, A B), so that load rising or falling across the rounds favours no cell."""
    return [(cell, r) for r in range(first, first + rounds) for cell in (cells if r % 2 else cells[::-1])]


def still_open(timing: dict, world: dict[str, int]) -> list[str]:
    """The cells the next rounds would re-time: the fastest re-timed cell and those it may be faster than
    by more than the margin but the rounds cannot yet tell (ranking.undecided); [] when every gap is
    decided."""
    rounds = round_medians(timing, world)
    pooled = retimed_throughput(timing, world)
    if len(pooled) < 2:
        return []
    lead = max(pooled, key=lambda cell: pooled[cell].median)
    others = undecided(rounds, lead)
    return [cell for cell in timing["cells"] if cell == lead or cell in others] if others else []


def plan_more(timing: dict, world: dict[str, int], elapsed_s: float, budget_s: float = RETIME_BUDGET_S) -> list[str]:
    """The cells to re-time in two more rounds (still_open), or [] with timing["stopped"] set: DECIDED
    when no gap is open, BUDGET when two more rounds of them, at the rounds' mean cost per probe so far,
    would end past budget_s. Pure: retime.json so far in."""
    more = still_open(timing, world)
    if not more:
        timing["stopped"] = DECIDED
        return []
    per_probe = elapsed_s / max(1, len(timing["probes"]))
    if elapsed_s + per_probe * 2 * len(more) > budget_s:
        timing["stopped"] = BUDGET
        return []
    return more


def retime_leaders(session: Session, recipe: Recipe, on_start=None) -> dict | None:
    """Re-time the grid's leading cells (see the module docstring) and write retime.json; returns what
    it wrote, or None when speed decides nothing (one cell in the top bucket), the recipe turned it off
    (retime_rounds=0) or it was done already.
    on_start(cells, rounds, steps) is called before the first rounds and before each two rounds added."""
    rounds = recipe.retime_rounds
    if not rounds or session.store.read_json(RETIME_FILE) is not None:
        return None
    grid = analyze(session.dir)
    leaders = speed_decides(grid, RETIME_MOST_CELLS)
    if not leaders:
        return None
    cells = [o.probe_id for o in leaders]
    added = [o.probe_id for o in tie_order_added(grid, RETIME_MOST_CELLS)]
    of = {o.probe_id: o for o in leaders}
    world = {o.probe_id: devices(o.record) for o in leaders}
    timing_recipe = dataclasses.replace(recipe, forensics_steps=0)  # the replay times nothing
    t0, order, records, more = time.monotonic(), [], [], cells
    while more:
        first, n = (order[-1][1] + 1, 2) if order else (1, rounds)  # after the first rounds, two at a time
        if on_start:
            on_start(more, n, RETIME_STEPS)
        extra = interleaved(more, n, first)
        records += run_rounds(session, timing_recipe, recipe, of, extra)
        order += extra
        timing = {**timing_record(cells, rounds, order, records, t0), "tie_order_added": added}
        more = plan_more(timing, world, time.monotonic() - t0)
    session.store.write_json(RETIME_FILE, timing)
    return timing


def run_rounds(
    session: Session, timing_recipe: Recipe, recipe: Recipe, of: dict, order: list[tuple[str, int]]
) -> list[ProbeRecord]:
    """One short timing probe per (cell, round), in that order, on one slot."""
    probes = [
        PlannedProbe(f"{cell} retime{r}", of[cell].record.cell, seed_offset=of[cell].record.seed - recipe.seed)
        for cell, r in order
    ]
    return session.time_only(timing_recipe, probes, RETIME_STEPS)


def timing_record(
    cells: list[str], least: int, order: list[tuple[str, int]], records: list[ProbeRecord], t0: float
) -> dict:
    """retime.json's content for the rounds run so far (`stopped` is added once the re-timing ends)."""
    return {
        "cells": cells,
        "rounds": max(r for _, r in order),
        "min_rounds": least,
        "budget_s": RETIME_BUDGET_S,
        "steps": RETIME_STEPS,
        "order": [f"{cell} retime{r}" for cell, r in order],
        "wall_s": time.monotonic() - t0,
        "probes": [
            {
                "probe_id": rec.probe_id,
                "of": cell,
                "round": n,
                "status": rec.status,
                "steps": [s.to_dict() for s in rec.steps],
                "throughput": rec.throughput.to_dict() if rec.throughput else None,
                "host_load": rec.host_load,
                "wall_s": rec.wall_s,
            }
            for rec, (cell, n) in zip(records, order)
        ],
    }
