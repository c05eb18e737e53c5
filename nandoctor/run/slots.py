"""Slots: where this machine runs probes, one at a time per slot (run/local.py places probes on them).
Each slot reports to its placement through one queue of events (slot index, generation, message), so
the placement waits on one thing.

- WarmSlot owns a warm worker (`python -m nandoctor.child.worker`) and asks it to fork a child per probe:
  the import of torch / transformers / peft is paid once per worker, not once per probe. The worker
  speaks on pipes of its own (record/worker_messages.py), never on its stdout.
- ColdSlot starts a fresh `python -m nandoctor.child` per probe: the baseline, and the fallback
  (`--cold`) when forking is not wanted.

Either way a probe is its own process in its own session: a timeout kills its whole process group, and
closing a slot kills its probe. Messages: record.Ready, record.Started, record.Exited, and Died (the
worker itself ended). A slot is not pinned to a GPU: each probe is launched with its own environment
(probe_env: CUDA_VISIBLE_DEVICES its GPU set).

`packed_jobs` decides how many probes share a GPU host at once.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..device import DeviceFacts
from ..env import OPENMP_WAIT_ENV, RUN_DIR_ENV, RUNNER_ENV, VISIBLE_DEVICES_ENV, get_own_process_key
from ..record import PARENT_ENV, Exited, Fork, Preload, message_line, read_message
from .cache import default_cache_dir
from .zygote import ZygoteWorker, fork_worker

# What one more probe costs a GPU beyond its model's training memory: its own CUDA context (each probe
# is its own process) and the allocator's slack.
CUDA_CONTEXT_BYTES = 1 << 30
GPU_FIT_FRACTION = 0.85  # of each GPU's memory, for the probes packed on it
CORES_PER_GPU_PROBE = 2  # a GPU probe's host side: its Python thread and the data/launch work
# How a probe's idle OpenMP threads wait, unless the user said (env.OPENMP_WAIT_ENV). GNU libgomp (torch's
# OpenMP on Linux) spins 300,000 turns before an idle thread sleeps: where other processes hold the cores,
# that spinning takes the time slices of the thread it waits for, and a probe crawls. Sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) costs a tiny probe 1.8x its step time on an idle host; a short spin keeps the
# idle speed, and with the threads sized to the free cores (child/threads.py) keeps a busy host's cost
# small (bench/busy_host.py, bench/RESULTS.md). libgomp reads it when it loads: it is in the environment
# a probe process or warm worker starts with.
OPENMP_WAIT = {"GOMP_SPINCOUNT": "10000"}


def gpu_fit(device: DeviceFacts | dict, probe_bytes: int) -> list[int]:
    """How many one-GPU probes of `probe_bytes` training memory fit on each GPU at once (plus a CUDA
    context each, within GPU_FIT_FRACTION of its memory); at least one per GPU."""
    per_probe = probe_bytes + CUDA_CONTEXT_BYTES
    return [max(1, int(GPU_FIT_FRACTION * g.memory_bytes // per_probe)) for g in DeviceFacts.of(device).gpus]


def packed_jobs(device: DeviceFacts | dict, estimate_bytes: int, peak_bytes: int | None = None) -> int:
    """How many probes run at once by default. On a GPU host: as many as fit in each GPU's memory
    (each takes the planner's training-memory estimate, or the largest peak measured so far once a
    probe has finished, plus a CUDA context), summed over the GPUs, and at most one per
    CORES_PER_GPU_PROBE cores; at least one. On a CPU host: one (K probes on a CPU only share the
    same cores; `--jobs` asks for more)."""
    device = DeviceFacts.of(device)
    if not device.gpus:
        return 1
    per_probe = (peak_bytes or estimate_bytes) + CUDA_CONTEXT_BYTES
    fit = sum(int(GPU_FIT_FRACTION * g.memory_bytes // per_probe) for g in device.gpus)
    cores = max(1, (device.cpu_count or 1) // CORES_PER_GPU_PROBE)
    return max(1, min(fit, cores))


def most_jobs(device: DeviceFacts | dict) -> int:
    """The most probes packed_jobs can ever choose on this host: the slots a session makes room for."""
    device = DeviceFacts.of(device)
    if not device.gpus:
        return 1
    return max(1, (device.cpu_count or 1) // CORES_PER_GPU_PROBE)


def inductor_cache_env() -> dict:
    """Every probe of a run, and later runs, share inductor's FX-graph and autotune caches under the
    nandoctor cache directory, so that a compiled cell pays its compile once (names from
    torch/_inductor/config.py, torch/_functorch/config.py and torch/_inductor/runtime/cache_dir_utils.py)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(default_cache_dir() / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }


def probe_env(gpus: str | None = None, run: str | None = None) -> dict:
    """The environment of a probe process (and of a warm worker): this one's, with `gpus` as its
    CUDA_VISIBLE_DEVICES when given (the GPUs it was allotted, as this process was given them),
    `run` (the run's directory) as RUN_DIR_ENV and this process as RUNNER_ENV, which tell the run's own
    processes from other users' load (env.host_load), and OpenMP's short spin (OPENMP_WAIT) unless the
    user set how threads wait."""
    env = dict(os.environ)
    if not any(name in env for name in OPENMP_WAIT_ENV):
        env.update(OPENMP_WAIT)
    if gpus is not None:
        env[VISIBLE_DEVICES_ENV] = gpus
    if run is not None:
        env[RUN_DIR_ENV] = run
        runner = get_own_process_key()
        if runner:
            env[RUNNER_ENV] = f"{runner[0]}:{runner[1]!r}"
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


