"""What placing a probe through a scheduler costs beyond the probe itself, measured in one run on
the local clusters: K one-step tiny-llama probes, one at a time, through the local executor (cold
slots, the baseline), SLURM (tests/cluster/slurm_up.sh; export SLURM_CONF) and a Ray started here on
127.0.0.1. Per probe: the parent's time from handing the probe over to holding its record, minus the
probe process's own wall time on the node (wall_s). Start-up is reported apart: SLURM's canary job
(the shared-filesystem check, which gathers the device facts on the node), Ray's start and its
facts task. Goal: <= 3 s per probe for SLURM, <= 1 s for Ray.
Usage: python bench/executor_overhead.py [K] [local,slurm,ray]"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nandoctor.cells import Cell
from nandoctor.env import collect_summary
from nandoctor.executors import executor_config
from nandoctor.models import plan_model
from nandoctor.plan import PlannedProbe
from nandoctor.recipes import resolve_model
from nandoctor.run.scheduler import Scheduler
from nandoctor.run.session import PLACEMENTS, probe_spec
from nandoctor.run.store import ResultsStore
from nandoctor.run.task import ProbeTask


def tasks(k: int) -> list[ProbeTask]:
    recipe = resolve_model("tiny-llama")
    device = collect_summary()
    plan = plan_model(recipe, device)
    cell = Cell("fp32", "eager", "off")
    return [
        ProbeTask(probe_spec(recipe, PlannedProbe(f"{cell.id} #{i}", cell), plan, device, 1, 1, threads=1), 120.0)
        for i in range(k)
    ]


def measure(kind: str, k: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"nandoctor-bench-{kind}-"))
    store = ResultsStore(run_dir)
    t0 = time.perf_counter()
    executor = executor_config(kind, [] if kind == "local" else ["parallel=1", "cpus=1"])
    placement = PLACEMENTS[kind](executor, run_dir, jobs=1, warm=False)  # locally: cold slots, the baseline
    placement.facts()  # the start-up job that gathers the device facts (SLURM: the canary)
    startup = time.perf_counter() - t0
    overheads, walls = [], []
    with Scheduler(placement, store, retries=0) as scheduler:
        for task in tasks(k):
            t1 = time.perf_counter()
            [record] = scheduler.run([task])
            took = time.perf_counter() - t1
            assert record.status == "ok", (record.status, record.error, record.log_tail)
            overheads.append(took - record.wall_s)
            walls.append(record.wall_s)
    return {"kind": kind, "startup_s": startup, "overhead_s": overheads, "wall_s": walls}


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["local", "slurm", "ray"]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    print(f"{k} one-step tiny-llama probes, one at a time; load average {os.getloadavg()[0]:.1f}")
    print("| executor | start-up s | probe wall s (median) | overhead per probe s (median) | min | max |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        m = measure(kind, k)
        o = m["overhead_s"]
        print(
            f"| {kind} | {m['startup_s']:.2f} | {statistics.median(m['wall_s']):.2f} | {statistics.median(o):.2f} "
            f"| {min(o):.2f} | {max(o):.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
