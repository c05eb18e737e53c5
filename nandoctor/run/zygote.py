"""The client of a zygote (child/zygote.py): a warm worker forked from a process that has already
imported torch and transformers, instead of a fresh `python -m nandoctor.child.worker`. Used when
ZYGOTE_ENV names the zygote's socket and the zygote agrees (the worker's environment equals its own
apart from each run's own variables); otherwise WarmSlot.open spawns its worker as always.

ZygoteWorker stands in for the subprocess.Popen of a spawned worker: pid, poll, wait and kill. The
zygote sends the worker's exit status on the connection the worker was asked for."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading

from ..record import ZYGOTE_ENV

CONNECT_TIMEOUT_S = 5.0


class ZygoteWorker:
    """A warm worker the zygote forked: the subset of subprocess.Popen that WarmSlot uses."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self._conn = pid, conn
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _read(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return None
            try:
                answer = self._conn.recv(64).decode()
            except OSError:
                answer = ""
            # the zygote ended without saying (it died): so did the workers it forked, with it
            self.returncode = int(answer.split()[1]) if answer.startswith("exit ") else -signal.SIGKILL
            self._conn.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._read(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read(timeout)
        if code is None:
            raise subprocess.TimeoutExpired("zygote worker", timeout)
        return code

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_worker(commands_in: int, messages_out: int, env: dict) -> ZygoteWorker | None:
    """A warm worker from the zygote named in ZYGOTE_ENV, with these pipe ends and environment; None
    when there is none, it cannot be reached, or it refuses (then the caller spawns one)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(path)
        request = {
            "env": env,
            "cwd": os.getcwd(),
            "pgid": os.getpgid(0),
            "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        }
        socket.send_fds(conn, [json.dumps(request).encode()], [commands_in, messages_out, 2])
        answer = conn.recv(64).decode()
        conn.settimeout(None)
    except OSError:
        conn.close()
        return None
    if not answer.startswith("pid "):
        conn.close()
        return None
    return ZygoteWorker(int(answer.split()[1]), conn)
