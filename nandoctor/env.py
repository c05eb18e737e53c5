"""Environment facts, one small function each, each returning None when the thing is absent.

Leaf module: imports nothing from nandoctor. torch is imported lazily so that `nandoctor --help`
and the pure analysis stay fast. Gathering only; rendering lives in the report modules.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys


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


def get_cuda_devices() -> list[dict]:
    """One dict per visible CUDA device from torch; empty on a CPU-only build or machine."""
    import torch
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                    "memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count})
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
        "executable": sys.executable,
    }
