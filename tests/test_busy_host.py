"""A probe on a host whose cores other processes keep busy: its idle OpenMP threads spin briefly before
they sleep (libgomp's default spin takes the time slices of the thread they wait for) unless the user
said how they wait; a one-process CPU probe trains with as many threads as the cores other processes
leave free (never below one, never above its share), or the user's OMP_NUM_THREADS when set; its
record says what it ran with, and a probe sized down by the load is not cached. Speed itself is
measured in bench/busy_host.py, not asserted here."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time

import pytest
from conftest import ALL_CORES, record_list, run_cli, unpinned

from nandoctor.cells import Cell
from nandoctor.env import get_cpu_count, get_process_env
from nandoctor.record import ProbeRecord, ProbeSpec
from nandoctor.run.cache import ProbeCache
from nandoctor.run.local import threads_per_probe
from nandoctor.run.slots import ColdSlot, WarmSlot, probe_env

WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
NO_WAIT_SETTINGS = dict.fromkeys(WAIT_SETTINGS)  # run_cli's env: removed


@pytest.fixture
def no_openmp_settings(monkeypatch):
    for name in (*WAIT_SETTINGS, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def wait_for_environ(pid: int, timeout_s: float = 60.0) -> None:
    """Until /proc/PID/environ has the environment the process was started with. Popen returns once the
    exec has begun (the close-on-exec pipe closed), before the kernel has laid out the new program's
    environment: read at once, it is empty (15 of 50 python starts here, on a loaded host), and every
    setting reads None. A busy host widens that window: the ColdSlot case failed so under load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f.read(1):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid}'s environment still empty after {timeout_s:.0f} s")


def started_env(tmp_path, slot_class) -> dict:
    """The OpenMP wait settings of a real process a slot starts, read from /proc/PID/environ: a warm
    worker, or a cold probe whose spec is a FIFO nobody writes (it blocks reading it, alive, until killed)."""
    slot = slot_class(0, queue.Queue(), str(tmp_path))
    try:
        if slot_class is WarmSlot:
            slot.open()
            pid = slot.worker_pid
        else:
            os.mkfifo(tmp_path / "spec.json")
            slot.launch(tmp_path / "spec.json", tmp_path / "result.json", tmp_path / "log.txt", {})
            pid = slot.pid
        wait_for_environ(pid)
        return {name: get_process_env(pid, name) for name in WAIT_SETTINGS}
    finally:
        slot.close()


def test_a_probes_environment_spins_briefly_by_default(no_openmp_settings):
    env = probe_env()
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env


@pytest.mark.parametrize(
    "name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000"), ("KMP_BLOCKTIME", "0")]
)
def test_a_users_own_wait_setting_wins(no_openmp_settings, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    env = probe_env()
    assert env[name] == value
    assert {n: env.get(n) for n in WAIT_SETTINGS if n != name} == {n: None for n in WAIT_SETTINGS if n != name}


@pytest.mark.parametrize("slot_class", [WarmSlot, ColdSlot])
def test_warm_workers_and_cold_probes_start_with_the_short_spin(no_openmp_settings, tmp_path, slot_class):
    assert started_env(tmp_path, slot_class) == {
        "OMP_WAIT_POLICY": None,
        "GOMP_SPINCOUNT": "10000",
        "KMP_BLOCKTIME": None,
    }


@pytest.mark.parametrize("slot_class", [WarmSlot, ColdSlot])
def test_warm_workers_and_cold_probes_start_with_the_users_wait_policy(
    no_openmp_settings, monkeypatch, tmp_path, slot_class
):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert started_env(tmp_path, slot_class) == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": None,
        "KMP_BLOCKTIME": None,
    }


@pytest.mark.parametrize("given, threads", [(None, 4), ("1", 1), ("3,2", 3), ("0", 4), ("many", 4)])
def test_a_probes_threads_are_the_users_omp_num_threads_when_set(monkeypatch, given, threads):
    """8 cores, 2 probes at once: 4 threads each, unless OMP_NUM_THREADS says (its first level, > 0)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if given is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    assert threads_per_probe(2, 8) == threads


@pytest.fixture
def torch_threads():
    """The probes below run in this process: its torch threads are restored after each."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def train_in_process(planned: int) -> ProbeRecord:
    """A real 2-step fp32/sdpa tiny-llama probe trained in this process, planned for `planned` threads."""
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS
    from nandoctor.models import plan_model
    from nandoctor.recipes import resolve_model

    recipe = resolve_model("tiny-llama")
    cell = Cell("fp32", "sdpa", "off")
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), 2, recipe.seed, "cpu", planned)
    record = ProbeRecord(spec.probe_id, cell)
    run_probe(spec, record, ONE_PROCESS, None)
    assert len(record.steps) == 2 and record.error is None
    return record


