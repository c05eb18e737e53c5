"""Recipe + axes -> the list of probes to run. Cells the device cannot run are planned as
`unsupported` with the reason and never spawned. The fp32 reference cell always comes first (the
others' drift is judged against it), then the cheap cells, so a user sees most verdicts early."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from .capabilities import cell_support, computes_in_half
from .cells import AXES, DEFAULT_AXES, HARDWARE_AXES, Cell, parse_axis_values, reference_of
from .config import Recipe
from .device import DeviceFacts
from .errors import NandoctorError

CPU_DEFAULT_COMPILE = ["off"]  # the first inductor step costs ~36 s on a 2-core CPU: opt in with --axis

# On a CPU, half precision is slower, not faster: tiny-llama steps measured on the 2-core dev machine,
# 1 thread, took 0.15 s in fp32, 0.7 s in bf16-amp and 1.0 s in bf16-pure (no half-precision matmul
# units). Compiling costs most everywhere (cells.Compilation.cost).


@dataclass(frozen=True)
class PlannedProbe:
    probe_id: str
    cell: Cell
    unsupported: str | None = None
    overrides: dict = field(default_factory=dict)  # dotted recipe fields set for this probe (bisect)
    seed_offset: int = 0
    recipe: Recipe | None = None  # this probe's recipe variant (the overrides applied); None: the run's


def default_axes(recipe: Recipe, device: DeviceFacts) -> dict[str, list[str]]:
    """The values each axis takes unless --axis says otherwise: the cell table's default-grid rows
    (the fp8 dtypes and the optimizers other than adamw are opt-in), then the recipe's own axes."""
    axes = {name: list(values) for name, values in DEFAULT_AXES.items()}
    if device.device != "cuda":
        axes["compile"] = list(CPU_DEFAULT_COMPILE)
    for name, values in recipe.axes.items():
        axes[name] = parse_axis_values(name, values)
    return axes


def cost_rank(cell: Cell, device: DeviceFacts) -> tuple[int, bool]:
    """Sort key: cheaper cells first."""
    return cell.compilation.cost, device.device != "cuda" and computes_in_half(cell.dtype)


def hardware_kinds(axes: dict[str, list[str]]) -> list[str]:
    """The hardware a grid probes each cell on: the values of its hardware axis (--axis partition= /
    node_type=), or [""] (wherever the executor puts it)."""
    return next((list(v) for k, v in axes.items() if k in HARDWARE_AXES), [""])


def quantized_without_adapter(recipe: Recipe, cells) -> None:
    """A quantized base is frozen (bitsandbytes' layers hold no trainable weight): a cell with a `quant`
    value trains an adapter, or it is the user's error, said before any probe runs."""
    quantized = [c.quant for c in cells if c.quant != "none"]
    if quantized and recipe.adapter.type == "none":
        raise NandoctorError(
            f"quant={quantized[0]} loads a frozen quantized base, which trains adapters only: "
            "add --set adapter.type=lora (or dora), or drop the quant axis"
        )


def engine_without_gpu(recipe: Recipe, device: DeviceFacts) -> None:
    """rollout.engine=vllm asks for vLLM, which samples on a CUDA GPU only: on a host without one it is
    the user's error, said before any probe runs (auto lets generate() stand in and says so)."""
    if recipe.objective == "grpo" and recipe.rollout.engine == "vllm" and device.device != "cuda":
        raise NandoctorError(
            f"rollout.engine=vllm samples with vLLM, which needs a CUDA GPU; this host has none "
            f"(device {device.device or 'unknown'}): use rollout.engine=auto or generate"
        )


def plan_grid(
    recipe: Recipe,
    device: DeviceFacts | dict,
    axes: dict[str, list[str]] | None = None,
    devices: dict[str, DeviceFacts | dict] | None = None,
) -> list[PlannedProbe]:
    """Cross product of the axes (defaults filled in from the recipe and device), on each hardware kind:
    the references first (one per kind: fidelity is judged against the fp32 of the same hardware),
    then by cost_rank, keeping the axes' order among equals. devices: the facts of each kind of hardware
    (an executor gathers them where its probes run; "" without a hardware axis): a cell is supported or
    not by its own kind's facts, by `device` where none are given."""
    device = DeviceFacts.of(device)
    devices = {kind: DeviceFacts.of(facts) for kind, facts in (devices or {}).items()}
    chosen = default_axes(recipe, device)
    for name, values in (axes or {}).items():
        chosen[name] = parse_axis_values(name, values)
    cells = [Cell(**dict(zip(AXES, values))) for values in itertools.product(*(chosen[axis] for axis in AXES))]
    kinds = hardware_kinds(chosen)
    quantized_without_adapter(recipe, cells)
    # one reference per kind of hardware and base (a quantized base's drift is its own fp32 cell's)
    references = list(dict.fromkeys(reference_of(replace(c, hardware=h)) for c in cells for h in kinds))
    others = sorted(
        (replace(c, hardware=h) for c in cells for h in kinds if replace(c, hardware=h) not in references),
        key=lambda c: cost_rank(c, device),
    )
    return [
        PlannedProbe(probe_id=c.id, cell=c, unsupported=cell_support(c, devices.get(c.hardware) or device))
        for c in references + others
    ]
