"""Before a grid names a winner on speed, time the cells that speed decides between again, back to back and
interleaved, the way careful benchmarks compare two programs: a few short probes per cell, in rounds A B
C, then C B A, on one slot, so that whatever else the host does in those seconds weighs on every cell
alike. The grid's own probes ran minutes apart, each under whatever load there was then.

Which cells (`choose`): analysis.outcomes.speed_candidates, per kind of hardware, from the recommended
one's fidelity bucket: the RETIME_MOST_CELLS fastest by their grid probes' tokens/s (never the first few
of the tie order: on a loaded host the wide margin leaves the tie order to decide nearly every place),
less those the fastest beats on the grid's own probes beyond the loaded margin (ranking.compare_speed,
at least Thresholds.loaded_speed_margin, wider when the grid's probes measured more load:
load.unpaired_margin); the tie order's first takes the last place when the grid cannot tell it from the
slowest of the others kept, since a tie would pick it. Then the budget: the re-timing may take
RETIME_SHARE of the grid's summed training time (its probes' train_s), so that it costs the same share
of a tiny grid as of a large one and grows with a loaded host's slower grid. Each cell's round is
estimated from its grid probe (start-up, first step and RETIME_STEPS - 1 steady steps); the fastest and
the tie order's first are kept (by_priority), the others while their first retime_rounds rounds fit, and
when not even those two fit nothing is re-timed ("over budget", said with the estimate): the grid's own
probes decide.

How many rounds: the recipe's retime_rounds at least; then, as pyperf calibrates its runs, two more at a
time for as long as the fastest cell's gain over another is above the speed margin on average but not
yet at the one-sided 95% lower bound of its per-round ratio (analysis.ranking.undecided), more rounds
can still change the recommendation (`settled`: the tie order's first among the cells not proven slower
than the fastest is one of those open gaps), another two rounds still fit in the budget at the rounds'
own cost so far, and the rounds that fit could prove one of the open gaps were its per-round mean and
swing so far to hold (`out_of_reach`: a 1.09x gap whose two rounds swing to a 0.48x lower bound is not
proven by two more, and those rounds would only spend the user's time). Gaps that cannot change the
recommendation stay "not told apart" in the ranking: the user's wall time goes to the question they
asked. A busy host swings the per-round ratios, so it takes more rounds to tell a real gap from the
swing; a quiet one seldom needs more than the first.

It says what it does (`on_news`, a RetimeNews each): before the first rounds, before each two added,
when it re-times nothing, and, while a round runs, at least every RETIME_SAY_S, so that no ten seconds
pass without a line; no two lines are the same.

What is kept: retime.json beside results.jsonl (the probes' folders under retime/), every round's steps,
throughput and host load, the rounds run, the budget and why the re-timing stopped ("decided",
"settled", "budget", "out of reach" or "over budget"); the analysis then ranks those cells on their
pooled rounds and compares them round by round (analysis.speed). Runs probes, so it sits with the API,
not in the analysis.
"""

from __future__ import annotations

import dataclasses
import time

from .analysis.outcomes import ProbeOutcome, RunAnalysis, analyze, speed_candidates, tie_first, tie_order_key
from .analysis.ranking import paired_ratios, provable, ratio_interval, told_apart, undecided
from .analysis.speed import devices, retimed_throughput, round_medians
from .config import Recipe
from .plan import PlannedProbe
from .record import ProbeRecord
from .run.session import Session
from .run.store import RETIME_FILE

RETIME_STEPS = 5  # per round: the warm-up step and 4 steady ones, ~0.3 s of a tiny model on a quiet CPU
RETIME_MOST_CELLS = 3  # bounds the cost of the first rounds: 6 short probes at most
# The re-timing's whole wall time, extra rounds included, as a share of the grid's summed training time
# (issue 34: a re-timing that took longer than the 8-cell grid it ranked decided a 4% gap nobody asked
# about). A tiny model's 8-cell grid trains ~10 s on a quiet 2-core CPU: ~1.5 s of rounds.
RETIME_SHARE = 0.15
RETIME_SAY_S = 9.0  # while rounds run, a line at least this often (the scheduler looks every second)
# why the re-timing stopped
DECIDED, SETTLED, BUDGET, OVER_BUDGET, OUT_OF_REACH = "decided", "settled", "budget", "over budget", "out of reach"
# the most two-round batches plan_more projects over when the rounds so far cost nothing measurable
MOST_BATCHES = 50


