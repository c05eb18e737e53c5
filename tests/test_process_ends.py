"""Every process ends, whatever happens (issue 28 item 4): a cold slot's probe dies with its slot, a
warm worker that prints cannot break the protocol, one that never finishes importing ends its probe as
a record, and one whose parent died before it started does not run."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from nandoctor.cells import Cell
from nandoctor.executors import ExecutorConfig
from nandoctor.models import plan_model
from nandoctor.plan import PlannedProbe
from nandoctor.recipes import resolve_model
from nandoctor.record import PARENT_ENV, read_message

CPU = {"device": "cpu", "cpu_count": 1, "gpus": []}
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def tiny_task():
    from nandoctor.run.session import probe_spec
    from nandoctor.run.task import ProbeTask

    recipe, cell = resolve_model("tiny-llama"), Cell("fp32", "eager", "off")
    return ProbeTask(probe_spec(recipe, PlannedProbe(cell.id, cell), plan_model(recipe, CPU), CPU, 1, 1), 60.0)


def alive(pid: int) -> bool:
    """Running, not a zombie left for a PID 1 that does not reap (a container's)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_closing_a_cold_slot_kills_the_probe_it_runs(tmp_path, monkeypatch):
    from nandoctor.run import placed, slots  # noqa: F401 -- placed keeps the real child_command
    from nandoctor.run.local import LocalPlacement
    from nandoctor.run.placement import PlacedProbe
    from nandoctor.run.task import write_spec

    monkeypatch.setattr(slots, "child_command", lambda spec, result: SLEEPER)  # a probe that trains for minutes
    placement = LocalPlacement(ExecutorConfig(), tmp_path, jobs=1, warm=False)
    task = tiny_task()
    probe = PlacedProbe(task, tmp_path / "probe")
    write_spec(task, probe.folder)
    placement.submit([probe])
    pid = placement.slots[0].pid
    assert alive(pid)
    placement.close()  # the runner ends (Ctrl-C, SIGTERM, an error): its probe must not train on
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_a_warm_worker_that_never_finishes_importing_ends_its_probe_as_a_lost_record(tmp_path, monkeypatch):
    from nandoctor.analysis.verdicts import harness_verdict
    from nandoctor.run import local, slots
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.store import ResultsStore

    monkeypatch.setattr(slots, "WORKER_COMMAND", SLEEPER)  # an import that hangs
    monkeypatch.setattr(local, "READY_TIMEOUT_S", 0.2)  # a sleeper is never ready, however long it is given
    start = time.monotonic()
    placement = local.LocalPlacement(ExecutorConfig(), tmp_path, jobs=1)
    workers = []
    with Scheduler(placement, ResultsStore(tmp_path), retries=1) as scheduler:
        workers.append(placement.slots[0].worker_pid)
        [record] = scheduler.run([tiny_task()])
        workers.append(placement.slots[0].worker_pid)
    assert time.monotonic() - start < 30  # a record, not a hang
    assert record.status == "lost" and record.launch == "warm"
    not_ready = "NOT_READY: its warm worker did not finish importing within 0.2 s"
    assert record.reason == f"the scheduler lost this probe on all 2 attempts ({not_ready}; {not_ready})"
    assert harness_verdict(record).name == "killed"
    assert not any(alive(pid) for pid in workers)  # each was replaced, then closed


def test_a_worker_whose_parent_died_before_it_started_does_not_run(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is nobody's parent now
    commands_in, commands = os.pipe()
    messages, messages_out = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-m", "nandoctor.child.worker", str(commands_in), str(messages_out)],
        env={**os.environ, PARENT_ENV: str(gone.pid)},
        pass_fds=(commands_in, messages_out),
        stdin=subprocess.DEVNULL,
    )
    os.close(commands_in)
    os.close(messages_out)
    try:
        assert worker.wait(timeout=60) == 1
    finally:
        worker.kill()
        os.close(commands)
    with os.fdopen(messages) as said:
        assert said.read() == ""  # never Ready: it imported nothing


def test_a_line_that_is_not_a_worker_message_is_skipped_not_fatal():
    assert read_message("Failed to load image Python extension\n") is None
    assert read_message('{"type": "Ready", "pid": 7, "threads": 1}\n').pid == 7
    assert read_message('{"type": "Launch"}\n') is None and read_message("[1, 2]\n") is None


# Any module imported at start-up that prints (here Python's sitecustomize, which every interpreter of
# the run imports: the CLI, its warm worker, the probe) writes to stdout before the worker says Ready.
PRINTING_SITE = 'print("Failed to load image Python extension: libc10_cuda.so: cannot open shared object file")\n'


@pytest.mark.slow  # a real grid
def test_a_warm_worker_whose_imports_print_still_runs_its_probes(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PRINTING_SITE)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager",
        "--axis",
        "compile=off",
        "--steps",
        "2",
        "--out",
        tmp_path / "run",
        env={"PYTHONPATH": path},
        timeout=300,  # before, the worker's line killed the reader and the run waited forever
        process=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[  1/1] fp32/eager/off" in proc.stdout and "stable" in proc.stdout
    assert "Failed to load image Python extension" in proc.stderr  # the worker's print reached the user
