"""The `parallel` axis as data and pure logic: its rows, what cannot run, the step-0 gradient
agreement verdict, the exact one-process reference, the code a user pastes, bisect factors and the
launcher's choice of the failed rank. No processes (tests/test_parallel_probes.py runs real ranks)."""

import pytest
from parallel_records import parallel_record

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.analysis.verdicts import GRAD_MISMATCH, classify
from nandoctor.bisect.engine import Bisection, Run
from nandoctor.bisect.factors import parse_configurations
from nandoctor.capabilities import cell_support, parallel_support
from nandoctor.cells import DEFAULT_AXES, Cell, reduce_dtype
from nandoctor.child.launch import first_failure
from nandoctor.config import Recipe, set_field
from nandoctor.errors import NandoctorError
from nandoctor.recommend import recommendation
from nandoctor.record import ProbeRecord, ProbeSpec, Step
from nandoctor.run.fingerprint import probe_fingerprint

CPU = {"device": "cpu", "gpus": [], "cpu_count": 2}
ONE_GPU = {"device": "cuda", "gpus": [{"index": 0, "name": "H100", "capability": "9.0", "memory_bytes": 80 << 30}]}


def test_the_default_grid_stays_one_process_and_old_ids_are_unchanged():
    assert DEFAULT_AXES["parallel"] == ("none",)
    assert Cell("bf16-amp", "sdpa", "off").id == "bf16-amp/sdpa/off"
    assert Cell("bf16-amp", "sdpa", "off").to_dict() == {"dtype": "bf16-amp", "attn": "sdpa", "compile": "off"}


@pytest.mark.parametrize(
    "text", ["bf16-amp/sdpa/off/fsdp2", "fp32/eager/off/adamw-fused/ddp", "fp32/eager/off/adamw-fused"]
)
def test_a_parallel_cell_id_parses_back_to_the_same_cell(text):
    assert Cell.parse(text).id == text


def test_the_single_cell_of_a_parallel_cell_is_its_exact_reference():
    assert Cell.parse("bf16-amp/sdpa/off/fsdp2").single == Cell("bf16-amp", "sdpa", "off")


def test_each_row_names_the_dtype_its_gradients_are_reduced_in():
    assert reduce_dtype(Cell.parse("bf16-amp/sdpa/off/fsdp2"), "fp32") == "float32"
    assert reduce_dtype(Cell.parse("bf16-amp/sdpa/off/fsdp2-reduce-low"), "fp32") == "bfloat16"
    assert reduce_dtype(Cell.parse("bf16-amp/sdpa/off/ddp-bf16-hook"), "fp32") == "bfloat16"
    assert reduce_dtype(Cell.parse("bf16-pure/sdpa/off/ddp"), "fp32") == "bfloat16"  # DDP reduces the grads' own dtype
    assert reduce_dtype(Cell("bf16-amp"), "fp32") is None


def test_a_bf16_hook_or_a_low_reduction_on_an_fp32_cell_is_unsupported_with_the_reason():
    assert "bf16 compress hook" in cell_support(Cell.parse("fp32/sdpa/off/ddp-bf16-hook"), CPU)
    assert "is fsdp2 there" in cell_support(Cell.parse("fp32/sdpa/off/fsdp2-reduce-low"), CPU)
    assert cell_support(Cell.parse("bf16-amp/sdpa/off/ddp-bf16-hook"), CPU) is None


def test_a_gpu_host_with_fewer_gpus_than_ranks_is_unsupported():
    why = parallel_support(Cell.parse("bf16-amp/sdpa/off/fsdp2"), 2, 4, ONE_GPU)
    assert "needs one GPU per rank, this host has 1" in why
    assert parallel_support(Cell.parse("bf16-amp/sdpa/off/fsdp2"), 2, 4, CPU) is None  # gloo ranks share the CPU
    assert parallel_support(Cell("bf16-amp"), 8, 4, ONE_GPU) is None  # one process reads no world_size


def test_a_global_batch_that_does_not_split_over_the_ranks_is_unsupported():
    assert "does not split over world_size=4" in parallel_support(Cell.parse("fp32/sdpa/off/ddp"), 4, 6, CPU)


