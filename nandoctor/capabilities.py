"""Which grid cells a device can run, as data. The planner records the others as `unsupported`
with the reason, without spawning a process.

Imports only cells (each axis value's row says which GPU features and packages it needs), device and
env (to look a package up when `device` does not say). `device` is the DeviceFacts
`env.collect_summary()` returns (or the dict a run keeps); its `packages` say which optional packages
are installed, found on the path but never imported, so planning a grid pays neither torchao's import
(3 s on a 2-core CPU) nor bitsandbytes' device probing.
"""

from __future__ import annotations

from packaging.version import Version

from .cells import ATTENTIONS, FP8_QUANT, PACKAGES, PRECISIONS, Cell
from .device import DeviceFacts, PackageFacts
from .env import get_package

# What each CUDA compute capability runs natively, one row per architecture generation. A GPU
# between two rows (8.6, 12.0) gets the row of the largest capability not above its own.
GPU_FEATURES = ("fp32", "tf32", "fp16", "bf16", "fp8", "sdpa:flash", "sdpa:cudnn", "flash_attention_2")
CAPABILITY_TABLE = {
    #       arch         fp32  tf32   fp16  bf16   fp8    flash  cudnn  fa2
    "7.0": ("Volta", True, False, True, False, False, False, False, False),
    "7.5": ("Turing", True, False, True, False, False, False, False, False),
    "8.0": ("Ampere", True, True, True, True, False, True, True, True),
    "8.9": ("Ada", True, True, True, True, True, True, True, True),
    "9.0": ("Hopper", True, True, True, True, True, True, True, True),
    "10.0": ("Blackwell", True, True, True, True, True, True, True, True),
}
FEATURE_SOURCES = {
    "fp32": "every CUDA GPU",
    "tf32": "TF32 is an Ampere (sm80) tensor-core mode; torch.backends.cuda.matmul.allow_tf32 docs",
    "fp16": "fp16 tensor cores since Volta (sm70); NVIDIA Volta architecture whitepaper",
    "bf16": "bf16 tensor-core math arrived with Ampere (sm80); "
    "Turing and older only emulate it (torch.cuda.is_bf16_supported)",
    "fp8": "fp8 (e4m3/e5m2) tensor cores since Ada (sm89) and Hopper (sm90); "
    "torch._scaled_mm and Transformer Engine require sm89+",
    "sdpa:flash": "PyTorch's flash SDPA kernels need sm80+ "
    "(torch/nn/attention docs, sdp_utils.cpp check_flash_attention_hardware_support)",
    "sdpa:cudnn": "cuDNN fused attention needs sm80+ and cuDNN 9 (torch sdp_utils.cpp check_cudnn_hardware_support)",
    "flash_attention_2": "flash-attn 2 supports Ampere, Ada and Hopper (Dao-AILab/flash-attention README); "
    "sm100 runs its PTX",
}


def capability_row(capability: str | float) -> tuple[str, dict[str, bool]] | None:
    """(architecture, {feature: native}) for a compute capability like '8.6', or None below 7.0."""
    cc = float(capability)
    known = [k for k in CAPABILITY_TABLE if float(k) <= cc]
    if not known:
        return None
    arch, *flags = CAPABILITY_TABLE[max(known, key=float)]
    return arch, dict(zip(GPU_FEATURES, flags))


def gpu_capabilities(env: DeviceFacts | dict) -> list[dict]:
    """One row per visible GPU (from torch, else from NVML): its architecture and which precisions
    and kernels run natively. `env` is what env.collect_doctor() returns."""
    env = DeviceFacts.of(env)
    nvml = env.nvml
    gpus = env.gpus or (nvml.devices if nvml is not None and nvml.available else ())
    rows = []
    for g in gpus:
        row = capability_row(g.capability)
        arch, native = row if row else ("pre-Volta", {f: f == "fp32" for f in GPU_FEATURES})
        rows.append(
            {
                "index": g.index,
                "name": g.name,
                "capability": g.capability,
                "architecture": arch,
                "memory_bytes": g.memory_bytes,
                "native": native,
            }
        )
    return rows


def min_capability(feature: str) -> str:
    """The lowest compute capability in the table that runs `feature` natively."""
    return min((k for k, row in CAPABILITY_TABLE.items() if row[1 + GPU_FEATURES.index(feature)]), key=float)


def computes_in_half(dtype: str) -> bool:
    return PRECISIONS[dtype].compute != "float32"


def cell_features(cell: Cell) -> list[str]:
    """The GPU_FEATURES a cell needs."""
    return [*cell.attention.gpu_features, *cell.precision.gpu_features]


