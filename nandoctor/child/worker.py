"""A warm worker: `python -m nandoctor.child.worker`, started by the runner, one per slot.

It imports torch, transformers and the probe code once (peft too when a recipe of the run trains an
adapter: it costs seconds of import), then for each probe it is sent it
forks a fresh child that runs `entry.main([SPEC, RESULT])` and `os._exit()`s. The child is a copy of
an already-imported process, so a probe starts in milliseconds instead of seconds, and it is still its
own process: a crash, hang or leaked state dies with it.

The worker never runs a torch op and never touches CUDA: GNU OpenMP's thread pool and a CUDA context
do not survive fork(), so both are first created in the child (which also sets its thread count).
It holds no thread at all when it forks: numpy's (and scipy's) OpenBLAS start a pool of worker
threads the moment they are loaded (peft and transformers import them), which is what made Python 3.12
warn "This process is multi-threaded, use of fork() may lead to deadlocks" in every worker (issue 10);
the worker caps OpenBLAS at its calling thread before anything imports it. Its "ready" message says
how many threads it has (1), and the runner's tests hold it to that.

Protocol (record/worker_messages.py: Preload, Fork, Ready, Started, Exited), one JSON line each, on two pipes of its
own whose descriptors are its two arguments: commands in, messages out. Its stdout is its parent's
stderr, so a module that prints while it is imported reaches the user's terminal, never the protocol. Per Fork it
sends Started (the child's pid, its threads at the fork) and Exited (returncode n < 0: killed by
signal -n). Like a probe process it dies with its parent (lifetime.py), and exits at once if that
parent died before it could be tied to it.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import signal
import sys
import traceback

from ..cells import PACKAGES
from ..optional import UNUSED_BY_PROBES, hidden
from ..record import PARENT_ENV, Exited, Fork, Preload, Ready, Started, message_line, read_message
from .lifetime import die_with_parent, parent_gone
from .threads import note_idle


def thread_count() -> int | None:
    """Threads of this process, native ones included (threading.enumerate() sees Python's only);
    None where there is no procfs (macOS) to count them with."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def preload(model_type: str | None = None, adapter: bool = False) -> None:
    """Import what every probe needs (and the modeling module of model_type, and peft for an adapter),
    running no torch op. The optional packages are not among them: a child whose cell needs one
    imports it (optional.py). Where an installed package that this import pulls in needs a hidden one
    (transformers 5.17 imports scikit-learn, which imports scipy, when it is installed), the preload
    imports again hiding less, then nothing: hiding saves under a second, never a worker.

    The garbage collector stays off while it imports, and what it imported is frozen afterwards
    (gc.freeze): the import makes some 600,000 objects that live as long as the worker, and the full
    passes the collector would make over them as they come cost a 2-core CPU about a fifth of the import
    (bench/RESULTS.md). Frozen, they are never scanned again, in the worker or in a probe it forks, whose
    copy-on-write pages then stay shared. The few cycles the import leaves as garbage stay with it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        for hiding in ([*PACKAGES, *UNUSED_BY_PROBES], [*PACKAGES], []):
            try:
                with hidden(hiding):
                    _preload(model_type, adapter)
                return
            except ImportError:
                if not hiding:
                    raise
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def _preload(model_type: str | None, adapter: bool) -> None:
    if adapter:
        import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    from .. import env  # noqa: F401
    from . import build, entry, plan, train  # noqa: F401

    if model_type:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        name = model_type_to_module_name(model_type)
        try:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            # custom code (trust_remote_code) or an unknown type: each child imports the model's own module,
            # but what every modeling module imports (modeling_utils, and with it torch._dynamo and
            # torch.distributed.tensor: most of 9 s on a 2-core CPU) is imported once, here
            importlib.import_module("transformers.modeling_utils")


def run_child(fork: Fork, protocol: tuple[int, ...], worker: int) -> None:
    """In the forked child of the worker `worker` (its pid): own session (so a timeout kills the whole
    group), tied to the worker's life, the protocol's pipes closed, its environment (its GPUs) set before
    anything reads it, output to the probe's log, then the probe. Never returns; exits 1 at once when
    the worker died before the tie held (as a cold probe does, child/__main__.py): nobody would wait
    for this probe, and it would train on as an orphan."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        if parent_gone(str(worker), os.getppid()):
            os._exit(1)
        for fd in protocol:
            os.close(fd)
        os.environ.update(fork.env)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(fork.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        faulthandler.enable()
        if "CUDA_VISIBLE_DEVICES" in fork.env:
            print(f"nandoctor: this probe's GPUs: CUDA_VISIBLE_DEVICES={fork.env['CUDA_VISIBLE_DEVICES']}", flush=True)
        if fork.kind == "plan":
            from .plan import main as plan

            code = plan(fork.path, fork.result)
        else:
            from .entry import main

            code = main([fork.path, fork.result])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    """argv: the descriptors of the command pipe (read) and the message pipe (written)."""
    die_with_parent()
    if parent_gone(os.environ.pop(PARENT_ENV, None), os.getppid()):
        return 1  # its parent died while it started: nobody would ever send it a probe
    return serve(int(argv[0]), int(argv[1]))


def serve(commands_fd: int, messages_fd: int) -> int:
    """Import, say Ready, then fork a child per Fork command until the command pipe closes (the run is
    over or gone). A worker that a zygote forked (zygote.py) starts here, its imports already done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle: it closes the workers
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read when OpenBLAS loads (in preload): no pool to fork over
    messages = os.fdopen(messages_fd, "w", buffering=1)

    def send(message) -> None:
        messages.write(message_line(message))
        messages.flush()

    preload()
    send(Ready(os.getpid(), thread_count()))
    note_idle()  # the next probe measures the free cores from here (child/threads.py)
    for line in os.fdopen(commands_fd):
        command = read_message(line)
        if isinstance(command, Preload):
            preload(command.model_type, command.adapter)
            note_idle()
            continue
        if not isinstance(command, Fork):
            continue
        sys.stderr.flush()
        threads = thread_count()
        worker = os.getpid()
        pid = os.fork()
        if pid == 0:
            run_child(command, (commands_fd, messages_fd), worker)
        send(Started(pid, threads))
        _, status = os.waitpid(pid, 0)
        send(Exited(pid, os.waitstatus_to_exitcode(status)))
        note_idle()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