def test_world_size_and_grad_reduce_are_validated_recipe_fields():
    assert set_field(Recipe(), "world_size", "4").validate().world_size == 4
    with pytest.raises(NandoctorError, match="world_size must be > 0"):
        set_field(Recipe(), "world_size", "0").validate()
    with pytest.raises(NandoctorError, match="grad_reduce='max' is not valid; valid: avg, sum"):
        set_field(Recipe(), "grad_reduce", "max").validate()


def test_gradients_w_times_the_one_process_ones_are_a_summing_reduction():
    verdict = classify(parallel_record("fp32/sdpa/off/fsdp2", norm_ratio=2.0, max_rel_error=1.0))
    assert verdict.name == GRAD_MISMATCH and verdict.failed and verdict.step == 0
    assert "gradients are 2.00x the single-process ones: the reduction sums instead of averaging" in verdict.reason


def test_gradients_one_wth_of_the_one_process_ones_are_divided_twice():
    verdict = classify(parallel_record("fp32/sdpa/off/ddp", norm_ratio=0.5, max_rel_error=0.5))
    assert verdict.name == GRAD_MISMATCH and "divides by the world size (2) twice" in verdict.reason


def test_an_error_beyond_what_the_reduce_dtype_explains_fails_and_within_it_passes():
    beyond = classify(parallel_record("fp32/sdpa/off/ddp", max_rel_error=0.01))
    assert (
        beyond.name == GRAD_MISMATCH
        and "beyond the 0.0001 a float32 computation and reduction explain" in beyond.reason
    )
    assert (
        classify(parallel_record("bf16-amp/sdpa/off/fsdp2-reduce-low", max_rel_error=0.012, reduce=("bfloat16",))).name
        == "stable"
    )


def test_a_tensor_group_beyond_ten_times_its_fp32_floor_fails_while_the_whole_is_within_its_dtype_tolerance():
    groups = {"router": {"error": 0.03, "floor": 0.001}, "rest": {"error": 0.0058, "floor": 0.006}}
    record = parallel_record("bf16-amp/sdpa/off/ddp", max_rel_error=0.03, groups=groups, worst_group="router")
    verdict = classify(record)
    assert verdict.name == GRAD_MISMATCH
    assert "within 0.05 per parameter, but the router's own gradient by 0.03 (beyond 0.01)" in verdict.reason
    assert "the rest's own" not in verdict.reason and "load-balancing" not in verdict.reason  # no balancing loss
    groups["router"]["floor"] = 0.004  # bound 0.04: the router's 0.03 is its own rounding
    assert classify(record).name == "stable"


def test_a_router_failing_as_a_whole_inside_its_wide_bf16_floor_still_names_the_balancing_loss_per_rank():
    # measured: tiny Qwen3-MoE, 2 gloo ranks, bf16-amp DDP, router_aux_loss_coef 0.001 (the router's floor 0.042)
    groups = {"router": {"error": 0.2448, "floor": 0.0424}, "rest": {"error": 0.0029, "floor": 0.0059}}
    record = parallel_record(
        "bf16-amp/sdpa/off/ddp", max_rel_error=0.2878, groups=groups, worst_group="router", balancing_loss=0.001
    )
    reason = classify(record).reason
    assert "in the router), beyond the 0.05 a bfloat16 computation and reduction explain: the load-balancing" in reason
    assert "counted 2 times" in reason and "model.config.router_aux_loss_coef / 2" in reason


def test_a_parallel_probe_is_measured_against_the_one_process_probe_of_its_cell():
    single = ProbeRecord("bf16-amp/sdpa/off", Cell("bf16-amp"), steps=[Step(i, 8.3 - 0.01 * i, 5.0) for i in range(4)])
    parallel = parallel_record("bf16-amp/sdpa/off/fsdp2")
    parallel.steps = [Step(i, (8.3 - 0.01 * i) * 1.001, 5.0) for i in range(4)]
    outcomes = {o.probe_id: o for o in analyze_records({"kind": "grid"}, [single, parallel]).outcomes}
    assert outcomes["bf16-amp/sdpa/off/fsdp2"].exact_fidelity == pytest.approx(0.001)
    assert outcomes["bf16-amp/sdpa/off"].exact_fidelity is None