@dataclasses.dataclass(frozen=True)
class RetimeNews:
    """What the re-timing is doing, for a line of progress. kind: "start" (the first rounds), "more" (two
    rounds added: `open` holds each gap still open as (faster, slower, RatioInterval)), "running" (a round
    runs: `probe` is it), "over budget" (nothing re-timed: `estimate_s` is what the first rounds would
    take)."""

    kind: str
    cells: list[str]
    rounds: tuple[int, int]  # the first and last round of this step
    steps: int
    elapsed_s: float
    budget_s: float
    train_s: float  # the grid's summed training time the budget is a share of
    open: list = dataclasses.field(default_factory=list)
    probe: str | None = None
    estimate_s: float | None = None
    share: float = RETIME_SHARE


def retime_budget(grid: RunAnalysis) -> tuple[float, float]:
    """(budget_s, the grid's summed train_s): RETIME_SHARE of the time its probes trained."""
    train_s = sum(o.record.train_s or 0.0 for o in grid.outcomes)
    return RETIME_SHARE * train_s, train_s


def round_cost(o: ProbeOutcome) -> float:
    """A re-timing probe's wall time, estimated from the cell's grid probe: its start-up (wall_s less
    train_s), its first step (the warm-up), and RETIME_STEPS - 1 of its steady steps."""
    r = o.record
    times = [s.time_s for s in r.steps if s.time_s is not None]
    if not times or r.wall_s is None:
        return r.wall_s or 0.0
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    return max(0.0, r.wall_s - (r.train_s or sum(times))) + times[0] + (RETIME_STEPS - 1) * steady


def by_priority(kind: list[ProbeOutcome]) -> list[ProbeOutcome]:
    """One bucket's candidates (fastest first) in the order the budget keeps them: the fastest on its grid
    probe, the tie order's first (the winner if they all tie), then the others, fastest first."""
    first = tie_first(kind)
    return [kind[0], *(o for o in kind if o is first and o is not kind[0]), *(o for o in kind[1:] if o is not first)]


def choose(grid: RunAnalysis, rounds: int, budget_s: float) -> tuple[list[ProbeOutcome], float]:
    """(the cells to re-time, the first rounds' estimated wall time), see the module docstring: per kind
    of hardware, analysis.outcomes.speed_candidates (the fastest on their grid probes, and the tie order's first
    when the grid cannot tell it from them), cut to the budget: the two first by_priority always, the
    others while their rounds fit. ([], estimate) when not even the first two of a kind fit: nothing to
    re-time. The cells come in run order: fastest on its grid probe first."""
    picked = [by_priority(kind) for kind, _ in speed_candidates(grid, RETIME_MOST_CELLS)]
    estimate = rounds * sum(round_cost(o) for kind in picked for o in kind[:2])
    if not picked or estimate > budget_s:
        return [], estimate
    kept = [kind[:2] for kind in picked]
    for kind, chosen in zip(picked, kept):
        for o in kind[2:]:
            more = estimate + rounds * round_cost(o)
            if more <= budget_s:
                chosen.append(o)
                estimate = more
    run_order = [o for kind, _ in speed_candidates(grid, RETIME_MOST_CELLS) for o in kind]
    order = {id(o): i for i, o in enumerate(run_order)}
    return sorted((o for chosen in kept for o in chosen), key=lambda o: order[id(o)]), estimate


def interleaved(cells: list[str], rounds: int, first: int = 1) -> list[tuple[str, int]]:
    """(probe id, round) in run order for rounds first..first+rounds-1: odd rounds in rank order, even
    ones reversed (A B, B A, A B), so that load rising or falling across the rounds favours no cell."""
    return [(cell, r) for r in range(first, first + rounds) for cell in (cells if r % 2 else cells[::-1])]