def package_missing(module: str, device: DeviceFacts) -> str | None:
    """Why optional package `module` (a cells.PACKAGES key) is unusable: absent, or older than the
    release nandoctor was checked with; None when it is fine."""
    pkg = PACKAGES[module]
    found = device.packages.get(module) or PackageFacts.from_dict(get_package(module))
    if not found.importable:
        return f"{module} is not installed: {pkg.install}"
    if pkg.min_version and found.version and Version(found.version) < Version(pkg.min_version):
        return (
            f"{module} {found.version} is older than {pkg.min_version}, the oldest checked: pip install -U {pkg.dist}"
        )
    return None


def cell_packages(cell: Cell) -> list[str]:
    """The optional packages (cells.PACKAGES keys) a cell needs: its fp8 recipe's, its optimizer's and its
    quantization's."""
    fp8 = cell.precision.fp8
    used = [p for p in (fp8.package if fp8 else None, cell.optimizer_row.package) if p]
    return used + [p for p in (cell.quantization.package,) if p and p not in used]


def cell_support(cell: Cell, device: DeviceFacts | dict) -> str | None:
    """None when the device can run the cell, else a one-line reason it cannot."""
    device = DeviceFacts.of(device)
    on_cuda = device.device == "cuda"
    for row in (cell.precision, cell.attention, cell.optimizer_row):
        if row.cuda_only and not on_cuda:
            return row.cuda_only
    cc = device.gpu_capability
    if on_cuda and cc is not None:
        row = capability_row(cc)
        native = row[1] if row else {}
        for feature in cell_features(cell):
            if not native.get(feature, False):
                return (
                    f"{feature} needs compute capability {min_capability(feature)}, "
                    f"this GPU has {cc} ({FEATURE_SOURCES[feature]})"
                )
        if cell.attention.half_only_cuda and not computes_in_half(cell.dtype):
            return cell.attention.half_only_cuda
        if cell.attn == "sdpa:flash" and device.flash_sdpa is False:
            return "this torch build has no CUDA flash SDPA kernel (torch.backends.cuda.is_flash_attention_available())"
        if cell.attn == "sdpa:cudnn" and (device.cudnn or 0) < 90000:
            return f"cuDNN SDPA needs cuDNN 9, this build has {device.cudnn}"
    package = cell.attention.package
    if package and not getattr(device, package, None):  # the version fact of its package (flash_attn)
        return f"{cell.attn} needs the {package.replace('_', '-')} package, which is not installed"
    for module in cell_packages(cell):
        missing = package_missing(module, device)
        if missing:
            return missing
    if cell.compile == "inductor" and not on_cuda and not device.cxx:
        return "inductor on CPU generates C++ and no C++ compiler is on PATH"
    if cell.parallel_row.needs_half and not computes_in_half(cell.dtype):
        return cell.parallel_row.needs_half
    if cell.quant != "none" and cell.precision.fp8:
        return FP8_QUANT
    return None


def quant_support(cell: Cell, storage: str, weights: str) -> str | None:
    """None unless the cell's quantized base cannot be sharded as it is stored: FSDP2 flattens and shards
    every parameter of a unit together, so the packed 4-bit weights must sit in the dtype of the
    others (bnb_4bit_quant_storage; bitsandbytes-foundation/bitsandbytes#970). `storage` and `weights`
    are torch dtype names: the recipe's quant.storage and the cell's weight dtype."""
    if cell.quantization.bits == 4 and cell.parallel_row.wrapper == "fsdp2" and storage != weights:
        return (
            f"fsdp2 shards a 4-bit base only when its quant storage is the model's dtype: the packed weights "
            f"are {storage}, the others {weights}; set quant.storage to the weights' dtype"
        )
    if cell.quantization.bits == 8 and cell.parallel_row.wrapper == "fsdp2":
        return "fsdp2 cannot shard bitsandbytes' Int8Params (an 8-bit base has no quant storage dtype to match)"
    return None


def parallel_support(
    cell: Cell, world_size: int, batch_size: int, device: DeviceFacts | dict, objective: str = "sft"
) -> str | None:
    """None unless a parallel cell cannot run as `world_size` ranks here: a GPU host needs one GPU per
    rank (NCCL), and the global batch must split evenly so that every rank trains the same number of
    rows (the one-process probe of the same batch is then the exact reference). An RL probe samples
    its completions in one process only."""
    if cell.parallel_row.wrapper is None:
        return None
    if objective != "sft":
        return f"objective={objective} probes run in one process; a {cell.parallel} cell is not probed for it"
    device = DeviceFacts.of(device)
    gpus = len(device.gpus)
    if device.device == "cuda" and gpus < world_size:
        return (
            f"{cell.parallel} with world_size={world_size} needs one GPU per rank, this host has {gpus}; "
            f"set world_size={max(gpus, 1)} or fewer"
        )
    if batch_size % world_size:
        return (
            f"batch_size={batch_size} does not split over world_size={world_size} ranks; "
            f"set batch_size to a multiple of {world_size}"
        )
    return None


