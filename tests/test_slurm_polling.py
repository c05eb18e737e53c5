"""A polite SLURM client (issue 28 item 3): squeue is asked once for all of the run's jobs (canaries,
probes, cancelled jobs), at a cadence that backs off while nothing changes, its answer shared between
callers. Measured with fake `sbatch`, `squeue` and `scancel` on PATH that count their calls and answer
as a one-node cluster would, and a fake clock, so that minutes of a run take a second here. A fake
`srun` too: submitit refuses to build an executor without one on PATH, and no job of these tests ever
runs, so they need no SLURM installed (issue 34: README's test command failed on a machine without)."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from nandoctor.executors import executor_config

pytest.importorskip("submitit")

# Each shim logs its arguments, one call a line, to $FAKE_SLURM/<name>.calls. squeue answers the jobs
# asked for (-j) from $FAKE_SLURM/states.json ({job id: "STATE|reason"}); scancel marks them CANCELLED.
SBATCH = """
import os, sys
from pathlib import Path
home = Path(os.environ["FAKE_SLURM"])
with open(home / "sbatch.calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
counter = home / "next_job"
job = int(counter.read_text()) if counter.exists() else 100
counter.write_text(str(job + 1))
print(f"Submitted batch job {job}")
"""
SQUEUE = """
import json, os, sys
from pathlib import Path
home = Path(os.environ["FAKE_SLURM"])
with open(home / "squeue.calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
asked = sys.argv[sys.argv.index("-j") + 1].split(",")
states = json.loads((home / "states.json").read_text())
for job, said in states.items():
    if job.split("_")[0] in asked:
        print(f"{job}|{said}")
"""
SCANCEL = """
import json, os, sys
from pathlib import Path
home = Path(os.environ["FAKE_SLURM"])
with open(home / "scancel.calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
states = json.loads((home / "states.json").read_text())
states.update({job: "CANCELLED|None" for job in sys.argv[1:]})
(home / "states.json").write_text(json.dumps(states))
"""
SRUN = """
import sys
sys.exit("fake srun: the jobs of these tests never run")
"""


class FakeClock:
    """time.monotonic / time.sleep for on_slurm: sleeping advances the clock at once, and lets the test's
    cluster move (on_tick(now))."""

    def __init__(self, on_tick):
        self.now, self.on_tick = 1000.0, on_tick

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_tick(self.now)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    home = tmp_path / "fake-slurm"
    home.mkdir()
    for name, code in (("sbatch", SBATCH), ("squeue", SQUEUE), ("scancel", SCANCEL), ("srun", SRUN)):
        shim = home / name
        shim.write_text(f"#!{sys.executable} -S\n{code}")
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    (home / "states.json").write_text("{}")
    monkeypatch.setenv("FAKE_SLURM", str(home))
    monkeypatch.setenv("PATH", f"{home}{os.pathsep}{os.environ['PATH']}")
    return home


def calls(home: Path, name: str) -> list[str]:
    path = home / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


def set_states(home: Path, states: dict[str, str]) -> None:
    now = json.loads((home / "states.json").read_text())
    now.update(states)
    (home / "states.json").write_text(json.dumps(now))


def test_a_grid_on_slurm_asks_squeue_once_for_all_its_jobs_and_backs_off_to_one_call_per_ten_seconds(
    cluster, tmp_path, monkeypatch
):
    from nandoctor.cells import Cell
    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run import on_slurm
    from nandoctor.run.placement import PlacedProbe
    from nandoctor.run.session import probe_spec
    from nandoctor.run.task import ProbeTask, probe_dir, write_spec

    run_dir = tmp_path / "run"
    world = {"canary at": 1005.0, "probes start at": None}

    def tick(now: float) -> None:  # what the one node does while the parent sleeps
        if now >= world["canary at"]:
            for canary in world["placement"].canaries:
                canary.write_text(json.dumps({"gathered": {"host": "node1"}}))
            world["canary at"] = float("inf")
        if world["probes start at"] is not None and now >= world["probes start at"]:
            for probe in world["probes"]:
                (probe.folder / "log.txt").write_text("")  # the job runs: its wrapper opened the probe's log
            world["probes start at"] = None

    clock = FakeClock(tick)
    monkeypatch.setattr(on_slurm, "time", clock)
    set_states(cluster, {"100": "RUNNING|None"})
    placement = world["placement"] = on_slurm.SlurmPlacement(
        executor_config("slurm", ["queue_wait=600"]),
        run_dir,
        warm=False,  # it plans nothing: no planner worker
    )
    # the node writes the canary's file 5 s in; the canary is still RUNNING then, as far as squeue knows
    assert placement.facts() == {"": {"gathered": {"host": "node1"}}}
    assert len(calls(cluster, "squeue")) <= 5 / on_slurm.FLOOR_S + 1

    recipe, device = resolve_model("tiny-llama"), {"device": "cpu", "cpu_count": 2, "gpus": []}
    plan = plan_model(recipe, device)
    probes = []
    for i in range(8):
        planned = PlannedProbe(f"fp32/eager/off #{i}", Cell("fp32", "eager", "off"))
        task = ProbeTask(probe_spec(recipe, planned, plan, device, 2, 1), 60.0)
        probes.append(PlacedProbe(task, probe_dir(run_dir, task.probe_id)))
        write_spec(task, probes[-1].folder)
    placement.submit(probes)
    assert [p.job_id for p in probes] == [f"101_{i}" for i in range(8)]  # one array
    set_states(cluster, {f"101_{i}": "RUNNING|None" for i in range(8)})
    world["probes"], world["probes start at"] = probes, clock.now + 3

    before = len(calls(cluster, "squeue"))
    start = clock.now
    while clock.now - start < 600:  # ten minutes of probes that run on and on: nothing changes
        assert placement.wait(probes, 1.0) == []
    steady = calls(cluster, "squeue")[before:]
    assert len(steady) <= 600 / 10, len(steady)  # at most one call per 10 s...
    assert len(steady) >= 600 / on_slurm.CEILING_S  # ...and still asking: a lost job would be noticed
    assert all(call.split("-j ")[1].split()[0] == "101" for call in steady)  # one call for the whole array
    assert all(p.state == "running" for p in probes)  # seen from their log.txt, not from squeue

    # four end with their outcome written; four are lost with their node: squeue tells that, once
    for probe in probes[:4]:
        (probe.folder / "placed.json").write_text(json.dumps({"returncode": 0, "wall_s": 1.0, "node": "node1"}))
    set_states(cluster, {f"101_{i}": "NODE_FAIL|None" for i in range(4, 8)})
    ended, asked = {}, len(calls(cluster, "squeue"))
    while len(ended) < 8:
        ended.update({p.task.probe_id: e.state for p, e in placement.wait(probes, 1.0)})
        probes = [p for p in probes if p.task.probe_id not in ended]
    assert sorted(ended.values()) == ["EXITED"] * 4 + ["NODE_FAIL"] * 4
    assert len(calls(cluster, "squeue")) - asked == 1  # the first call due said what the files could not

    # what a cancel waits for shares the answers of the probes' polls: one squeue per FLOOR_S at most
    placement.submit(world["probes"][:2])
    set_states(cluster, {"102_0": "PENDING|Priority", "102_1": "PENDING|Priority"})
    asked, t0 = len(calls(cluster, "squeue")), clock.now
    placement.wait(world["probes"][:2], 1.0)
    placement.cancel(world["probes"][:2], wait_s=20)
    assert calls(cluster, "scancel")[-1] == "102_0 102_1"
    assert len(calls(cluster, "squeue")) - asked <= (clock.now - t0) / on_slurm.FLOOR_S + 1
    placement.close()


def test_squeues_answer_is_shared_by_every_caller_for_the_floor_interval(cluster, monkeypatch):
    from nandoctor.run import on_slurm

    clock = FakeClock(lambda now: None)
    monkeypatch.setattr(on_slurm, "time", clock)
    set_states(cluster, {"7": "RUNNING|None", "8_0": "PENDING|Priority"})
    queue = on_slurm.SlurmQueue()
    queue.track(["7", "8_0"])
    assert queue.states() == {"7": ("RUNNING", "None"), "8_0": ("PENDING", "Priority")}
    clock.sleep(on_slurm.FLOOR_S / 2)
    assert queue.states() == queue.states() == queue.answer  # the canary's wait, the cancel's wait...
    assert queue.poll() is None  # ...and the probes' poll: nothing asked again yet
    assert len(calls(cluster, "squeue")) == 1 and "-j 7,8 " in calls(cluster, "squeue")[0]
    clock.sleep(on_slurm.FLOOR_S)
    assert queue.poll() is not None and len(calls(cluster, "squeue")) == 2


@pytest.mark.slow  # 20 submissions through submitit and the shims: a minute on a loaded 2-core host
def test_a_run_submitting_one_job_at_a_time_asks_squeue_at_most_ten_times_a_minute(cluster, tmp_path, monkeypatch):
    # issue 34: a real 8-cell grid asked squeue 12.7-18.8 times a minute after its first 30 s: each
    # submission (the re-timing's, one at a time) and each start squeue saw before the job's log.txt
    # reset the cadence to FLOOR_S, though the files say both
    from nandoctor.cells import Cell
    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run import on_slurm
    from nandoctor.run.placement import PlacedProbe
    from nandoctor.run.session import probe_spec
    from nandoctor.run.task import ProbeTask, probe_dir, write_spec

    run_dir = tmp_path / "run"
    world = {"placement": None, "running": None, "log at": None, "end at": None}

    def tick(now: float) -> None:  # the node: the canary at once, then each job's log 2 s in, its end 4 s in
        placement = world["placement"]
        if placement is not None:
            for canary in placement.canaries:
                canary.write_text(json.dumps({"gathered": {"host": "node1"}}))
        probe = world["running"]
        if probe is not None and now >= world["log at"]:
            (probe.folder / "log.txt").write_text("")
        if probe is not None and now >= world["end at"]:
            (probe.folder / "placed.json").write_text(json.dumps({"returncode": 0, "wall_s": 4.0, "node": "node1"}))
            set_states(cluster, {probe.job_id: "COMPLETED|None"})

    clock = FakeClock(tick)
    monkeypatch.setattr(on_slurm, "time", clock)
    set_states(cluster, {"100": "RUNNING|None"})
    placement = world["placement"] = on_slurm.SlurmPlacement(
        executor_config("slurm", ["queue_wait=600"]), run_dir, warm=False
    )
    placement.facts()
    recipe, device = resolve_model("tiny-llama"), {"device": "cpu", "cpu_count": 2, "gpus": []}
    plan = plan_model(recipe, device)
    start, since = clock.now, None
    for i in range(20):  # 20 jobs of ~4 s, one after another: the re-timing's way
        planned = PlannedProbe(f"fp32/eager/off retime{i}", Cell("fp32", "eager", "off"))
        task = ProbeTask(probe_spec(recipe, planned, plan, device, 2, 1), 60.0)
        probe = PlacedProbe(task, probe_dir(run_dir, task.probe_id))
        write_spec(task, probe.folder)
        placement.submit([probe])
        set_states(cluster, {probe.job_id: "RUNNING|None"})  # squeue knows it runs before its log.txt is there
        world.update({"running": probe, "log at": clock.now + 2, "end at": clock.now + 4})
        while not placement.wait([probe], 1.0):
            pass
        if since is None and clock.now - start >= 30:
            since = (len(calls(cluster, "squeue")), clock.now)
    minutes = (clock.now - since[1]) / 60
    assert minutes > 0.5 and (len(calls(cluster, "squeue")) - since[0]) / minutes <= 10
    placement.close()