def standing(timing: dict, world: dict[str, int]) -> tuple[dict, str | None]:
    """The rounds so far (analysis.speed.round_medians) and the fastest re-timed cell by its pooled rounds
    (None with fewer than two cells re-timed): what every decision on more rounds starts from."""
    rounds = round_medians(timing, world)
    pooled = retimed_throughput(timing, world)
    lead = max(pooled, key=lambda cell: pooled[cell].median) if len(pooled) >= 2 else None
    return rounds, lead


def still_open(timing: dict, world: dict[str, int]) -> list[str]:
    """The cells the next rounds would re-time: the fastest re-timed cell and those it may be faster than
    by more than the margin but the rounds cannot yet tell (ranking.undecided); [] when every gap is
    decided."""
    rounds, lead = standing(timing, world)
    others = undecided(rounds, lead) if lead else []
    return [cell for cell in timing["cells"] if cell == lead or cell in others] if others else []


def open_gaps(timing: dict, world: dict[str, int]) -> list[tuple[str, str, object]]:
    """(fastest, other, RatioInterval) for each gap still_open, for the line that says why rounds are added."""
    more = still_open(timing, world)
    if not more:
        return []
    rounds, lead = standing(timing, world)
    return [(lead, c, ratio_interval(paired_ratios(rounds, lead, c))) for c in more if c != lead]


def settled(timing: dict, rounds: dict, lead: str, more: list[str]) -> bool:
    """Whether more rounds can no longer change which cell is recommended: of the re-timed cells not
    proven slower than the fastest (`lead`, with the `rounds` so far: standing), the tie order's first
    (timing["tie_order"]) is the fastest itself or one within the margin of it, not one of the open gaps
    (`more`). False without a tie order (a retime.json written before it was kept)."""
    order = timing.get("tie_order")
    if not order:
        return False
    slower = set(told_apart(rounds, lead))
    first = next((cell for cell in order if cell not in slower), None)
    return first is not None and (first == lead or first not in more)


