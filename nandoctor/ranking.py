"""Order stable probes: fidelity to the fp32 reference first (in buckets, so that near-equal fidelity
lets speed decide), then tokens/s, then peak memory. Pure: works on plain numbers."""
from __future__ import annotations

import math
import statistics

from .config import THRESHOLDS, Thresholds


def tokens_per_s(steps: list[dict]) -> float | None:
    """Median throughput, leaving out step 0 (allocator warm-up, compilation) when there are others."""
    rates = [s["tokens_per_s"] for s in steps[1:] or steps if s.get("tokens_per_s")]
    return statistics.median(rates) if rates else None


def rank_key(fidelity: float | None, speed: float | None, memory: int | None, t: Thresholds = THRESHOLDS):
    bucket = math.floor(fidelity / t.fidelity_bucket) if fidelity is not None else 0
    return (bucket, -(speed or 0.0), memory or 0)


def rank(rows: list[dict], t: Thresholds = THRESHOLDS) -> list[dict]:
    """rows: dicts with 'fidelity', 'tokens_per_s', 'peak_memory_bytes'. Returns them best first."""
    return sorted(rows, key=lambda r: rank_key(r.get("fidelity"), r.get("tokens_per_s"), r.get("peak_memory_bytes"), t))
