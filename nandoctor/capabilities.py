"""Which grid cells a device can run, as data. The planner records the others as `unsupported`
with the reason, without spawning a process.

Imports only config. `device` is the dict `env.collect_summary()` returns.
"""
from __future__ import annotations

from .config import Cell

# Minimum CUDA compute capability per feature, with the source of the number.
MIN_CAPABILITY = {
    "bf16": (8.0, "bf16 tensor-core math arrived with Ampere (sm80); torch.cuda.is_bf16_supported()"),
    "tf32": (8.0, "TF32 is an Ampere (sm80) tensor-core mode; torch.backends.cuda.matmul.allow_tf32 docs"),
    "sdpa:flash": (8.0, "PyTorch's flash SDPA kernels need sm80+ (torch/nn/attention docs, sdp_utils.cpp)"),
    "sdpa:cudnn": (8.0, "cuDNN fused attention needs sm80+ and cuDNN 9 (torch sdp_utils.cpp check_cudnn_hardware_support)"),
    "flash_attention_2": (8.0, "flash-attn 2 supports Ampere, Ada and Hopper only (Dao-AILab/flash-attention README)"),
}

# Attention kernels that accept only half-precision inputs on CUDA.
HALF_ONLY_CUDA = {
    "sdpa:flash": "the CUDA flash SDPA kernel takes fp16/bf16 inputs only",
    "sdpa:cudnn": "the cuDNN SDPA kernel takes fp16/bf16 inputs only",
    "flash_attention_2": "flash-attn 2 takes fp16/bf16 inputs only",
}

CUDA_ONLY = {
    "tf32": "tf32 is a CUDA matmul mode; this device is a CPU",
    "sdpa:efficient": "the memory-efficient SDPA kernel is CUDA-only",
    "sdpa:cudnn": "cuDNN SDPA is CUDA-only",
    "flash_attention_2": "flash-attn 2 is CUDA-only",
}


def _capability(device: dict) -> float | None:
    gpus = device.get("gpus") or []
    return float(gpus[0]["capability"]) if gpus else None


def computes_in_half(dtype: str) -> bool:
    return dtype not in ("fp32", "tf32")


def cell_support(cell: Cell, device: dict) -> str | None:
    """None when the device can run the cell, else a one-line reason it cannot."""
    on_cuda = device.get("device") == "cuda"
    for feature in (cell.dtype, cell.attn):
        if feature in CUDA_ONLY and not on_cuda:
            return CUDA_ONLY[feature]
    cc = _capability(device)
    if on_cuda and cc is not None:
        features = [cell.attn] + (["bf16"] if cell.dtype.startswith("bf16") else []) + (["tf32"] if cell.dtype == "tf32" else [])
        for feature in features:
            if feature in MIN_CAPABILITY and cc < MIN_CAPABILITY[feature][0]:
                need, why = MIN_CAPABILITY[feature]
                return f"{feature} needs compute capability {need}, this GPU has {cc} ({why})"
        if cell.attn in HALF_ONLY_CUDA and not computes_in_half(cell.dtype):
            return HALF_ONLY_CUDA[cell.attn]
        if cell.attn == "sdpa:cudnn" and (device.get("cudnn") or 0) < 90000:
            return f"cuDNN SDPA needs cuDNN 9, this build has {device.get('cudnn')}"
    if cell.attn == "flash_attention_2" and not device.get("flash_attn"):
        return "flash_attention_2 needs the flash-attn package, which is not installed"
    if cell.compile == "inductor" and not on_cuda and not device.get("cxx"):
        return "inductor on CPU generates C++ and no C++ compiler is on PATH"
    return None
