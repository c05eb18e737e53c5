"""The node side of a probe an executor placed: what a SLURM job or a Ray task runs.

It starts the probe process a cold slot starts (slots.child_command: `python -m nandoctor.child SPEC
RESULT`, its output in log.txt), in a session of its own, and gives it the local runner's time budget
(runner.RunningProbe: timeout_s for the build and the timed steps, then the replay's own), killing its
process group when it overruns. It returns how the probe ended (and writes it to placed.json next to the
spec), so that the parent classifies it with runner.collect exactly as a local probe. It imports no torch:
the job pays the child's imports once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .. import jsonio
from ..env import get_nvml
from ..record import BUILT_FILE, STALE_FILES, ProbeSpec
from .runner import LOG_TAIL_CHARS, MAX_WAIT_S, ProbeTask, RunningProbe
from .slots import child_command, kill_group, probe_env

PLACED_FILE = "placed.json"
CARRIED_FILES = ("result.json", "steps.jsonl", BUILT_FILE)  # what a Ray task carries back whole; log.txt: its tail


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
    job and partition (SLURM's environment; None under Ray)."""
    from ..env import collect_doctor

    where = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "partition": os.environ.get("SLURM_JOB_PARTITION"),
    }
    return {**collect_doctor(), "gathered": where}


def run_placed(folder: str, timeout_s: float) -> dict:
    """Run the probe whose spec.json is in `folder` within its budget; returns {returncode, timed_out,
    replay_overran, wall_s, node, gpus, gpu} and writes it to folder/placed.json."""
    folder = Path(folder)
    spec = ProbeSpec.from_dict(jsonio.loads((folder / "spec.json").read_text()))
    gpus = node_gpus()
    env = probe_env(None)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    for stale in (*STALE_FILES, PLACED_FILE):
        (folder / stale).unlink(missing_ok=True)
    with open(folder / "log.txt", "wb") as out:
        proc = subprocess.Popen(
            child_command(folder / "spec.json", folder / "result.json"),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    probe = RunningProbe(ProbeTask(spec, timeout_s), folder, time.monotonic(), pid=proc.pid)
    try:
        while True:
            try:
                returncode = proc.wait(timeout=max(0.01, min(MAX_WAIT_S, probe.left_s())))
                break
            except subprocess.TimeoutExpired:
                if probe.left_s() < 0:
                    probe.timed_out = probe.timed_at is None
                    probe.replay_overran = probe.timed_at is not None
                    kill_group(proc.pid)
    finally:
        kill_group(proc.pid)  # the job is ending (or being cancelled): nothing of the probe outlives it
    placed = {
        "returncode": returncode,
        "timed_out": probe.timed_out,
        "replay_overran": probe.replay_overran,
        "wall_s": probe.elapsed,
        "node": socket.gethostname(),
        "gpus": gpus,
        "gpu": gpu_names(gpus),
    }
    (folder / PLACED_FILE).write_text(jsonio.dumps(placed))
    return placed


def run_carried(spec: dict, timeout_s: float) -> dict:
    """run_placed in a scratch folder of the node, for an executor without a shared filesystem (Ray):
    returns {"placed": ..., "files": {name: text}} with the probe's result, steps and log tail."""
    with tempfile.TemporaryDirectory(prefix="nandoctor-probe-") as scratch:
        folder = Path(scratch)
        (folder / "spec.json").write_text(jsonio.dumps(spec))
        placed = run_placed(str(folder), timeout_s)
        files = {
            name: (folder / name).read_text(errors="replace") for name in CARRIED_FILES if (folder / name).exists()
        }
        log = (folder / "log.txt").read_bytes()[-16 * LOG_TAIL_CHARS :]
        files["log.txt"] = log.decode(errors="replace")
        return {"placed": placed, "files": files}
