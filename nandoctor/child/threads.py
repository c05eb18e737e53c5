"""How many CPU threads a probe trains with, and what its record says about them.

The placement plans a probe's share of the host (spec.threads: this host's cores over --jobs, a job's
cpus, or the user's OMP_NUM_THREADS); the W ranks of a parallel probe split it. A one-process CPU probe
then sizes its share to the cores other processes leave free among those it may run on (its affinity:
a SLURM job's cores are its own), measured while it builds, for at least MIN_SAMPLE_S. Threads beyond
the free cores wait for one another at every parallel region while other processes hold the cores, and
a probe crawls (bench/busy_host.py). Never below one, never above the plan; a user's OMP_NUM_THREADS is
kept as given, and a CUDA probe keeps its plan (its CPU threads only launch the work). How idle threads
wait (a short spin) is set in the probe's environment before it starts (run/slots.probe_env): OpenMP
reads it when it loads.
"""

from __future__ import annotations

import os
import time

from ..env import cpu_cores_between, get_cpu_count, get_cpu_set, get_host_sample, get_openmp_env
from ..record import ProbeSpec

# The shortest window the free cores are measured over: the host's CPU counters tick every 10 ms, so a
# shorter one misreads them by a large share of a core. A build shorter than this waits out the rest.
MIN_SAMPLE_S = 0.1


def free_share(planned: int, cpu_count: int, other_cores: float) -> int:
    """`planned` threads of a host of `cpu_count` cores, scaled to the cores that `other_cores` busy
    ones leave free (rounded half up), at least 1 and at most `planned`."""
    free = max(0.0, cpu_count - other_cores)
    return max(1, min(planned, int(planned * free / cpu_count + 0.5)))


def start(spec: ProbeSpec, world_size: int) -> tuple[int, dict | None]:
    """Set the threads the build runs with (the probe's planned share; a rank's part of it) and return
    them with the sample of its cores the free ones are measured from (None: this probe keeps its plan)."""
    import torch

    planned = max(1, spec.threads // world_size)
    torch.set_num_threads(planned)
    sizes = spec.device == "cpu" and world_size == 1 and "OMP_NUM_THREADS" not in os.environ
    return planned, get_host_sample(get_cpu_set()) if sizes else None


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
