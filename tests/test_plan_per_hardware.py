"""Cells are planned with the facts of the hardware they run on (issue 18): an executor gathers each
kind's device facts where its probes run, so a CPU login node does not call an H100 partition's CUDA
cells unsupported. Pure planning on hand-made facts here; the facts gathered by real jobs on the
two-partition SLURM and on Ray node types are checked in test_executor_slurm.py / test_executor_ray.py."""

from nandoctor.config import Recipe
from nandoctor.executors import ExecutorConfig
from nandoctor.plan import plan_grid
from nandoctor.run.session import planning_device

LOGIN_NODE = {"device": "cpu", "cpu_count": 4, "ram_bytes": 16 << 30}
H100 = {
    "device": "cuda",
    "gpus": [{"name": "NVIDIA H100", "capability": "9.0", "memory_bytes": 80 << 30}],
    "cudnn": 90100,
}
V100 = {
    "device": "cuda",
    "gpus": [{"name": "Tesla V100", "capability": "7.0", "memory_bytes": 16 << 30}],
    "cudnn": 90100,
}
GRID = {"dtype": ["fp32", "bf16-amp"], "attn": ["eager"], "compile": ["off"], "partition": ["h100", "v100"]}


def unsupported(probes) -> dict:
    return {p.probe_id: p.unsupported for p in probes if p.unsupported}


def test_each_kind_of_hardware_decides_its_own_cells_not_the_submit_host():
    grid = {**GRID, "attn": ["eager", "sdpa:efficient"]}
    on_host = unsupported(plan_grid(Recipe(), LOGIN_NODE, grid))  # CUDA-only SDPA kernel, judged on the CPU host
    assert set(on_host) == {f"{d}/sdpa:efficient/off@{k}" for d in ("fp32", "bf16-amp") for k in ("h100", "v100")}
    per_kind = unsupported(plan_grid(Recipe(), LOGIN_NODE, grid, {"h100": H100, "v100": V100}))
    assert set(per_kind) == {"bf16-amp/eager/off@v100", "bf16-amp/sdpa:efficient/off@v100"}  # only the V100 lacks bf16
    assert all("compute capability" in why and "7.0" in why for why in per_kind.values())


def test_the_model_is_planned_for_the_kind_with_the_least_memory():
    assert planning_device({"h100": H100, "v100": V100}) is V100


def test_a_placed_parallel_probe_is_judged_by_the_gpus_its_job_asks_for():
    from nandoctor.capabilities import parallel_support
    from nandoctor.cells import Cell
    from nandoctor.run.placement import job_device

    ddp = Cell("bf16-amp", "sdpa", "off", parallel="ddp")
    slurm = ExecutorConfig("slurm", {"gpus": 1})
    one_gpu_job = H100  # the facts job asked for one probe's GPU and saw one
    assert parallel_support(ddp, 4, 8, one_gpu_job) is not None
    assert parallel_support(ddp, 4, 8, job_device(slurm, one_gpu_job, 4)) is None  # a 4-rank job asks for 4 GPUs
