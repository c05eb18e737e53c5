"""A probe process (`python -m nandoctor.child`, what a cold slot starts and what an executor's job or
task starts on its node) dies with the process that started it. A Ray task cancelled with force, or a
job step killed, ends that process without its cleanup: before this, the probe trained on as an orphan
(seen in a clean-clone run: the Ray Ctrl-C test found a probe process alive after every task had gone)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nandoctor.cells import Cell
from nandoctor.jsonio import dumps
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model
from nandoctor.record import BUILT_FILE, PARENT_ENV, ProbeSpec

STARTER = """
import subprocess, sys, time
from pathlib import Path
from nandoctor.run.slots import child_command, probe_env
folder = Path(sys.argv[1])
with open(folder / "log.txt", "wb") as log:
    proc = subprocess.Popen(child_command(folder / "spec.json", folder / "result.json"), env=probe_env(None),
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
print(proc.pid, flush=True)
time.sleep(600)
"""


def long_probe(folder: Path, steps: int) -> None:
    recipe = resolve_model("tiny-llama")
    spec = ProbeSpec(
        "fp32/sdpa/off", recipe, Cell(), plan_model(recipe, {"device": "cpu"}), steps, recipe.seed, "cpu", 1
    )
    (folder / "spec.json").write_text(dumps(spec.to_dict()))


def alive(pid: int) -> bool:
    """Running, not a zombie left for a PID 1 that does not reap (a container's)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.slow  # a real probe process, started as a cold slot starts it, trains until it is killed
def test_a_probe_whose_starter_is_killed_stops_training(tmp_path):
    long_probe(tmp_path, steps=100_000)  # hours of steps: it ends only if it is killed
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    probe = int(starter.stdout.readline())
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / BUILT_FILE).exists():  # built: it is training
            assert alive(probe) and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.2)
        starter.kill()  # SIGKILL: no cleanup of its own runs, as under a forced cancel
        starter.wait()
        deadline = time.monotonic() + 30
        while alive(probe) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(probe), "the probe trains on after the process that started it was killed"
    finally:
        if alive(probe):
            os.kill(probe, signal.SIGKILL)


def test_a_probe_whose_starter_died_before_it_started_does_not_run(tmp_path):
    long_probe(tmp_path, steps=3)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is nobody's parent now
    env = {**os.environ, PARENT_ENV: str(gone.pid)}
    done = subprocess.run(
        [sys.executable, "-m", "nandoctor.child", str(tmp_path / "spec.json"), str(tmp_path / "result.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and not (tmp_path / BUILT_FILE).exists() and not (tmp_path / "result.json").exists()


def test_a_warm_forked_probe_whose_worker_died_before_it_was_tied_does_not_run(tmp_path):
    # issue 34: the worker's forked child tied itself to the worker without checking, as a cold probe does,
    # that the worker was still its parent; had it died in between, the probe trained on as an orphan
    from nandoctor.child.worker import run_child
    from nandoctor.record import Fork

    long_probe(tmp_path, steps=3)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is nobody's parent now: the worker that forked this child, died
    log = tmp_path / "log.txt"
    pid = os.fork()
    if pid == 0:
        try:
            run_child(Fork("spec", str(tmp_path / "spec.json"), str(tmp_path / "result.json"), str(log)), (), gone.pid)
        finally:
            os._exit(3)  # never back into pytest
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert not log.exists() and not (tmp_path / BUILT_FILE).exists() and not (tmp_path / "result.json").exists()


@pytest.mark.slow  # a real probe process
def test_a_placed_probe_streams_its_last_step_while_it_runs(tmp_path, monkeypatch):
    """A Ray task's probe runs in a scratch folder of its node: the parent's heartbeat hears its last step
    only because the task streams it back (before, every Ray heartbeat said "no step yet")."""
    from nandoctor.run import placed

    monkeypatch.setattr(placed, "STEP_EVERY_S", 0.2)
    long_probe(tmp_path, steps=40)
    items = list(placed.run_carried(json.loads((tmp_path / "spec.json").read_text()), 300.0, str(tmp_path)))
    streamed = [item["step"]["step"] for item in items if "step" in item]
    assert streamed and streamed == sorted(set(streamed)) and streamed[-1] <= 39  # while it ran, in order
    assert items[-1]["placed"]["returncode"] == 0 and items[-1]["files"]["result.json"]


@pytest.mark.slow  # a real probe process
def test_a_cancel_that_lands_as_its_probe_starts_still_ends_the_probe(tmp_path, monkeypatch):
    """A Ray task cancelled without force gets a KeyboardInterrupt at its next bytecode
    (`_thread.interrupt_main`). One that came the moment the placed probe's process existed, before the
    wrapper held its pid, left the probe training after its task had ended (the Ray cancel test, under
    load, once found a probe left). Here the cancel lands inside the probe's Popen, after its fork."""
    import _thread
    import threading

    from nandoctor.run import placed

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("interrupt_main interrupts the main thread; this test runs in another")
    long_probe(tmp_path, steps=100_000)
    started, real_popen = [], subprocess.Popen

    def popen_then_cancelled(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc.pid)
        _thread.interrupt_main()
        return proc

    monkeypatch.setattr(placed.subprocess, "Popen", popen_then_cancelled)
    try:
        with pytest.raises(KeyboardInterrupt):
            list(placed.watch_probe(tmp_path, 300.0, str(tmp_path)))
        assert started and not alive(started[0])
    finally:
        for pid in started:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# A SLURM job as submitit runs it: SIGTERM only logged ("Bypassing signal SIGTERM"), then the job's function.
SLURM_JOB = """
import signal, sys
signal.signal(signal.SIGTERM, lambda *_: print("bypassed", flush=True))
from nandoctor.run.placed import run_placed
print("started", flush=True)
run_placed(sys.argv[1], 600.0, sys.argv[1])
"""


@pytest.mark.slow  # a real probe process
def test_a_slurm_jobs_sigterm_ends_its_probe_though_submitit_ignores_it(tmp_path):
    """scancel sends a job SIGTERM, and SIGKILL only after the cluster's KillWait; submitit ignores the
    SIGTERM. A node that tracks a job's processes by parentage lost a job cancelled in its first second
    (the one-node SLURM of the executor tests, under load): its probe trained on after its run had ended.
    The job's function now ends its probe on SIGTERM itself."""
    long_probe(tmp_path, steps=100_000)  # hours of steps: it ends only if it is ended
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    job = subprocess.Popen([sys.executable, "-c", SLURM_JOB, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    probes = []
    try:
        assert job.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 120
        while not (tmp_path / "log.txt").exists() or not (
            probes := [p.pid for p in psutil.Process(job.pid).children()]
        ):
            assert time.monotonic() < deadline, "the probe never started"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) != 0  # ended by the signal, not by its probe's hours of steps
        assert [p for p in probes if alive(p)] == []
        assert not (tmp_path / "result.json").exists()
    finally:
        job.kill()
        for pid in probes:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
