"""Only the GPUs it was given: a rank's device comes from the CUDA_VISIBLE_DEVICES its launcher received,
NVML's devices are narrowed to that list (indices, GPU- and MIG- identifiers), and the host-load figure
reads only those GPUs and does not count the run's own sibling probes as other processes. CUDA_VISIBLE_DEVICES
is faked, and NVML with it (a fake `pynvml` module: the smallest seam), with real sibling processes."""

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest

from nandoctor import env
from nandoctor.child.launch import rank_env
from nandoctor.env import (
    RUN_DIR_ENV,
    RUNNER_ENV,
    get_gpu_count_guess,
    get_gpu_load,
    get_host_sample,
    get_visible_gpus,
    host_load,
    parse_visible_devices,
)

UUIDS = [f"GPU-{d * 8}-1111-2222-3333-444455556666" for d in "abcd"]  # GPU-aaaaaaaa-..., GPU-bbbbbbbb-...
MIGS = ["MIG-0d0d0d0d-1111-2222-3333-444455556666", "MIG-1e1e1e1e-1111-2222-3333-444455556666"]


def test_rank_r_gets_the_r_th_gpu_its_launcher_was_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [rank_env(r, 2, "cuda")["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["2", "3"]


def test_gpu_and_mig_identifiers_are_handed_on_as_spelled(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUIDS[3]},{MIGS[1]}")
    assert [rank_env(r, 2, "cuda")["CUDA_VISIBLE_DEVICES"] for r in range(2)] == [UUIDS[3], MIGS[1]]


def test_unset_visible_devices_give_rank_r_gpu_r_and_cpu_ranks_no_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [rank_env(r, 3, "cuda")["CUDA_VISIBLE_DEVICES"] for r in range(3)] == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert rank_env(1, 2, "cpu")["CUDA_VISIBLE_DEVICES"] == ""


def test_a_launcher_given_fewer_gpus_than_ranks_refuses_to_place_them(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match=r"a 2-rank probe was given 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES='3'\)"):
        rank_env(0, 2, "cuda")


def test_the_visible_list_is_read_as_cuda_reads_it():
    assert parse_visible_devices(None) is None  # every device
    assert parse_visible_devices("") == parse_visible_devices("-1") == parse_visible_devices("none") == []
    assert parse_visible_devices(" 2, 3") == ["2", "3"]
    assert parse_visible_devices("0,-1,1") == ["0"]  # CUDA stops at the first entry that names no device
    assert parse_visible_devices(f"{UUIDS[1]},{MIGS[0]}") == [UUIDS[1], MIGS[0]]


# --- NVML, faked: four GPUs, the last in MIG mode with two MIG devices --------------------------------


@dataclass
class FakeProcess:  # what nvmlDeviceGetComputeRunningProcesses lists
    pid: int
    usedGpuMemory: int


class FakeNVMLError(Exception):
    pass


def fake_pynvml(processes: dict) -> types.ModuleType:
    """A `pynvml` whose host has GPUs 0-3 (UUIDS); GPU 3 is in MIG mode with MIGS on it. `processes`:
    {NVML index or MIG uuid: [FakeProcess]}."""
    gpus = [("gpu", i) for i in range(4)]
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetName = lambda h: "Fake H100"
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 * 2**30)
    m.nvmlSystemGetDriverVersion = lambda: "570.0"
    m.nvmlSystemGetCudaDriverVersion = lambda: 12080
    m.nvmlDeviceGetUUID = lambda h: UUIDS[h[1]] if h[0] == "gpu" else h[1]

    def mig_mode(h):
        if h[1] != 3:
            raise FakeNVMLError("Not Supported")
        return [1, 1]

    def mig_device(h, j):
        if j >= len(MIGS):
            raise FakeNVMLError("Not Found")
        return ("mig", MIGS[j])

    def utilisation(h):
        if h[0] == "mig":
            raise FakeNVMLError("Not Supported")
        return types.SimpleNamespace(gpu=10 * h[1])

    m.nvmlDeviceGetMigMode = mig_mode
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_device
    m.nvmlDeviceGetUtilizationRates = utilisation
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: processes.get(h[1], [])
    return m


@pytest.fixture
def nvml(monkeypatch):
    """Installs a fake pynvml with the given processes; returns the installer."""

    def install(processes: dict | None = None):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(processes or {}))

    return install