def _torch_version(device: DeviceFacts) -> tuple[int, int]:
    try:
        return tuple(int(x) for x in (device.torch or "").split("+")[0].split(".")[:2])
    except ValueError:
        return (0, 0)


def data_masked(data, lint: dict | None) -> bool:
    """Whether the batches a probe trains on make transformers materialise an attention mask (input_support's
    `padded`): the synthetic stream when it pads (data.pad_fraction); the user's rows (data.path) when
    they are packed by position_ids (transformers builds the per-segment mask from them) or by a block
    mask, or when a batch the lint chose (run.json's data.batches) holds padded positions. Without the
    lint (a resumed run), the user's rows count as padded: rows of one length are the exception."""
    if data.source != "file":
        return data.pad_fraction > 0
    if data.packing in ("position_ids", "block_mask"):
        return True
    if lint is None:
        return True
    return any(b.get("padded", 0) > 0 for b in lint.get("batches") or [])


def input_support(cell: Cell, shape: dict, padded: bool, device: DeviceFacts | dict) -> str | None:
    """None unless the cell's pinned CUDA SDPA kernel is certain to refuse the inputs transformers will
    give it (then PyTorch raises "No available kernel"), judged from the model's shape (ModelPlan.shape)
    and whether the data has padding. Such cells are planned unsupported and never spawned."""
    device = DeviceFacts.of(device)
    if device.device != "cuda" or not cell.attn.startswith("sdpa:"):
        return None
    # transformers materialises the attention mask when there is padding, and under torch.compile before
    # torch 2.14 (masking_utils._ignore_causal_mask_sdpa: no is_causal skip while tracing, pytorch#176499)
    masked = padded or (cell.compile != "off" and _torch_version(device) < (2, 14))
    if cell.attn == "sdpa:flash" and masked:
        return "the flash SDPA kernel takes no attention mask, and transformers passes a materialised bool mask " + (
            "for padded batches" if padded else f"under torch.compile ({cell.compile})"
        )
    if cell.attn == "sdpa:efficient" and shape.get("kv_heads", shape.get("heads")) != shape.get("heads") and not masked:
        return (
            f"the memory-efficient SDPA kernel has no grouped-query attention: with no mask transformers calls "
            f"SDPA with enable_gqa ({shape['heads']} query / {shape['kv_heads']} key-value heads), and both fused "
            "kernels require query, key and value to have the same num_heads (sdp_utils.cpp)"
        )
    return None


def sdpa_backends(device: DeviceFacts | dict) -> dict[str, bool]:
    """Which scaled_dot_product_attention backends this device runs (with half inputs): the sdpa:*
    rows of the cell table, judged by cell_support. On a CPU, math and a CPU flash kernel exist."""
    device = DeviceFacts.of(device)
    return {
        name.split(":")[1]: cell_support(Cell("fp16-amp", name, "off"), device) is None
        for name in ATTENTIONS
        if name.startswith("sdpa:")
    }


def emulated_notes(device: DeviceFacts | dict, cells: list[Cell], said: set) -> list[str]:
    """A line for each compute dtype of `cells` that this CPU emulates (its measured matmul time over fp32's
    beyond Thresholds.emulated_cost), not in `said` yet (added to it): said before its first probe runs, so
    that the user can drop those cells rather than wait. Nothing on a GPU host or where nothing was measured."""
    from .cells import SHORT_DTYPES
    from .thresholds import THRESHOLDS

    cost = DeviceFacts.of(device).cpu_matmul_cost or {}
    by_dtype: dict[str, list[str]] = {}
    for cell in cells:
        by_dtype.setdefault(cell.precision.compute, []).append(cell.id)
    out = []
    for dtype, ids in by_dtype.items():
        ratio = cost.get(dtype)
        if dtype in said or ratio is None or not ratio > THRESHOLDS.emulated_cost:
            continue
        said.add(dtype)
        name = SHORT_DTYPES.get(dtype, dtype)
        shown = ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        out.append(
            f"{name} runs emulated on this CPU: a matmul in {name} took {ratio:.0f}x fp32's time here (measured "
            f"now), so its {len(ids)} probe(s) ({shown}) will train about that much slower than fp32's; "
            f"leave {name} out with --axis dtype=... to skip them"
        )
    return out
