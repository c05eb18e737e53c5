"""Every JSON file nandoctor writes is strict JSON: a non-finite float is written as the string float()
reads back ("NaN", "Infinity", "-Infinity"), never as the bare NaN / Infinity that Python's json writes by
default and strict parsers (jq, JavaScript, most JSON libraries) reject. Readers turn those strings back
into floats; the bare constants of files written before this still read. Pure: no torch."""

from __future__ import annotations

import json
import math

NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def json_safe(data):
    """data with every non-finite float as the string float() reads back ("NaN", "Infinity",
    "-Infinity"); tuples become lists, as json writes them."""
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else "Infinity" if data > 0 else "-Infinity"
    if isinstance(data, dict):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    return data


def restore(data):
    """The inverse of json_safe on parsed JSON: the strings "NaN", "Infinity", "-Infinity" back to floats."""
    if isinstance(data, str):
        return NONFINITE_TEXT.get(data, data)
    if isinstance(data, dict):
        return {k: restore(v) for k, v in data.items()}
    if isinstance(data, list):
        return [restore(v) for v in data]
    return data


def dumps(data, **kwargs) -> str:
    """Strict JSON text of data (non-finite floats as strings; anything json cannot write as its str())."""
    kwargs.setdefault("default", str)
    return json.dumps(json_safe(data), allow_nan=False, **kwargs)


def loads(text: str):
    """Parsed JSON with non-finite floats restored; bare NaN / Infinity (older files) read too."""
    return restore(json.loads(text))
