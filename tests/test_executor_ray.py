"""The Ray executor on a real local Ray bound to 127.0.0.1: one task per probe, its files carried
back, the verdicts and losses the local executor gives, crashes, hangs and OOMs included; Ctrl-C
leaves no task running and --resume finishes the run."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from clusters import (
    EQUAL_GRID,
    MISBEHAVING_CELLS,
    MISBEHAVING_VERDICTS,
    LocalRay,
    another_checkouts_probe,
    assert_like_local,
    interrupt_when_running,
    misbehaving_checkpoint,
    probe_processes,
    ray_skip_reason,
)
from conftest import records, run_cli, run_cli_noting_imports, summary, verdicts

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ray_skip_reason() is not None, reason=str(ray_skip_reason()))]


@pytest.fixture(scope="module")
def local_ray():
    ray = LocalRay()
    yield ray
    ray.stop()


def on_ray(local_ray):
    return ("--executor", "ray", "--executor-opt", f"address={local_ray.address}", "--executor-opt", "cpus=1")


@pytest.fixture(scope="module")
def foreign_probe():
    """Another checkout's probe on this host while these tests run: theirs must not be taken for ours."""
    with another_checkouts_probe() as proc:
        yield proc


@pytest.fixture(scope="module")
def interrupted(local_ray, foreign_probe, tmp_path_factory):
    """The small grid on both kinds of node the local Ray declares (custom resources node_small,
    node_big), interrupted by Ctrl-C once a probe runs, then resumed on Ray."""
    out = tmp_path_factory.mktemp("ray-equal") / "run"
    code, printed = interrupt_when_running(
        ["--out", out, *EQUAL_GRID, *on_ray(local_ray), "--axis", "node_type=node_small,node_big"],
        local_ray.env,
        local_ray.proc.pid,
        out,
    )
    children_after = probe_processes(local_ray.proc.pid)  # at once: the run waits for its cancelled tasks to end
    free_after = local_ray.free_cpus()
    gathered = (out / "hardware.json").read_text()
    resumed = run_cli("grid", "--resume", out, *on_ray(local_ray), env=local_ray.env, process=True)
    return out, code, printed, free_after, children_after, resumed, gathered


CANCEL_A_RUNNING_PROBE = """
import json, sys, time
from pathlib import Path
from clusters import probe_processes
from nandoctor import jsonio
from nandoctor.executors import executor_config
from nandoctor.record import ProbeSpec
from nandoctor.run.on_ray import GRACEFUL_CANCEL_S, RayPlacement
from nandoctor.run.placement import PlacedProbe
from nandoctor.run.task import ProbeTask
spec = ProbeSpec.from_dict(jsonio.loads(Path(sys.argv[4]).read_text()))  # planned by the test: no torch imported here
placement = RayPlacement(executor_config("ray", ["address=" + sys.argv[1], "cpus=1"]), Path(sys.argv[2]), kept={"": {}})
try:
    probe = PlacedProbe(ProbeTask(spec, 600.0), Path(sys.argv[2]))
    placement.submit([probe])
    deadline = time.monotonic() + 120
    ray_head = int(sys.argv[3])  # the process that started the test's Ray: our probes descend from it
    while not (running := probe_processes(ray_head)) and time.monotonic() < deadline:
        time.sleep(0.1)
    asked = time.monotonic()
    placement.cancel([probe], wait_s=30)  # wait() never read the node's name: it waits in the generator
    took = time.monotonic() - asked
    probes = len(probe_processes(ray_head))  # at once: the probe itself has ended
    ended, _ = placement.ray.wait([probe.handle.completed()], timeout=0)
    # the task ended its probe itself, before the cancel would have killed its worker with force
    print(json.dumps({"task_ended": len(ended) == 1, "probes": probes, "graceful": took < GRACEFUL_CANCEL_S}))
finally:
    placement.close()
"""


