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

Protocol, one JSON object per line. stdin: {"preload": model_type, "adapter": bool}, {"spec": path, "result": path,
"log": path} (a probe) or {"plan": path, "result": path, "log": path} (the run's device facts and model
plans, child/plan.py, forked like a probe). stdout: {"ready": pid, "threads": n} once imported, then
per probe {"started": child_pid, "threads": n at the fork} and {"exited": child_pid, "returncode": n}
(n < 0: killed by signal -n).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import sys
import traceback

from .. import jsonio
from ..cells import PACKAGES
from ..optional import UNUSED_BY_PROBES, hidden
from .lifetime import die_with_parent


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
    imports it (optional.py)."""
    with hidden([*PACKAGES, *UNUSED_BY_PROBES]):
        _preload(model_type, adapter)


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
            pass  # custom code (trust_remote_code) or an unknown type: the child imports it itself


def run_child(command: dict) -> None:
    """In the forked child: own session (so a timeout kills the whole group), output to the probe's
    log, then the probe. Never returns."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        faulthandler.enable()
        if "plan" in command:
            from .plan import main as plan

            code = plan(command["plan"], command["result"])
        else:
            from .entry import main

            code = main([command["spec"], command["result"]])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def send(message: dict) -> None:
    sys.stdout.write(jsonio.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle: it closes the workers
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read when OpenBLAS loads (in preload): no pool to fork over
    preload()
    send({"ready": os.getpid(), "threads": thread_count()})
    for line in sys.stdin:
        command = jsonio.loads(line)
        if "preload" in command:
            preload(command["preload"], command.get("adapter", False))
            continue
        sys.stderr.flush()
        threads = thread_count()
        pid = os.fork()
        if pid == 0:
            run_child(command)
        send({"started": pid, "threads": threads})
        _, status = os.waitpid(pid, 0)
        send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
