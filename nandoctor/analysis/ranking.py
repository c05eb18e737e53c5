"""Order stable probes. Pure: works on the run's probe table, never runs anything.

The order, best first:
1. fidelity to the fp32 reference, in buckets (Thresholds.fidelity_bucket), so that near-equal
   fidelity lets what follows decide; for an RL probe (objective=grpo), whose loss is no fidelity, the
   rollout's mismatch instead: its mean |dlogp| in buckets of the log-ratio bound it gives a long
   completion (Thresholds.rollout_bucket_nats at rollout_reference_tokens);
2. configurations no nandoctor rule flags before flagged ones;
3. speed per device (a W-rank probe's tokens/s over W: the probe table's `tokens_per_s`), but only
   where it is told apart from noise (`compare_speed`). Two cells re-timed in the same interleaved
   rounds are compared on their paired per-round ratios: one is faster only when the one-sided 95%
   lower bound of that ratio (Student's t over the rounds' log ratios, `ratio_interval`) is above
   1 + Thresholds.speed_margin, so the swing between rounds that a busy host makes is measured, not
   guessed. Any other pair is compared on its grid probes: faster only when the median is above the
   other's by more than the margin (on a loaded host, the wider margin load.unpaired_margin derives
   from the load each probe measured) AND the lower
   quartile is above the other's upper quartile. Starting from the fastest probe left, every probe
   not clearly slower than it forms one speed class;
4. inside a speed class, a fixed order of adoption (`adoption_key`): compile off before compiled
   ones (nothing to wait for, nothing to break), then precisions that keep fp32 master weights, no
   GradScaler and no fp8 conversion before those that do (the more robust first), then attention:
   plain `sdpa` (what transformers picks when none is named) before `eager` (one argument) before a
   pinned SDPA backend or a kernel package (code around the training loop, an extra install), then the
   default optimizer before one from another package; cell-table order settles the rest;
5. then lower peak memory, then closer fidelity, then the probe id (so the order of the rows does not
   matter).

A probe whose fidelity is unknown (no reference to compare with) ranks after every measured one.

So a recommendation changes between two runs only when one configuration is faster by more than
the noise both measured; otherwise the same fixed order picks the same one. docs/ranking.md says the
same for users.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pandas as pd

from ..cells import ATTENTIONS, COMPILATIONS, DEFAULT_OPTIMIZER, OPTIMIZERS, PRECISIONS
from ..record import Step, Throughput
from ..thresholds import THRESHOLDS, Thresholds

# transformers uses sdpa when no attn_implementation is given and torch supports it
# (PreTrainedModel's default attention choice in transformers v5): nothing for the user to set.
DEFAULT_ATTENTION = "sdpa"


def tokens_per_s(steps: list[Step]) -> float | None:
    """Median throughput of the steady steps (record.warmup_steps leaves out the warm-up ones)."""
    t = Throughput.of(steps)
    return t.median if t else None


def adoption_key(dtype: str | None, attn: str | None, compile: str | None, optimizer: str | None) -> tuple:
    """Sort key of a cell by what adopting it asks of a user: cheaper and more robust first (see the
    module docstring). Values the cell table does not know sort last."""

    def index(table: dict, name) -> int:
        return list(table).index(name) if name in table else len(table)

    c, p, a, o = (
        COMPILATIONS.get(compile),
        PRECISIONS.get(dtype),
        ATTENTIONS.get(attn),
        OPTIMIZERS.get(optimizer or DEFAULT_OPTIMIZER),
    )
    compile_key = (c is None, c.cost if c else 0, index(COMPILATIONS, compile))
    precision_key = (
        (p is None,)
        + ((p.weights is not None, p.fp8 is not None, p.scaler, p.autocast is not None) if p else ())
        + (index(PRECISIONS, dtype),)
    )
    attention_key = (
        (a is None,)
        + ((a.sdpa_backend is not None or a.package is not None, a.name != DEFAULT_ATTENTION) if a else ())
        + (index(ATTENTIONS, attn),)
    )
    optimizer_key = (
        (o is None,)
        + ((o.package is not None, o.name != DEFAULT_OPTIMIZER) if o else ())
        + (index(OPTIMIZERS, optimizer or DEFAULT_OPTIMIZER),)
    )
    return compile_key, precision_key, attention_key, optimizer_key


def fidelity_bucket(fidelity: float | None, t: Thresholds = THRESHOLDS) -> tuple[bool, float]:
    """The sort key of the bucket of fidelities the ranking treats as equal: (unknown, bucket). A probe
    whose fidelity is unknown (None or NaN: nothing to compare it with) sorts after every probe whose
    fidelity was measured; an infinite one sorts after every finite one."""
    try:
        fidelity = float(fidelity)
    except (TypeError, ValueError):
        return True, 0.0
    if math.isnan(fidelity):
        return True, 0.0
    return False, float(math.floor(fidelity / t.fidelity_bucket)) if math.isfinite(fidelity) else fidelity


def mismatch_bucket(mismatch: float | None, t: Thresholds = THRESHOLDS) -> tuple[bool, float]:
    """The sort key of an RL probe's rollout mismatch (mean |dlogp|) in the ranking: (unknown, bucket) of
    its log-ratio bound at rollout_reference_tokens, in rollout_bucket_nats steps; unknown sorts last."""
    bound = t.rollout_log_ratio(mismatch) if isinstance(mismatch, (int, float)) else None
    if bound is None:
        return True, 0.0
    return False, float(math.floor(bound / t.rollout_bucket_nats))


def order_bucket(fidelity: float | None, mismatch: float | None, t: Thresholds = THRESHOLDS) -> tuple:
    """The first sort key of the ranking: the mismatch bucket where an RL probe measured one, else the
    fidelity bucket."""
    if isinstance(mismatch, (int, float)) and not math.isnan(mismatch):
        return mismatch_bucket(mismatch, t)
    return fidelity_bucket(fidelity, t)


def _number(row, column: str, default: float) -> float:
    value = row.get(column) if hasattr(row, "get") else None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(value) else value


def _speed(row) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) tokens/s; a probe without a spread has none; without a
    rate it is the slowest."""
    median = _number(row, "tokens_per_s", 0.0)
    return median, _number(row, "tokens_per_s_q1", median), _number(row, "tokens_per_s_q3", median)


