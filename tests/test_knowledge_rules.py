"""Every known-issue rule fires on a setup that has the problem and stays silent on one that does
not. Setups are real: recipes, cells, TrainingArguments dicts, tokenizers built with `tokenizers`,
model configs from transformers; the facts come from nandoctor's own fact gathering."""

import pytest
from checkpoints import save_tokenizer
from parallel_records import PARALLEL_CASES

from nandoctor.analysis.verdicts import judged_facts
from nandoctor.cells import Cell
from nandoctor.config import Recipe, set_field
from nandoctor.data import all_masked_batches
from nandoctor.knowledge import evaluate, rule_by_id, rules
from nandoctor.knowledge.facts import env_facts, observed_facts, setup_facts, trainer_cell
from nandoctor.models import model_config
from nandoctor.recipes import recipe_by_name
from nandoctor.record import ProbeRecord, Step
from nandoctor.userdata.tokenizer import load_tokenizer

CPU = {"device": "cpu", "gpus": [], "cudnn": None}


def scaled(scales):
    """A probe record whose steps ran at these (loss scale, skipped) pairs."""
    return ProbeRecord(
        "fp16-amp/sdpa/off", Cell("fp16-amp"), steps=[Step(i, 8.0, 1.0, k, s) for i, (s, k) in enumerate(scales)]
    )


TINY = recipe_by_name("tiny-llama")


def gpu(cc: str, cudnn: int = 90300) -> dict:
    return {
        "device": "cuda",
        "gpus": [{"index": 0, "name": "test", "capability": cc, "memory_bytes": 16 << 30}],
        "cudnn": cudnn,
    }


def recipe(**fields) -> Recipe:
    r = TINY
    for key, value in fields.items():
        r = set_field(r, key.replace("__", "."), value)
    return r.validate()


def facts(
    recipe_=TINY, cell="fp32/sdpa/off", env=CPU, trainer_args=None, tokenizer=None, config=None, eager=False, **extra
):
    c = trainer_cell(trainer_args) if trainer_args and cell is None else Cell.parse(cell)
    return {**env_facts(env), **setup_facts(recipe_, c, config, trainer_args, tokenizer, eager), **extra}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = tmp_path_factory.mktemp("tokenizers")
    return {
        name: load_tokenizer(save_tokenizer(base / name, **special))
        for name, special in {
            "no-pad": {},
            "pad-id0": {"pad_token": "!"},
            "pad-eos": {"pad_token": "<|end_of_text|>"},
            "dedicated": {"pad_token": "<pad>"},
        }.items()
    }


def gemma2():
    return model_config(recipe_by_name("gemma-2-2b"))


def masked_file_recipe(tmp_path):
    path = tmp_path / "zeros.jsonl"
    path.write_text('{"input_ids": [0, 0, 0, 0, 0, 0, 0, 0]}\n' * 16)  # every token 0: the pad id under policy id0
    return recipe(data__source="file", data__path=str(path), pad_token__policy="id0")


def routed(name_or_config, cell="fp32/sdpa/off", **fields):
    """The setup facts of a mixture of experts: a recipe (with `fields` set) or a transformers config
    trained by the default recipe, through models.router_facts as the doctor gathers them."""
    from nandoctor.knowledge.facts import router_setup_facts
    from nandoctor.models import router_facts

    r = recipe(**fields)
    if isinstance(name_or_config, str):
        r = recipe_by_name(name_or_config)
        for key, value in fields.items():
            r = set_field(r, key.replace("__", "."), value)
        config = model_config(r)
    else:
        config = name_or_config
    return facts(r, cell, model_type=config.model_type, **router_setup_facts(router_facts(config, r)))


def moe_config(model_type, **kwargs):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kwargs)


def routing_record(no_token: int, rows: int = 256):
    """A record of an 8-expert top-2 router whose layer 0 left `no_token` experts without a token."""
    tokens = [2 * rows // (8 - no_token)] * (8 - no_token) + [0] * no_token
    at = {"step": 3, "tokens": tokens, "no_token": no_token, "rows": rows, "largest_share": max(tokens) / rows}
    moe = {"experts": 8, "top_k": 2, "layers": [{"layer": 0, "module": "model.layers.0.mlp.gate", "step_last": at}]}
    return ProbeRecord("fp32/sdpa/off", Cell("fp32"), steps=[Step(0, 7.0, 1.0)], moe=moe)


# packed by position_ids alone, nothing else passed, the segments alone exact against fp32 (packing_floor)
BY_POSITIONS = {"packing_cause": "position_ids alone, as collated", "packing_floor": 0.0, "packing_segments": 2}


def layer(kind: str, later: float) -> dict:
    """One layer of measure.packing_isolation's packing_layers: rounding on the first segment, `later` past it."""
    return {"layer": 0, "kind": kind, "first_segment": 2e-7, "later_segments": later}


MOE_CASES = {
    "moe-load-balancing-off": (
        lambda t, p: routed("qwen3-30b-a3b"),
        lambda t, p: routed("qwen3-30b-a3b", moe__aux_loss="on"),
    ),
    "moe-aux-loss-on-aux-free-family": (
        lambda t, p: routed(moe_config("deepseek_v3", router_aux_loss_coef=0.001)),
        lambda t, p: routed(moe_config("deepseek_v3")),
    ),
    "moe-aux-loss-llama4": (
        lambda t, p: routed(moe_config("llama4_text"), moe__aux_loss="on"),
        lambda t, p: routed(moe_config("llama4_text")),
    ),
    "moe-mxfp4-weights": (
        lambda t, p: routed(moe_config("gpt_oss", quantization_config={"quant_method": "mxfp4"})),
        lambda t, p: routed(moe_config("gpt_oss")),
    ),
    "moe-expert-collapse": (
        lambda t, p: judged_facts(routing_record(no_token=6)),
        lambda t, p: judged_facts(routing_record(no_token=1)),
    ),
    "moe-fp32-router-for-low-precision": (
        lambda t, p: routed("mixtral-8x7b", cell="bf16-amp/sdpa/off"),
        lambda t, p: routed("mixtral-8x7b", cell="bf16-amp/sdpa/off", moe__router_dtype="fp32"),
    ),
    "packing-linear-attention-fallback-leaks": (
        lambda t, p: judged_facts(
            checked(
                {"packing_layers": [layer("linear_attention", 0.115)], "packing_max_logit_diff": 0.115, **BY_POSITIONS}
            )
        ),
        lambda t, p: judged_facts(
            checked(
                {"packing_layers": [layer("linear_attention", 2e-7)], "packing_max_logit_diff": 2e-7, **BY_POSITIONS}
            )
        ),
    ),
    "packing-attention-layer-ignores-position-ids": (
        lambda t, p: judged_facts(
            checked(
                {"packing_layers": [layer("sliding_attention", 0.95)], "packing_max_logit_diff": 0.95, **BY_POSITIONS}
            )
        ),
        lambda t, p: judged_facts(
            checked(
                {"packing_layers": [layer("sliding_attention", 0.95)], "packing_max_logit_diff": 3e-7, **BY_POSITIONS}
            )
        ),
    ),
    "gemma3-token-type-ids": (
        lambda t, p: facts(model_type=moe_config("gemma3").model_type),
        lambda t, p: facts(model_type=model_config(recipe_by_name("gemma-3-4b")).model_type),
    ),
}

CASES = {  # rule id: (a setup with the problem, a setup without it); each a function of (tokenizers, tmp_path)
    "no-native-bf16": (
        lambda t, p: facts(cell="bf16-amp/sdpa/off", env=gpu("7.5")),
        lambda t, p: facts(cell="fp16-amp/sdpa/off", env=gpu("7.5")),
    ),
    "bf16-weights-with-fp16-grad-scaler": (
        lambda t, p: facts(recipe(model__dtype_on_load="bf16"), cell=None, trainer_args={"fp16": True}),
        lambda t, p: facts(recipe(model__dtype_on_load="bf16"), cell=None, trainer_args={"bf16": True}),
    ),
    "fp16-weights-with-grad-scaler": (
        lambda t, p: facts(recipe(model__dtype_on_load="fp16"), cell="fp16-amp/sdpa/off"),
        lambda t, p: facts(recipe(model__dtype_on_load="fp32"), cell="fp16-amp/sdpa/off"),
    ),
    "bf16-weights-without-fp32-master": (
        lambda t, p: facts(cell="bf16-pure/sdpa/off"),
        lambda t, p: facts(cell="bf16-amp/sdpa/off"),
    ),
    "cudnn-sdpa-before-9.3": (
        lambda t, p: facts(cell="bf16-amp/sdpa:cudnn/off", env=gpu("9.0", cudnn=90100)),
        lambda t, p: facts(cell="bf16-amp/sdpa:cudnn/off", env=gpu("9.0", cudnn=90300)),
    ),
    "flash-attention-2-with-softcapping": (
        lambda t, p: facts(recipe_by_name("gemma-2-2b"), cell="bf16-amp/flash_attention_2/off", config=gemma2()),
        lambda t, p: facts(recipe_by_name("gemma-2-2b"), cell="bf16-amp/eager/off", config=gemma2()),
    ),
    "efficient-sdpa-with-padding": (
        lambda t, p: facts(recipe(data__pad_fraction="0.25"), cell="bf16-amp/sdpa:efficient/off"),
        lambda t, p: facts(recipe(data__pad_fraction="0.0"), cell="bf16-amp/sdpa:efficient/off"),
    ),
    "device-map-auto-for-training": (
        lambda t, p: facts(trainer_args={"model_init_kwargs": {"device_map": "auto"}}),
        lambda t, p: facts(trainer_args={"model_init_kwargs": {}}),
    ),
    "compile-before-eager-is-stable": (
        lambda t, p: facts(cell=None, trainer_args={"torch_compile": True}),
        lambda t, p: facts(cell="fp32/sdpa/inductor", eager=True),
    ),
    "tokenizer-without-pad-token": (
        lambda t, p: facts(tokenizer=t["no-pad"]),
        lambda t, p: facts(tokenizer=t["dedicated"]),
    ),
    "pad-token-is-id-0": (lambda t, p: facts(tokenizer=t["pad-id0"]), lambda t, p: facts(tokenizer=t["dedicated"])),
    "pad-equals-eos-with-masked-labels": (
        lambda t, p: facts(tokenizer=t["pad-eos"]),
        lambda t, p: facts(recipe(pad_token__mask_labels="false"), tokenizer=t["pad-eos"]),
    ),
    "schedule-free-saved-in-train-mode": (
        lambda t, p: facts(cell="fp32/sdpa/off/sf-adamw"),
        lambda t, p: facts(cell="fp32/sdpa/off/adamw"),
    ),
    "fp16-adamw-eps-below-smallest-normal": (
        lambda t, p: facts(recipe(optimizer__eps="1e-8"), cell="fp16-pure/sdpa/off"),
        lambda t, p: facts(recipe(optimizer__eps="1e-4"), cell="fp16-pure/sdpa/off"),
    ),
    "peft-adapters-not-fp32": (
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-pure/sdpa/off"),
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-amp/sdpa/off"),
    ),
    "batch-with-all-labels-masked": (
        lambda t, p: facts(all_masked_batches=all_masked_batches(masked_file_recipe(p), model_config(TINY))),
        lambda t, p: facts(all_masked_batches=all_masked_batches(TINY, model_config(TINY))),
    ),
    "trainer-bf16-and-fp16": (
        lambda t, p: facts(cell=None, trainer_args={"bf16": True, "fp16": True}),
        lambda t, p: facts(cell=None, trainer_args={"bf16": True, "fp16": False}),
    ),
    "trainer-nan-inf-filter-hides-nan": (
        lambda t, p: facts(trainer_args={"logging_nan_inf_filter": True}),
        lambda t, p: facts(trainer_args={"logging_nan_inf_filter": False}),
    ),
    "grad-scale-falls-below-1": (
        lambda t, p: observed_facts(scaled([(2.0, True), (1.0, True)])),
        lambda t, p: observed_facts(scaled([(65536.0, True), (32768.0, False)])),
    ),
    "gradients-all-zero": (
        lambda t, p: observed_facts(
            ProbeRecord("fp32/sdpa/off", Cell("fp32"), steps=[Step(i, 6.93, 0.0) for i in range(3)])
        ),
        lambda t, p: observed_facts(
            ProbeRecord("fp32/sdpa/off", Cell("fp32"), steps=[Step(0, 6.93, 0.0), Step(1, 6.9, 0.2)])
        ),
    ),
    "fp8-batch-tokens-not-multiple-of-16": (  # tiny-llama batches 4 sequences: 4 * 65 = 260 tokens
        lambda t, p: facts(recipe(seq_len="65"), cell="fp8-tensorwise/sdpa/off", env=gpu("9.0")),
        lambda t, p: facts(recipe(seq_len="64"), cell="fp8-tensorwise/sdpa/off", env=gpu("9.0")),
    ),
    "fp8-torchao-without-compile": (
        lambda t, p: facts(cell="fp8-rowwise/sdpa/off", env=gpu("9.0")),
        lambda t, p: facts(cell="fp8-rowwise/sdpa/inductor", env=gpu("9.0")),
    ),
    "fp8-rowwise-on-blackwell": (
        lambda t, p: facts(cell="fp8-rowwise/sdpa/off", env=gpu("12.0")),
        lambda t, p: facts(cell="fp8-rowwise/sdpa/off", env=gpu("9.0")),
    ),
    "packing-leaks-across-segments": (
        lambda t, p: judged_facts(checked({"packing_max_logit_diff": 0.77, "packing_floor": 0.0})),
        lambda t, p: judged_facts(checked({"packing_max_logit_diff": 2e-7, "packing_floor": 0.0})),
    ),
    "accumulation-normalised-per-micro-batch": (
        lambda t, p: judged_facts(checked({"accumulation_error": 1.18, "accumulation_floor": 0.0})),
        lambda t, p: judged_facts(checked({"accumulation_error": 8.9e-8, "accumulation_floor": 0.0})),
    ),
    "moe-balancing-loss-counted-per-micro-batch": (
        lambda t, p: judged_facts(checked(BALANCING_COUNTED_TWICE)),
        lambda t, p: judged_facts(checked({**BALANCING_COUNTED_TWICE, "accumulation_balancing_loss": None})),
    ),
    "fp16-overflow-on-trained-weights": (
        lambda t, p: facts(cell="fp16-amp/sdpa/off", model_type="gemma3_text"),
        lambda t, p: facts(cell="bf16-amp/sdpa/off", model_type="gemma3_text"),
    ),
    "trainable-group-without-gradient": (
        lambda t, p: judged_facts(grouped([{"adapter": None, "modules_to_save": 0.4}] * 3)),
        lambda t, p: judged_facts(grouped([{"adapter": 0.0, "modules_to_save": 0.4}, {"adapter": 0.1, "x": 1.0}])),
    ),
    # quantized bases (issue 36)
    "qlora-fp16-compute": (
        lambda t, p: facts(recipe(adapter__type="lora"), cell="fp16-amp/sdpa/off/nf4"),
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-amp/sdpa/off/nf4"),
    ),
    "kbit-prepare-upcasts-to-fp32": (
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-amp/sdpa/off/nf4"),
        lambda t, p: facts(recipe(adapter__type="lora", quant__prepare="false"), cell="bf16-amp/sdpa/off/nf4"),
    ),
    "kbit-prepare-switches-checkpointing-on": (
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-amp/sdpa/off/int8"),
        lambda t, p: facts(
            recipe(adapter__type="lora", gradient_checkpointing="non_reentrant"), cell="bf16-amp/sdpa/off/int8"
        ),
    ),
    "reentrant-checkpointing-with-adapters-across-ranks": (
        lambda t, p: facts(
            recipe(adapter__type="lora", gradient_checkpointing="reentrant"), cell="bf16-amp/sdpa/off/ddp"
        ),
        lambda t, p: facts(
            recipe(adapter__type="lora", gradient_checkpointing="non_reentrant"), cell="bf16-amp/sdpa/off/ddp"
        ),
    ),
    "fsdp-quant-storage-not-weights-dtype": (
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-pure/sdpa/off/fsdp2/nf4"),
        lambda t, p: facts(recipe(adapter__type="lora", quant__storage="bf16"), cell="bf16-pure/sdpa/off/fsdp2/nf4"),
    ),
    "merge-into-quantized-base": (
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-amp/sdpa/off/fp4"),
        lambda t, p: facts(recipe(adapter__type="lora"), cell="bf16-amp/sdpa/off"),
    ),
    "tied-embeddings-trained-through-modules-to-save": (
        lambda t, p: facts(recipe(adapter__type="lora", adapter__modules_to_save="lm_head"), tied_embeddings=True),
        lambda t, p: facts(recipe(adapter__type="lora", adapter__modules_to_save="lm_head"), tied_embeddings=False),
    ),
    **PARALLEL_CASES,
    **MOE_CASES,
}


# a tiny Qwen3-MoE's figures at 2 micro-batches with its balancing loss on (tests/test_moe_accumulation.py)
BALANCING_COUNTED_TWICE = {
    "accumulation_error": 3.8e-4,
    "accumulation_floor": 0.0,
    "loss_normalization": "tokens",
    "accumulation_balancing_loss": 0.001,
    "accumulation_groups": {"router": {"error": 0.122, "floor": 0.0}, "experts": {"error": 1.6e-4, "floor": 0.0}},
}


def checked(setup_checks: dict) -> ProbeRecord:
    """A probe record whose step-0 setup checks measured these figures."""
    return ProbeRecord("fp32/sdpa/off", Cell("fp32"), steps=[Step(0, 6.9, 1.0)], setup_checks=setup_checks)


def grouped(groups: list[dict]) -> ProbeRecord:
    """A probe record whose steps recorded these per-group gradient norms."""
    return ProbeRecord(
        "fp32/sdpa/off", Cell("fp32"), steps=[Step(i, 6.9 - i, 1.0, groups=g) for i, g in enumerate(groups)]
    )


KNOWN_ISSUES = ("environment", "setup", "probe")  # the scopes judged on facts (the data lint's and live: figures)


def test_every_rule_has_a_case_and_evidence():
    assert {r.id for r in rules(*KNOWN_ISSUES)} == set(CASES)
    assert all(r.evidence and r.fix and r.why for r in rules())


def fired(facts: dict, rule_id: str) -> bool:
    """Whether the rule fires on these facts in a scope it is judged in."""
    return any(rule_id in [r.id for r in evaluate(facts, s)] for s in rule_by_id(rule_id).scope)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_on_the_problem_and_not_without_it(rule_id, tokenizers, tmp_path):
    bad, good = CASES[rule_id]
    assert fired(bad(tokenizers, tmp_path), rule_id)
    assert not fired(good(tokenizers, tmp_path), rule_id)


def test_a_clean_cpu_setup_fires_nothing():
    assert evaluate({**env_facts(CPU), **setup_facts(TINY, Cell("fp32", "sdpa", "off"))}, "setup") == []
    assert evaluate(env_facts(CPU), "environment") == []


def test_unknown_facts_do_not_fire_comparisons():
    # precision unknown: still advised
    assert [r.id for r in evaluate({"gpu_capability": 7.5}, "environment")] == ["no-native-bf16"]
    assert evaluate({"cudnn_version": None, "attn": "sdpa:cudnn"}, "setup") == []


def test_a_rule_is_judged_only_in_its_scopes():
    leak = {"packing_leaks": True}
    assert [r.id for r in evaluate(leak, "probe")] == ["packing-leaks-across-segments"]
    assert evaluate(leak, "setup") == [] and evaluate({"rows_misaligned": 3}, "probe") == []
    assert [r.id for r in evaluate({"rows_misaligned": 3}, "data")] == ["completion-mask-misaligned"]


def test_peft_autocast_adapter_dtype_decides_the_dtype_the_adapter_trains_in():
    """peft keeps LoRA weights in fp32 over a half base unless autocast_adapter_dtype=False; its
    modules_to_save copies stay in the base's dtype either way (tests/test_training_options.py
    measures both on a built model)."""

    def fired(cell, **fields):
        r = recipe(adapter__type="lora", **fields)
        f = facts(r, cell=cell)
        return f["trainable_dtype"], {rule.id for rule in evaluate(f, "setup")}

    dtype, ids = fired("bf16-amp/sdpa/off", model__dtype_on_load="bf16")
    assert dtype == "fp32" and "peft-adapters-not-fp32" not in ids
    dtype, ids = fired("bf16-amp/sdpa/off", model__dtype_on_load="bf16", adapter__autocast_adapter_dtype="false")
    assert dtype == "bf16" and "peft-adapters-not-fp32" in ids
    dtype, ids = fired("fp16-amp/sdpa/off", model__dtype_on_load="fp16", adapter__autocast_adapter_dtype="false")
    assert dtype == "fp16" and "fp16-weights-with-grad-scaler" in ids
    assert "fp16-weights-with-grad-scaler" not in fired("fp16-amp/sdpa/off", model__dtype_on_load="fp16")[1]
    dtype, ids = fired("fp16-amp/sdpa/off", model__dtype_on_load="bf16", adapter__modules_to_save="[lm_head]")
    assert dtype == "bf16" and "bf16-weights-with-fp16-grad-scaler" in ids and "peft-adapters-not-fp32" not in ids


def test_planning_reads_no_rows_and_the_doctor_counts_masked_batches_on_the_lints_batches(tmp_path):
    # issue 34: the planning child encoded the whole file for this count (within its 300 s limit)
    from nandoctor.doctor import run_doctor
    from nandoctor.models import config_facts

    masked = masked_file_recipe(tmp_path)
    assert config_facts(masked)["all_masked_batches"] is None
    report = run_doctor(set_field(masked, "data.batches", 2), axes={"dtype": ["fp32"], "attn": ["eager"]})
    supervised = [b["supervised"] for b in report["data"]["batches"]]  # the first 2, then the worst ones
    assert len(supervised) >= 2 and set(supervised) == {0}
    assert "batch-with-all-labels-masked" in {f["id"] for f in report["findings"]}
