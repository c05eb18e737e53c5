"""The device facts as typed data: what one machine is (its Python and library versions, its GPUs, CPU,
memory, compiler and optional packages), as env.py gathers them and as every run keeps them (run.json's
`env` and `env_by_hardware`, hardware.json, each probe record's `env`).

One writer, one reader: env.collect_summary / collect_doctor build DeviceFacts, `DeviceFacts.from_dict`
reads what any version wrote (a key an older version did not record reads as its field's default, and
`to_dict` writes back exactly the keys that were read, in their order, the unknown ones included).
`DeviceFacts.of` takes either form, for the functions that callers (tests, the Python API) hand plain
dicts.

Foundation module: imports only typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .typed import AsWritten


@dataclass(frozen=True)
class GpuFacts(AsWritten):
    """One CUDA device, as torch (env.get_cuda_devices) or NVML (env.get_nvml) sees it."""

    index: int | None = None
    name: str | None = None
    capability: str | None = None  # CUDA compute capability, "8.0"
    memory_bytes: int | None = None
    multiprocessors: int | None = None  # torch only

    @classmethod
    def from_dict(cls, data: dict) -> GpuFacts:
        return cls.read(data)

    def to_dict(self) -> dict:
        return self.written()


@dataclass(frozen=True)
class PackageFacts(AsWritten):
    """An optional package (env.get_package): found on the path (never imported), and its version."""

    importable: bool = False
    version: str | None = None

    @classmethod
    def from_dict(cls, data: dict) -> PackageFacts:
        return cls.read(data)

    def to_dict(self) -> dict:
        return self.written()


@dataclass(frozen=True)
class NvmlFacts(AsWritten):
    """The NVIDIA Management Library's answer (env.get_nvml): the driver and every GPU of the host, or
    why it is not available (every CPU-only machine)."""

    available: bool | None = None
    reason: str | None = None  # why not, when not available
    driver: str | None = None
    cuda_driver: str | None = None
    devices: tuple[GpuFacts, ...] = ()

    @classmethod
    def from_dict(cls, data: dict) -> NvmlFacts:
        return cls.read(data, {"devices": _gpus})

    def to_dict(self) -> dict:
        return self.written({"devices": _gpu_dicts})


def _gpus(data) -> tuple[GpuFacts, ...]:
    return tuple(g if isinstance(g, GpuFacts) else GpuFacts.from_dict(g) for g in data or ())


def _gpu_dicts(gpus: tuple[GpuFacts, ...]) -> list[dict]:
    return [g.to_dict() for g in gpus]


@dataclass(frozen=True)
class DeviceFacts(AsWritten):
    """What one machine is. collect_summary's facts (every probe record carries them: enough to rerun
    and to compare), then those collect_doctor adds, then where an executor's start-up job gathered
    them. A fact the machine lacks is None (no CUDA, no compiler, no psutil)."""

    python: str | None = None
    platform: str | None = None
    torch: str | None = None
    transformers: str | None = None
    peft: str | None = None
    cuda: str | None = None  # the CUDA version torch was built with
    cudnn: int | None = None
    device: str | None = None  # "cuda" when torch sees a GPU, else "cpu"
    gpus: tuple[GpuFacts, ...] = ()  # the GPUs torch sees
    cpu_count: int | None = None  # the cores this process may use
    cpu_model: str | None = None
    ram_bytes: int | None = None
    ram_available_bytes: int | None = None
    cxx: str | None = None  # the C++ compiler inductor uses on a CPU
    flash_attn: str | None = None  # the flash-attn package's version
    flash_sdpa: bool | None = None  # whether this torch build has the CUDA flash SDPA kernel
    packages: dict[str, PackageFacts] = field(default_factory=dict)  # env.ACCELERATION_PACKAGES
    executable: str | None = None
    # collect_doctor
    nvml: NvmlFacts | None = None
    nccl: str | None = None
    cpu_name: str | None = None
    cpu_capability: str | None = None  # the SIMD level torch's CPU kernels use
    # on a CPU host: {compute dtype: its matmul time over fp32's} (env.get_cpu_matmul_cost)
    cpu_matmul_cost: dict | None = None
    # where an executor's start-up job read them (run/placed.node_facts): host, pid, job, partition, ...
    gathered: dict | None = None
    # the FLOP/s a probe can expect, when a caller gives it (never gathered: models.device_flops measures)
    train_flops: float | None = None

    @classmethod
    def from_dict(cls, data: dict) -> DeviceFacts:
        """Facts as run.json, hardware.json or a probe record holds them, from any version."""
        return cls.read(data, {"gpus": _gpus, "nvml": _nvml, "packages": _packages})

    def to_dict(self) -> dict:
        """The facts as JSON data: the keys they were gathered or read with, in their order."""
        return self.written(
            {
                "gpus": _gpu_dicts,
                "nvml": lambda n: n.to_dict() if n is not None else None,
                "packages": lambda p: {m: f.to_dict() for m, f in p.items()},
            }
        )

    @classmethod
    def of(cls, facts: DeviceFacts | dict | None) -> DeviceFacts | None:
        """Facts given as DeviceFacts or as the dict run.json holds (a test's, a Python API caller's)."""
        return facts if facts is None or isinstance(facts, DeviceFacts) else cls.from_dict(facts)

    def gathered_at(self, where: dict) -> DeviceFacts:
        """These facts with where they were gathered (`gathered`) added or replaced."""
        return DeviceFacts.from_dict({**self.to_dict(), "gathered": where})

    @property
    def gpu_capability(self) -> float | None:
        """The lowest compute capability of the GPUs torch sees (what every cell must run on); None without."""
        return min(float(g.capability) for g in self.gpus) if self.gpus else None


def _nvml(data) -> NvmlFacts | None:
    return data if data is None or isinstance(data, NvmlFacts) else NvmlFacts.from_dict(data)


def _packages(data) -> dict[str, PackageFacts]:
    return {m: p if isinstance(p, PackageFacts) else PackageFacts.from_dict(p) for m, p in (data or {}).items()}
