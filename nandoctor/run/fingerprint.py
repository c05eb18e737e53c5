"""A probe's fingerprint: a hash of everything that decides its numbers, so that a result can be
reused (`--cache`) exactly when rerunning the probe would compute the same thing.

What goes in: the probe's spec (recipe with its overrides applied, cell, model plan, steps, seed,
device, threads: CPU kernels split reductions by thread count), the weight files' names, sizes and
modification times for a local checkpoint, and the environment (library versions, device, GPU,
CPU model, and the version of every optional package the cell uses). What stays out: the run's
location, the plan's prose (`why` quotes free memory), the recipe's fp8 section for a cell that is
not fp8 and its parallel fields for a one-process cell (it reads none of them; runs written before they
existed keep their fingerprints) and
the forensics replay's and the build's time budgets (they never change a number, and runs before
them had none).
Pure apart from stat()ing weight files; imports only the cell table.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..cells import OPTIMIZERS, PRECISIONS, Cell

ENV_KEYS = ("python", "torch", "transformers", "peft", "cuda", "cudnn", "device", "flash_attn", "cpu_model")


def environment_key(env: dict) -> dict:
    """The facts of an environment (env.collect_summary()) that can change a probe's numbers."""
    key = {k: env.get(k) for k in ENV_KEYS}
    key["gpus"] = [(g.get("name"), g.get("capability")) for g in env.get("gpus") or []]
    return key


def weights_stamp(path: str | None) -> list:
    if not path:
        return []
    files = sorted(p for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin", ".json", ".py"))
    return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


# Specs written before the typed ProbeSpec carried this constant; hashing it still keeps the cache
# entries of those runs reachable.
LEGACY_SPEC = {"stop_on_nonfinite": True}
NOT_NUMERICS = (
    "forensics_timeout_s",
    "build_timeout_s",
    "retime_rounds",
)  # recipe fields that decide no number of the probe
PARALLEL_FIELDS = ("world_size", "grad_reduce")  # read by parallel cells only
NOT_SPEC_NUMERICS = ("probe_id", "replay_failed_only")  # nor do these spec fields (whether the replay runs)


def package_versions(cell: Cell, env: dict) -> dict:
    """{package: version} of the optional packages the cell's fp8 recipe and optimizer use."""
    fp8 = PRECISIONS[cell.dtype].fp8
    used = [p for p in (fp8.package if fp8 else None, OPTIMIZERS[cell.optimizer].package) if p]
    return {p: ((env.get("packages") or {}).get(p) or {}).get("version") for p in used}


def probe_fingerprint(spec: dict, overrides: dict, env: dict) -> str:
    """sha256 hex of the probe's spec (ProbeSpec.to_dict()), its overrides and its environment; key
    order does not matter."""
    spec = {**LEGACY_SPEC, **{k: v for k, v in spec.items() if k not in NOT_SPEC_NUMERICS}}
    spec["recipe"] = {k: v for k, v in spec.get("recipe", {}).items() if k not in NOT_NUMERICS}
    # why is prose; refuses follows from the architecture and the transformers version (in the environment)
    plan = {k: v for k, v in spec.get("model_plan", {}).items() if k not in ("why", "refuses")}
    cell = Cell(**spec["cell"])
    recipe = spec.get("recipe", {})
    if PRECISIONS[cell.dtype].fp8 is None:
        recipe = {k: v for k, v in recipe.items() if k != "fp8"}
    if cell.parallel_row.wrapper is None:
        recipe = {k: v for k, v in recipe.items() if k not in PARALLEL_FIELDS}
    payload = {
        "spec": {**spec, "recipe": recipe, "model_plan": plan},
        "overrides": overrides,
        "env": environment_key(env),
        "weights": weights_stamp(plan.get("path")),
    }
    packages = package_versions(cell, env)
    if packages:  # only cells that use an optional package carry the key, so older fingerprints stay
        payload["packages"] = packages
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
