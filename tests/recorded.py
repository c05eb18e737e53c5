"""Probe records and run meta made by hand from recorded figures, for the pure tests of the ranking,
the re-timing decision and the report words: an analysis and its renderings without a probe process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from nandoctor.cells import Cell
from nandoctor.config import Recipe, recipe_to_dict
from nandoctor.record import ProbeRecord, Step

FIXTURE = Path(__file__).parent / "fixtures" / "run-before-issue-9"  # fp32, fp16-pure x eager, sdpa; 3 steps
_RUN = json.loads((FIXTURE / "run.json").read_text())


def meta(kind: str = "grid", steps: int = 8, **extra) -> dict:
    """A run.json's meta as the reports read it: the fixture run's environment and model plan."""
    return {
        "kind": kind,
        "run_id": kind,
        "created": "2026-11-27 10:00:00",
        "command": f"nandoctor {kind}",
        "recipe": recipe_to_dict(Recipe(name="tiny-llama")),
        "model_plan": _RUN["model_plan"],
        "env": _RUN["env"],
        "steps": steps,
        "seed": 0,
        "jobs": 1,
        **extra,
    }


# The model plan of a small Llama architecture twin, as run.json holds it.
TWIN_PLAN = {
    "source": "architecture-twin",
    "scale": "full",
    "model_type": "llama",
    "params": 1,
    "full_params": 1,
    "trainable_params": 1,
    "path": None,
    "why": "test",
    "shape": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 176, "vocab": 1024},
}


def twin_meta(n_probes: int, run_id: str = "props", ram_bytes: int = 2**34) -> dict:
    """A run.json's meta for n_probes probes of the twin on a made-up 2-core host without GPUs
    (ram_bytes may be any number, e.g. one beyond float range)."""
    return {
        "kind": "grid",
        "run_id": run_id,
        "created": "now",
        "command": "nandoctor grid",
        "recipe": {"name": "tiny-llama"},
        "model_plan": copy.deepcopy(TWIN_PLAN),  # each meta its own, as each run.json read
        "steps": 4,
        "seed": 0,
        "jobs": 1,
        "env": {"cpu_count": 2, "ram_bytes": ram_bytes, "gpus": []},
        "planned": n_probes,
        "doctor": {"setup": {"cells": []}, "findings": []},
    }


def losses(n: int) -> list[float]:
    return [8.0 - 0.1 * i for i in range(n)]


def steps(rates: list[float], loss: list[float] | None = None) -> list[Step]:
    """A falling loss curve (the same for every probe, so every one is as faithful as fp32) at these
    per-step tokens/s."""
    loss = loss or losses(len(rates))
    return [Step(i, x, 1.0, time_s=1.0 / r, tokens=1, tokens_per_s=r) for i, (x, r) in enumerate(zip(loss, rates))]


def probe(cell: str, rates: list[float], host: dict | None = None, world_size: int | None = None) -> ProbeRecord:
    """A stable probe of `cell`; a parallel cell carries its ranks' agreement with the one-process gradient."""
    c = Cell.parse(cell)
    parallel = None
    if c.parallel_row.wrapper:
        agree = {"max_rel_error": 0.0, "worst_param": "w", "norm_ratio": 1.0, "params": 1}
        parallel = {"world_size": world_size or 2, "backend": "gloo", "grad_agreement": agree}
    return ProbeRecord(c.id, c, "ok", steps=steps(rates), host_load=host, parallel=parallel)


def busy(other_cores: float, cpu_count: int = 2) -> dict:
    """env.host_load of a probe timed while other processes kept `other_cores` cores busy."""
    return {"wall_s": 1.0, "cpu_count": cpu_count, "other_cpu_cores": other_cores, "loadavg": [2.0, 1.5, 1.0]}


def timing_of(rounds: dict[str, list[list[float]]], n_steps: int = 5, host: dict | None = None, **extra) -> dict:
    """retime.json from per-round step rates: {cell: [round 1 rates, round 2 rates, ...]}; a cell may sit
    out a round (None)."""
    probes = [
        {
            "probe_id": f"{cell} retime{n}",
            "of": cell,
            "round": n,
            "status": "ok",
            "steps": [s.to_dict() for s in steps(rates)],
            "host_load": host,
        }
        for cell, runs in rounds.items()
        for n, rates in enumerate(runs, 1)
        if rates is not None
    ]
    return {
        "cells": list(rounds),
        "rounds": max(len(runs) for runs in rounds.values()),
        "steps": n_steps,
        "order": [p["probe_id"] for p in probes],
        "wall_s": 3.0,
        "probes": probes,
        **extra,
    }
