"""A zygote (child/zygote.py) forks a run's warm worker already imported: the probes it forks train
exactly as a spawned worker's do, a run whose environment differs gets a spawned worker (its own SLURM or
Ray client settings aside), and a run killed outright leaves neither its zygote-forked worker nor its
probe behind. Real CLI runs beside a real zygote (this module runs without the session's:
conftest.SPAWNED_WORKERS)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import record_list, run_cli

from nandoctor.record import ZYGOTE_ENV
from nandoctor.run.slots import probe_env

GRID = ("grid", "--axis", "dtype=fp32", "--axis", "attn=eager", "--axis", "compile=off", "--set", "retime_rounds=0")


@pytest.fixture(scope="module")
def zygote_socket(tmp_path_factory):
    path = tmp_path_factory.mktemp("own-zygote") / "socket"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nandoctor.child.zygote", str(path)], env=probe_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    yield proc, path
    proc.kill()
    proc.wait()


def workers_of(zygote: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(zygote.pid).children()


def start(args, env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nandoctor", *map(str, args)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_a_zygote_forked_worker_trains_bit_identically_to_a_spawned_one(zygote_socket, tmp_path):
    zygote, path = zygote_socket
    run = start((*GRID, "--steps", "16", "--out", tmp_path / "zygote"), {ZYGOTE_ENV: str(path)})
    worker = wait_for(lambda: next(iter(workers_of(zygote)), None))  # the zygote forked this run's worker
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out[-2000:] + err[-2000:]
    assert [r["worker_pid"] for r in record_list(tmp_path / "zygote")] == [worker.pid]
    spawned = run_cli(*GRID, "--steps", "16", "--out", tmp_path / "spawned", process=True)
    assert spawned.returncode == 0, spawned.stdout[-2000:] + spawned.stderr[-2000:]
    losses = [
        [(s["loss"], s["grad_norm"]) for s in r["steps"]]
        for r in (record_list(tmp_path / d)[0] for d in ("zygote", "spawned"))
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 16


@pytest.mark.slow
def test_a_run_whose_environment_differs_spawns_its_own_worker(zygote_socket, tmp_path):
    # libgomp reads OMP_* when torch loads: the zygote's import cannot serve another value
    zygote, path = zygote_socket
    run = start((*GRID, "--steps", "2", "--out", tmp_path / "run"), {ZYGOTE_ENV: str(path), "OMP_NUM_THREADS": "1"})
    worker = wait_for(lambda: next(iter(psutil.Process(run.pid).children()), None))
    assert workers_of(zygote) == []
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out[-2000:] + err[-2000:]
    assert [r["worker_pid"] for r in record_list(tmp_path / "run")] == [worker.pid]


@pytest.mark.slow
def test_a_run_with_its_own_cache_and_cluster_client_settings_is_served_by_the_zygote(zygote_socket, tmp_path):
    # NANDOCTOR_CACHE_DIR, and the inductor cache the run puts in it, are read after the import; what the
    # cluster tests set for their own SLURM and Ray (clusters.py) is read by the run's cluster client,
    # never by what a worker imports (child/zygote.py ZYGOTE_PER_RUN, CLUSTER_CLIENT_PREFIXES)
    zygote, path = zygote_socket
    clients = {"SLURM_CONF": str(tmp_path / "slurm.conf"), "RAY_AUTH_MODE": "disabled"}
    env = {ZYGOTE_ENV: str(path), "NANDOCTOR_CACHE_DIR": str(tmp_path / "cache"), **clients}
    run = start((*GRID, "--steps", "2", "--cache", "--out", tmp_path / "run"), env)
    worker = wait_for(lambda: next(iter(workers_of(zygote)), None))
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out[-2000:] + err[-2000:]
    assert [r["worker_pid"] for r in record_list(tmp_path / "run")] == [worker.pid]


@pytest.mark.slow
def test_a_killed_run_leaves_no_zygote_forked_worker_and_no_probe(zygote_socket, tmp_path):
    zygote, path = zygote_socket
    run = start((*GRID, "--steps", "100000", "--out", tmp_path / "run"), {ZYGOTE_ENV: str(path)})
    worker = wait_for(lambda: next(iter(workers_of(zygote)), None))
    probe = wait_for(lambda: next(iter(worker.children()), None))  # training now
    run.send_signal(signal.SIGKILL)
    run.wait()
    gone, alive = psutil.wait_procs([worker, probe], timeout=10)
    assert alive == [] and workers_of(zygote) == []
