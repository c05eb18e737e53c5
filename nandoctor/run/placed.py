"""The node side of a probe an executor placed: what a SLURM job or a Ray task runs.

It starts the probe process a cold slot starts (slots.child_command: `python -m nandoctor.child SPEC
RESULT`, its output in log.txt), in a session of its own, and watches its time budget (task.Budget,
the one every local slot applies too), killing its process group when it overruns. It writes how the
probe ended (placement.Outcome) to placed.json next to the spec, atomically, so that the parent
classifies it with task.collect exactly as a local probe. It imports no torch: the job pays the
child's imports once.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from .. import jsonio
from ..env import get_nvml
from ..record import BUILT_FILE, STALE_FILES, ProbeSpec
from .placement import Outcome
from .slots import child_command, kill_group, probe_env
from .store import write_atomic
from .task import LOG_TAIL_CHARS, OUTCOME_FILE, SPEC_FILE, Budget, ProbeTask, last_step

CARRIED_FILES = ("result.json", "steps.jsonl", BUILT_FILE)  # what a Ray task carries back whole; log.txt: its tail
WATCH_S = 0.5  # how often the wrapper looks at its probe's budget
REAP_S = 10.0  # how long the wrapper waits for its killed probe to be gone
STEP_EVERY_S = 5.0  # how often a Ray task streams its probe's last step back (for the parent's heartbeat)


def node_gpus() -> str | None:
    """The GPUs the scheduler gave this job, as it names them (CUDA_VISIBLE_DEVICES), or None."""
    return os.environ.get("CUDA_VISIBLE_DEVICES") or None


def gpu_names(visible: str | None) -> str | None:
    """What the GPUs this job may use are, measured here on the node (NVML, no torch): their names,
    joined; None on a node without NVML or GPUs. `visible` (CUDA_VISIBLE_DEVICES) narrows them when
    it lists indices."""
    devices = get_nvml().get("devices") or []
    wanted = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if wanted and all(v.isdigit() for v in wanted):
        devices = [d for d in devices if str(d["index"]) in wanted]
    return ", ".join(d["name"] for d in devices) or None


def node_facts() -> dict:
    """This node's device facts (env.collect_doctor, which imports torch), as a job sized like one probe
    sees them, and where they were gathered: `gathered` names the host, the process and the scheduler's
    job and partition (SLURM's environment; None under Ray). As JSON data: the job writes or returns it."""
    from ..env import collect_doctor

    where = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "partition": os.environ.get("SLURM_JOB_PARTITION"),
    }
    return collect_doctor().gathered_at(where).to_dict()


def missing_inputs(inputs: dict[str, str]) -> dict[str, str]:
    """The run's input files (recipe field -> path: config.PATH_FIELDS) that this node does not have."""
    return {key: path for key, path in inputs.items() if not os.path.exists(path)}