def test_the_recommendation_writes_fsdp2_accelerate_lightning_and_trainer_settings():
    recipe = Recipe(world_size=4, batch_size=8)
    rec = recommendation(Cell.parse("bf16-amp/sdpa/off/fsdp2").to_dict(), recipe, recipe, [])
    code = "\n".join(rec["python"])
    assert "mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert "fully_shard(layer, mp_policy=mp)" in code and "fully_shard(model, mp_policy=mp)" in code
    assert (
        'Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy={"param_dtype": '
        'torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.bfloat16}))'
    ) in code
    assert rec["accelerate"]["distributed_type"] == "FSDP" and rec["accelerate"]["fsdp_config"]["fsdp_version"] == 2
    assert rec["accelerate"]["mixed_precision"] == "bf16" and rec["accelerate"]["num_processes"] == 4
    assert rec["lightning"] == {"precision": "bf16-mixed", "gradient_clip_val": 1.0, "strategy": "fsdp", "devices": 4}
    assert rec["training_arguments"]["fsdp"] == "full_shard auto_wrap"
    assert rec["training_arguments"]["per_device_train_batch_size"] == 2  # the global batch over 4 ranks
    assert "--parallel fsdp2" in rec["command"]


def test_the_low_reduction_row_writes_reduce_dtype_none_and_the_hook_row_registers_it():
    low = recommendation(Cell.parse("bf16-amp/sdpa/off/fsdp2-reduce-low").to_dict(), Recipe(), Recipe(), [])
    assert any("reduce_dtype=None" in line for line in low["python"])
    hook = recommendation(Cell.parse("bf16-amp/sdpa/off/ddp-bf16-hook").to_dict(), Recipe(), Recipe(), [])
    assert any("register_comm_hook(None, default_hooks.bf16_compress_hook)" in line for line in hook["python"])


def test_bisect_takes_parallel_and_world_size_as_factors():
    good, bad = parse_configurations(
        Recipe(), CPU, "dtype=bf16-amp", "dtype=bf16-amp,parallel=fsdp2-reduce-low,world_size=4", []
    )
    assert {k for k in bad if bad[k] != good[k]} == {"parallel", "world_size"}


def test_bisect_names_parallel_when_it_is_the_culprit():
    good, bad = parse_configurations(
        Recipe(), CPU, "dtype=bf16-amp", "dtype=bf16-amp,attn=sdpa,parallel=fsdp2-reduce-low", []
    )

    def oracle(trials):
        return [
            Run(
                t.key,
                GRAD_MISMATCH if t.config["parallel"] == "fsdp2-reduce-low" else "stable",
                t.config["parallel"] == "fsdp2-reduce-low",
            )
            for t in trials
        ]

    result = Bisection(good, bad, oracle, reruns=0).run()
    assert [c.factors for c in result.culprits] == [["parallel"]]


def test_the_launcher_blames_the_rank_that_died_of_a_signal_over_one_that_lost_its_peer():
    assert first_failure([1, -11]) == 1  # rank 0 exited with gloo's connection error after rank 1 segfaulted
    assert first_failure([None, 1]) == 1
    assert first_failure([0, None]) is None


def test_one_process_fingerprints_ignore_the_parallel_fields_and_parallel_ones_do_not():
    from nandoctor.record import ModelPlan

    plan = ModelPlan("architecture-twin", "full", "llama", 1, 1, 1, None, "", {})

    def fingerprint(cell, recipe):
        return probe_fingerprint(ProbeSpec(cell.id, recipe, cell, plan, 2, 0, "cpu", 1).to_dict(), {}, CPU)

    one, par = Cell("fp32"), Cell.parse("fp32/sdpa/off/ddp")
    assert fingerprint(one, Recipe()) == fingerprint(one, Recipe(world_size=4))
    assert fingerprint(par, Recipe()) != fingerprint(par, Recipe(world_size=4))


def test_a_crashed_parallel_probe_names_the_rank_that_died():
    record = ProbeRecord(
        "fp32/sdpa/off/ddp",
        Cell.parse("fp32/sdpa/off/ddp"),
        "signal",
        signal="SIGSEGV",
        failed_rank=1,
        ranks=[{"rank": 0, "killed": True}, {"rank": 1, "signal": "SIGSEGV"}],
    )
    verdict = classify(record)
    assert (
        verdict.name == "crash"
        and "SIGSEGV (segmentation fault) on rank 1 of 2 after 0 completed step(s)" in verdict.reason
    )
