"""Numerics forensics, the reading half (pure, no torch): the origin of a failure, per-module headroom
and update loss, from the forensics record the probe process wrote (child/hooks.py)."""

from __future__ import annotations

import math

from ..record import Step

PHASES = (
    "forward",
    "backward",
    "reduction",
    "optimizer",
)  # the order they happen in within one step (reduction: parallel probes)
FINFO_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
}  # torch.finfo(dtype).max
# torch.finfo(dtype).eps: the gap between 1.0 and the next value. TF32 matmuls keep fp16's 10-bit mantissa.
FINFO_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "tf32": 2.0**-10}


def replayed(f: dict | None) -> bool:
    """Forensics that measured something: not a replay that failed ("error") nor one that could not run
    ("not_run": a probe under the user's trainer, child/probe.py)."""
    return bool(f) and "error" not in f and "not_run" not in f


def origin(forensics: dict | None) -> dict | None:
    """The first event that made the run unrecoverable: the earliest by (step, phase, rank), leaving
    out backward and reduction overflows at steps the GradScaler skipped and recovered from (its
    calibration). A parallel probe's events carry the rank that saw them."""
    if not forensics:
        return None
    steps = {s["step"]: Step.from_dict(s) for s in forensics.get("steps", [])}

    def harmful(e):
        s = steps.get(e["step"])
        calibration = s is not None and s.skipped and s.unrecoverable() is None
        return not (e["phase"] in ("backward", "reduction") and calibration)

    events = sorted(
        (e for e in forensics.get("events", []) if harmful(e)),
        key=lambda e: (e["step"], PHASES.index(e["phase"]), e.get("rank", 0)),
    )
    return events[0] if events else None


def ranks_alike(forensics: dict | None, event: dict) -> list[int]:
    """The other ranks that saw the same event (step, phase, module and parameter) as `event`'s rank."""
    same = ("step", "phase", "module", "parameter")
    return sorted(
        {
            e["rank"]
            for e in (forensics or {}).get("events", [])
            if "rank" in e and e.get("rank") != event.get("rank") and all(e.get(k) == event.get(k) for k in same)
        }
    )


def headroom(forensics: dict | None) -> list[dict]:
    """Per module: largest |activation| and |gradient| seen, and the compute dtype's largest finite
    value divided by each (1.0 = at the edge, below 1 = overflowed). Tightest activation first."""
    if not forensics:
        return []
    limit = FINFO_MAX[forensics["compute_dtype"]]
    acts, grads = forensics.get("activation_absmax", {}), forensics.get("gradient_absmax", {})

    def ratio(x):
        return None if x is None else (0.0 if not math.isfinite(x) else (math.inf if x == 0 else limit / x))

    rows = [
        {
            "module": m,
            "activation_absmax": acts.get(m),
            "activation_headroom": ratio(acts.get(m)),
            "gradient_absmax": grads.get(m),
            "gradient_headroom": ratio(grads.get(m)),
        }
        for m in set(acts) | set(grads)
    ]
    big = math.inf
    return sorted(
        rows,
        key=lambda r: (
            r["activation_headroom"] if r["activation_headroom"] is not None else big,
            r["gradient_headroom"] if r["gradient_headroom"] is not None else big,
            r["module"],
        ),
    )


def update_loss(forensics: dict | None) -> dict | None:
    """Mean and largest per-step fraction of parameter elements whose update rounded away."""
    values = [s["update_loss"] for s in (forensics or {}).get("steps", []) if s.get("update_loss") is not None]
    if not values:
        return None
    return {
        "mean": sum(values) / len(values),
        "max": max(values),
        "steps": len(values),
        "weight_dtype": forensics["weight_dtype"],
    }