def inputs_not_on_node(missing: dict[str, str], host: str, executor: str, where: str = "") -> str:
    """The one line that stops a run whose inputs a node lacks, with what to do."""
    named = ", ".join(f"{key} {path!r}" for key, path in missing.items())
    return (
        f"--executor {executor}: {named} not found on node {host}{where}; its probes read the run's inputs at "
        "the same path there: put them on a filesystem every node mounts, or copy them to that path"
    )


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM raised as a KeyboardInterrupt while the block runs: what a SLURM job's wrapper needs.
    scancel, a preemption or the job's time limit send the job SIGTERM (SIGKILL follows after the
    cluster's KillWait), and submitit only logs it ("Bypassing signal SIGTERM"), leaving a job time to
    checkpoint. A probe has nothing to save: the wrapper ends its probe at once and the job ends. SLURM's
    SIGKILL alone is not enough where the node tracks a job's processes by parentage
    (proctrack/linuxproc): a job cancelled in its first second was lost track of, and its probe trained
    on for 27 s after its run had ended. Only the main thread can set the handler."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is None:
        yield  # None: a handler set outside Python, which this could not put back
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_held():
    """A KeyboardInterrupt (a Ray task cancelled without force: `_thread.interrupt_main`; a Ctrl-C; a
    SLURM job's SIGTERM inside sigterm_interrupts) held back while the block runs and raised when it
    ends. Around a probe's start: one raised inside Popen, after the fork, or before the watch below
    began, would lose the probe's pid, and the probe would train on, unwatched, after its task had ended.
    Only the main thread receives it, and only there can its handler be set."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # None: a handler set outside Python, which this could not put back
        return
    held = []
    interrupting = signal.getsignal(signal.SIGTERM) is signal.default_int_handler  # inside sigterm_interrupts
    signals = (signal.SIGINT, signal.SIGTERM) if interrupting else (signal.SIGINT,)
    previous = {signum: signal.signal(signum, lambda *_: held.append(True)) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        raise KeyboardInterrupt


def watch_probe(folder: Path, timeout_s: float, run: str, step_every_s: float = math.inf):
    """Run the probe whose spec.json is in `folder` within its budget, as a probe of `run` (the run's
    directory, RUN_DIR_ENV). A generator: it yields {"step": its last step} every step_every_s while the
    probe runs (when that step is new), and returns the Outcome (also written to folder/placed.json)."""
    spec = ProbeSpec.from_dict(jsonio.loads((folder / SPEC_FILE).read_text()))
    gpus = node_gpus()
    for stale in (*STALE_FILES, OUTCOME_FILE):
        (folder / stale).unlink(missing_ok=True)
    proc = None
    try:
        with open(folder / "log.txt", "wb") as out, interrupts_held():
            proc = subprocess.Popen(
                child_command(folder / SPEC_FILE, folder / "result.json"),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=probe_env(gpus, run),
                start_new_session=True,
            )
        budget = Budget(ProbeTask(spec, timeout_s), folder)
        said, said_at = None, time.monotonic()
        while True:
            try:
                returncode = proc.wait(timeout=max(0.01, min(WATCH_S, budget.left_s())))
                break
            except subprocess.TimeoutExpired:
                if budget.overran():
                    kill_group(proc.pid)
            if time.monotonic() - said_at >= step_every_s:
                said_at, step = time.monotonic(), last_step(folder / "steps.jsonl")
                if step is not None and step != said:
                    said = step
                    yield {"step": step}
    finally:
        if proc is not None:
            kill_group(proc.pid)  # the job is ending (or being cancelled): nothing of the probe outlives it
            try:
                proc.wait(timeout=REAP_S)  # reaped before the task ends: a cancel that waits sees it gone
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                pass
    outcome = Outcome(
        returncode,
        budget.timed_out,
        budget.replay_overran,
        budget.elapsed,
        node=socket.gethostname(),
        gpus=gpus,
        gpu=gpu_names(gpus),
    )
    write_atomic(folder / OUTCOME_FILE, jsonio.dumps(outcome.to_dict()))
    return outcome


def run_placed(folder: str, timeout_s: float, run: str) -> dict:
    """What a SLURM job runs: watch_probe in `folder` (on the shared filesystem); returns its Outcome as
    a dict (placed.json holds the same). A SIGTERM (the job cancelled) ends the probe and the job."""
    with sigterm_interrupts():
        watch = watch_probe(Path(folder), timeout_s, run)
        while True:
            try:
                next(watch)
            except StopIteration as done:
                return done.value.to_dict()


def run_carried(spec: dict, timeout_s: float, run: str):
    """watch_probe in a scratch folder of the node, for an executor without a shared filesystem (Ray).
    A generator: yields {"step": ...} items while the probe runs, then {"placed": Outcome dict,
    "files": {name: text}} with the probe's result, steps and log tail."""
    with tempfile.TemporaryDirectory(prefix="nandoctor-probe-") as scratch:
        folder = Path(scratch)
        (folder / SPEC_FILE).write_text(jsonio.dumps(spec))
        outcome = yield from watch_probe(folder, timeout_s, run, STEP_EVERY_S)
        files = {
            name: (folder / name).read_text(errors="replace") for name in CARRIED_FILES if (folder / name).exists()
        }
        log = (folder / "log.txt").read_bytes()[-16 * LOG_TAIL_CHARS :]
        files["log.txt"] = log.decode(errors="replace")
        yield {"placed": outcome.to_dict(), "files": files}
