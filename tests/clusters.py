"""Real clusters on this machine for the executor tests: a one-node SLURM (tests/cluster/slurm_up.sh)
and a local Ray bound to 127.0.0.1, each started once per test module; and the local runs their
results are compared with, made once per pytest process."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from checkpoints import save_custom_llama
from conftest import records, run_cli, unpinned, verdicts

SLURM_UP = Path(__file__).parent / "cluster" / "slurm_up.sh"

# The small grid every executor runs: tiny-llama, the fp32 reference and pure fp16 (its loss is NaN at
# step 1), one thread per probe everywhere (locally --jobs 2 on 2 cores; remotely cpus=1), so the losses
# are bit-equal. One stable cell: no re-timing (retime.py) lengthens the test; no forensics replay of the
# NaN (3 s of each fp16 probe on a 2-core CPU) either: a replay runs in the probe wherever it was placed.
EQUAL_GRID = ("--axis", "dtype=fp32,fp16-pure", "--axis", "attn=eager", "--axis", "compile=off", "--steps", "3")
EQUAL_GRID += ("--set", "forensics_steps=0")
EQUAL_VERDICTS = {"fp32/eager/off": "stable", "fp16-pure/eager/off": "nonfinite"}


def assert_like_local(out: Path, launch: str, kinds: tuple[str, ...]) -> None:
    """The equal grid run at `out` through an executor on each kind of hardware of its hardware axis
    (probe ids CELL@KIND) has the local run's verdicts and bit-equal losses, and each record names the
    executor, its job, its node and the kind of hardware it asked for."""
    local = local_run()
    assert verdicts(local) == EQUAL_VERDICTS
    assert verdicts(out) == {f"{cell}@{kind}": v for cell, v in EQUAL_VERDICTS.items() for kind in kinds}
    there = records(local)
    for probe_id, record in records(out).items():
        cell, _, kind = probe_id.partition("@")
        assert losses(record) == losses(there[cell])  # measured on the node it ran on
        assert record["launch"] == launch and record["job_id"] and record["node"]
        assert record["cell"]["hardware"] == kind


def losses(record: dict) -> list[str]:
    return [repr(s["loss"]) for s in record["steps"]]  # repr: NaN equals NaN


MISBEHAVING_CODE = '''
import ctypes, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class MisbehavingLlamaConfig(LlamaConfig):
    model_type = "misbehaving-llama"


class MisbehavingLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code that ends its probe per attention cell: eager reads address 0 (a real SIGSEGV),
    sdpa with only the math kernel sleeps forever, sdpa with only the flash kernel asks for 256 TiB
    (the CPU allocator refuses it)."""
    config_class = MisbehavingLlamaConfig

    def forward(self, *args, **kwargs):
        if self.config._attn_implementation == "eager":
            ctypes.string_at(0)
        if not torch.backends.cuda.flash_sdp_enabled():  # inside sdpa_kernel([MATH])
            time.sleep(3600)
        if not torch.backends.cuda.math_sdp_enabled():  # inside sdpa_kernel([FLASH_ATTENTION])
            torch.empty(1 << 48, dtype=torch.uint8)
        return super().forward(*args, **kwargs)