# One-sided 95% quantiles of Student's t distribution for 1..30 degrees of freedom (any table of it, e.g.
# the NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2); past 30, the normal quantile.
T95 = (
    6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
    1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
    1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
)  # fmt: skip
NORMAL95 = 1.645


@dataclass(frozen=True)
class RatioInterval:
    """a's tokens/s over b's across interleaved rounds both ran: the geometric mean of the per-round
    ratios and its one-sided 95% bounds (Student's t on the log ratios, the rounds' own swing as the noise)."""

    ratio: float
    low: float
    high: float
    ratios: tuple[float, ...]  # per round, in round order


def ratio_interval(ratios: list[float] | None) -> RatioInterval | None:
    """The RatioInterval of per-round ratios (paired_ratios); None for fewer than two."""
    if not ratios or len(ratios) < 2 or min(ratios) <= 0:
        return None
    logs = [math.log(r) for r in ratios]
    mean, bound = statistics.fmean(logs), log_bound(logs, len(logs))
    return RatioInterval(math.exp(mean), math.exp(mean - bound), math.exp(mean + bound), tuple(ratios))


def log_bound(logs: list[float], rounds: int) -> float:
    """The one-sided 95% half-width of the mean of per-round log ratios at `rounds` rounds, their swing
    (standard deviation) as `logs` show it: Student's t over the rounds' own noise."""
    quantile = T95[rounds - 2] if rounds - 1 <= len(T95) else NORMAL95
    return quantile * statistics.stdev(logs) / math.sqrt(rounds)


def provable(ratios: list[float] | None, rounds: int, t: Thresholds = THRESHOLDS) -> bool:
    """Whether `rounds` interleaved rounds could prove the gain the per-round `ratios` show so far, were
    their mean and swing to hold: the one-sided 95% lower bound (ratio_interval's) at that many rounds above
    1 + speed_margin. True where the ratios cannot say (fewer than two): nothing rules the gain out."""
    if not ratios or len(ratios) < 2 or min(ratios) <= 0:
        return True
    logs = [math.log(r) for r in ratios]
    return statistics.fmean(logs) - log_bound(logs, max(rounds, len(logs))) > math.log(1 + t.speed_margin)


ROUNDS, MARGIN, SPREAD = "rounds", "margin", "spread"  # which rule decided a comparison


