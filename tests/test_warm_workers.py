"""Warm workers end to end: real probes forked from a warm worker, real segfaults and hangs."""

import os
import signal

import pytest
from checkpoints import save_crashing_llama
from conftest import records, summary, verdicts

pytestmark = pytest.mark.slow  # end to end: real probe processes


@pytest.fixture(scope="module")
def crashing_run(tmp_path_factory):
    from conftest import run_cli

    base = tmp_path_factory.mktemp("crashing")
    ckpt = save_crashing_llama(base / "ckpt")
    out = base / "run"
    # fp32/eager segfaults, then fp32/sdpa:math hangs, then fp32/sdpa (planned after the hang) trains;
    # cells that run on a CPU and on a GPU alike
    proc = run_cli(
        "grid",
        "--model",
        ckpt,
        "--trust-remote-code",
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager,sdpa:math,sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "2",
        "--set",
        "timeout_s=4",
        "--out",
        out,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a crash and a timeout are harness failures
    return out


def test_a_segfault_in_a_warm_child_is_classified_as_crash(crashing_run):
    probe = next(p for p in summary(crashing_run)["probes"] if p["probe_id"] == "fp32/eager/off")
    assert probe["verdict"] == "crash"
    assert "SIGSEGV" in probe["reason"]
    tail = records(crashing_run)["fp32/eager/off"]["log_tail"]
    assert "Fatal Python error: Segmentation fault" in tail
    assert "Extension modules:" not in tail  # faulthandler's module list would crowd the stack out of the tail


def test_a_hang_in_a_warm_child_times_out(crashing_run):
    hung = records(crashing_run)["fp32/sdpa:math/off"]
    assert verdicts(crashing_run)["fp32/sdpa:math/off"] == "timeout"
    # the runner's SIGKILL ended it: after its whole 4 s budget (counted from its build), and before its sleep
    # of 3600 s could end on its own (an upper bound of a few seconds past 4 would measure the host's load)
    assert hung["exit_code"] == -signal.SIGKILL
    assert hung["timeout_s"] == 4 <= hung["wall_s"] < 3600 and hung["timed_out_in"] == "steps"


def test_the_worker_survives_its_childrens_crash_and_hang(crashing_run):
    recs = records(crashing_run)
    assert list(recs) == ["fp32/eager/off", "fp32/sdpa:math/off", "fp32/sdpa/off"]
    assert verdicts(crashing_run)["fp32/sdpa/off"] == "stable"  # planned after the hang
    assert {r["launch"] for r in recs.values()} == {"warm"}
    assert len({r["worker_pid"] for r in recs.values()}) == 1  # one worker ran all three, never replaced


def tiny_task(steps=2):
    from nandoctor.cells import Cell
    from nandoctor.env import collect_summary
    from nandoctor.models import plan_model
    from nandoctor.plan import PlannedProbe
    from nandoctor.recipes import resolve_model
    from nandoctor.run.session import probe_spec
    from nandoctor.run.task import ProbeTask

    recipe, device = resolve_model(None), collect_summary()
    cell = Cell("fp32", "sdpa", "off")
    return ProbeTask(
        probe_spec(recipe, PlannedProbe(cell.id, cell), plan_model(recipe, device), device, steps, 1), recipe.timeout_s
    )


def test_a_killed_worker_is_replaced_and_the_next_probe_runs(tmp_path, monkeypatch):
    from nandoctor.executors import ExecutorConfig
    from nandoctor.run.local import LocalPlacement
    from nandoctor.run.scheduler import Scheduler
    from nandoctor.run.store import ResultsStore

    # one thread each: a probe otherwise trains on the cores other processes leave free, and 1 vs 2 threads
    # moves a loss's last digits
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    task = tiny_task()
    # the second probe may be handed to the dead worker before its death is heard: placed again (retries)
    with Scheduler(LocalPlacement(ExecutorConfig(), tmp_path, jobs=1), ResultsStore(tmp_path), retries=1) as runner:
        first = runner.run([task])[0]
        os.kill(first.worker_pid, signal.SIGKILL)
        second = runner.run([task])[0]
    assert first.status == second.status == "ok"
    assert second.worker_pid != first.worker_pid
    assert [s.loss for s in second.steps] == [s.loss for s in first.steps]


def test_warm_and_cold_probes_give_bit_identical_results(tmp_path, cli):
    runs = {}
    for mode in ("warm", "cold"):
        out = tmp_path / mode
        # --jobs 1: one worker forks the two probes (the fp32 reference, bf16-amp) in turn (one spawned
        # worker's imports, not two); cold, each probe imports torch and transformers
        proc = cli(
            "grid",
            "--axis",
            "dtype=bf16-amp",
            "--axis",
            "attn=sdpa",
            "--axis",
            "compile=off",
            "--steps",
            "3",
            "--jobs",
            "1",
            "--set",
            "retime_rounds=0",
            "--out",
            out,
            *(["--cold"] if mode == "cold" else []),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "(on their grid probes: re-timing off)" in proc.stdout and not (out / "retime.json").exists()
        assert "not re-timed back to back (retime_rounds=0)" in (out / "report.md").read_text()
        runs[mode] = out
    warm, cold = records(runs["warm"]), records(runs["cold"])
    assert {r["launch"] for r in warm.values()} == {"warm"} and {r["launch"] for r in cold.values()} == {"cold"}
    assert verdicts(runs["warm"]) == verdicts(runs["cold"])
    assert len(warm) == 2
    for probe_id, w in warm.items():
        assert [(s["loss"], s["grad_norm"]) for s in w["steps"]] == [
            (s["loss"], s["grad_norm"]) for s in cold[probe_id]["steps"]
        ]
        assert w["fingerprint"] == cold[probe_id]["fingerprint"]