def plan_more(timing: dict, world: dict[str, int], elapsed_s: float, budget_s: float | None = None) -> list[str]:
    """The cells to re-time in two more rounds (still_open), or [] with timing["stopped"] set: DECIDED
    when no gap is open, SETTLED when the open gaps cannot change the recommendation (`settled`), BUDGET
    when two more rounds of them, at the rounds' mean cost per probe so far, would end past budget_s (by
    default timing["budget_s"]), OUT_OF_REACH when the rounds that do fit could not prove any open gap at
    the swing the rounds so far show (`out_of_reach`). Pure: retime.json so far in."""
    budget_s = timing["budget_s"] if budget_s is None else budget_s
    more = still_open(timing, world)
    if not more:
        timing["stopped"] = DECIDED
        return []
    rounds, lead = standing(timing, world)
    if settled(timing, rounds, lead, more):
        timing["stopped"] = SETTLED
        return []
    per_probe = elapsed_s / max(1, len(timing["probes"]))
    batch = per_probe * 2 * len(more)
    if elapsed_s + batch > budget_s:
        timing["stopped"] = BUDGET
        return []
    batches = int((budget_s - elapsed_s) // batch) if batch > 0 else MOST_BATCHES
    if out_of_reach(timing, rounds, lead, more, batches):
        timing["stopped"] = OUT_OF_REACH
        return []
    return more


def out_of_reach(timing: dict, rounds: dict, lead: str, more: list[str], batches: int) -> bool:
    """Whether no gap still open (`more`) could be proven in the rounds the budget has left, `batches` of
    two: each gap's per-round ratios so far (`rounds`, against `lead`: standing), their mean and swing
    held, would still leave its lower bound at or under the margin after them (ranking.provable). Rounds
    that could not decide are not run."""
    reach = max((p["round"] for p in timing["probes"]), default=0) + 2 * batches
    return not any(provable(paired_ratios(rounds, lead, c), reach) for c in more if c != lead)


class Ticker:
    """Hands each RetimeNews on and, while a round runs, says so once RETIME_SAY_S have passed without a
    line (the scheduler's heartbeat calls it at least every second)."""

    def __init__(self, on_news, t0: float, budget_s: float, train_s: float):
        self.on_news, self.t0, self.budget_s, self.train_s = on_news, t0, budget_s, train_s
        self.said_at = t0

    def __call__(self, kind: str, cells: list[str], rounds: tuple[int, int], **more) -> None:
        now = time.monotonic()
        self.said_at = now
        if self.on_news:
            news = RetimeNews(kind, cells, rounds, RETIME_STEPS, now - self.t0, self.budget_s, self.train_s, **more)
            self.on_news(news)

    def alive(self, running, step_of=None) -> None:
        if running and time.monotonic() - self.said_at >= RETIME_SAY_S:
            probe = running[0].task.probe_id
            cell, _, n = probe.rpartition(" retime")
            self("running", [cell], (int(n), int(n)), probe=probe)


def retime_leaders(session: Session, recipe: Recipe, on_news=None) -> dict | None:
    """Re-time the grid's leading cells (see the module docstring) and write retime.json; returns what
    it wrote, or None when speed decides nothing (one cell in the top bucket, or the grid's own probes
    tell the others apart beyond any load's swing), the recipe turned it off (retime_rounds=0) or it was
    done already. on_news(RetimeNews) hears what it does."""
    rounds = recipe.retime_rounds
    if not rounds or session.store.read_json(RETIME_FILE) is not None:
        return None
    grid = analyze(session.dir)
    budget_s, train_s = retime_budget(grid)
    leaders, estimate = choose(grid, rounds, budget_s)
    t0 = time.monotonic()
    tick = Ticker(on_news, t0, budget_s, train_s)
    base = {"min_rounds": rounds, "budget_s": budget_s, "budget_share": RETIME_SHARE, "grid_train_s": train_s}
    # the fixed tie order of the re-timed cells, which picks between those the rounds do not tell apart
    base["tie_order"] = [o.probe_id for o in sorted(leaders, key=tie_order_key)]
    if not leaders:
        wanted = [o.probe_id for kind, _ in speed_candidates(grid, RETIME_MOST_CELLS) for o in by_priority(kind)[:2]]
        if estimate <= budget_s or len(wanted) < 2:  # the grid's probes alone tell them apart
            return None
        tick(OVER_BUDGET, wanted, (1, rounds), estimate_s=estimate)
        timing = {"cells": wanted, "rounds": 0, **base, "steps": RETIME_STEPS, "order": [], "probes": []}
        timing |= {"wall_s": 0.0, "estimate_s": estimate, "tie_order_added": [], "stopped": OVER_BUDGET}
        session.store.write_json(RETIME_FILE, timing)
        return timing
    cells = [o.probe_id for o in leaders]
    added = [o.probe_id for _, o in speed_candidates(grid, RETIME_MOST_CELLS) if o is not None and o in leaders]
    of = {o.probe_id: o for o in leaders}
    world = {o.probe_id: devices(o.record) for o in leaders}
    timing_recipe = dataclasses.replace(recipe, forensics_steps=0)  # the replay times nothing
    order, records, more, gaps = [], [], cells, []
    while more:
        first, n = (order[-1][1] + 1, 2) if order else (1, rounds)  # after the first rounds, two at a time
        tick("more" if order else "start", more, (first, first + n - 1), open=gaps, estimate_s=estimate)
        extra = interleaved(more, n, first)
        records += run_rounds(session, timing_recipe, recipe, of, extra, tick.alive)
        order += extra
        timing = {**timing_record(cells, order, records, t0), **base, "tie_order_added": added}
        more = plan_more(timing, world, time.monotonic() - t0)
        gaps = open_gaps(timing, world) if more else []
    session.store.write_json(RETIME_FILE, timing)
    return timing


def run_rounds(
    session: Session, timing_recipe: Recipe, recipe: Recipe, of: dict, order: list[tuple[str, int]], on_alive=None
) -> list[ProbeRecord]:
    """One short timing probe per (cell, round), in that order, on one slot."""
    probes = [
        PlannedProbe(f"{cell} retime{r}", of[cell].record.cell, seed_offset=of[cell].record.seed - recipe.seed)
        for cell, r in order
    ]
    return session.time_only(timing_recipe, probes, RETIME_STEPS, on_alive)


def timing_record(cells: list[str], order: list[tuple[str, int]], records: list[ProbeRecord], t0: float) -> dict:
    """retime.json's content for the rounds run so far (the budget and `stopped` are added by the caller)."""
    return {
        "cells": cells,
        "rounds": max(r for _, r in order),
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
