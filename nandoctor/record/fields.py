"""How the boundary dataclasses read their dicts: unknown keys ignored (records written by earlier versions
still read), figures given as Python ints kept as floats."""

from __future__ import annotations

import dataclasses
import math


def as_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def ints_as_floats(obj, names: tuple[str, ...]) -> None:
    """Each named figure of obj given as a Python int as a float from here on, an int too large for a
    float as +-inf (a user's loss computed in ints, a hand-written record), so that every later stage
    does float arithmetic on it without overflowing (and pandas gets floats)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(obj, name, as_float(value))


def known_fields(cls, data: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}
