"""How a probe's processes share it: the strategy the probe body (probe.py) and its replay (replay.py)
are written against, so that both exist once for one process and for W ranks.

`Ranks` itself is one process, the W=1 case: every hook below does nothing. parallel.DistributedRanks
is rank r of a W-rank DDP or FSDP2 probe: it joins the process group, measures the step-0 gradient
agreement and wraps the model (`prepare`), trains its rows of each global batch (Setup.rows), makes
each step the probe's (`agree`), adds its reduction watch to the replay, and counts the probe's other
processes as its own when it measures the host's load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..env import get_host_sample, host_load
from ..record import ProbeRecord, ProbeSpec, Step
from .build import Setup


class Ranks:
    """One process trains the whole probe."""

    rank = 0
    world_size = 1
    underflow_note: str | None = None  # why the replay cannot measure gradient underflow here, if it cannot

    def join(self, spec: ProbeSpec) -> None:
        """Meet the probe's other processes, before anything is built."""

    def prepare(self, spec: ProbeSpec, s: Setup, record: ProbeRecord, mark_built: Callable[[], None]) -> Setup:
        """The setup the timed steps train, from the one `setup` built (`mark_built`: the build is done,
        for a strategy whose preparation must run on the timed steps' budget)."""
        return s

    def model(self, s: Setup) -> Any:
        """The module the training loop calls (before torch.compile): the setup's own, or its wrapper."""
        return s.model

    def agree(self, step: Step) -> None:
        """Make this process's measured step the probe's (a rank's: over every rank)."""

    def peers(self) -> list[int]:
        """The pids of the probe's other processes: none for one process."""
        return []

    def replay_watches(self, s: Setup) -> tuple[Setup, list]:
        """The replay's setup and the watches this strategy adds to it (each with end_step and remove)."""
        return s, []

    def mark(self, forensics: dict) -> dict:
        """This process's forensics record, marked as its own."""
        return forensics

    def exit_code(self, forensics: dict) -> int:
        """How the process ends once its replay is done: the timed result stands whatever the replay did
        (its error is data), so 0."""
        return 0


ONE_PROCESS = Ranks()


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue  # it has ended: nothing more to count
        out[pid] = t.user + t.system
    return out


def _own_on_gpus(pids: set[int]) -> dict[int, tuple[int, int]]:
    """GPU index -> (how many of `pids` run on it, the memory they hold), as NVML sees them."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError without a driver: then host_load saw no GPU either
        return {}
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        mine = [[p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid in pids] for h in handles]
        return {i: (len(ps), sum(p.usedGpuMemory or 0 for p in ps)) for i, ps in enumerate(mine)}
    except pynvml.NVMLError:
        return {}
    finally:
        pynvml.nvmlShutdown()


def host_sample(ranks: Ranks) -> dict:
    """What probe_load compares: env.get_host_sample, and the CPU seconds of the probe's other processes."""
    return {**get_host_sample(), "peers_cpu_s": _cpu_seconds(ranks.peers())}


def probe_load(before: dict) -> dict:
    """env.host_load since `before` (a host_sample), with the probe's other processes (a parallel
    probe's launcher and other ranks) counted as the probe's own, not as other processes keeping the
    host busy; `own_processes` says how many processes the probe ran."""
    load = host_load(before)
    peers = before["peers_cpu_s"]
    if peers and load["other_cpu_cores"] is not None:
        now = _cpu_seconds(list(peers))
        used = sum(now[pid] - seconds for pid, seconds in peers.items() if pid in now)
        load["other_cpu_cores"] = max(0.0, load["other_cpu_cores"] - used / load["wall_s"])
    if peers and load["gpus"]:
        own = _own_on_gpus(set(peers))
        for gpu in load["gpus"]:
            count, held = own.get(gpu["index"], (0, 0))
            gpu["other_processes"] -= count
            gpu["other_memory_bytes"] -= held
    load["own_processes"] = 1 + len(peers)
    return load