@dataclass
class Died:
    """A warm worker ended (its exit status): posted by the slot's reader when the worker's pipe closes."""

    returncode: int


class ColdSlot:
    """A fresh Python process per probe."""

    kind = "cold"

    def __init__(self, index: int, events: queue.Queue, run: str | None = None):
        self.index, self.events, self.run = index, events, run
        self.ready = True
        self.pid: int | None = None
        self.generation = 0
        self.threads = None  # no worker, no fork
        self.opened_at = 0.0

    @property
    def worker_pid(self) -> int | None:
        return None

    def open(self) -> None:
        pass

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        pass

    def launch(self, spec: Path, result: Path, log: Path, env: dict, kind: str = "spec") -> None:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                child_command(spec, result),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**probe_env(run=self.run), **env},
                start_new_session=True,
            )
        self.pid = proc.pid

        def wait():
            self.events.put((self.index, self.generation, Exited(proc.pid, proc.wait())))

        threading.Thread(target=wait, daemon=True).start()

    def kill_probe(self) -> None:
        if self.pid:
            kill_group(self.pid)

    def close(self) -> None:
        self.kill_probe()


WORKER_COMMAND = [sys.executable, "-m", "nandoctor.child.worker"]


class WarmSlot:
    """A warm worker that forks one child per probe; replaced by a fresh one if it dies."""

    kind = "warm"

    def __init__(self, index: int, events: queue.Queue, run: str | None = None):
        self.index, self.events, self.run = index, events, run
        self.ready = False
        self.pid: int | None = None  # the running probe's pid
        self.generation = 0
        self.worker: subprocess.Popen | ZygoteWorker | None = None
        self.commands = None  # the pipe the worker reads its commands from
        self.preloads: list[Preload] = []  # the preload commands every worker of this slot is sent
        self.threads: int | None = None  # the worker's threads when it last reported (ready, or at a fork)
        self.opened_at = 0.0  # when its worker was started: its readiness is timed from then

    @property
    def worker_pid(self) -> int | None:
        return self.worker.pid if self.worker else None

    def open(self) -> None:
        """Start the worker; a Ready event arrives once it has imported everything."""
        self.generation += 1
        self.ready, self.pid, self.opened_at = False, None, time.monotonic()
        commands_in, commands = os.pipe()
        messages, messages_out = os.pipe()
        # the worker is in the runner's process group (Ctrl-C reaches it); each probe gets its own
        try:
            env = probe_env(run=self.run)  # its forks inherit it
            # forked, already imported, by a zygote when one is named and agrees (run/zygote.py)
            self.worker = fork_worker(commands_in, messages_out, env) or subprocess.Popen(
                [*WORKER_COMMAND, str(commands_in), str(messages_out)],
                stdin=subprocess.DEVNULL,
                stdout=2,  # what its imports print goes where its errors go, never into the run's own output
                env=env,
                pass_fds=(commands_in, messages_out),
            )
        finally:
            os.close(commands_in)
            os.close(messages_out)
        self.commands = os.fdopen(commands, "w", buffering=1)
        threading.Thread(
            target=self._read, args=(self.worker, os.fdopen(messages), self.generation), daemon=True
        ).start()
        for command in self.preloads:
            self._send(command)

    def _read(self, worker: subprocess.Popen | ZygoteWorker, messages, generation: int) -> None:
        with messages:
            for line in messages:
                message = read_message(line)
                if message is not None:  # nothing else writes here; a torn line is skipped, not fatal
                    self.events.put((self.index, generation, message))
        self.events.put((self.index, generation, Died(worker.wait())))

    def _send(self, command) -> None:
        try:
            self.commands.write(message_line(command))
            self.commands.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the worker died (or was closed): its reader thread reports it

    def preload(self, model_type: str | None, adapter: bool = False) -> None:
        command = Preload(model_type, adapter)
        if command in self.preloads:
            return
        self.preloads.append(command)
        if self.worker:  # else open() sends it
            self._send(command)

    def launch(self, spec: Path, result: Path, log: Path, env: dict, kind: str = "spec") -> None:
        """Fork a child that runs a probe (kind "spec") or plans the run (kind "plan": child/plan.py),
        with `env` set in it first."""
        self.pid = None  # known when the worker says Started
        self._send(Fork(kind, str(spec), str(result), str(log), env))

    def kill_probe(self) -> None:
        if self.pid:
            kill_group(self.pid)

    def kill_worker(self) -> None:
        """Kill the worker (and so the probe it forked, which dies with it) without waiting for it."""
        self.kill_probe()
        if self.worker and self.worker.poll() is None:
            self.worker.kill()

    def close(self) -> None:
        self.kill_probe()
        if not self.worker or self.worker.poll() is not None:
            return
        # no probe runs now (killed above), and the worker holds nothing to finish: killing it spares
        # the wait for its interpreter's teardown (a second or more of unloading torch)
        self.worker.kill()
        self.worker.wait()
        try:
            self.commands.close()
        except OSError:
            pass