@dataclass(frozen=True)
class SpeedComparison:
    """Whether speed a beats speed b beyond their noise, and the rule and figures that decided it."""

    faster: bool
    rule: str  # ROUNDS: the paired re-timing rounds; MARGIN: the medians; SPREAD: the interquartile ranges
    margin: float  # the relative gain a had to exceed
    a: tuple[float, float, float]  # (median, q1, q3) tokens/s per device
    b: tuple[float, float, float]
    interval: RatioInterval | None = None  # ROUNDS: the per-round ratios a / b and their bounds

    @property
    def gain(self) -> float:
        """a's median over b's (the rounds' geometric mean ratio when the rounds decided)."""
        if self.interval is not None:
            return self.interval.ratio
        return self.a[0] / self.b[0] if self.b[0] else math.inf


def compare_speed(
    a: tuple[float, float, float],
    b: tuple[float, float, float],
    t: Thresholds = THRESHOLDS,
    ratios: list[float] | None = None,
    margin: float | None = None,
) -> SpeedComparison:
    """Whether speed a = (median, q1, q3) beats b beyond their measured noise (see the module docstring).
    ratios: a's tokens/s over b's in each interleaved re-timing round both ran (paired_ratios); with two
    or more, they alone decide, with Thresholds.speed_margin: a must be faster than b by more than the
    margin at the one-sided 95% lower bound of their mean ratio. Otherwise the medians must differ by more
    than `margin` (Thresholds.speed_margin when None; on a loaded host the caller passes
    load.unpaired_margin) and the interquartile ranges must not overlap."""
    interval = ratio_interval(ratios)
    if interval is not None:
        return SpeedComparison(interval.low > 1 + t.speed_margin, ROUNDS, t.speed_margin, a, b, interval)
    margin = t.speed_margin if margin is None else max(t.speed_margin, margin)
    if not a[0] > b[0] * (1 + margin):
        return SpeedComparison(False, MARGIN, margin, a, b)
    return SpeedComparison(a[1] > b[2], SPREAD, margin, a, b)


def clearly_faster(
    a: tuple[float, float, float],
    b: tuple[float, float, float],
    t: Thresholds = THRESHOLDS,
    ratios: list[float] | None = None,
    margin: float | None = None,
) -> bool:
    """compare_speed(...).faster."""
    return compare_speed(a, b, t, ratios, margin).faster


def paired_ratios(rounds: dict[str, dict[int, float]] | None, a: str, b: str) -> list[float] | None:
    """Probe a's median tokens/s over probe b's, round by round, for the re-timing rounds both trained
    through (rounds: probe id -> {round: median}, analysis.outcomes.round_medians); None for fewer than two."""
    ra, rb = (rounds or {}).get(a) or {}, (rounds or {}).get(b) or {}
    ratios = [ra[n] / rb[n] for n in sorted(ra.keys() & rb.keys()) if rb[n] > 0]
    return ratios if len(ratios) >= 2 else None


def _intervals(rounds: dict[str, dict[int, float]], lead: str):
    """(other, RatioInterval of lead's per-round ratio over other's) for each other re-timed probe whose
    rounds give one."""
    for other in rounds:
        interval = ratio_interval(paired_ratios(rounds, lead, other)) if other != lead else None
        if interval is not None:
            yield other, interval


def undecided(rounds: dict[str, dict[int, float]], lead: str, t: Thresholds = THRESHOLDS) -> list[str]:
    """The re-timed probes the interleaved rounds cannot yet tell from `lead` (the fastest of them): the
    geometric mean of lead's per-round ratio over theirs is above 1 + speed_margin, but the one-sided 95%
    lower bound is not. More rounds may prove that gain; a cell whose mean ratio is already within the
    margin is a tie that more rounds would only confirm, so it is not listed (retime.py stops for it)."""
    return [other for other, i in _intervals(rounds, lead) if i.ratio > 1 + t.speed_margin >= i.low]


def told_apart(rounds: dict[str, dict[int, float]], lead: str, t: Thresholds = THRESHOLDS) -> list[str]:
    """The re-timed probes the interleaved rounds prove slower than `lead`: the one-sided 95% lower bound
    of lead's per-round ratio over theirs is above 1 + speed_margin (compare_speed's rule on rounds)."""
    return [other for other, i in _intervals(rounds, lead) if i.low > 1 + t.speed_margin]


