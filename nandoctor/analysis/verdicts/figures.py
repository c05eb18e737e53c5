"""How a measured figure is written in a verdict's reason."""

from __future__ import annotations

import math


def _fmt(x: float) -> str:
    return repr(x) if not math.isfinite(x) else f"{x:.4g}"


def _own(group: str) -> str:
    """ "router's own", "experts' own": a tensor group's name as the owner of its gradient."""
    return f"{group}' own" if group.endswith("s") else f"{group}'s own"


def _num(x) -> float:
    """A figure as a float: NaN when absent, +-inf for an int beyond a float's range."""
    if not isinstance(x, (int, float)):
        return math.nan
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf
