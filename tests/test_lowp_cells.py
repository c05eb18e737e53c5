"""The low-precision values are rows of the cell table: the optimizer axis (default adamw, so that old
runs keep their ids and fingerprints) and the fp8 dtypes, both opt-in; the recommendation turns
them into the user's own code and TrainingArguments(optim=...)."""

import pytest

from nandoctor.cells import ALIASES, AXES, DEFAULT_AXES, OPTIMIZERS, PRECISIONS, Cell, precision_of_training_args
from nandoctor.config import Recipe, set_field
from nandoctor.errors import NandoctorError
from nandoctor.plan import plan_grid
from nandoctor.recommend import recommendation
from nandoctor.record import ProbeRecord, ProbeSpec
from nandoctor.run.fingerprint import probe_fingerprint

H100 = {
    "device": "cuda",
    "gpus": [{"name": "H100", "capability": "9.0", "memory_bytes": 8e10}],
    "cudnn": 90100,
    "flash_attn": "2.8.0",
    "flash_sdpa": True,
    "packages": {"torchao": {"importable": True, "version": "0.18.0"}},
}
ENV = {
    "python": "3.11.7",
    "torch": "2.13.0",
    "device": "cpu",
    "gpus": [],
    "cpu_model": "Some CPU",
    "packages": {"torchao": {"importable": True, "version": "0.18.0"}},
}


def test_the_default_optimizer_stays_out_of_ids_and_dicts():
    assert Cell("fp32", "sdpa", "off").id == "fp32/sdpa/off" == Cell.parse("fp32/sdpa/off/adamw").id
    assert Cell("fp32", "sdpa", "off").to_dict() == {"dtype": "fp32", "attn": "sdpa", "compile": "off"}
    cell = Cell.parse("bf16-amp/sdpa/off/ao-adamw8bit")
    assert cell.id == "bf16-amp/sdpa/off/ao-adamw8bit" and cell.to_dict()["optimizer"] == "ao-adamw8bit"
    assert Cell(**cell.to_dict()) == cell


def test_a_bad_optimizer_or_cell_is_one_clear_error():
    with pytest.raises(NandoctorError, match="unknown optimizer value 'adam8'"):
        Cell.parse("fp32/sdpa/off/adam8")
    with pytest.raises(NandoctorError, match=r"expected dtype/attn/compile\[/optimizer\]"):
        Cell.parse("fp32/sdpa")


def test_a_record_written_before_the_optimizer_axis_reads_with_adamw():
    record = ProbeRecord.from_dict(
        {"probe_id": "fp32/sdpa/off", "cell": {"dtype": "fp32", "attn": "sdpa", "compile": "off"}}
    )
    assert record.cell.optimizer == "adamw" and record.optimizer_state_bytes is None and record.fp8_excluded is None
    assert record.to_dict()["cell"] == {"dtype": "fp32", "attn": "sdpa", "compile": "off"}


def test_the_default_grid_does_not_grow():
    assert len(plan_grid(Recipe(), H100)) == 126
    assert DEFAULT_AXES["optimizer"] == ("adamw",) and not any(PRECISIONS[d].fp8 for d in DEFAULT_AXES["dtype"])
    assert {"adamw", "adamw-fused", "bnb-adamw8bit", "ao-adamw8bit", "sf-adamw", "muon"} <= set(AXES["optimizer"])


def test_opt_in_values_join_the_grid_when_named():
    ids = [
        p.probe_id
        for p in plan_grid(
            Recipe(),
            H100,
            {"dtype": ["fp8-rowwise"], "attn": ["sdpa"], "compile": ["off"], "optimizer": ["adamw", "ao-adamw8bit"]},
        )
    ]
    assert ids == ["fp32/eager/off", "fp8-rowwise/sdpa/off", "fp8-rowwise/sdpa/off/ao-adamw8bit"]


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-rowwise", "fp8-te-hybrid", "fp8-te-e4m3"])
def test_fp8_rows_run_in_bf16_autocast_with_fp32_master_weights(name):
    p = PRECISIONS[name]
    assert (p.autocast, p.weights, p.compute, p.scaler) == ("bfloat16", None, "bfloat16", False)
    assert p.gpu_features == ("bf16", "fp8") and "CPU" in p.cuda_only and p.training_args == {"bf16": True}
    assert p.fp8.package == ("transformer_engine" if name.startswith("fp8-te-") else "torchao") and not p.default_grid


def test_bf16_training_arguments_still_mean_bf16_amp_and_transformer_engine_is_te_hybrid():
    assert precision_of_training_args({"bf16": True}) == "bf16-amp"
    assert ALIASES["dtype"]["bf16-mixed"] == "bf16-amp" and ALIASES["dtype"]["transformer-engine"] == "fp8-te-hybrid"


def test_an_8bit_optimizer_recommends_its_transformers_optim_and_the_class_for_a_custom_loop():
    config = {"dtype": "bf16-amp", "attn": "sdpa", "compile": "off", "optimizer": "bnb-adamw8bit"}
    rec = recommendation(config, Recipe(), Recipe(), [])
    assert rec["training_arguments"]["optim"] == "adamw_bnb_8bit" and rec["training_arguments"]["bf16"] is True
    assert rec["command"] == "nandoctor check --dtype bf16-amp --attn sdpa --compile off --optimizer bnb-adamw8bit"
    assert any(
        line.startswith("optimizer = bitsandbytes.optim.AdamW8bit(model.parameters(), lr=0.001")
        for line in rec["python"]
    )
    plain = recommendation({**config, "optimizer": "adamw"}, Recipe(), Recipe(), [])
    assert plain["training_arguments"]["optim"] == "adamw_torch"  # what the probe ran, not transformers' fused default
    assert all(o.transformers_optim for o in OPTIMIZERS.values() if o.split is None)  # muon: Trainer(optimizers=)


def test_an_fp8_cell_recommends_the_users_own_conversion_code_and_its_lightning_string():
    rec = recommendation({"dtype": "fp8-rowwise", "attn": "sdpa", "compile": "inductor"}, Recipe(), Recipe(), [])
    assert any(
        line.startswith('convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise")')
        for line in rec["python"]
    )
    assert rec["lightning"]["precision"] == "bf16-mixed" and rec["training_arguments"]["bf16"] is True
    recipe = set_field(Recipe(), "fp8.amax_history_len", "16")
    te = recommendation({"dtype": "fp8-te-e4m3", "attn": "sdpa", "compile": "off"}, recipe, recipe, [])
    assert te["lightning"]["precision"] == "transformer-engine"
    assert any('Format.E4M3, amax_history_len=16, amax_compute_algo="max"' in line for line in te["python"])


def spec(cell: Cell, recipe: Recipe | None = None) -> dict:
    from nandoctor.record import ModelPlan

    plan = ModelPlan("architecture-twin", "full", "llama", 1, 1, 1, None, "why", {})
    return ProbeSpec(cell.id, recipe or Recipe(), cell, plan, 3, 0, "cpu", 1).to_dict()


def test_the_fp8_section_is_in_the_fingerprint_of_fp8_cells_only():
    short = set_field(Recipe(), "fp8.amax_history_len", "16")
    fp32, fp8 = Cell("fp32"), Cell("fp8-te-hybrid")
    assert probe_fingerprint(spec(fp32), {}, ENV) == probe_fingerprint(spec(fp32, short), {}, ENV)
    assert probe_fingerprint(spec(fp8), {}, ENV) != probe_fingerprint(spec(fp8, short), {}, ENV)


def test_a_cell_that_uses_a_package_is_fingerprinted_with_its_version():
    ao = Cell("fp32", optimizer="ao-adamw8bit")
    newer = {**ENV, "packages": {"torchao": {"importable": True, "version": "0.19.0"}}}
    assert probe_fingerprint(spec(ao), {}, ENV) != probe_fingerprint(spec(ao), {}, newer)
    assert probe_fingerprint(spec(Cell("fp32")), {}, ENV) == probe_fingerprint(spec(Cell("fp32")), {}, newer)
