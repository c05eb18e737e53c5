"""Parsing --good / --bad / --factor into configurations, and the default target: pure, no probes."""

import pytest

from nandoctor.bisect.factors import fastest_cell, parse_assignments, parse_configurations
from nandoctor.cells import DEFAULT_AXES, FASTEST_FIRST, TABLES
from nandoctor.config import Recipe
from nandoctor.errors import NandoctorError

CPU = {"device": "cpu", "gpus": [], "cxx": "/usr/bin/g++"}
T4 = {
    "device": "cuda",
    "gpus": [{"capability": "7.5", "memory_bytes": 16 << 30}],
    "cudnn": 90100,
    "cxx": "/usr/bin/g++",
}


def test_a_comma_inside_a_tuple_value_does_not_split_the_assignment():
    assert parse_assignments("dtype=fp16-pure,adapter.target_modules=q_proj,v_proj,grad_clip=0", "--bad") == {
        "dtype": "fp16-pure",
        "adapter.target_modules": "q_proj,v_proj",
        "grad_clip": "0",
    }


def test_target_is_the_baseline_plus_the_bad_values_typed_like_the_recipe():
    good, bad = parse_configurations(Recipe(), CPU, None, "dtype=fp16-pure,optimizer.eps=1e-8", ["grad_clip=0"])
    assert good == {
        "dtype": "fp32",
        "attn": "eager",
        "compile": "off",
        "optimizer": "adamw",
        "parallel": "none",
        "quant": "none",
        "optimizer.eps": 1e-8,
        "grad_clip": 1.0,
    }
    assert bad == {**good, "dtype": "fp16-pure", "grad_clip": 0.0}


def test_a_target_equal_to_the_baseline_is_rejected():
    with pytest.raises(NandoctorError, match="the target and the baseline are the same configuration"):
        parse_configurations(Recipe(), CPU, None, "dtype=fp32,optimizer.eps=1e-8", [])


def test_without_bad_the_target_is_the_fastest_cell_the_device_supports():
    # a CPU has no half-precision matmul units and a first inductor step outlasts a short probe
    assert fastest_cell(CPU).id == "fp32/sdpa:flash/off"
    # a T4 (sm75) has no bf16 and no flash / cuDNN SDPA: fp16 with the memory-efficient kernel, fused AdamW
    assert fastest_cell(T4).id == "fp16-pure/sdpa:efficient/inductor/adamw-fused"
    assert fastest_cell({**T4, "cxx": None}).compile == "inductor"  # a GPU compiles without a host C++ compiler


def test_the_fastest_first_orders_come_from_the_cell_rows_as_they_were_listed():
    assert FASTEST_FIRST == {
        "cuda": {
            "dtype": ("bf16-pure", "fp16-pure", "bf16-amp", "fp16-amp", "tf32", "fp32"),
            "attn": ("sdpa:flash", "sdpa:cudnn", "flash_attention_2", "sdpa:efficient", "sdpa", "eager"),
            "compile": ("inductor", "aot_eager", "off"),
            "optimizer": ("adamw-fused", "adamw"),
            "parallel": ("none",),
            "quant": ("none",),
        },
        "cpu": {
            "dtype": ("fp32", "bf16-amp", "fp16-amp", "bf16-pure", "fp16-pure"),
            "attn": ("sdpa:flash", "sdpa", "sdpa:math", "eager"),
            "compile": ("off", "aot_eager", "inductor"),
            "optimizer": ("adamw",),
            "parallel": ("none",),
            "quant": ("none",),
        },
    }


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_every_default_grid_row_has_a_place_in_the_fastest_first_order(kind):
    # a new row without a speed_rank would never be bisect's default target; the only rows left out are
    # those a CPU cannot run and sdpa:math on CUDA, where the fused kernels sdpa picks are faster
    left_out = {("attn", "sdpa:math")} if kind == "cuda" else set()
    for axis, table in TABLES.items():
        places = [row.speed_rank[kind] for row in table.values() if kind in row.speed_rank]
        assert len(set(places)) == len(places), f"two {axis} rows share a place on {kind}"
        for value in DEFAULT_AXES[axis]:
            cannot_run = kind == "cpu" and getattr(table[value], "cuda_only", None)
            if (axis, value) not in left_out and not cannot_run:
                assert value in FASTEST_FIRST[kind][axis], f"{axis}={value} has no speed_rank[{kind!r}]"


def test_the_optimizer_is_a_factor_like_the_other_axes():
    good, bad = parse_configurations(Recipe(), CPU, None, "optimizer=ao-adamw8bit,optimizer.eps=1e-6", [])
    assert (good["optimizer"], bad["optimizer"]) == ("adamw", "ao-adamw8bit")
    assert (good["optimizer.eps"], bad["optimizer.eps"]) == (1e-8, 1e-6)


def test_opt_in_values_are_never_the_default_target():
    h100 = {
        "device": "cuda",
        "gpus": [{"capability": "9.0", "memory_bytes": 80 << 30}],
        "cudnn": 90100,
        "flash_sdpa": True,
        "packages": {"torchao": {"importable": True, "version": "0.18.0"}},
        "torch": "2.14.0",
    }
    assert fastest_cell(h100).id == "bf16-pure/sdpa:flash/inductor/adamw-fused"


def test_the_default_target_is_never_a_cell_its_probe_would_refuse():
    # On the H200 (torch 2.11) `bisect --model llama-3.1-8b` took bf16-pure/sdpa:flash/inductor as its target,
    # which the planner refuses (flash gets a materialised mask under torch.compile before torch 2.14): the
    # bisection ended "could not test the target" (docs/gpu/2026-11-27-h200.md)
    h200 = {"device": "cuda", "gpus": [{"capability": "9.0", "memory_bytes": 141 << 30}], "cudnn": 91002}
    h200.update(flash_sdpa=True, torch="2.11.0+cu130")
    assert fastest_cell(h200).id == "bf16-pure/sdpa:flash/off/adamw-fused"


def test_an_optimizer_this_device_cannot_run_is_one_clear_error():
    with pytest.raises(NandoctorError, match="cannot run on this device: paging moves optimizer state"):
        parse_configurations(Recipe(), CPU, None, "optimizer=bnb-paged-adamw8bit", [])


def test_unsupported_target_is_one_clear_error():
    with pytest.raises(NandoctorError, match="cannot run on this device: cuDNN SDPA is CUDA-only"):
        parse_configurations(Recipe(), CPU, None, "attn=sdpa:cudnn", [])


def test_bad_value_for_a_recipe_field_names_the_flag():
    with pytest.raises(NandoctorError, match="--good: recipe .*pad_token.policy='left'"):
        parse_configurations(Recipe(), CPU, "pad_token.policy=left", None, [])


def test_timeouts_ooms_and_kills_are_unresolved_unless_the_user_hunts_them():
    from nandoctor.bisect.oracle import resolved

    assert [resolved(v, ()) for v in ("stable", "nonfinite", "crash", "timeout", "oom", "killed", "unsupported")] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert resolved("timeout", ("timeout",)) and not resolved("oom", ("timeout",))


def test_a_list_valued_factor_is_typed_by_its_field():
    good, bad = parse_configurations(Recipe(), CPU, None, "dtype=bf16-amp,optimizer.betas=0.9,0.95", [])
    assert good["optimizer.betas"] == (0.9, 0.999) and bad["optimizer.betas"] == (0.9, 0.95)
    assert all(type(b) is float for b in bad["optimizer.betas"])
