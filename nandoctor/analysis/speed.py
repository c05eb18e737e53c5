"""How fast each probe ran, as the ranking compares it: tokens/s per device, from the grid's own probe or
from the interleaved re-timing rounds (retime.json), and the per-round figures those rounds pair up.

Per device: a parallel probe's steps count the tokens of all its W ranks, so its tokens/s is W devices'
work; ranked against one-process cells on that figure, a 2-rank probe would win on the second device
alone. Every figure the ranking reads is divided by the probe's devices (its Throughput.devices, or its
world size for records written before that field; 1 for one process), and the reports say so. Pure:
reads records and retime.json."""

from __future__ import annotations

import dataclasses

from ..record import ProbeRecord, Step, Throughput


def devices(record: ProbeRecord) -> int:
    """The devices (ranks) a probe trained on: its throughput's (Throughput.devices, which the probe
    body records), else its measured world size, else the recipe's for a parallel cell (records written
    before either), else 1."""
    if record.throughput is not None and record.throughput.devices > 1:
        return record.throughput.devices
    measured = (record.parallel or {}).get("world_size")
    if isinstance(measured, int) and measured > 0:
        return measured
    if record.cell.parallel_row.wrapper:
        return int((record.recipe or {}).get("world_size") or 1)
    return 1


def per_device(t: Throughput | None, n: int) -> Throughput | None:
    """A throughput whose rates count n devices' tokens, as one device's (Throughput.per_device); a
    figure that does not say its devices (steps pooled here, an older record) counts n."""
    if t is None:
        return None
    if t.devices == 1 and n > 1:
        t = dataclasses.replace(t, devices=n)
    return t.per_device if t.devices > 1 else t


def grid_throughput(record: ProbeRecord) -> Throughput | None:
    """What the grid's own probe measured, per device."""
    return per_device(record.throughput or Throughput.of(record.steps), devices(record))


def retimed_rounds(timing: dict | None) -> list[tuple[str, object, list[Step]]]:
    """(probe id, round, steps) of each re-timing round that trained to the end (retime.json)."""
    return [
        (p["of"], p.get("round"), [Step.from_dict(s) for s in p.get("steps") or []])
        for p in (timing or {}).get("probes", [])
        if p.get("status") == "ok"
    ]


def retimed_throughput(timing: dict | None, world: dict[str, int] | None = None) -> dict[str, Throughput]:
    """Probe id -> its throughput per device over the re-timing rounds that trained to the end
    (retime.json); world: probe id -> its devices (1 when absent)."""
    runs: dict[str, list[list[Step]]] = {}
    for of, _, steps in retimed_rounds(timing):
        runs.setdefault(of, []).append(steps)
    pooled = {of: per_device(Throughput.pooled(steps), (world or {}).get(of, 1)) for of, steps in runs.items()}
    return {of: t for of, t in pooled.items() if t}


def round_medians(timing: dict | None, world: dict[str, int] | None = None) -> dict[str, dict[int, float]]:
    """Probe id -> {re-timing round: the median tokens/s per device of that round's steady steps}, for the
    rounds that trained to the end (retime.json): what ranking.paired_ratios compares round by round."""
    out: dict[str, dict[int, float]] = {}
    for of, n, steps in retimed_rounds(timing):
        t = Throughput.of(steps)
        if t and isinstance(n, int):
            out.setdefault(of, {})[n] = t.median / (world or {}).get(of, 1)
    return out
