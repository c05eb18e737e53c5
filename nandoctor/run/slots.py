"""Slots: where probes run, one at a time per slot. Each slot reports to the runner through one
queue of events (slot index, generation, message), so the runner waits on one thing.

- WarmSlot owns a warm worker (`python -m nandoctor.child.worker`) and asks it to fork a child per probe:
  the import of torch / transformers / peft is paid once per worker, not once per probe.
- ColdSlot starts a fresh `python -m nandoctor.child` per probe: the baseline, and the fallback
  (`--cold`) when forking is not wanted.

Either way a probe is its own process in its own session: a timeout kills its whole process group.
Messages: {"ready": pid}, {"started": pid}, {"exited": pid, "returncode": n}, {"died": returncode}.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path


def probe_env(gpu: int | None) -> dict:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)  # the probe sees one GPU, as device 0
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a segfault leaves its Python stack in log.txt
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


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

    def open(self) -> None:
        pass

    def preload(self, model_type: str) -> None:
        pass

    def launch(self, spec: Path, result: Path, log: Path) -> None:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "nandoctor.child", str(spec), str(result)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=probe_env(self.gpu), start_new_session=True)
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
        self.preloads: list[str] = []

    def open(self) -> None:
        """Start the worker; a {"ready"} event arrives once it has imported everything."""
        self.generation += 1
        self.ready, self.pid = False, None
        # the worker is in the runner's process group (Ctrl-C reaches it); each probe gets its own
        self.worker = subprocess.Popen([sys.executable, "-m", "nandoctor.child.worker"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=probe_env(self.gpu), text=True, bufsize=1)
        threading.Thread(target=self._read, args=(self.worker, self.generation), daemon=True).start()
        for model_type in self.preloads:
            self._send({"preload": model_type})

    def _read(self, worker: subprocess.Popen, generation: int) -> None:
        for line in worker.stdout:
            self.events.put((self.index, generation, json.loads(line)))
        self.events.put((self.index, generation, {"died": worker.wait()}))

    def _send(self, command: dict) -> None:
        try:
            self.worker.stdin.write(json.dumps(command) + "\n")
            self.worker.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker died: its reader thread reports it

    def preload(self, model_type: str) -> None:
        self.preloads.append(model_type)
        if self.worker:  # else open() sends it
            self._send({"preload": model_type})

    def launch(self, spec: Path, result: Path, log: Path) -> None:
        self.pid = None  # known when the worker says {"started": pid}
        self._send({"spec": str(spec), "result": str(result), "log": str(log)})

    def kill_probe(self) -> None:
        if self.pid:
            kill_group(self.pid)

    def close(self) -> None:
        self.kill_probe()
        if not self.worker or self.worker.poll() is not None:
            return
        if not self.ready:
            self.worker.kill()  # still importing: nothing to finish
        else:
            self.worker.stdin.close()  # the worker's loop ends at EOF
        try:
            self.worker.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.worker.kill()
            self.worker.wait()
