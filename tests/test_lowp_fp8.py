"""fp8: which linears go to fp8 and which stay in high precision (named, with why), and the cast
maths behind the forensics (amax, scale, saturation, flush to zero), on crafted tensors and on a
real torchao float8 step of a tiny Llama (torchao's float8 casts run on CPU too)."""

import pytest
import torch
from checkpoints import TINY
from transformers import AutoConfig, AutoModelForCausalLM

from nandoctor.cells import PRECISIONS
from nandoctor.child.fp8 import DelayedScale, Fp8Watch, cast_stats, dynamic_scale, fp8_exclusions, prepare_fp8


def tiny_llama(**overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**TINY, **overrides}))


def cpu_fp8_matmul_refusal(dtype: str = "fp8-tensorwise") -> str | None:
    """Why this CPU cannot multiply fp8 matrices as the dtype's torchao recipe does (torch._scaled_mm,
    which torchao's float8 linears call: one scale per tensor, or per row and column for fp8-rowwise),
    or None. oneDNN builds that matmul only from AVX512-FP16 on (Sapphire Rapids and later): with
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 it raises "could not create a primitive descriptor"; torch 2.11's
    CPU kernel takes per-tensor scales only. The planner never spawns an fp8 cell on a CPU; these tests
    run the probe's code in process."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    rowwise = dtype == "fp8-rowwise"
    scale_a, scale_b = (torch.ones(16, 1), torch.ones(1, 16)) if rowwise else (torch.tensor(1.0), torch.tensor(1.0))
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except RuntimeError as e:
        scaling = "row-wise scales" if rowwise else "per-tensor scales"
        return f"this CPU cannot run an fp8 matmul with {scaling} (torch._scaled_mm: {str(e).splitlines()[0][:80]})"
    return None


def skip_without_fp8_matmul(dtype: str = "fp8-tensorwise"):
    refusal = cpu_fp8_matmul_refusal(dtype)
    if refusal:
        pytest.skip(refusal)


def linears(model):
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_lm_head_and_linears_with_features_not_divisible_by_16_stay_in_high_precision():
    left_out = fp8_exclusions(tiny_llama(intermediate_size=200))  # 200 = 12 * 16 + 8
    mlp = {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(left_out) == mlp | {"lm_head"}
    assert left_out["model.layers.0.mlp.down_proj"] == "200 -> 64 features: fp8 GEMMs need both divisible by 16"
    assert "torchtitan" in left_out["lm_head"]


def test_torchao_conversion_swaps_exactly_the_linears_not_left_out():
    pytest.importorskip("torchao")
    model = tiny_llama(intermediate_size=200)
    eligible = linears(model) - set(fp8_exclusions(model))
    _, left_out = prepare_fp8(model, PRECISIONS["fp8-tensorwise"].fp8)
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == eligible and converted.isdisjoint(left_out)
    assert linears(model) == set(left_out) | converted  # Float8Linear is an nn.Linear subclass


def test_a_value_beyond_the_e4m3_max_saturates_and_one_below_half_the_smallest_subnormal_flushes():
    # e4m3: max 448, smallest subnormal 2**-9; 460 still rounds to 448, 500 is clipped
    x = torch.tensor([500.0, 460.0, 448.0, 1.0, 2.0**-9, 2.0**-11, 0.0])
    stats = cast_stats(x, "e4m3", 1.0)
    assert stats["amax"] == 500.0 and stats["scale_min"] == stats["scale_max"] == 1.0
    assert stats["saturated"] == pytest.approx(1 / 6)  # shares of the 6 non-zero values
    assert stats["flushed"] == pytest.approx(1 / 6)


def test_e5m2_trades_precision_for_range():
    x = torch.tensor([60000.0, 70000.0, 2.0**-16, 2.0**-18])  # max 57344; smallest subnormal 2**-16
    stats = cast_stats(x, "e5m2", 1.0)
    assert stats["saturated"] == pytest.approx(1 / 4) and stats["flushed"] == pytest.approx(1 / 4)
    assert cast_stats(x, "e4m3", 1.0)["saturated"] == pytest.approx(2 / 4)


def test_dynamic_tensorwise_scale_maps_amax_to_the_format_max_and_flushes_the_small_tail():
    x = torch.tensor([1000.0, 1.0, 1e-2, 1e-5])  # a 1e8 dynamic range no fp8 format holds
    scale = dynamic_scale(x, "e4m3")
    stats = cast_stats(x, "e4m3", scale)
    assert (1000.0 * scale).item() == pytest.approx(448.0)
    assert stats["saturated"] == 0.0 and stats["flushed"] == pytest.approx(
        1 / 4
    )  # 1e-5 * 0.448 < 2**-10; 1e-2 * 0.448 > 2**-9


def test_rowwise_scales_are_per_row_powers_of_two_at_or_below_the_exact_scale():
    x = torch.tensor([[3.0, -1.0], [0.01, 0.02]])
    scale = dynamic_scale(x, "e4m3", rowwise=True, power_of_2=True)
    exact = 448.0 / x.abs().amax(dim=-1, keepdim=True)
    assert scale.shape == (2, 1) and torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    assert (scale <= exact).all() and (scale > exact / 2).all()


def test_delayed_scaling_saturates_a_tensor_larger_than_any_in_its_history():
    delayed = DelayedScale("e4m3", history_len=4)
    assert delayed.observe(torch.tensor([1.0, -0.5]))["scale_max"] == 1.0  # TE starts at scale 1
    spike = delayed.observe(torch.tensor([2.0, 0.5]))  # cast at 448 / 1.0: 2.0 -> 896 is clipped
    assert spike["saturated"] == pytest.approx(1 / 2)
    assert delayed.scale == pytest.approx(448.0 / 2.0)


def test_delayed_scaling_max_algo_remembers_a_spike_for_its_history_length_most_recent_does_not():
    remembered, recent = DelayedScale("e4m3", history_len=3), DelayedScale("e4m3", history_len=3, algo="most_recent")
    for amax in (100.0, 1.0, 1.0):
        remembered.observe(torch.tensor([amax]))
        recent.observe(torch.tensor([amax]))
    assert remembered.scale == pytest.approx(448.0 / 100.0) and recent.scale == pytest.approx(448.0)
    remembered.observe(torch.tensor([1.0]))  # the spike leaves the 3-step window
    assert remembered.scale == pytest.approx(448.0)


@pytest.mark.parametrize("dtype", ["fp8-tensorwise", "fp8-rowwise"])
def test_fp8_watch_records_each_fp8_linear_on_a_real_step(dtype):
    pytest.importorskip("torchao")
    skip_without_fp8_matmul(dtype)
    model = tiny_llama()
    forward, left_out = prepare_fp8(model, PRECISIONS[dtype].fp8)
    watch = Fp8Watch(model, PRECISIONS[dtype].fp8)
    batch = torch.randint(
        0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0)
    )  # fp8 matmuls want multiples of 16
    with torch.autocast("cpu", dtype=torch.bfloat16), forward():
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    watch.remove()
    assert torch.isfinite(loss) and set(left_out) == {"lm_head"}
    assert set(watch.stats) == linears(model) - {"lm_head"}
    for roles in watch.stats.values():
        assert set(roles) == {"input", "weight", "grad_output"}
        assert all(s["saturated"] == 0.0 and 0.0 <= s["flushed"] < 1.0 and s["amax"] > 0 for s in roles.values())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 tensor cores need CUDA compute capability >= 8.9",
)
def test_fp8_tensorwise_trains_on_a_gpu_with_fp8_tensor_cores():
    pytest.importorskip("torchao")
    model = tiny_llama().cuda()
    forward, _ = prepare_fp8(model, PRECISIONS["fp8-tensorwise"].fp8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, TINY["vocab_size"], (4, 64), device="cuda")
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16), forward():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp8-tensorwise", "fp8-rowwise"])
def test_an_fp8_probe_and_its_replay_run_in_process_on_a_cpu(dtype):
    """The planner never spawns fp8 on a CPU, but torchao's float8 casts run there: the probe's own
    code (setup, training loop, memory split, forensics replay with the fp8 watch) runs end to end."""
    pytest.importorskip("torchao")
    skip_without_fp8_matmul(dtype)
    from nandoctor.cells import Cell
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS
    from nandoctor.child.replay import forensics_of
    from nandoctor.config import set_field
    from nandoctor.models import plan_model
    from nandoctor.recipes import recipe_by_name
    from nandoctor.record import ProbeRecord, ProbeSpec

    # 2 x 16 tokens, not 4 x 64: oneDNN's fp8 matmul on a CPU is its reference kernel (65 ms for one
    # 256 x 128 x 128 product here), so the probe's 210 of them cost 37 s at the recipe's default size
    recipe = recipe_by_name("tiny-llama")
    for field, value in (("forensics_steps", "2"), ("batch_size", "2"), ("seq_len", "16")):
        recipe = set_field(recipe, field, value)
    cell = Cell(dtype)
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), 2, 0, "cpu", 1)
    record = ProbeRecord(spec.probe_id, cell)
    s, snapshot, *_ = run_probe(spec, record, ONE_PROCESS, None)
    assert len(record.steps) == 2 and all(torch.isfinite(torch.tensor(s.loss)) for s in record.steps)
    assert set(record.fp8_excluded) == {"lm_head"}
    assert (
        record.optimizer_state_bytes >= 2 * record.weights_bytes > 0
    )  # AdamW's two fp32 moments over fp32 master weights
    f = forensics_of(spec, record, s, snapshot, None, ONE_PROCESS)
    assert "error" not in f, f.get("traceback")
    assert f["reproduced"]  # the replay restored the converted model from its snapshot
    casts = f["fp8"]["casts"]
    assert f["fp8"]["excluded"] == record.fp8_excluded and "model.layers.0.self_attn.q_proj" in casts
    assert all(set(roles) == {"input", "weight", "grad_output"} for roles in casts.values())
    assert all(s["saturated"] == 0.0 for roles in casts.values() for s in roles.values())  # dynamic scaling never clips
