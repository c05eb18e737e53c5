"""Environment facts, one small function each, each returning None when the thing is absent.

Foundation module: imports only device (the DeviceFacts that collect_summary and collect_doctor
build). torch is imported lazily so that `nandoctor --help` and the pure analysis stay fast. Gathering
only; rendering lives in the report modules.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import time

from .device import DeviceFacts

# Every probe process of one run carries its run directory in this variable (set by the scheduler): a
# process whose environment holds the same value is the run's own, not another user's load.
RUN_DIR_ENV = "NANDOCTOR_RUN_DIR"
# ... and the process that runs the session as "PID:START" (its start time as psutil gives it, so that a
# probe on another node, where that pid is some other process, matches nothing): the runner is the run's
# own too, though it was started without RUN_DIR_ENV
RUNNER_ENV = "NANDOCTOR_RUNNER"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# The OpenMP settings that decide how a probe's CPU threads run: how an idle one waits (the standard
# name, GNU libgomp's and Intel's), and how many (torch's default). Both libraries read them when they load.
OPENMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
OPENMP_ENV = ("OMP_NUM_THREADS", *OPENMP_WAIT_ENV)


def get_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def get_cpu_set() -> set[int] | None:
    """The numbers of the cores this process may run on (its affinity: a SLURM job's or taskset's), or
    None where the OS does not say (macOS): then every core."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def get_cpu_count() -> int:
    cpus = get_cpu_set()
    return len(cpus) if cpus is not None else (os.cpu_count() or 1)


def get_openmp_env() -> dict:
    """This process's OpenMP settings (OPENMP_ENV): name -> value as set, None when unset."""
    return {name: os.environ.get(name) for name in OPENMP_ENV}


def get_cpu_model() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo); CPU kernels, and so the last digits of a loss, depend on it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def get_ram_bytes() -> tuple[int, int] | None:
    """(total, available) system memory, or None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    vm = psutil.virtual_memory()
    return vm.total, vm.available


def get_load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (runnable processes, ours included); None where the OS has none."""
    try:
        return list(os.getloadavg())
    except (AttributeError, OSError):
        return None


def get_cpu_busy_s(cpus: set[int] | None = None) -> float | None:
    """Seconds all cores together (or the cores numbered `cpus`) have spent busy since boot, or None
    without psutil. Steal (time a hypervisor gave to other machines) counts as busy: it is load the
    probe competes with; guest time is already inside user time."""
    try:
        import psutil
    except ImportError:
        return None
    times = (
        [psutil.cpu_times()] if cpus is None else [t for i, t in enumerate(psutil.cpu_times(percpu=True)) if i in cpus]
    )
    return sum(getattr(t, name, 0.0) for t in times for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def get_own_cpu_s() -> float:
    """CPU seconds this process (all its threads) has used."""
    t = os.times()
    return t.user + t.system


def get_gpu_load() -> list[dict] | None:
    """Per GPU this process may use (get_visible_gpus: CUDA_VISIBLE_DEVICES mapped to NVML's devices; the
    host's other GPUs are someone else's business): its index, UUID and visible position, NVML's
    utilisation (percent of its last sample period a kernel ran; None where NVML does not measure it, a
    MIG device), and the compute processes on it other than this one and this run's own (other_processes,
    other_memory_bytes); None without NVML (nvidia-ml-py or the driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError without a driver
        return None
    run = os.environ.get(RUN_DIR_ENV)
    try:
        out = []
        for gpu, h in _visible_handles(pynvml):
            others = [
                p
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                if p.pid != os.getpid() and not (run and get_process_env(p.pid, RUN_DIR_ENV) == run)
            ]
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            except pynvml.NVMLError:
                util = None
            out.append(
                {
                    "index": gpu["index"],
                    "uuid": gpu["uuid"],
                    "visible": gpu["visible"],
                    "util_percent": util,
                    "other_processes": len(others),
                    "other_memory_bytes": sum(p.usedGpuMemory or 0 for p in others),
                }
            )
        return out
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def get_process_env(pid: int, name: str) -> str | None:
    """The value of environment variable `name` in process `pid` as it started (/proc/PID/environ), or
    None when it lacks it or its environment cannot be read (another user's process, one that ended,
    a system without /proc)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def get_own_process_key() -> tuple | None:
    """This process as get_run_cpu_s keys the run's processes: (pid, start time); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        return (os.getpid(), psutil.Process().create_time())
    except psutil.Error:
        return None


def get_run_cpu_s() -> dict | None:
    """{(pid, start time): CPU seconds} of this run's other processes (RUN_DIR_ENV holding this process's
    value, and the runner RUNNER_ENV names; this process excluded); {} outside a run, None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    run = os.environ.get(RUN_DIR_ENV)
    if not run:
        return {}

    def cpu_s(pid: int) -> tuple[tuple, float] | None:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                t = proc.cpu_times()
                return (pid, proc.create_time()), t.user + t.system
        except psutil.Error:  # ended meanwhile
            return None

    own = (cpu_s(pid) for pid in psutil.pids() if pid != os.getpid() and get_process_env(pid, RUN_DIR_ENV) == run)
    out = dict(found for found in own if found)
    runner = runner_key()
    if runner and runner not in out and runner[0] != os.getpid():
        found = cpu_s(runner[0])
        if found and found[0] == runner:  # on another node that pid is some other process
            out[runner] = found[1]
    return out


