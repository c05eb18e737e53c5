"""Environment facts, one small function each, each returning None when the thing is absent.

Leaf module: imports nothing from nandoctor. torch is imported lazily so that `nandoctor --help`
and the pure analysis stay fast. Gathering only; rendering lives in the report modules.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
import time


def get_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def get_cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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


def get_cpu_busy_s() -> float | None:
    """Seconds all cores together have spent busy since boot, or None without psutil. Steal (time a
    hypervisor gave to other machines) counts as busy: it is load the probe competes with; guest time is
    already inside user time."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def get_own_cpu_s() -> float:
    """CPU seconds this process (all its threads) has used."""
    t = os.times()
    return t.user + t.system


def get_gpu_load() -> list[dict] | None:
    """Per visible GPU: NVML's utilisation (percent of its last sample period a kernel ran) and the
    compute processes on it other than this one; None without NVML (nvidia-ml-py or the driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError without a driver
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            others = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid != os.getpid()]
            out.append(
                {
                    "index": i,
                    "util_percent": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                    "other_processes": len(others),
                    "other_memory_bytes": sum(p.usedGpuMemory or 0 for p in others),
                }
            )
        return out
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def get_host_sample() -> dict:
    """What host_load compares: wall clock, the host's and this process's CPU seconds."""
    return {"wall": time.monotonic(), "busy_s": get_cpu_busy_s(), "own_s": get_own_cpu_s()}


def host_load(before: dict) -> dict:
    """Other processes' use of the host since `before` (a get_host_sample): the cores they kept busy on
    average (None without psutil), the load averages now, and the GPUs' use by other processes."""
    after = get_host_sample()
    wall = after["wall"] - before["wall"]
    other = None
    if before["busy_s"] is not None and after["busy_s"] is not None and wall > 0:
        other = max(0.0, (after["busy_s"] - before["busy_s"] - (after["own_s"] - before["own_s"])) / wall)
    return {
        "wall_s": wall,
        "cpu_count": get_cpu_count(),
        "other_cpu_cores": other,
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


def get_gpu_count_guess() -> int:
    """How many GPUs torch will see, read without importing torch (seconds of import): NVML's device
    count, narrowed by CUDA_VISIBLE_DEVICES; 0 without NVML. A session starts its first warm worker
    on this guess before it has the device facts, and starts it again if torch disagrees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    nvml = get_nvml()
    count = len(nvml["devices"]) if nvml["available"] else 0
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return count


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


ACCELERATION_PACKAGES = {
    "flash_attn": ("flash-attn", "flash_attn"),
    "transformer_engine": ("transformer-engine", "transformer_engine"),
    "torchao": ("torchao",),
    "bitsandbytes": ("bitsandbytes",),
}


def get_package(module: str) -> dict:
    """Whether a package is importable (found on the path, not imported: importing flash-attn
    without a GPU can itself fail) and its installed version."""
    found = importlib.util.find_spec(module) is not None
    version = next((v for v in map(get_version, ACCELERATION_PACKAGES.get(module, (module,))) if v), None)
    return {"importable": found, "version": version}


def collect_doctor() -> dict:
    """Everything `nandoctor doctor` reports about this machine, as data."""
    import torch

    summary = collect_summary()
    return {
        **summary,
        "nvml": get_nvml(),
        "nccl": get_nccl_version(),
        "cpu_name": get_cpu_model(),
        "cpu_capability": get_cpu_capability(),
        "cuda_available": torch.cuda.is_available(),
    }


def collect_summary() -> dict:
    """The facts every probe record and report carries (enough to rerun and to compare)."""
    import torch

    devices = get_cuda_devices()
    ram = get_ram_bytes()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
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