def visible(value: str | None, monkeypatch) -> list[tuple]:
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)  # restored after the test
    return [(g["visible"], g["id"], g["index"], g["uuid"], g["mig"]) for g in get_visible_gpus()]


def test_the_visible_list_maps_indices_uuids_and_mig_ids_to_nvml_devices(nvml, monkeypatch):
    nvml()
    assert visible(None, monkeypatch) == [(i, None, i, UUIDS[i], False) for i in range(4)]
    assert visible("2,3", monkeypatch) == [(0, "2", 2, UUIDS[2], False), (1, "3", 3, UUIDS[3], False)]
    assert visible(f"{UUIDS[1]},0", monkeypatch) == [(0, UUIDS[1], 1, UUIDS[1], False), (1, "0", 0, UUIDS[0], False)]
    assert visible("GPU-cccc", monkeypatch) == [(0, "GPU-cccc", 2, UUIDS[2], False)]  # a prefix naming one GPU
    assert visible(MIGS[1], monkeypatch) == [(0, MIGS[1], 3, MIGS[1], True)]
    assert visible("1,7,2", monkeypatch) == [(0, "1", 1, UUIDS[1], False)]  # no GPU 7: CUDA's list ends there
    assert visible("", monkeypatch) == []


def test_the_gpu_count_guess_is_the_number_of_visible_gpus_nvml_knows(nvml, monkeypatch):
    nvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7")
    assert get_gpu_count_guess() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIGS[0])
    assert get_gpu_count_guess() == 1


def sleeping(run_dir: str | None) -> subprocess.Popen:
    """A real process, alive until killed, carrying `run_dir` as its run (None: no run)."""
    child_env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV}
    if run_dir:
        child_env[RUN_DIR_ENV] = run_dir
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=child_env)


@pytest.fixture
def processes():
    started = []

    def start(run_dir):
        started.append(sleeping(run_dir))
        return started[-1].pid

    yield start
    for p in started:
        p.kill()
        p.wait()


def test_gpu_load_reads_only_the_runs_gpus_and_counts_only_other_runs_processes(nvml, processes, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, "/runs/ours")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    sibling, foreign, unlabelled = processes("/runs/ours"), processes("/runs/theirs"), processes(None)
    gone = subprocess.Popen(["true"])
    gone.wait()
    ended = gone.pid  # its environment can no longer be read: counted as another's
    gib = 2**30
    nvml(
        {
            0: [FakeProcess(foreign, 9 * gib)],  # not a GPU of this run: not read
            2: [FakeProcess(os.getpid(), gib), FakeProcess(sibling, 2 * gib), FakeProcess(foreign, 3 * gib)],
            3: [FakeProcess(sibling, gib), FakeProcess(unlabelled, 4 * gib), FakeProcess(ended, 5 * gib)],
        }
    )
    load = get_gpu_load()
    assert [(g["index"], g["uuid"], g["visible"]) for g in load] == [(2, UUIDS[2], 0), (3, UUIDS[3], 1)]
    assert [(g["util_percent"], g["other_processes"], g["other_memory_bytes"]) for g in load] == [
        (20, 1, 3 * gib),
        (30, 2, 9 * gib),
    ]


def test_gpu_load_on_a_mig_device_has_no_utilisation_but_counts_its_processes(nvml, processes, monkeypatch):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)  # outside a run every other process is another's
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIGS[0])
    nvml({MIGS[0]: [FakeProcess(processes("/runs/any"), 2**30)]})
    assert [(g["index"], g["util_percent"], g["other_processes"]) for g in get_gpu_load()] == [(3, None, 1)]


SPINNER = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < 0.4:
    pass
