"""Slots: where probes run, one at a time per slot. Each slot reports to the runner through one
queue of events (slot index, generation, message), so the runner waits on one thing.

- WarmSlot owns a warm worker (`python -m nandoctor.child.worker`) and asks it to fork a child per probe:
  the import of torch / transformers / peft is paid once per worker, not once per probe.
- ColdSlot starts a fresh `python -m nandoctor.child` per probe: the baseline, and the fallback
  (`--cold`) when forking is not wanted.

Either way a probe is its own process in its own session: a timeout kills its whole process group.
Messages: {"ready": pid, "threads": n}, {"started": pid}, {"exited": pid, "returncode": n}, {"died": returncode}.

`packed_jobs` decides how many probes share a GPU host at once.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .. import jsonio
from ..record import PARENT_ENV
from .cache import default_cache_dir

# What one more probe costs a GPU beyond its model's training memory: its own CUDA context (each probe
# is its own process) and the allocator's slack.
CUDA_CONTEXT_BYTES = 1 << 30
GPU_FIT_FRACTION = 0.85  # of each GPU's memory, for the probes packed on it
CORES_PER_GPU_PROBE = 2  # a GPU probe's host side: its Python thread and the data/launch work


def packed_jobs(device: dict, estimate_bytes: int, peak_bytes: int | None = None) -> int:
    """How many probes run at once by default. On a GPU host: as many as fit in each GPU's memory
    (each takes the planner's training-memory estimate, or the largest peak measured so far once a
    probe has finished, plus a CUDA context), summed over the GPUs, and at most one per
    CORES_PER_GPU_PROBE cores; at least one. On a CPU host: one (K probes on a CPU only share the
    same cores; `--jobs` asks for more)."""
    gpus = device.get("gpus") or []
    if not gpus:
        return 1
    per_probe = (peak_bytes or estimate_bytes) + CUDA_CONTEXT_BYTES
    fit = sum(int(GPU_FIT_FRACTION * g["memory_bytes"] // per_probe) for g in gpus)
    cores = max(1, (device.get("cpu_count") or 1) // CORES_PER_GPU_PROBE)
    return max(1, min(fit, cores))


def most_jobs(device: dict) -> int:
    """The most probes packed_jobs can ever choose on this host: the slots a session makes room for."""
    if not device.get("gpus"):
        return 1
    return max(1, (device.get("cpu_count") or 1) // CORES_PER_GPU_PROBE)


def inductor_cache_env() -> dict:
    """Every probe of a run, and later runs, share inductor's FX-graph and autotune caches under the
    nandoctor cache directory, so that a compiled cell pays its compile once (names from
    torch/_inductor/config.py, torch/_functorch/config.py and torch/_inductor/runtime/cache_dir_utils.py)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(default_cache_dir() / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }


def probe_env(gpu: int | None) -> dict:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)  # the probe sees one GPU, as device 0
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a segfault leaves its Python stack in log.txt
    env["TOKENIZERS_PARALLELISM"] = "false"
    env[PARENT_ENV] = str(os.getpid())  # the probe process dies with this one (child/__main__.py)
    for name, value in inductor_cache_env().items():
        env.setdefault(name, value)  # a user's own inductor cache settings win
    return env


def child_command(spec: Path, result: Path) -> list[str]:
    """The probe process a cold slot starts, and what an executor places on a node (run/placed.py)."""
    return [sys.executable, "-m", "nandoctor.child", str(spec), str(result)]


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ColdSlot:
    """A fresh Python process per probe."""

    kind = "cold"

    def __init__(self, index: int, events: queue.Queue, gpu: int | None):
        self.index, self.events, self.gpu = index, events, gpu
        self.ready = True
        self.pid: int | None = None
        self.generation = 0
        self.threads = None  # no worker, no fork

    def open(self) -> None:
        pass

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        pass

    def launch(self, spec: Path, result: Path, log: Path) -> None:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                child_command(spec, result),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=probe_env(self.gpu),
                start_new_session=True,
            )
        self.pid = proc.pid

        def wait():
            self.events.put((self.index, self.generation, {"exited": proc.pid, "returncode": proc.wait()}))

        threading.Thread(target=wait, daemon=True).start()

    def kill_probe(self) -> None:
        if self.pid:
            kill_group(self.pid)

    def close(self) -> None:
        pass


class WarmSlot:
    """A warm worker that forks one child per probe; replaced by a fresh one if it dies."""

    kind = "warm"

    def __init__(self, index: int, events: queue.Queue, gpu: int | None):
        self.index, self.events, self.gpu = index, events, gpu
        self.ready = False
        self.pid: int | None = None  # the running probe's pid
        self.generation = 0
        self.worker: subprocess.Popen | None = None
        self.preloads: list[dict] = []  # the preload commands every worker of this slot is sent
        self.threads: int | None = None  # the worker's threads when it last reported (ready, or at a fork)

    def open(self) -> None:
        """Start the worker; a {"ready"} event arrives once it has imported everything."""
        self.generation += 1
        self.ready, self.pid = False, None
        # the worker is in the runner's process group (Ctrl-C reaches it); each probe gets its own
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "nandoctor.child.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=probe_env(self.gpu),
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, args=(self.worker, self.generation), daemon=True).start()
        for command in self.preloads:
            self._send(command)

    def _read(self, worker: subprocess.Popen, generation: int) -> None:
        for line in worker.stdout:
            self.events.put((self.index, generation, jsonio.loads(line)))
        self.events.put((self.index, generation, {"died": worker.wait()}))

    def _send(self, command: dict) -> None:
        try:
            self.worker.stdin.write(jsonio.dumps(command) + "\n")
            self.worker.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker died: its reader thread reports it

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        command = {"preload": model_type, "adapter": adapter}
        if command in self.preloads:
            return
        self.preloads.append(command)
        if self.worker:  # else open() sends it
            self._send(command)

    def launch(self, spec: Path, result: Path, log: Path, kind: str = "spec") -> None:
        """Fork a child that runs a probe (kind "spec") or plans the run (kind "plan": child/plan.py)."""
        self.pid = None  # known when the worker says {"started": pid}
        self._send({kind: str(spec), "result": str(result), "log": str(log)})

    def kill_probe(self) -> None:
        if self.pid:
            kill_group(self.pid)

    def close(self) -> None:
        self.kill_probe()
        if not self.worker or self.worker.poll() is not None:
            return
        # no probe runs now (killed above), and the worker holds nothing to finish: killing it spares
        # the wait for its interpreter's teardown (a second or more of unloading torch)
        self.worker.kill()
        self.worker.wait()
        try:
            self.worker.stdin.close()
        except OSError:
            pass