def runner_key() -> tuple | None:
    """(pid, start time) of the run's runner, from RUNNER_ENV; None outside a run or when it does not read."""
    try:
        pid, start = os.environ[RUNNER_ENV].split(":")
        return (int(pid), float(start))
    except (KeyError, ValueError):
        return None


def get_host_sample(cpus: set[int] | None = None) -> dict:
    """What host_load compares: wall clock, the host's (or its cores numbered `cpus`), this process's and
    this run's other processes' CPU seconds."""
    return {
        "wall": time.monotonic(),
        "busy_s": get_cpu_busy_s(cpus),
        "own_s": get_own_cpu_s(),
        "run_s": get_run_cpu_s(),
    }


def cpu_cores_between(before: dict, after: dict) -> tuple[float | None, float | None]:
    """(the cores other processes kept busy on average between two get_host_samples, the cores this
    run's other processes did); (None, None) without psutil or without time between them."""
    wall = after["wall"] - before["wall"]
    if before["busy_s"] is None or after["busy_s"] is None or wall <= 0:
        return None, None
    run_s = sum(s - (before["run_s"] or {}).get(key, 0.0) for key, s in (after["run_s"] or {}).items())
    other = max(0.0, (after["busy_s"] - before["busy_s"] - (after["own_s"] - before["own_s"]) - run_s) / wall)
    return other, run_s / wall


def host_load(before: dict) -> dict:
    """Other processes' use of the host since `before` (a get_host_sample): the cores they kept busy on
    average (None without psutil), the load averages now, and the GPUs' use by other processes. This
    run's own other processes (its sibling probes and warm workers, RUN_DIR_ENV, and its runner,
    RUNNER_ENV) are not "other": the cores they kept busy are `run_cpu_cores`, apart. (A sibling that
    ended within the window took its CPU time with it: that time stays in `other_cpu_cores`.)"""
    after = get_host_sample()
    other, run = cpu_cores_between(before, after)
    return {
        "wall_s": after["wall"] - before["wall"],
        "cpu_count": get_cpu_count(),
        "other_cpu_cores": other,
        "run_cpu_cores": run,
        "loadavg": get_load_average(),
        "gpus": get_gpu_load(),
    }


def get_cuda_devices() -> list[dict]:
    """One dict per visible CUDA device from torch; empty on a CPU-only build or machine."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"{p.major}.{p.minor}",
                "memory_bytes": p.total_memory,
                "multiprocessors": p.multi_processor_count,
            }
        )
    return out


def get_cudnn_version() -> int | None:
    import torch

    if not torch.backends.cudnn.is_available():
        return None
    return torch.backends.cudnn.version()


def get_cxx_compiler() -> str | None:
    """inductor on CPU generates C++ and needs a compiler on PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def get_nvml() -> dict:
    """Driver and per-GPU facts from the NVIDIA Management Library. {'available': False, 'reason': ...}
    when the nvidia-ml-py package or the driver's libnvidia-ml is absent (every CPU-only machine)."""
    try:
        import pynvml
    except ImportError:
        return {"available": False, "reason": "the nvidia-ml-py package (pynvml) is not installed"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"NVML did not start: {e}"}
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            devices.append(
                {
                    "index": i,
                    "name": _text(pynvml.nvmlDeviceGetName(h)),
                    "capability": f"{major}.{minor}",
                    "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total,
                }
            )
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return {
            "available": True,
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "devices": devices,
        }
    except pynvml.NVMLError as e:
        return {"available": False, "reason": f"NVML query failed: {e}"}
    finally:
        pynvml.nvmlShutdown()


