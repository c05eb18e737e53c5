"""A probe trains only on the GPUs this process was given, and a W-rank probe owns its W GPUs for its
whole life (issue 28 items 1 and 2). Run on the CPU CI by faking what the hardware lacks here: the
inherited CUDA_VISIBLE_DEVICES list and a 4-GPU device dict. The probe processes are real processes
started by the real slots; each records the CUDA_VISIBLE_DEVICES it received and when it ran, instead
of training (no GPU here to train on)."""

import json
import sys
from dataclasses import replace

import pytest
from conftest import record_list

from nandoctor.cells import Cell
from nandoctor.models import plan_model
from nandoctor.plan import PlannedProbe
from nandoctor.recipes import resolve_model
from nandoctor.run.local import visible_gpus

GIVEN = "GPU-5d1e0c5a-aaaa,3,MIG-9b0c1d2e-bbbb,GPU-77c3f1de-cccc"  # a user's or a scheduler's binding
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30, "capability": [9, 0]}
FOUR_GPUS = {"device": "cuda", "cpu_count": 16, "gpus": [H100] * 4, "torch": "2.13.0"}

# What each fake probe does in place of training: note its GPUs and its lifetime next to its spec. It lives
# 0.4 s, ten times the spread of one wave's starts here (the probes a slot frees start within 0.04 s of each
# other), so that probes the scheduler lets run at once are seen at once, and a probe put on GPUs that
# another still holds is seen to overlap it.
PROBE = """
import json, os, sys, time
from pathlib import Path
spec = Path(sys.argv[1])
start = time.time()
time.sleep(0.4)
(spec.parent / "ran.json").write_text(json.dumps({"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "run": os.environ.get("NANDOCTOR_RUN_DIR"), "start": start, "end": time.time()}))
"""


def test_the_visible_gpus_are_the_given_list_in_its_own_spelling():
    assert visible_gpus(4, GIVEN) == ["GPU-5d1e0c5a-aaaa", "3", "MIG-9b0c1d2e-bbbb", "GPU-77c3f1de-cccc"]
    assert visible_gpus(2, " 4, 5 ") == ["4", "5"]  # a Ray task's assigned GPUs
    assert visible_gpus(2, "2,3,7") == ["2", "3"]  # CUDA stops at the first it cannot use: torch saw 2
    assert visible_gpus(3, None) == ["0", "1", "2"]  # unset: every GPU the facts list
    assert visible_gpus(0, "") == []


@pytest.fixture
def fake_probes(monkeypatch):
    # imported first, so that what imports child_command by name keeps the real one after this test
    from nandoctor.run import placed, session, slots  # noqa: F401

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", GIVEN)
    monkeypatch.setattr(slots, "child_command", lambda spec, result: [sys.executable, "-c", PROBE, str(spec)])


def probes(cells: list[str]) -> list[PlannedProbe]:
    return [PlannedProbe(f"{c} #{i}", Cell.parse(c)) for i, c in enumerate(cells)]


def ran(session, probe_ids) -> dict:
    from nandoctor.run.task import probe_dir

    return {p: json.loads((probe_dir(session.dir, p) / "ran.json").read_text()) for p in probe_ids}


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def most_at_once(runs: list[dict]) -> int:
    return max(sum(1 for other in runs if other["start"] <= r["start"] < other["end"]) for r in runs)