def retime_candidates(
    speeds: dict[str, tuple[float, float, float]],
    tie_first: str | None,
    most: int,
    margin: float | None = None,
    t: Thresholds = THRESHOLDS,
) -> list[str]:
    """The probes of one fidelity bucket worth re-timing, fastest first: speeds holds each probe's (median,
    q1, q3) tokens/s per device as its grid probe measured it (every one the same kind of figure). Those
    the fastest does not beat on that figure (compare_speed with `margin`: on a loaded host the wider one
    its load could swing), the `most` fastest of them by median. tie_first (the one the fixed tie order
    puts first, the winner if they all tie) takes the last place when the grid cannot tell it from the
    slowest of the others kept: one lucky-fast grid probe must not leave it out, and whether noise put it
    third or fourth must not decide the recommendation. [] for fewer than two."""
    by_speed = sorted(speeds, key=lambda p: -speeds[p][0])
    fastest = speeds[by_speed[0]] if by_speed else None
    near = [p for p in by_speed if not compare_speed(fastest, speeds[p], t, None, margin).faster]
    picked = near[:most]
    if tie_first in speeds and tie_first not in picked:
        kept = [p for p in near if p != tie_first][: most - 1]
        if not compare_speed(speeds[kept[-1]], speeds[tie_first], t, None, margin).faster:
            picked = kept + [tie_first]
    return picked if len(picked) > 1 else []


def tie_key(row) -> tuple:
    """Adoption order, then lower peak memory (unknown last), then closer fidelity (unknown last), then the
    probe id, so that the order does not depend on the order the rows came in."""
    cell = [row.get(axis) if hasattr(row, "get") else None for axis in ("dtype", "attn", "compile", "optimizer")]
    probe_id = row.get("probe_id") if hasattr(row, "get") else None
    return (
        adoption_key(*cell),
        _number(row, "peak_memory_bytes", math.inf),
        _number(row, "fidelity", math.inf),
        str(probe_id) if probe_id is not None else "",
    )


def rank(
    table: pd.DataFrame,
    t: Thresholds = THRESHOLDS,
    rounds: dict[str, dict[int, float]] | None = None,
    margin: float | None = None,
) -> pd.DataFrame:
    """The rows of `table` best first, with a `speed_class` column (0 for the fastest class of each
    fidelity bucket; rows of one class are equally fast within their noise). Columns read: fidelity (or
    rollout_logp_diff where an RL probe measured it: order_bucket),
    tokens_per_s (per device), peak_memory_bytes; optionally tokens_per_s_q1 / _q3 (the spread), flags,
    retimed (the re-timed rows of a bucket rank ahead of the others) and the cell's dtype / attn /
    compile / optimizer (the tie order). rounds: the re-timed probes' median tokens/s per interleaved
    round (round_medians), compared round by round; margin: the one grid probes are compared with
    (compare_speed; None: the quiet Thresholds.speed_margin)."""
    rows = {i: table.loc[i] for i in table.index}
    flags = table["flags"].fillna("").astype(bool) if "flags" in table else pd.Series(False, index=table.index)
    retimed = table["retimed"].fillna(False).astype(bool) if "retimed" in table else pd.Series(False, index=table.index)
    groups: dict[tuple, list] = {}
    for i in table.index:
        fidelity = rows[i].get("fidelity") if hasattr(rows[i], "get") else None
        mismatch = rows[i].get("rollout_logp_diff") if hasattr(rows[i], "get") else None
        groups.setdefault((order_bucket(fidelity, mismatch, t), bool(flags[i])), []).append(i)
    order, classes = [], {}
    for key in sorted(groups):
        # The re-timed rows of a bucket come first: they were its leaders when the re-timing chose them,
        # and a row left out (beyond RETIME_MOST_CELLS) was behind each of them then. Its figure, from a
        # longer probe at another time, is not compared with theirs.
        speed_class = 0
        for part in ([i for i in groups[key] if retimed[i]], [i for i in groups[key] if not retimed[i]]):
            left = sorted(part, key=lambda i: (-_speed(rows[i])[0], tie_key(rows[i])))
            while left:
                lead, lead_id = _speed(rows[left[0]]), str(rows[left[0]].get("probe_id"))
                tied = [left[0]] + [
                    i
                    for i in left[1:]
                    if not clearly_faster(
                        lead, _speed(rows[i]), t, paired_ratios(rounds, lead_id, str(rows[i].get("probe_id"))), margin
                    )
                ]
                tied.sort(key=lambda i: tie_key(rows[i]))
                order += tied
                classes.update({i: speed_class for i in tied})
                left = [i for i in left if i not in tied]
                speed_class += 1
    out = table.loc[order].copy()
    out["speed_class"] = [classes[i] for i in order]
    return out
