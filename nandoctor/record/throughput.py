"""Tokens/s of a probe's steady steps, warm-up left out: what the ranking compares."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from .fields import known_fields
from .steps import Step

# A leading step slower than this share of the later steps' median rate is still warming up
# (allocator growth, lazy kernel choice, a compile or recompile); a step that is merely noisy is not.
WARMUP_RATE_SHARE = 0.5


def warmup_steps(rates: list[float]) -> int:
    """How many leading per-step rates (tokens/s) are warm-up: always the first, when there are
    others, then each next one slower than WARMUP_RATE_SHARE of the median of the steps after it,
    leaving at least half of them steady."""
    if len(rates) < 2:
        return 0
    n = 1
    while n < len(rates) // 2 and rates[n] < WARMUP_RATE_SHARE * statistics.median(rates[n + 1 :]):
        n += 1
    return n


@dataclass(frozen=True)
class Throughput:
    """Tokens/s of a probe's steady steps: the median and the spread of the per-step rates (quartiles,
    min, max), warm-up steps left out. The spread is what the ranking calls noise. A W-rank probe's
    rates count every rank's tokens (`devices` = W); `per_device` is what one of its devices did."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    steps: int  # steady steps measured
    warmup: int  # leading steps left out
    devices: int = 1  # the devices (ranks) whose tokens the rates count; records before it: one process

    @classmethod
    def of_rates(cls, rates: list[float], warmup: int = 0, devices: int = 1) -> Throughput | None:
        """From steady per-step rates (already without warm-up); None when there are none."""
        if not rates:
            return None
        q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive") if len(rates) > 1 else rates * 3
        return cls(statistics.median(rates), q1, q3, min(rates), max(rates), len(rates), warmup, devices)

    @classmethod
    def of(cls, steps: list[Step], devices: int = 1) -> Throughput | None:
        rates = steady_rates(steps)
        return cls.of_rates(rates[0], rates[1], devices)

    @classmethod
    def pooled(cls, runs: list[list[Step]], devices: int = 1) -> Throughput | None:
        """One figure from several probes of the same cell (re-timing rounds): their steady rates
        together, so that the spread covers the differences between rounds too."""
        steady = [steady_rates(steps) for steps in runs]
        return cls.of_rates([r for rates, _ in steady for r in rates], sum(w for _, w in steady), devices)

    @property
    def per_device(self) -> Throughput:
        """The same rates divided among the devices: what compares a W-rank probe with a one-process one."""
        rates = {name: getattr(self, name) / self.devices for name in ("median", "q1", "q3", "low", "high")}
        return dataclasses.replace(self, **rates, devices=1)

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median else math.inf

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Throughput | None:
        return cls(**known_fields(cls, data)) if data else None


def steady_rates(steps: list[Step]) -> tuple[list[float], int]:
    """(the steady steps' tokens/s, how many leading steps were warm-up); steps without a rate (a live
    run's batch without an attention mask) are left out."""
    rates = [s.tokens_per_s for s in steps if s.tokens_per_s]
    warmup = warmup_steps(rates)
    return rates[warmup:], warmup