def parse_visible_devices(value: str | None) -> list[str] | None:
    """The devices a CUDA_VISIBLE_DEVICES value lets a process use, as it spells them (indices, GPU-<uuid>,
    MIG-<uuid>), in its order: None when unset (every device); otherwise the entries CUDA reads, up to
    the first that cannot name a device (so "", "-1" and "none" leave none, and "0,-1,1" only 0)."""
    if value is None:
        return None
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not ((entry.isascii() and entry.isdigit()) or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def get_visible_gpus() -> list[dict] | None:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES), in the order CUDA numbers them, as NVML knows
    them (NVML lists every GPU of the host and ignores the variable): [{"visible": CUDA's index here,
    "id": the entry as spelled (None when the variable is unset), "index": NVML's index of the physical
    GPU, "uuid", "name", "mig": whether it is a MIG device}]. An index names NVML's GPU of that index
    (CUDA_DEVICE_ORDER=PCI_BUS_ID's order; CUDA's default orders the fastest first, the same order on a
    host of one GPU model); a GPU- or MIG- identifier, or a prefix naming one device, names that device.
    As CUDA does, the list ends at the first entry naming no device. None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError without a driver
        return None
    try:
        return [gpu for gpu, _ in _visible_handles(pynvml)]
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _visible_handles(pynvml) -> list[tuple[dict, object]]:
    """get_visible_gpus's devices, each with its NVML handle; NVML initialised by the caller."""
    devices = []  # every GPU, and every MIG device of a GPU in MIG mode
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = _text(pynvml.nvmlDeviceGetName(h))
        devices.append(({"index": i, "uuid": _text(pynvml.nvmlDeviceGetUUID(h)), "name": name, "mig": False}, h))
        try:
            mig_mode = pynvml.nvmlDeviceGetMigMode(h)[0]
        except pynvml.NVMLError:  # not a MIG-capable GPU
            mig_mode = 0
        for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h) if mig_mode else 0):
            try:
                m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except pynvml.NVMLError:  # no MIG device in this slot
                continue
            devices.append(({"index": i, "uuid": _text(pynvml.nvmlDeviceGetUUID(m)), "name": name, "mig": True}, m))
    entries = parse_visible_devices(os.environ.get(VISIBLE_DEVICES_ENV))
    if entries is None:
        return [
            ({"visible": n, "id": None, **gpu}, h) for n, (gpu, h) in enumerate(d for d in devices if not d[0]["mig"])
        ]
    out = []
    for entry in entries:
        if entry.isdigit():
            named = [d for d in devices if not d[0]["mig"] and d[0]["index"] == int(entry)]
        else:
            named = [d for d in devices if d[0]["uuid"].startswith(entry)]
        if len(named) != 1:
            break
        gpu, h = named[0]
        out.append(({"visible": len(out), "id": entry, **gpu}, h))
    return out


def get_gpu_count_guess() -> int:
    """How many GPUs torch will see, read without importing torch (seconds of import): the GPUs
    CUDA_VISIBLE_DEVICES names that NVML knows (get_visible_gpus); 0 without NVML. A session starts its
    first warm worker on this guess before it has the device facts, and starts it again if torch
    disagrees."""
    return len(get_visible_gpus() or [])


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def get_nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "nccl"):
        return None
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def get_flash_sdpa_built() -> bool | None:
    """Whether this torch build has PyTorch's own CUDA flash-attention SDPA kernel; None without CUDA.
    (Which SDPA backends a device can run is decided in capabilities.sdpa_backends, from this fact.)"""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.backends.cuda.is_flash_attention_available()