def trained_threads(monkeypatch, cores: int, busy: float) -> dict:
    """The cpu_threads of a probe planned for all `cores` cores of a host (faked) on which other
    processes keep `busy` cores busy (the figure faked)."""
    from nandoctor.child import threads

    monkeypatch.setattr(threads, "get_cpu_count", lambda: cores)
    monkeypatch.setattr(threads, "cpu_cores_between", lambda before, after: (busy, 0.0))
    return train_in_process(cores).cpu_threads


@pytest.mark.parametrize("busy, trained", [(0.0, 4), (0.4, 4), (1.0, 3), (2.6, 1), (3.0, 1), (4.0, 1)])
def test_a_cpu_probe_trains_with_the_cores_other_processes_leave_free(
    no_openmp_settings, monkeypatch, torch_threads, busy, trained
):
    used = trained_threads(monkeypatch, 4, busy)
    assert used["torch"] == trained and used["planned"] == 4 and used["other_cpu_cores"] == busy
    assert used["OMP_NUM_THREADS"] is None


def test_the_users_omp_num_threads_is_kept_however_busy_the_host(no_openmp_settings, monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    used = trained_threads(monkeypatch, 4, 3.0)
    assert (used["torch"], used["planned"], used["other_cpu_cores"], used["OMP_NUM_THREADS"]) == (4, 4, None, "4")


def test_a_cuda_probe_and_a_rank_keep_their_planned_threads(no_openmp_settings, torch_threads):
    from nandoctor.child import threads
    from nandoctor.models import plan_model
    from nandoctor.recipes import resolve_model

    recipe = resolve_model("tiny-llama")
    cell = Cell("fp32", "sdpa", "off")
    plan = plan_model(recipe, {"device": "cpu"})
    cuda = ProbeSpec(cell.id, recipe, cell, plan, 2, recipe.seed, "cuda", 4)
    cpu = ProbeSpec(cell.id, recipe, cell, plan, 2, recipe.seed, "cpu", 4)
    assert threads.start(cuda, 1) == (4, None)
    assert threads.start(cpu, 2) == (2, None)  # a rank of two: half the probe's threads, as planned


def sample_in_a_fork() -> dict | None:
    """What threads.inherited_sample() gives a child this process forks (as a warm worker forks a probe)."""
    from nandoctor import jsonio
    from nandoctor.child import threads

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            sample = threads.inherited_sample()
            if sample:  # JSON has no tuple keys: [pid, start, CPU seconds] per process
                sample = {**sample, "run_s": [[*key, cpu] for key, cpu in sample["run_s"].items()]}
            os.write(write, jsonio.dumps(sample).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def test_a_probe_a_warm_worker_forks_measures_from_the_workers_idle_moment(monkeypatch):
    """note_idle in this process (as a warm worker, idle, samples the host), then a real fork: the child
    starts its window at that sample, its own CPU from zero and this process's among the run's; a sample
    older than IDLE_SAMPLE_MOST_S, or this process itself, gets none (it samples afresh)."""
    pytest.importorskip("psutil", reason="without psutil the host's CPU load is not measured")
    from nandoctor.child import threads
    from nandoctor.env import RUN_DIR_ENV, get_own_process_key

    monkeypatch.setenv(RUN_DIR_ENV, "/runs/ours")
    monkeypatch.setattr(threads, "_idle", None)
    threads.note_idle()
    inherited = sample_in_a_fork()
    assert inherited["wall"] == threads._idle["wall"] and inherited["own_s"] == 0.0
    me = get_own_process_key()
    assert [*me, threads._idle["run_s"][me]] in inherited["run_s"]  # this process's CPU so far: the run's
    assert threads.inherited_sample() is None  # not in the worker itself
    monkeypatch.setitem(threads._idle, "wall", threads._idle["wall"] - threads.IDLE_SAMPLE_MOST_S - 1.0)
    assert sample_in_a_fork() is None


def test_a_cpu_probe_starts_its_window_at_the_inherited_sample_when_there_is_one(monkeypatch, torch_threads):
    from nandoctor.child import threads
    from nandoctor.models import plan_model
    from nandoctor.recipes import resolve_model

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recipe = resolve_model("tiny-llama")
    cell = Cell("fp32", "sdpa", "off")
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), 2, recipe.seed, "cpu", 2)
    inherited = {"wall": 1.0, "busy_s": 5.0, "own_s": 0.0, "run_s": {}}
    monkeypatch.setattr(threads, "inherited_sample", lambda: inherited)
    assert threads.start(spec, 1) == (2, inherited)
    monkeypatch.setattr(threads, "inherited_sample", lambda: None)
    assert threads.start(spec, 1)[1]["wall"] > 1.0  # sampled now


def test_free_cores_are_a_share_of_the_probes_own_plan():
    """4 probes at once on 16 cores (4 threads each), 8 cores busy elsewhere: each keeps half its share."""
    from nandoctor.child import threads

    assert threads.free_share(4, 16, 8.0) == 2
    assert threads.free_share(4, 16, 0.0) == 4
    assert threads.free_share(1, 16, 16.0) == 1


