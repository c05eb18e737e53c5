"""The compute-capability table is data: these tests read it like a spec sheet."""

import pytest

from nandoctor.capabilities import CAPABILITY_TABLE, FEATURE_SOURCES, GPU_FEATURES, capability_row, cell_support
from nandoctor.cells import Cell
from nandoctor.config import Recipe
from nandoctor.plan import plan_grid

EXPECTED = {  # capability: features that run natively
    "7.0": {"fp32", "fp16"},
    "7.5": {"fp32", "fp16"},
    "8.0": {"fp32", "tf32", "fp16", "bf16", "sdpa:flash", "sdpa:cudnn", "flash_attention_2"},
    "8.9": set(GPU_FEATURES),
    "9.0": set(GPU_FEATURES),
    "10.0": set(GPU_FEATURES),
}


@pytest.mark.parametrize("cc", sorted(EXPECTED, key=float))
def test_capability_table_row(cc):
    _, native = capability_row(cc)
    assert {f for f, ok in native.items() if ok} == EXPECTED[cc]


def test_capability_table_covers_the_six_generations_and_cites_every_feature():
    assert set(CAPABILITY_TABLE) == set(EXPECTED)
    assert [row[0] for row in CAPABILITY_TABLE.values()] == ["Volta", "Turing", "Ampere", "Ada", "Hopper", "Blackwell"]
    assert set(FEATURE_SOURCES) == set(GPU_FEATURES) and all(FEATURE_SOURCES.values())


def test_a_capability_between_rows_gets_the_generation_below():
    assert capability_row("8.6")[0] == "Ampere" and capability_row("8.6")[1]["fp8"] is False
    assert capability_row("12.0")[0] == "Blackwell"
    assert capability_row("6.1") is None


def gpu(cc: str, cudnn: int = 90300) -> dict:
    return {
        "device": "cuda",
        "gpus": [{"index": 0, "name": "test", "capability": cc, "memory_bytes": 16 << 30}],
        "cudnn": cudnn,
        "flash_attn": "2.7.0",
        "cxx": "/usr/bin/g++",
    }


def test_bf16_is_unsupported_on_turing_with_the_reason():
    reason = cell_support(Cell("bf16-amp", "sdpa", "off"), gpu("7.5"))
    assert reason.startswith("bf16 needs compute capability 8.0, this GPU has 7.5")


def test_flash_attention_2_below_ampere_and_fp16_on_turing():
    assert "flash_attention_2 needs compute capability 8.0" in cell_support(
        Cell("fp16-amp", "flash_attention_2", "off"), gpu("7.5")
    )
    assert cell_support(Cell("fp16-amp", "sdpa", "off"), gpu("7.5")) is None
    assert cell_support(Cell("bf16-amp", "flash_attention_2", "off"), gpu("9.0")) is None


def test_planner_prunes_cuda_only_cells_on_cpu():
    cpu = {"device": "cpu", "gpus": [], "cxx": "/usr/bin/g++", "flash_attn": None}
    probes = plan_grid(
        Recipe(),
        cpu,
        {"dtype": ["fp32", "tf32"], "attn": ["sdpa", "sdpa:efficient", "sdpa:cudnn", "flash_attention_2"]},
    )
    unsupported = {p.probe_id: p.unsupported for p in probes if p.unsupported}
    assert set(unsupported) == {
        c
        for c in (p.probe_id for p in probes)
        if "tf32" in c or "efficient" in c or "cudnn" in c or "flash_attention_2" in c
    }
    assert "fp32/sdpa/off" not in unsupported and "fp32/eager/off" not in unsupported
    assert unsupported["fp32/sdpa:cudnn/off"] == "cuDNN SDPA is CUDA-only"


def test_gpu_rows_come_from_nvml_when_torch_sees_no_gpu():
    from nandoctor.capabilities import gpu_capabilities

    env = {
        "gpus": [],
        "nvml": {
            "available": True,
            "driver": "550.54",
            "cuda_driver": "12.4",
            "devices": [{"index": 0, "name": "Tesla T4", "capability": "7.5", "memory_bytes": 15 << 30}],
        },
    }
    (row,) = gpu_capabilities(env)
    assert row["architecture"] == "Turing" and row["native"]["fp16"] and not row["native"]["bf16"]
    assert gpu_capabilities({"gpus": [], "nvml": {"available": False, "reason": "no driver"}}) == []
