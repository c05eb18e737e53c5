"""How loaded the host was while probes were timed, from the `host_load` each probe measured over its
own timed steps (env.host_load) and from the re-timing rounds. Pure: reads records and retime.json."""

from __future__ import annotations

import math
import statistics

from ..record import ProbeRecord
from ..thresholds import THRESHOLDS, Thresholds


def _share(sample: dict) -> float | None:
    cores, count = sample.get("other_cpu_cores"), sample.get("cpu_count") or 1
    return None if cores is None else cores / count


def _gpu_others(sample: dict) -> int:
    return max((g.get("other_processes") or 0 for g in sample.get("gpus") or []), default=0)


def load_summary(records: list[ProbeRecord], timing: dict | None = None, t: Thresholds = THRESHOLDS) -> dict | None:
    """{'probes', 'cpu_count', 'other_cpu_cores_median', 'other_cpu_cores_max', 'loaded_probes',
    'loadavg_max', 'gpu_other_processes_max', 'retiming_other_cpu_cores', 'significant'} over the
    probes that measured their host's load (loaded: t.loaded_cpu_share of the cores busy, or another
    process on a GPU); None when none did (runs written before it was measured)."""
    samples = [r.host_load for r in records if r.host_load]
    retiming = [p["host_load"] for p in (timing or {}).get("probes", []) if p.get("host_load")]
    if not samples and not retiming:
        return None
    every = samples + retiming
    cores = [s["other_cpu_cores"] for s in every if s.get("other_cpu_cores") is not None]
    loaded = [s for s in every if (_share(s) or 0.0) >= t.loaded_cpu_share or _gpu_others(s)]
    averages = [s["loadavg"][0] for s in every if s.get("loadavg")]
    retime_cores = [s["other_cpu_cores"] for s in retiming if s.get("other_cpu_cores") is not None]
    return {
        "probes": len(every),
        "cpu_count": every[0].get("cpu_count"),
        "other_cpu_cores_median": statistics.median(cores) if cores else None,
        "other_cpu_cores_max": max(cores) if cores else None,
        "loaded_probes": len(loaded),
        "loadavg_max": max(averages) if averages else None,
        "gpu_other_processes_max": max(map(_gpu_others, every)),
        "retiming_other_cpu_cores": statistics.median(retime_cores) if retime_cores else None,
        "significant": bool(loaded),
    }


def unpaired_margin(load: dict | None, t: Thresholds = THRESHOLDS) -> float:
    """The relative gain one grid probe must show over another, timed at another moment, to count as
    faster (ranking.compare_speed). On a quiet host: Thresholds.speed_margin. On a loaded one
    (load_summary's `significant`), what the measured load could make of two equal cells, at least
    Thresholds.loaded_speed_margin: a probe sized for the n cores it may use, sharing them with other
    processes that keep k cores busy, gets about n / (n + k) of its CPU time, so one probe timed beside
    the most load any probe measured (k = other_cpu_cores_max) and another timed alone differ by up to k / n.
    Re-timing rounds run back to back and are compared on their paired ratios, not with this margin."""
    if not (load and load.get("significant")):
        return t.speed_margin
    cores, count = load.get("other_cpu_cores_max"), load.get("cpu_count") or 1
    swing = math.ceil(100 * cores / count) / 100 if isinstance(cores, (int, float)) and math.isfinite(cores) else 0.0
    return max(t.speed_margin, t.loaded_speed_margin, swing)
