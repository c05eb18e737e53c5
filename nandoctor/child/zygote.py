"""A zygote: one process that has imported what a warm worker imports (worker.preload) and forks a warm
worker for each run that asks, so that a run started beside it skips the seconds of `import torch,
transformers` its worker would pay (8-10 s on a 2-core CPU). `python -m nandoctor.child.zygote SOCKET`
serves on a Unix socket; a run finds it through ZYGOTE_ENV (run/zygote.py is the client, WarmSlot.open
the caller).

A request carries the run's worker environment, working directory, CPU affinity and process group, and
three descriptors (SCM_RIGHTS): the worker's command pipe, its message pipe, and where its stderr goes.
The zygote forks only when that environment equals its own apart from ZYGOTE_PER_RUN (the variables
each run sets for itself) and CLUSTER_CLIENT_PREFIXES (its SLURM or Ray client's settings): every other
variable may have been read at import (libgomp reads GOMP_SPINCOUNT and OMP_* when it loads,
huggingface_hub its HF_* constants), so a run with another one gets a fresh worker, as without a zygote.
The forked worker joins the run's process group when it can, takes its affinity and environment, and
then serves the run exactly as a spawned worker does (worker.serve). The zygote answers `pid N`, and
`exit N` on the same connection when that worker ends, so the run can wait for it as for a child of its
own. The worker is the zygote's child, not the run's, so the parent-death signal cannot tie it to the
run: the zygote watches the run's process and kills its worker when it ends (its probe dies with the
worker, as run_child ties it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

from ..env import RUN_DIR_ENV, RUNNER_ENV
from ..record import PARENT_ENV, ZYGOTE_ENV
from .lifetime import die_with_parent
from .worker import preload, serve

# What a run sets in its worker's environment for itself (run/slots.py probe_env), or what changes from
# one test or shell to the next and nothing reads at import.
ZYGOTE_PER_RUN = frozenset(
    {
        PARENT_ENV,
        RUN_DIR_ENV,
        RUNNER_ENV,
        ZYGOTE_ENV,
        "PYTEST_CURRENT_TEST",
        # the run's cache (run/cache.py), read when a probe is looked up, and the inductor cache in it
        # (slots.inductor_cache_env), which torch reads when it first compiles (cache_dir_utils.cache_dir)
        "NANDOCTOR_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "GITHUB_STEP_SUMMARY",
        "PWD",
        "OLDPWD",
        "_",
        "SHLVL",
    }
)
# ... and the settings of a run's cluster client (SLURM_CONF: which cluster sbatch and squeue ask;
# RAY_ADDRESS, RAY_AUTH_MODE, ...), read by submitit's commands and by ray in the run's own process. A
# worker imports neither submitit nor ray, and no Python module it imports names a SLURM_ or RAY_ variable
# (torch 2.13, transformers 5.24); what reads one at run time sees the run's own value, since a forked
# worker takes the run's environment.
CLUSTER_CLIENT_PREFIXES = ("SLURM_", "RAY_")
MAX_REQUEST = 1 << 20


def comparable(env: dict) -> dict:
    """An environment less the variables each run may set for itself."""
    return {k: v for k, v in env.items() if k not in ZYGOTE_PER_RUN and not k.startswith(CLUSTER_CLIENT_PREFIXES)}


def _become_worker(request: dict, fds: list[int], listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: the run's worker. Never returns."""
    code = 1
    try:
        listener.close()
        conn.close()
        commands_fd, messages_fd, stderr_fd = fds
        try:
            os.setpgid(0, request["pgid"])  # Ctrl-C of the run's group reaches it, as a spawned worker's
        except (OSError, KeyError, TypeError):
            pass
        if request.get("affinity") and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, request["affinity"])
        os.dup2(stderr_fd, 2)
        os.dup2(stderr_fd, 1)  # what its imports print goes where its errors go (WarmSlot.open: stdout=2)
        os.close(stderr_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(PARENT_ENV)
        code = serve(commands_fd, messages_fd)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


class Children:
    """The workers this zygote forked: pid -> (the connection its run asked on, a pidfd of that run)."""

    def __init__(self):
        self.by_pid: dict[int, tuple[socket.socket, int]] = {}

    def add(self, pid: int, conn: socket.socket, run: int) -> None:
        try:
            watch = os.pidfd_open(run)
        except (OSError, AttributeError):
            os.kill(pid, signal.SIGKILL)  # the run is already gone: so is its worker
            watch = -1
        self.by_pid[pid] = (conn, watch)

    def runs(self) -> dict[int, int]:
        """pidfd -> worker pid, for the runs still watched."""
        return {watch: pid for pid, (_, watch) in self.by_pid.items() if watch >= 0}

    def run_ended(self, watch: int, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        conn, _ = self.by_pid[pid]
        os.close(watch)
        self.by_pid[pid] = (conn, -1)

    def reap(self) -> None:
        while self.by_pid:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn, watch = self.by_pid.pop(pid, (None, -1))
            if watch >= 0:
                os.close(watch)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def _answer(conn: socket.socket, own: dict, listener: socket.socket, children: Children) -> None:
    """Fork a worker for the run asking on `conn`, or say no (with the variables that differ)."""
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    try:
        request = json.loads(data.decode())
        env = request["env"]
        theirs = comparable(env)
        differ = sorted(k for k in theirs.keys() | own.keys() if theirs.get(k) != own.get(k))
        if len(fds) != 3 or differ or not str(env.get(PARENT_ENV, "")).isdigit():
            conn.sendall(f"no {' '.join(differ)}\n".encode())
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            _become_worker(request, fds, listener, conn)
        children.add(pid, conn, int(env[PARENT_ENV]))
        conn.sendall(f"pid {pid}\n".encode())
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)


def main(argv: list[str]) -> int:
    """argv: the socket path. Serves until its parent ends (it dies with it)."""
    die_with_parent()
    own = comparable(dict(os.environ))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test run or shell that started it stops it
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # as worker.main: no OpenBLAS pool to fork over
    # transformers' modeling_utils (and what it pulls in: torch._dynamo, torch.distributed.tensor) is
    # most of a worker's import, and comes with the first modeling module: the embedded default's
    preload("llama")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(argv[0])
    listener.listen(16)
    children = Children()
    print("ready", flush=True)
    while True:
        runs = children.runs()
        readable, _, _ = select.select([listener, *runs], [], [], 0.2)
        for watch in readable:
            if watch in runs:
                children.run_ended(watch, runs[watch])
        children.reap()
        if listener in readable:
            conn, _ = listener.accept()
            _answer(conn, own, listener, children)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
