"""The device facts and the run meta are dataclasses with one reader (from_dict) and one writer (to_dict):
what env.py gathers and what any earlier run wrote (run.json's env, hardware.json, a record's env) reads
into them and is written back as it was, key for key, so that runs stay readable both ways."""

import json
from pathlib import Path

from conftest import record_list

from nandoctor import jsonio
from nandoctor.device import DeviceFacts, GpuFacts, NvmlFacts, PackageFacts
from nandoctor.env import collect_doctor, collect_summary
from nandoctor.runmeta import RunMeta

FIXTURES = Path(__file__).parent / "fixtures"
OLD_RUNS = [FIXTURES / "run-before-issue-9", FIXTURES / "run-lr30"]

# what an executor's start-up job wrote on an H100 node (placed.node_facts), older fields only: no
# flash_sdpa, no packages, a cuDNN, NVML's devices without multiprocessors, and the job that read them
H100_NODE = {
    "python": "3.11.7",
    "torch": "2.13.0+cu128",
    "cuda": "12.8",
    "cudnn": 91002,
    "device": "cuda",
    "gpus": [
        {
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "capability": "9.0",
            "memory_bytes": 85 << 30,
            "multiprocessors": 132,
        }
    ],
    "cpu_count": 16,
    "nvml": {
        "available": True,
        "driver": "580.65.06",
        "cuda_driver": "13.0",
        "devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_bytes": 85 << 30}],
    },
    "gathered": {"host": "gpu17", "pid": 4242, "job": "7731", "partition": "h100"},
}


def same_json(data: dict) -> bool:
    """DeviceFacts read from `data` write it back byte for byte (keys, their order, and values)."""
    return jsonio.dumps(DeviceFacts.from_dict(json.loads(jsonio.dumps(data))).to_dict()) == jsonio.dumps(data)


def test_the_facts_this_machine_gathers_are_typed_and_round_trip_unchanged():
    facts = collect_doctor()
    assert isinstance(facts, DeviceFacts) and facts.device in ("cpu", "cuda") and facts.cpu_count >= 1
    assert all(isinstance(g, GpuFacts) for g in facts.gpus) and isinstance(facts.nvml, NvmlFacts)
    assert all(isinstance(p, PackageFacts) for p in facts.packages.values())
    assert DeviceFacts.from_dict(facts.to_dict()) == facts and same_json(facts.to_dict())
    summary = collect_summary().to_dict()
    assert "nvml" not in summary and "gathered" not in summary  # a record's env stays the summary's keys
    assert list(summary) == list(facts.to_dict())[: len(summary)]


def test_an_old_runs_facts_read_typed_and_write_back_as_they_were():
    for run in OLD_RUNS:
        meta = json.loads((run / "run.json").read_text())
        records = record_list(run)
        for env in [meta["env"]] + [r["env"] for r in records if r.get("env")]:
            assert same_json(env), run.name
    old = DeviceFacts.from_dict(json.loads((OLD_RUNS[0] / "run.json").read_text())["env"])
    # written before flash_sdpa was a fact, with sdpa_backends and cuda_available that no longer are ones
    assert old.flash_sdpa is None and not old.has("flash_sdpa") and "flash_sdpa" not in old.to_dict()
    backends = {"math": True, "flash": True, "efficient": False, "cudnn": False}
    assert old.unknown == {"sdpa_backends": backends, "cuda_available": False}
    assert old.device == "cpu" and old.gpus == () and old.nvml.available is False
    assert old.packages["torchao"] == PackageFacts(importable=False, version=None, read_keys=("importable", "version"))


def test_a_nodes_facts_keep_their_gpus_nvml_and_where_they_were_gathered():
    node = DeviceFacts.from_dict(H100_NODE)
    assert same_json(H100_NODE)
    assert node.gpus[0].capability == "9.0" and node.gpu_capability == 9.0 and node.gpus[0].multiprocessors == 132
    assert node.nvml.devices[0].multiprocessors is None and "multiprocessors" not in node.nvml.devices[0].to_dict()
    assert node.gathered["job"] == "7731" and node.packages == {} and not node.has("packages")
    moved = node.gathered_at({"host": "gpu18"})
    assert moved.to_dict() == {**H100_NODE, "gathered": {"host": "gpu18"}}
    assert DeviceFacts.of(H100_NODE) == node and DeviceFacts.of(node) is node


def test_run_json_of_an_old_run_reads_typed_and_writes_back_as_it_was():
    for run in OLD_RUNS:
        text = (run / "run.json").read_text()
        meta = RunMeta.from_dict(json.loads(text))
        assert jsonio.dumps(meta.to_dict()) == jsonio.dumps(json.loads(text)), run.name
        assert meta.kind == "grid" and isinstance(meta.env, DeviceFacts) and meta.env.cpu_count == 2
        assert meta.executor is None and not meta.has("executor")  # written before the executors
        assert meta.request is None and meta.env_by_hardware == {}


def test_run_json_of_a_placed_grid_types_each_kind_of_hardwares_facts():
    written = {
        "kind": "grid",
        "run_id": "r",
        "steps": 8,
        "env": H100_NODE,
        "executor": "slurm",
        "env_by_hardware": {"h100": H100_NODE, "a100": {**H100_NODE, "gpus": []}},
        "axes": {"partition": ["h100", "a100"]},
        "baseline": None,
        "host_load": 0.5,  # a key this version does not know
    }
    meta = RunMeta.from_dict(json.loads(json.dumps(written)))
    assert meta.env_by_hardware["h100"].gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert meta.env_by_hardware["a100"].gpus == () and meta.baseline is None and meta.has("baseline")
    assert meta.unknown == {"host_load": 0.5} and meta.to_dict() == written
    assert list(meta.to_dict()) == list(written)