@pytest.fixture
def busy_loop_per_core():
    """A `while True: pass` process on every core this process may use, for the test's length."""
    cores = get_cpu_count()
    if cores < 2:
        pytest.skip("one core: a probe planned for it has no thread to give up")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    time.sleep(0.5)  # the loops have started and hold their cores
    yield cores
    for loop in loops:
        loop.kill()
        loop.wait()


def test_with_a_busy_loop_on_every_core_a_cpu_probe_gives_up_threads(
    no_openmp_settings, torch_threads, busy_loop_per_core
):
    """Nothing faked: the busy loops are other processes, and the probe measures them while it builds.
    N loops on N cores leave the probe at most about one core, so it trains with fewer threads than
    its plan of every core (one on a 2-core host)."""
    cores = busy_loop_per_core
    used = train_in_process(cores).cpu_threads
    assert used["planned"] == cores
    assert used["other_cpu_cores"] > 0.5 and used["torch"] < cores


def test_a_probe_sized_down_by_the_load_is_not_cached(tmp_path):
    """Its last digits depend on its thread count, so a rerun on another load would not repeat it."""
    cache = ProbeCache(tmp_path)
    for fingerprint, torch_threads in (("sized-down", 1), ("as-planned", 2)):
        record = ProbeRecord("fp32/sdpa/off", Cell(), "ok", fingerprint=fingerprint)
        record.cpu_threads = {"torch": torch_threads, "planned": 2, "other_cpu_cores": 1.5}
        cache.add(record, tmp_path / "run")
    assert ProbeCache(tmp_path).lookup("sized-down") is None
    assert ProbeCache(tmp_path).lookup("as-planned") is not None


@pytest.mark.slow
def test_cache_says_in_one_line_that_it_kept_no_probe_sized_down_by_the_load(tmp_path):
    """Nothing faked: a busy loop on every core of the host (not only this xdist worker's), and a grid
    with --cache on all of them; its probe gives up threads to the loops, is not stored, and the run says so."""
    if len(ALL_CORES) < 2:
        pytest.skip("one core: a probe planned for it has no thread to give up")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=unpinned) for _ in ALL_CORES]
    try:
        time.sleep(0.5)  # the loops have started and hold their cores
        proc = run_cli(
            *("grid", "--axis", "dtype=fp32", "--axis", "attn=eager", "--axis", "compile=off", "--steps", "2"),
            *("--set", "retime_rounds=0", "--cache", "--out", tmp_path / "run"),
            env={"NANDOCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": None, **NO_WAIT_SETTINGS},
            all_cores=True,
        )
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    used = record["cpu_threads"]
    assert used["torch"] < used["planned"] == len(ALL_CORES), used
    assert not (tmp_path / "cache" / "probes.jsonl").exists()
    said = [line for line in proc.stderr.splitlines() if "--cache" in line]
    assert said == [
        "nandoctor: WARNING: --cache stored none of 1 probe(s) that trained with fewer CPU threads than planned "
        "while other processes held cores, as their last digits depend on the load: "
        f"fp32/eager/off ({used['torch']} of {used['planned']} threads); on an idle host, or with "
        "OMP_NUM_THREADS set, they are stored"
    ]


@pytest.mark.slow
def test_a_warm_probe_records_its_threads_and_the_short_spin(fp32_check):
    out, proc, _ = fp32_check
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = record_list(out)
    spec = json.loads((out / "probes" / "fp32__eager__off" / "spec.json").read_text())
    used = record["cpu_threads"]
    assert used["planned"] == spec["threads"] and 1 <= used["torch"] <= spec["threads"]
    # measured where the probe trains on the CPU: on a GPU the cores other processes use do not slow it
    assert (used["other_cpu_cores"] is not None) == (record["env"]["device"] == "cpu")
    if not any(os.environ.get(name) for name in WAIT_SETTINGS):
        assert (used["GOMP_SPINCOUNT"], used["OMP_WAIT_POLICY"]) == ("10000", None)


@pytest.mark.slow
def test_a_cold_probe_trains_with_the_users_openmp_settings(tmp_path):
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
        "--set",
        "retime_rounds=0",
        "--set",
        "forensics_steps=0",
        "--cold",
        "--out",
        out,
        env={"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = record_list(out)
    assert record["launch"] == "cold"
    used = record["cpu_threads"]
    assert (used["torch"], used["planned"], used["other_cpu_cores"]) == (1, 1, None)
    assert (used["OMP_NUM_THREADS"], used["OMP_WAIT_POLICY"]) == ("1", "ACTIVE")
    assert used["GOMP_SPINCOUNT"] == os.environ.get("GOMP_SPINCOUNT")  # nandoctor's short spin is not added
