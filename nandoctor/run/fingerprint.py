"""A probe's fingerprint: a hash of everything that decides its numbers, so that a result can be
reused (`--cache`) exactly when rerunning the probe would compute the same thing.

What goes in: the probe's spec (recipe with its overrides applied, cell, model plan, steps, seed,
device, threads: CPU kernels split reductions by thread count), a local checkpoint's files
(digests.checkpoint_stamp: a hash of the bytes of every file: weights, config, generation config,
tokenizer files, chat template, modeling code), the content of
every data file and directory the recipe names (data.path, data.tokenizer: a sha256 of the bytes, so
that an edit of the same size and a copied file's old time are seen), nandoctor's own version, and
the environment (library versions, device, GPU, CPU model, and the version of every optional package
the cell uses). What stays out: the run's
location, the plan's prose (`why` quotes free memory), the recipe's fp8 section for a cell that is
not fp8, its parallel fields for a one-process cell and an sft probe's objective and rollout fields (it
reads none of them; runs written before they existed keep their fingerprints) and
the forensics replay's and the build's time budgets (they never change a number, and runs before
them had none).
Pure apart from reading the files it stamps; imports only the cell table, digests and the package's version.
"""

from __future__ import annotations

import hashlib
import json

import nandoctor

from ..cells import OPTIMIZERS, PRECISIONS, Cell
from ..config import with_load_dtype_resolved
from ..device import DeviceFacts
from ..digests import checkpoint_stamp, content_digest

ENV_KEYS = ("python", "torch", "transformers", "peft", "cuda", "cudnn", "device", "flash_attn", "cpu_model")


def environment_key(env: DeviceFacts | dict) -> dict:
    """The facts of an environment (env.collect_summary()) that can change a probe's numbers."""
    env = DeviceFacts.of(env)
    key = {k: getattr(env, k) for k in ENV_KEYS}
    key["gpus"] = [(g.name, g.capability) for g in env.gpus]
    return key


# The recipe's data fields that name a file or directory a probe reads.
DATA_FILES = ("path", "tokenizer")


def data_stamp(recipe: dict) -> dict:
    """{'data.path': digest, ...} for every data file or directory the recipe names; {} for none."""
    data = recipe.get("data") or {}
    return {f"data.{name}": content_digest(data[name]) for name in DATA_FILES if data.get(name)}


# Specs written before the typed ProbeSpec carried this constant; hashing it still keeps the cache
# entries of those runs reachable.
LEGACY_SPEC = {"stop_on_nonfinite": True}
NOT_NUMERICS = (
    "forensics_timeout_s",
    "forensics_share",
    "forensics_min_s",
    "build_timeout_s",
    "retime_rounds",
)  # recipe fields that decide no number of the probe
PARALLEL_FIELDS = ("world_size", "grad_reduce")  # read by parallel cells only
RL_FIELDS = ("objective", "rollout")  # an sft probe's fingerprint stays what it was before they existed
NOT_SPEC_NUMERICS = ("probe_id", "replay_failed_only")  # nor do these spec fields (whether the replay runs)


def package_versions(cell: Cell, env: DeviceFacts) -> dict:
    """{package: version} of the optional packages the cell's fp8 recipe and optimizer use."""
    fp8 = PRECISIONS[cell.dtype].fp8
    used = [p for p in (fp8.package if fp8 else None, OPTIMIZERS[cell.optimizer].package) if p]
    used += [p for p in (cell.quantization.package,) if p and p not in used]
    return {p: env.packages[p].version if p in env.packages else None for p in used}


def probe_fingerprint(spec: dict, overrides: dict, env: DeviceFacts | dict) -> str:
    """sha256 hex of the probe's spec (ProbeSpec.to_dict()), its overrides, its environment, nandoctor's
    version and its data files' contents; key order does not matter."""
    env = DeviceFacts.of(env)
    spec = {**LEGACY_SPEC, **{k: v for k, v in spec.items() if k not in NOT_SPEC_NUMERICS}}
    # "auto" is the dtype it loads: a probe keyed before "auto" was the default (fp32) stays cached
    spec["recipe"] = {
        k: v for k, v in with_load_dtype_resolved(spec.get("recipe", {})).items() if k not in NOT_NUMERICS
    }
    # why is prose; refuses follows from the architecture and the transformers version (in the environment);
    # named_shape is the recipe's model, which the recipe already keys
    plan = {k: v for k, v in spec.get("model_plan", {}).items() if k not in ("why", "refuses", "named_shape")}
    cell = Cell(**spec["cell"])
    recipe = spec.get("recipe", {})
    if PRECISIONS[cell.dtype].fp8 is None:
        recipe = {k: v for k, v in recipe.items() if k != "fp8"}
    if cell.parallel_row.wrapper is None:
        recipe = {k: v for k, v in recipe.items() if k not in PARALLEL_FIELDS}
    if cell.quant == "none":  # only a quantized base reads the quant section
        recipe = {k: v for k, v in recipe.items() if k != "quant"}
    if not cell.optimizer_row.eval_mode and "optimizer" in recipe:  # read by a schedule-free round trip only
        recipe["optimizer"] = {k: v for k, v in recipe["optimizer"].items() if k != "eval_before_save"}
    if recipe.get("objective", "sft") == "sft":  # only an RL probe reads the rollout section
        recipe = {k: v for k, v in recipe.items() if k not in RL_FIELDS}
    payload = {
        "spec": {**spec, "recipe": recipe, "model_plan": plan},
        "overrides": overrides,
        "env": environment_key(env),
        "weights": checkpoint_stamp(plan.get("path")),
        "nandoctor": nandoctor.__version__,  # a new release may compute the same probe differently
    }
    files = data_stamp(recipe)
    if files:  # only recipes that read a file carry the key
        payload["data_files"] = files
    packages = package_versions(cell, env)
    if packages:  # only cells that use an optional package carry the key, so older fingerprints stay
        payload["packages"] = packages
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