def test_cancel_returns_only_once_the_task_and_its_probe_have_ended(local_ray, foreign_probe, tmp_path):
    """A probe's task is a streaming generator. Waiting on the generator itself returns as soon as an item
    waits unread (its node's name), while the worker and the probe it started still run (measured here:
    back after 1 ms, the worker alive), so a Ctrl-C could leave the CLI with a probe still training (a
    clean-clone run of 2026-11-25 found one). cancel() waits on the task's completed() instead, and asks
    the task to end first, so that the task kills and reaps its probe itself (a worker killed with force
    leaves its probe to die after it: CI saw the probe, or the worker, still there just after). Run as
    its own driver process, as the CLI is."""
    import subprocess
    import sys

    from nandoctor import jsonio
    from nandoctor.cells import Cell
    from nandoctor.models import plan_model
    from nandoctor.recipes import recipe_by_name
    from nandoctor.record import ProbeSpec

    recipe, cell = recipe_by_name("tiny-llama"), Cell("fp32", "eager", "off")
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), 100_000, 0, "cpu", 1)  # minutes
    (tmp_path / "spec.json").write_text(jsonio.dumps(spec.to_dict()))
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CANCEL_A_RUNNING_PROBE,
            local_ray.address,
            str(tmp_path / "probe"),
            str(local_ray.proc.pid),
            str(tmp_path / "spec.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
        env={
            **os.environ,
            **local_ray.env,
            # this checkout's nandoctor and the tests' helpers, whatever checkout is installed
            "PYTHONPATH": os.pathsep.join(
                filter(
                    None, [str(Path(__file__).parent.parent), str(Path(__file__).parent), os.environ.get("PYTHONPATH")]
                )
            ),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"task_ended": True, "probes": 0, "graceful": True}
    assert foreign_probe.is_running()  # another checkout's probe, untouched and not counted


def test_the_local_ray_listens_on_loopback_only(local_ray):
    import subprocess

    listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout.splitlines()
    ours = [line for line in listening if any(name in line for name in ("gcs_server", "raylet", "ray::"))]
    loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:")
    assert ours and all(line.split()[3].startswith(loopback) for line in ours), "\n".join(ours)


def test_ctrl_c_cancels_every_task_and_prints_the_resume_command(interrupted):
    out, code, printed, free_after, children_after, *_ = interrupted
    assert code == 130, printed
    assert f"nandoctor grid --resume {out}" in printed
    assert free_after == 2.0 and children_after == []  # every task gone: the cluster's CPUs are free


def test_resume_on_ray_finishes_with_the_local_verdicts_and_losses(interrupted):
    out, *_, resumed, gathered = interrupted
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr  # a numerical failure is a finding, not an error
    assert_like_local(out, "ray", ("node_small", "node_big"))
    assert (out / "hardware.json").read_text() == gathered  # the first run's facts, not gathered again


@pytest.fixture(scope="module")
def misbehaving(local_ray, tmp_path_factory):
    """The misbehaving grid's run directory, and what its CLI process imported of torch and transformers."""
    out = tmp_path_factory.mktemp("ray-misbehaving") / "run"
    proc, imported = run_cli_noting_imports(
        "grid",
        "--model",
        misbehaving_checkpoint(),
        *MISBEHAVING_CELLS,
        *on_ray(local_ray),
        "--out",
        out,
        env=local_ray.env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return SimpleNamespace(out=out, imported=imported)


def test_the_cli_process_of_a_ray_grid_never_imports_torch_or_transformers(misbehaving):
    assert misbehaving.imported == []  # planned, custom modeling code and all, on a warm worker of this machine
    plan = json.loads((misbehaving.out / "run.json").read_text())["model_plan"]
    assert plan["model_type"] == "misbehaving-llama" and plan["params"] > 0


def test_a_segfault_a_hang_and_an_oom_get_the_local_verdicts(misbehaving):
    out = misbehaving.out
    assert verdicts(out) == MISBEHAVING_VERDICTS  # what each cell's misbehaviour gives locally (clusters.py)
    crashed = records(out)["fp32/eager/off"]
    assert crashed["signal"] == "SIGSEGV" and "Segmentation fault" in crashed["log_tail"]  # carried back from the node
    reasons = {p["probe_id"]: p["reason"] for p in summary(out)["probes"]}
    assert "can't allocate memory" in reasons["fp32/sdpa:flash/off"]
    # killed 4 s after its build (timeout_s), before its sleep of 3600 s could end on its own (not a latency
    # bound: a loaded host); the budget ran out in its steps, and it says so
    hung = records(out)["fp32/sdpa:math/off"]
    assert 4 <= hung["wall_s"] < 3600 and hung["timed_out_in"] == "steps"


def test_each_cell_runs_on_each_node_type_with_the_local_losses_and_its_own_recommendation(interrupted):
    out = interrupted[0]
    assert_like_local(out, "ray", ("node_small", "node_big"))
    assert summary(out)["recommended_by_hardware"] == {
        "node_small": "fp32/eager/off@node_small",
        "node_big": "fp32/eager/off@node_big",
    }
    assert "node_type=node_big (ran on " in (out / "report.md").read_text()


def test_each_node_types_cells_are_planned_with_facts_a_task_there_gathered(interrupted):
    out = interrupted[0]
    facts = json.loads((out / "hardware.json").read_text())
    assert set(facts) == {"node_small", "node_big"}
    node = records(out)["fp32/eager/off@node_big"]["node"]
    for kind, f in facts.items():
        where = f["gathered"]
        assert (
            where["resources"][kind] > 0 and where["resources"]["CPU"] == 1
        )  # Ray gave it this kind's share, as a probe
        assert where["host"] == node and where["ray_node"] and where["pid"] != os.getpid() and where["job"] is None
        assert f["device"] == "cpu" and f["torch"]  # env.collect_doctor, read in the task
        assert f"| planned on {kind}" in (out / "report.md").read_text()
    assert json.loads((out / "run.json").read_text())["env_by_hardware"] == facts


def test_a_node_type_no_node_declares_is_one_line_and_exit_2(local_ray, tmp_path):
    proc = run_cli(
        "grid",
        *EQUAL_GRID,
        *on_ray(local_ray),
        "--axis",
        "node_type=node_small,node_huge",
        "--out",
        tmp_path / "run",
        env=local_ray.env,
        process=True,
    )
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [
        "nandoctor: error: --axis node_type=node_huge: no node of this Ray cluster has the custom resource node_huge; "
        "its custom resources: node_big, node_small"
    ]


# --- a task the cluster never starts (issue 18: bounded queue wait) ---------------------------------


def test_a_task_no_node_can_start_is_cancelled_after_its_queue_wait_and_recorded_lost_not_judged(local_ray, tmp_path):
    out = tmp_path / "run"
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
        *on_ray(local_ray),
        "--executor-opt",
        "cpus=3",
        "--executor-opt",
        "queue_wait=5",
        "--executor-opt",
        "retries=1",
        "--out",
        out,
        env=local_ray.env,
        process=True,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # no stable configuration: nothing ran
    assert (
        "1 queued, 0 running, 0 done" in proc.stdout
        and "within 5 s while none runs is placed again (queue_wait)" in proc.stdout
    )
    record = records(out)["fp32/eager/off"]
    assert record["status"] == "lost" and record["launch"] == "ray" and record["steps"] == []
    # the task that gathered the device facts, with one CPU, ran (5 s: a Ray worker's start on a loaded
    # host took over 2 s here); a probe asking for 3 of the 2 never starts
    attempt = "NOT_STARTED: still queued after 5 s (queue_wait): no node has started it; it asks for CPU: 3"
    assert record["reason"] == f"the scheduler lost this probe on all 2 attempts ({attempt}; {attempt})"
    [probe] = summary(out)["probes"]
    assert probe["verdict"] == "killed" and "this says nothing about the configuration" in probe["reason"]
    assert local_ray.free_cpus() == 2.0  # the cancelled tasks hold nothing


def test_a_facts_task_the_cluster_never_starts_is_one_line_and_exit_2_after_queue_wait(local_ray, tmp_path):
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
        *on_ray(local_ray),
        "--executor-opt",
        "resources=node_gone:1",
        "--executor-opt",
        "queue_wait=2",
        "--out",
        tmp_path / "run",
        env=local_ray.env,
        process=True,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line.lower()] == [
        "nandoctor: error: --executor ray: the cluster did not start the task that gathers the device facts within 2 s "
        "(queue_wait); does a node have its resources (ray status)?"
    ]
    assert local_ray.free_cpus() == 2.0  # cancelled: it holds nothing


# The grid as the CLI runs it, with the task that gathers the device facts failing on its node (a
# broken driver, a library that does not import there): defined here, so Ray runs this one.
FAILING_FACTS = """
import sys
from nandoctor.cli import main
from nandoctor.run import on_ray

def task_facts(inputs=None):
    import socket
    yield socket.gethostname()
    raise RuntimeError("NVML: driver/library version mismatch")

on_ray.task_facts = task_facts
sys.exit(main(sys.argv[1:]))
"""


def test_a_facts_task_that_fails_is_one_line_and_exit_2(local_ray, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FAILING_FACTS, "grid", *EQUAL_GRID, *on_ray(local_ray), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **local_ray.env},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line.lower()] == [
        "nandoctor: error: --executor ray: the task that gathers the device facts failed: "
        "RuntimeError: NVML: driver/library version mismatch"
    ]
