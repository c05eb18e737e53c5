"""An accelerate config file (the YAML `accelerate config` writes, `accelerate launch --config_file`
reads) as the grid cell it trains, for `nandoctor doctor --accelerate-config`: `mixed_precision` is
the dtype row, `distributed_type` (with `fsdp_config`) the parallel row, `dynamo_config` the compile
row. Only the keys that decide a cell are read; the others are accelerate's business.

What accelerate does with them (accelerate 1.15, utils/dataclasses.py
FullyShardedDataParallelPlugin.set_mixed_precision): under FSDP, `mixed_precision: bf16` builds
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), so gradients are reduced in bf16, and the
YAML has no key for a reduce dtype; FSDP version 1 builds MixedPrecision with the same reduce dtype.
DDP (MULTI_GPU, and MULTI_CPU over gloo) all-reduces the gradients in their own dtype.
"""

from __future__ import annotations

from pathlib import Path

from ..cells import ACCELERATE_MIXED_PRECISION, COMPILATIONS, PARALLELS, PRECISIONS, Cell
from ..errors import NandoctorError

MIXED_PRECISION = ("no", *ACCELERATE_MIXED_PRECISION.values())
# distributed_type -> the one the parallel rows name: MULTI_CPU is DDP over gloo, the same wrapper
DISTRIBUTED = {"NO": "NO", "MULTI_CPU": "MULTI_GPU", "MULTI_GPU": "MULTI_GPU", "FSDP": "FSDP"}
DYNAMO_BACKENDS = {"NO": "off", **{c.backend.upper(): c.name for c in COMPILATIONS.values() if c.backend}}
FSDP_VERSIONS = (1, 2)


def _word(value, default: str) -> str:
    """A config value as text: YAML 1.1 reads an unquoted `NO` / `no` as False."""
    return default if value is None or value is False else str(value)


def _bad(path, what: str) -> NandoctorError:
    return NandoctorError(f"--accelerate-config {str(path)!r}: {what}")


def read_accelerate_config(path: str | Path) -> dict:
    """The config file as a dict, its cell-deciding keys checked and spelled out (a default where the
    file has none); a bad file is one NandoctorError line."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise NandoctorError(f"cannot read --accelerate-config {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise _bad(path, f"not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise _bad(path, "expected a mapping of accelerate config keys, as `accelerate config` writes it")
    distributed = _word(data.get("distributed_type"), "NO")
    if distributed not in DISTRIBUTED:
        raise _bad(path, f"distributed_type {distributed!r} is not linted; valid: {', '.join(DISTRIBUTED)}")
    mixed = _word(data.get("mixed_precision"), "no")
    if mixed not in MIXED_PRECISION:
        raise _bad(path, f"mixed_precision {mixed!r} is not linted; valid: {', '.join(MIXED_PRECISION)}")
    fsdp = data.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise _bad(path, "fsdp_config must be a mapping of fsdp_* keys")
    if distributed == "FSDP" and fsdp.get("fsdp_version", 1) not in FSDP_VERSIONS:
        raise _bad(path, f"fsdp_config.fsdp_version {fsdp['fsdp_version']!r} is not valid; valid: 1, 2")
    backend = _word((data.get("dynamo_config") or {}).get("dynamo_backend"), "NO").upper()
    if backend not in DYNAMO_BACKENDS:
        raise _bad(path, f"dynamo_config.dynamo_backend {backend!r} is not linted; valid: {', '.join(DYNAMO_BACKENDS)}")
    processes = data.get("num_processes", 1)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise _bad(path, f"num_processes must be a positive integer, got {processes!r}")
    return {
        **data,
        "distributed_type": distributed,
        "mixed_precision": mixed,
        "num_processes": processes,
        "dynamo_config": {**(data.get("dynamo_config") or {}), "dynamo_backend": backend},
    }


def precision_of_accelerate(mixed: str) -> str:
    """The dtype value `mixed_precision` amounts to: autocast in that dtype over the load dtype's
    weights (an -amp row), or fp32 for 'no'."""
    return next(
        (
            p.name
            for p in PRECISIONS.values()
            if p.fp8 is None
            and p.weights is None
            and p.autocast
            and ACCELERATE_MIXED_PRECISION.get(p.autocast) == mixed
        ),
        "fp32",
    )


def parallel_of_accelerate(distributed: str, precision: str, processes: int) -> str:
    """The parallel value a distributed_type trains with `precision`: DDP without a comm hook (the YAML
    sets none), or FSDP reducing in the dtype it computes in (fsdp2-reduce-low under bf16/fp16, which
    is what accelerate's plugin builds), and one process for NO or a single process."""
    kind = DISTRIBUTED[distributed]
    if kind == "NO" or processes == 1 and kind != "FSDP":
        return "none"
    rows = [p for p in PARALLELS.values() if p.accelerate.get("distributed_type") == kind and p.comm_hook is None]
    half = PRECISIONS[precision].compute != "float32"
    return next(p.name for p in rows if len(rows) == 1 or (p.reduce == "compute") == half)


def accelerate_cell(config: dict, attn: str = "sdpa", precision: str | None = None, compile: str | None = None) -> Cell:
    """The cell an accelerate config (as read_accelerate_config returns it) trains, with `attn`. `precision`
    and `compile` given (a TrainingArguments file's own flags, which the Trainer hands to accelerate) take
    its place."""
    precision = precision or precision_of_accelerate(config["mixed_precision"])
    compile = compile or DYNAMO_BACKENDS[config["dynamo_config"]["dynamo_backend"]]
    parallel = parallel_of_accelerate(config["distributed_type"], precision, config["num_processes"])
    return Cell(precision, attn, compile, parallel=parallel)
