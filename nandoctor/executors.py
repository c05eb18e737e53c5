"""Where probes run: the executors (--executor local / slurm / ray), the scheduler options each takes
(--executor-opt KEY=VALUE) as one table with their defaults, and the `ExecutorConfig` they fill.

Not part of the Recipe: where a probe ran does not change what it measures, so a probe's fingerprint
(and the cache, and --resume) stays the same across executors.

Foundation module: imports only errors and cells (the hardware axes an executor places).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cells import HARDWARE_AXES, parse_axis_values
from .errors import NandoctorError

# The scheduler's own settings for each kind of executor, typed.
EXECUTOR_OPTIONS = {
    "local": {},
    "slurm": {
        "partition": str,
        "account": str,
        "qos": str,
        "constraint": str,
        "time": int,
        "gpus": int,
        "cpus": int,
        "mem": str,
        "parallel": int,
        "retries": int,
        "queue_wait": int,
    },
    "ray": {
        "address": str,
        "resources": str,
        "gpus": float,
        "cpus": int,
        "parallel": int,
        "retries": int,
        "queue_wait": int,
    },
}
# queue_wait: seconds a placed probe may wait for the scheduler to start it. Past it the job is cancelled
# and placed again (an hour: a busy partition's queue is normal, a held job or resources no node has
# is not, and either way the wait is bounded by (retries + 1) hours, never a verdict).
EXECUTOR_DEFAULTS = {"cpus": 1, "parallel": 64, "retries": 2, "queue_wait": 3600}


@dataclass(frozen=True)
class ExecutorConfig:
    """Which engine places the probes: `local` (this machine's slots), `slurm` (submitit job arrays) or
    `ray` (one task per probe). options: the scheduler's settings, typed by EXECUTOR_OPTIONS.
    cpus: cores per probe (its threads); gpus: GPUs per probe; both per rank for a parallel probe (size);
    parallel: probes in flight at most; retries: how many times a probe the scheduler lost (node failure,
    preemption, never started) is placed again; queue_wait: seconds a probe may wait to be started."""

    kind: str = "local"
    options: dict = field(default_factory=dict)
    hardware: tuple = ()  # the kinds of machine the grid probes on (its hardware axis): partitions, Ray resources

    def option(self, name: str):
        return self.options.get(name, EXECUTOR_DEFAULTS.get(name))

    @property
    def remote(self) -> bool:
        return self.kind != "local"

    def size(self, ranks: int = 1) -> tuple:
        """(cpus, gpus) one probe of `ranks` ranks asks the scheduler for: the per-probe options times
        its ranks, since a parallel probe's launcher (child/launch.py) forks all W ranks in its one job
        or task. gpus is 0 where no GPUs were asked for."""
        return self.option("cpus") * ranks, (self.option("gpus") or 0) * ranks


def executor_config(kind: str | None, items: list[str] | tuple = ()) -> ExecutorConfig:
    """--executor KIND and its --executor-opt KEY=VALUE items as an ExecutorConfig; a kind or key that
    does not exist, or a value of the wrong type, is one NandoctorError."""
    kind = kind or "local"
    if kind not in EXECUTOR_OPTIONS:
        raise NandoctorError(f"--executor {kind!r} is not valid; valid: {', '.join(EXECUTOR_OPTIONS)}")
    valid = EXECUTOR_OPTIONS[kind]
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in valid:
            names = ", ".join(valid) or "none (it runs on this machine)"
            raise NandoctorError(
                f"bad --executor-opt {item!r} for --executor {kind}: expected KEY=VALUE with KEY one of {names}"
            )
        try:
            options[key] = valid[key](value.strip())
        except ValueError:
            raise NandoctorError(f"bad --executor-opt {item!r}: {key} takes a {valid[key].__name__}") from None
        if key == "retries" and options[key] < 0:
            raise NandoctorError(f"bad --executor-opt {item!r}: retries must be >= 0 (0: never place a probe again)")
        if valid[key] in (int, float) and options[key] <= 0 and key != "retries":
            raise NandoctorError(f"bad --executor-opt {item!r}: {key} must be > 0")
    return ExecutorConfig(kind, options)


def with_hardware(executor: ExecutorConfig, axes: dict | None) -> ExecutorConfig:
    """The executor that places a grid with these axes: its hardware axis (--axis partition= for slurm,
    node_type= for ray) becomes `hardware`, which the placement checks against the cluster before any
    probe runs. A hardware axis the executor cannot place is one NandoctorError."""
    named = [axis for axis in (axes or {}) if axis in HARDWARE_AXES]
    if not named:
        return executor
    if len(named) > 1:
        raise NandoctorError(f"--axis {' and --axis '.join(named)}: a grid has one hardware axis; pass one of them")
    axis = named[0]
    kind, noun = HARDWARE_AXES[axis]
    if executor.kind != kind:
        other = {k: a for a, (k, _) in HARDWARE_AXES.items()}.get(executor.kind)
        instead = f"; with --executor {executor.kind} the hardware axis is {other}" if other else ""
        raise NandoctorError(f"--axis {axis} names {noun}s: it needs --executor {kind}{instead}")
    if axis == "partition" and executor.option("partition") is not None:
        raise NandoctorError(
            "--axis partition and --executor-opt partition both choose the partition; pass one of them"
        )
    return replace(executor, hardware=tuple(parse_axis_values(axis, axes[axis])))