def get_cpu_capability() -> str | None:
    """The SIMD level torch's CPU kernels use (AVX2, AVX512, ...)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        return None


# The square matmul get_cpu_matmul_cost times: large enough that a dtype the CPU emulates shows its full
# cost (fp16 on a 2-core AMD EPYC with avx512_bf16: 16x fp32's time at 64, 24x at 128, 104x at 256, where its
# tiny-llama probes trained ~100x slower), small enough to take ~0.1 s there.
COST_MATMUL_SIZE = 256


def matmul_seconds(n: int, dtype=None, tries: int = 3, more_within_s: float = 0.0) -> float:
    """The best time of an n x n matmul in `dtype` (torch's fp32 by default) with torch's threads as they
    are: one untimed product first, then `tries` timed ones, and more (up to ten) while all of them took
    under `more_within_s` together. The best, so that a moment of load elsewhere does not count."""
    import time

    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times: list[float] = []
    while len(times) < tries or (len(times) < 10 and sum(times) < more_within_s):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return max(min(times), 1e-9)


def get_cpu_matmul_cost() -> dict[str, float]:
    """{compute dtype: the time of a COST_MATMUL_SIZE square matmul in it over fp32's}, for bfloat16 and
    float16, on one thread of this CPU (two threads on a loaded host wait on each other: fp32's time then
    swung 100-fold between runs here), the best of several (fp32's takes 0.3 ms: up to ten tries while
    they stay under 20 ms; a slow dtype three), so that a moment of load elsewhere does not count. Where
    a CPU lacks the units for a dtype, torch emulates it, and a probe in that dtype trains about this
    many times slower. Measured once a process: the CPU's units do not change, and each collect_doctor
    would otherwise spend ~60 ms on it again."""
    return dict(_measured_matmul_cost())


@functools.cache
def _measured_matmul_cost() -> dict[str, float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {
            str(dtype).removeprefix("torch."): matmul_seconds(COST_MATMUL_SIZE, dtype, tries=3, more_within_s=0.02)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
        }
    finally:
        torch.set_num_threads(threads)
    return {k: round(v / best["float32"], 2) for k, v in best.items() if k != "float32"}


ACCELERATION_PACKAGES = {
    "flash_attn": ("flash-attn", "flash_attn"),
    "transformer_engine": ("transformer-engine", "transformer_engine"),
    "torchao": ("torchao",),
    "bitsandbytes": ("bitsandbytes",),
    "schedulefree": ("schedulefree",),
}


def get_package(module: str) -> dict:
    """Whether a package is importable (found on the path, not imported: importing flash-attn
    without a GPU can itself fail) and its installed version."""
    found = importlib.util.find_spec(module) is not None
    version = next((v for v in map(get_version, ACCELERATION_PACKAGES.get(module, (module,))) if v), None)
    return {"importable": found, "version": version}


def collect_doctor() -> DeviceFacts:
    """Everything `nandoctor doctor` reports about this machine."""
    import torch

    return DeviceFacts.from_dict(
        {
            **_summary(),
            "nvml": get_nvml(),
            "nccl": get_nccl_version(),
            "cpu_name": get_cpu_model(),
            "cpu_capability": get_cpu_capability(),
            "cpu_matmul_cost": None if torch.cuda.is_available() else get_cpu_matmul_cost(),
        }
    )


def collect_summary() -> DeviceFacts:
    """The facts every probe record and report carries (enough to rerun and to compare)."""
    return DeviceFacts.from_dict(_summary())


def _summary() -> dict:
    """collect_summary's facts, as the JSON data DeviceFacts reads."""
    import torch

    devices = get_cuda_devices()
    ram = get_ram_bytes()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),  # not its TorchVersion: unpickling one (a Ray task's facts) imports torch
        "transformers": get_version("transformers"),
        "peft": get_version("peft"),
        "cuda": torch.version.cuda,
        "cudnn": get_cudnn_version() if devices else None,
        "device": "cuda" if devices else "cpu",
        "gpus": devices,
        "cpu_count": get_cpu_count(),
        "cpu_model": get_cpu_model(),
        "ram_bytes": ram[0] if ram else None,
        "ram_available_bytes": ram[1] if ram else None,
        "cxx": get_cxx_compiler(),
        "flash_attn": get_version("flash-attn") or get_version("flash_attn"),
        "flash_sdpa": get_flash_sdpa_built() if devices else None,
        "packages": {m: get_package(m) for m in ACCELERATION_PACKAGES},  # what the planner's support checks read
        "executable": sys.executable,
    }
