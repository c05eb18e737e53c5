"""Order stable probes: fidelity to the fp32 reference first (in buckets, so that near-equal fidelity
lets speed decide), then unflagged before flagged by nandoctor's own rules, then tokens/s, then peak
memory. Pure: works on the run's probe table."""
from __future__ import annotations

import statistics

import numpy as np
import pandas as pd

from ..config import THRESHOLDS, Thresholds
from ..record import Step


def tokens_per_s(steps: list[Step]) -> float | None:
    """Median throughput, leaving out step 0 (allocator warm-up, compilation) when there are others."""
    rates = [s.tokens_per_s for s in steps[1:] or steps if s.tokens_per_s]
    return statistics.median(rates) if rates else None


def rank(table: pd.DataFrame, t: Thresholds = THRESHOLDS) -> pd.DataFrame:
    """The rows of `table` (columns fidelity, tokens_per_s, peak_memory_bytes and, optionally, flags),
    best first; rows that tie keep their order."""
    flags = table["flags"] if "flags" in table else pd.Series("", index=table.index)
    keys = pd.DataFrame({
        "bucket": np.floor(table["fidelity"].astype(float) / t.fidelity_bucket).fillna(0),
        "flagged": flags.fillna("").astype(bool),
        "speed": -table["tokens_per_s"].astype(float).fillna(0.0),
        "memory": table["peak_memory_bytes"].astype(float).fillna(0),
    }, index=table.index)
    order = keys.sort_values(["bucket", "flagged", "speed", "memory"], kind="stable").index
    return table.loc[order]