print("done", flush=True)
sys.stdin.readline()  # alive until the test has sampled
"""


def test_the_cpu_time_of_the_runs_own_probes_is_not_other_load(monkeypatch):
    """A sibling probe (the same run directory) and another run's process each burn 0.4 CPU seconds while
    this process samples: the sibling's are the run's own (run_cpu_cores), the other run's are not."""
    pytest.importorskip("psutil", reason="without psutil the host's CPU load is not measured")
    monkeypatch.setenv(RUN_DIR_ENV, "/runs/ours")
    spinners = []
    for run in ("/runs/ours", "/runs/theirs"):
        proc = subprocess.Popen(
            [sys.executable, "-c", SPINNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, RUN_DIR_ENV: run},
        )
        assert proc.stdout.readline() == "ready\n"
        spinners.append(proc)
    try:
        before = get_host_sample()
        for proc in spinners:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        assert [proc.stdout.readline() for proc in spinners] == ["done\n", "done\n"]
        sample = host_load(before)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()
    assert 0.35 <= sample["run_cpu_cores"] * sample["wall_s"] <= 0.6  # the sibling's 0.4 s, not the other's
    assert sample["other_cpu_cores"] * sample["wall_s"] >= 0.35  # the other run's 0.4 s (and the host's own)


@pytest.mark.parametrize("named_right", [True, False])
def test_the_runner_named_with_its_start_time_is_the_runs_own(monkeypatch, named_right):
    """The process RUNNER_ENV names (a session's runner, started without RUN_DIR_ENV) burns 0.4 CPU seconds
    while this process samples: the run's own when the start time in the name is its own, other load when
    it is not (on another node that pid is some other process)."""
    psutil = pytest.importorskip("psutil", reason="without psutil the host's CPU load is not measured")
    monkeypatch.setenv(RUN_DIR_ENV, "/runs/ours")
    outside = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-c", SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=outside
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        start = psutil.Process(proc.pid).create_time() + (0.0 if named_right else 1.0)
        monkeypatch.setenv(RUNNER_ENV, f"{proc.pid}:{start!r}")
        before = get_host_sample()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        sample = host_load(before)
    finally:
        proc.kill()
        proc.wait()
    own_s, other_s = (sample[k] * sample["wall_s"] for k in ("run_cpu_cores", "other_cpu_cores"))
    if named_right:
        assert 0.35 <= own_s <= 0.6
    else:
        assert own_s == 0.0 and other_s >= 0.35


def test_host_load_outside_a_run_has_no_siblings(monkeypatch):
    pytest.importorskip("psutil", reason="without psutil the host's CPU load is not measured")
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    assert env.get_run_cpu_s() == {} and host_load(get_host_sample())["run_cpu_cores"] == 0.0


# --- a real GPU host -------------------------------------------------------------------------------

REAL_MAPPING = """
import json, torch
from nandoctor.env import get_gpu_load, get_visible_gpus
print(json.dumps({"torch": [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())],
                  "nvml": [g["uuid"] for g in get_visible_gpus()], "load": [g["uuid"] for g in get_gpu_load()]}))
"""


@pytest.mark.gpu
def test_the_mapping_names_the_gpus_cuda_uses_on_a_real_host():
    """For each GPU (by UUID, then by index, then the last two in reverse), torch in a process given only
    those sees the devices NVML's mapping names, in the same order, and the load figure reads those."""
    pytest.importorskip("pynvml")
    everything = get_visible_gpus()
    assert everything, "torch sees a GPU, NVML none"
    choices = [g["uuid"] for g in everything] + [str(g["index"]) for g in everything]
    if len(everything) > 1:
        choices.append(",".join(str(g["index"]) for g in everything[-2:][::-1]))
    for value in choices:
        out = subprocess.run(
            [sys.executable, "-c", REAL_MAPPING],
            capture_output=True,
            text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": value},
            check=True,
        )
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(seen["torch"]) == len(seen["nvml"]) == len(value.split(",")), (value, seen)
        assert all(n.endswith(t) for n, t in zip(seen["nvml"], seen["torch"])), (value, seen)  # torch drops "GPU-"
        assert seen["load"] == seen["nvml"], (value, seen)
