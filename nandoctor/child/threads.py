"""How many CPU threads a probe trains with, and what its record says about them.

The placement plans a probe's share of the host (spec.threads: this host's cores over --jobs, a job's
cpus, or the user's OMP_NUM_THREADS); the W ranks of a parallel probe split it. A one-process CPU probe
then sizes its share to the cores other processes leave free among those it may run on (its affinity:
a SLURM job's cores are its own), measured while it builds, over at least MIN_SAMPLE_S. A probe that a
warm worker forked measures from the moment that worker last fell idle (`note_idle`: after its import and
after each child it waited for), when that is at most IDLE_SAMPLE_MOST_S ago: the window then spans the
gap between two probes as well as the build, and a tiny model's build does not wait. Threads beyond the
free cores wait for one another at every parallel region while other processes hold the cores, and
a probe crawls (bench/busy_host.py). Never below one, never above the plan; a user's OMP_NUM_THREADS is
kept as given, and a CUDA probe keeps its plan (its CPU threads only launch the work). How idle threads
wait (a short spin) is set in the probe's environment before it starts (run/slots.probe_env): OpenMP
reads it when it loads.
"""

from __future__ import annotations

import os
import time

from ..env import cpu_cores_between, get_cpu_count, get_cpu_set, get_host_sample, get_openmp_env, get_own_process_key
from ..record import ProbeSpec

# The shortest window the free cores are measured over: the host's CPU counters tick every 10 ms, so a
# shorter one misreads them by a large share of a core. A build shorter than this waits out the rest.
MIN_SAMPLE_S = 0.1
# The oldest idle sample of its warm worker a probe measures from; an older one (the runner kept the worker
# waiting) would average the load of a moment long past, so the probe samples afresh
IDLE_SAMPLE_MOST_S = 1.0
_idle: dict | None = None  # note_idle's sample, in a warm worker; its forked children inherit it


def free_share(planned: int, cpu_count: int, other_cores: float) -> int:
    """`planned` threads of a host of `cpu_count` cores, scaled to the cores that `other_cores` busy
    ones leave free (rounded half up), at least 1 and at most `planned`."""
    free = max(0.0, cpu_count - other_cores)
    return max(1, min(planned, int(planned * free / cpu_count + 0.5)))


def note_idle() -> None:
    """In a warm worker about to wait for its next command: sample the host for the next child it forks to
    measure from. That child's own CPU time starts at zero, and the worker's CPU time so far is the run's
    (the worker carries RUN_DIR_ENV), so the sample counts it among the run's processes."""
    global _idle
    sample = get_host_sample(get_cpu_set())
    me = get_own_process_key()
    if sample["run_s"] is not None and me is not None:
        sample["run_s"] = {**sample["run_s"], me: sample["own_s"]}
    _idle = {**sample, "own_s": 0.0, "pid": os.getpid()}


def inherited_sample() -> dict | None:
    """The idle sample of the warm worker that forked this process, when it is at most
    IDLE_SAMPLE_MOST_S old; None in the worker itself, in a process no worker forked, or when stale."""
    if _idle is None or _idle["pid"] != os.getppid() or time.monotonic() - _idle["wall"] > IDLE_SAMPLE_MOST_S:
        return None
    return {k: v for k, v in _idle.items() if k != "pid"}


def start(spec: ProbeSpec, world_size: int) -> tuple[int, dict | None]:
    """Set the threads the build runs with (the probe's planned share; a rank's part of it) and return
    them with the sample of its cores the free ones are measured from (None: this probe keeps its plan)."""
    import torch

    planned = max(1, spec.threads // world_size)
    torch.set_num_threads(planned)
    sizes = spec.device == "cpu" and world_size == 1 and "OMP_NUM_THREADS" not in os.environ
    if not sizes:
        return planned, None
    return planned, inherited_sample() or get_host_sample(get_cpu_set())


def settle(planned: int, sample: dict | None) -> dict:
    """Before the timed steps: size the threads to the cores left free since `sample` (when there is
    one) and set them. Returns the record's cpu_threads: the threads it trains with (`torch`), its plan,
    the cores other processes kept busy while it built (None: not measured), its OpenMP settings."""
    import torch

    other = None
    if sample is not None:
        time.sleep(max(0.0, sample["wall"] + MIN_SAMPLE_S - time.monotonic()))
        other, _ = cpu_cores_between(sample, get_host_sample(get_cpu_set()))
    if other is not None:
        torch.set_num_threads(free_share(planned, get_cpu_count(), other))
    return {"torch": torch.get_num_threads(), "planned": planned, "other_cpu_cores": other, **get_openmp_env()}