'''
# No stable cell: that an executor's stable probe trains as the local one does, the equal grid shows
# (its losses bit for bit); each of these cells costs a job's import of torch.
MISBEHAVING_CELLS = (
    "--axis",
    "dtype=fp32",
    "--axis",
    "attn=eager,sdpa:math,sdpa:flash",
    "--axis",
    "compile=off",
    "--steps",
    "2",
    "--set",
    "timeout_s=4",
    "--set",
    "forensics_steps=0",
    "--trust-remote-code",
)
MISBEHAVING_VERDICTS = {
    "fp32/eager/off": "crash",
    "fp32/sdpa:math/off": "timeout",
    "fp32/sdpa:flash/off": "oom",
}


def slurm_skip_reason() -> str | None:
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")):
        return "SLURM is not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting slurmctld / slurmd needs root"
    try:
        import submitit  # noqa: F401
    except ImportError:
        return "submitit is not installed (pip install '.[slurm]')"
    return None


@contextlib.contextmanager
def own_slurm(folder: Path) -> Iterator[dict]:
    """A one-node cluster of this test run's own, its state, daemons and ports in `folder`
    (tests/cluster/slurm_up.sh picks ports nothing listens on, so it runs beside any other SLURM on this
    host); yields the environment its clients need, then cancels its jobs and stops its daemons. Skips
    the test, with the reason, when the host has no free ports for it."""
    out = subprocess.run(
        [str(SLURM_UP), str(folder)], capture_output=True, text=True, timeout=120, preexec_fn=unpinned
    )  # slurmd's jobs see the node's cores, not one xdist worker's
    if out.returncode == 3:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        subprocess.run([str(SLURM_UP), "--down", str(folder)], capture_output=True, timeout=120)


def active_slurm_jobs(env: dict) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True, env={**os.environ, **env})
    return [line for line in out.stdout.splitlines() if line.strip()]


def ray_skip_reason() -> str | None:
    """Read without importing ray: the skip mark of test_executor_ray is evaluated while every pytest
    process collects, and `import ray` costs 0.5 s of CPU there, fast tier included."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install '.[ray]')"
    return None


RAY_HEAD = """
import os, sys, time, ray
ctx = ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, log_to_driver=False,
               resources=RESOURCES)
print(ctx.address_info["gcs_address"], flush=True)
for line in sys.stdin:  # each line asks for the CPUs no task holds, once the cluster's view has caught up
    time.sleep(1)
    print(ray.available_resources().get("CPU", 0), flush=True)
# stdin closed by the test: ray's exit handler stops the cluster this process started
"""


# The custom resources the local Ray's one node declares: two kinds of node for --axis node_type=.
RAY_NODE_TYPES = {"node_small": 100, "node_big": 100}


class LocalRay:
    """A real Ray started by a process of ours, every server on 127.0.0.1 (Ray resolves its node
    address to the host's outward IP unless told its node is loopback-only), its one node declaring
    RAY_NODE_TYPES."""

    def __init__(self):
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
        self.env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"RESOURCES = {RAY_NODE_TYPES!r}" + RAY_HEAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=unpinned,
        )
        self.address = self.proc.stdout.readline().strip()
        assert self.address.startswith("127.0.0.1:"), self.address

    def free_cpus(self) -> float:
        """The CPUs no task holds, as the process that started the cluster sees them (a driver of its own,
        asked on its stdin: a fresh one would import and connect Ray each time)."""
        self.proc.stdin.write("free\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def probe_processes(ours: Path | int) -> list[psutil.Process]:
    """Probe processes (`python -m nandoctor.child SPEC RESULT`, a parallel probe's ranks included) alive
    on this machine that belong to this test: with a run directory, those whose spec lies in it (a
    SLURM job's probe: slurmd's job steps are not our descendants); with a pid, those descending from
    that process (a Ray this test started: its raylet's workers start the probes in scratch folders any
    other Ray's probes have too). Another checkout's probes, alike in every other way, are not listed."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []
        if args[1:3] != ["-m", "nandoctor.child"] or len(args) < 4:
            continue
        try:
            if isinstance(ours, int):
                mine = any(parent.pid == ours for parent in proc.parents())
            else:
                mine = (Path(proc.cwd()) / args[3]).resolve().is_relative_to(Path(ours).resolve())
        except psutil.Error:  # ended meanwhile
            continue
        if mine:
            found.append(proc)
    return found


FOREIGN_PROBE = "import time\ntime.sleep(3600)\n"


@contextlib.contextmanager
def another_checkouts_probe() -> Iterator[psutil.Process]:
    """A process alike in every way a machine-wide look sees to a probe that another checkout runs on this
    host (`python -m nandoctor.child .../nandoctor-probe-XXXX/spec.json ...`, its own package, a Ray
    scratch folder's name), sleeping until the test ends: a test that takes it for its own is wrong."""
    with tempfile.TemporaryDirectory(prefix="nandoctor-other-checkout-") as other:
        child = Path(other, "nandoctor", "child")
        child.mkdir(parents=True)
        for init in (child.parent / "__init__.py", child / "__init__.py"):
            init.write_text("")
        (child / "__main__.py").write_text(FOREIGN_PROBE)
        scratch = Path(tempfile.mkdtemp(prefix="nandoctor-probe-", dir=other))
        proc = subprocess.Popen(
            [sys.executable, "-m", "nandoctor.child", str(scratch / "spec.json"), str(scratch / "result.json")],
            cwd=other,
            env={**os.environ, "PYTHONPATH": other},
            start_new_session=True,
        )
        try:
            yield psutil.Process(proc.pid)
        finally:
            proc.kill()
            proc.wait()


@functools.cache
def local_run() -> Path:
    """A local run of the equal grid, made once per pytest process, as the reference its remote runs'
    losses are compared with bit for bit. (The misbehaving grid has no local run here: its verdicts are
    fixed by what each cell's forward does, MISBEHAVING_VERDICTS, and the local harness's crash, timeout
    and OOM verdicts are tested in test_harness_outcomes.py and test_robustness.py.)"""
    base = Path(tempfile.mkdtemp(prefix="nandoctor-local-equal-"))
    proc = run_cli("grid", *EQUAL_GRID, "--jobs", "2", "--out", base / "run")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # fp32 is stable, fp16-pure's NaN a verdict
    return base / "run"


@functools.cache
def misbehaving_checkpoint() -> Path:
    return save_custom_llama(
        Path(tempfile.mkdtemp(prefix="nandoctor-misbehaving-")) / "ckpt",
        "misbehaving_llama",
        "Misbehaving",
        MISBEHAVING_CODE,
    )


def interrupt_when_running(
    args: list, env: dict, ours: Path | int, run_dir: Path, timeout: float = 300, sig: int = signal.SIGINT
) -> tuple[int, str]:
    """Start `nandoctor grid ARGS`, send it `sig` (SIGINT: Ctrl-C; SIGTERM: what `timeout`, CI systems and a
    preempted job get) the moment its run has begun (run_dir/run.json)
    and a probe process of ours that was not there before runs on this machine (probe_processes(ours):
    the cluster's one node is this machine); returns its exit code and everything it printed. Watching the
    processes, not the queue line (said at most every QUEUE_LINE_S), so that on a fast machine the
    interrupt cannot come after the run's last probe (a clean-clone run of 2026-11-25 sent it once both
    4 s probes had ended: the run had finished and exited by SIGINT)."""
    before = set(probe_processes(ours))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nandoctor", "grid", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while not ((Path(run_dir) / "run.json").exists() and set(probe_processes(ours)) - before):
        assert proc.poll() is None, "the run ended before a probe ran:\n" + "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    return proc.returncode, "".join(lines)