def test_each_probe_gets_its_own_gpus_a_ddp_probe_owns_two_and_bisect_rounds_pack_again(tmp_path, fake_probes):
    from nandoctor.run.options import RunOptions
    from nandoctor.run.session import Session

    recipe = replace(resolve_model("tiny-llama"), retime_rounds=0)
    plan = plan_model(recipe, {"device": "cpu", "cpu_count": 2, "gpus": []})
    ddp = "fp32/eager/off/ddp"
    first = probes(["fp32/eager/off", "fp32/sdpa/off", "bf16-amp/eager/off", ddp, "bf16-amp/sdpa/off", ddp])
    second = probes(["fp32/eager/off", "fp32/sdpa/off", "bf16-amp/eager/off", "bf16-amp/sdpa/off"])
    second = [replace(p, probe_id=p.probe_id + " round 2") for p in second]
    options = RunOptions(out=tmp_path / "run", device=FOUR_GPUS, warm=False)
    with Session("bisect", recipe, options, plan=plan) as session:
        session.prepare()
        session.start(0)
        session.run(recipe, first)  # a bisection's round with parallel candidates...
        session.run(recipe, second)  # ...and the next one, with none
    one, two = ran(session, [p.probe_id for p in first]), ran(session, [p.probe_id for p in second])
    given = GIVEN.split(",")
    for probe_id, r in {**one, **two}.items():
        assert r["run"] == str(session.dir.resolve())  # its load is the run's own, not another user's
        gpus = r["gpus"].split(",")
        assert set(gpus) <= set(given) and len(set(gpus)) == len(gpus), (probe_id, r["gpus"])
        assert len(gpus) == (2 if probe_id.split(" ")[0] == ddp else 1), (probe_id, r["gpus"])
    for probe_id, r in one.items():
        if probe_id.startswith(ddp):  # no other probe on its GPUs while it runs
            for other_id, other in one.items():
                if other_id != probe_id and overlap(r, other):
                    assert not set(r["gpus"].split(",")) & set(other["gpus"].split(",")), (probe_id, other_id)
    assert most_at_once(list(one.values())) > 1  # the one-GPU probes still ran side by side
    assert most_at_once(list(two.values())) == 4  # the next round packs again: no limit left behind


@pytest.mark.slow  # a real warm worker imports torch
def test_a_probe_forked_by_a_warm_worker_gets_its_gpu_in_its_environment(tmp_path, monkeypatch):
    from nandoctor.executors import ExecutorConfig
    from nandoctor.run.local import LocalPlacement
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.session import probe_spec
    from nandoctor.run.store import ResultsStore
    from nandoctor.run.task import ProbeTask, probe_dir

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", GIVEN)
    recipe = resolve_model("tiny-llama")
    cpu = {"device": "cpu", "cpu_count": 1, "gpus": []}
    [probe] = probes(["fp32/eager/off"])
    task = ProbeTask(probe_spec(recipe, probe, plan_model(recipe, cpu), cpu, 1, 1), 60.0)
    placement = LocalPlacement(ExecutorConfig(), tmp_path, jobs=1)
    placement.fit(FOUR_GPUS, 1 << 20)
    with Scheduler(placement, ResultsStore(tmp_path), retries=0) as scheduler:
        [record] = scheduler.run([task])
    log = (probe_dir(tmp_path, probe.probe_id) / "log.txt").read_text()
    assert "nandoctor: this probe's GPUs: CUDA_VISIBLE_DEVICES=GPU-5d1e0c5a-aaaa\n" in log, log[-2000:]
    assert record.status == "ok" and record.launch == "warm"  # and it trained (on the CPU: its spec says so)


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_host_probes_train_on_the_gpu_they_were_given_by_its_uuid(tmp_path):
    """On a real GPU: the process is given its first GPU by UUID, as a scheduler binds it; each probe
    (two at once) gets that GPU in the same spelling and trains there."""
    import os

    import pynvml
    from conftest import run_cli, summary

    from nandoctor.run.task import probe_dir

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    out = tmp_path / "run"
    grid = ("--axis", "dtype=fp32,bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "4")
    proc = run_cli(
        "grid",
        *grid,
        "--jobs",
        "2",
        "--set",
        "retime_rounds=0",
        "--out",
        out,
        env={"CUDA_VISIBLE_DEVICES": uuid, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        process=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for probe in summary(out)["probes"]:
        assert probe["verdict"] == "stable", probe
        log = (probe_dir(out, probe["probe_id"]) / "log.txt").read_text()
        assert f"nandoctor: this probe's GPUs: CUDA_VISIBLE_DEVICES={uuid}\n" in log
    records = record_list(out)
    assert {r["device"] for r in records} == {"cuda"}
