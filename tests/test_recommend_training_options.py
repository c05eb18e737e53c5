"""The recommendation as code says how to train the user's rows the way the stable probe did: the
collator (DataCollatorWithFlattening and use_cache=False for packing, DataCollatorForLanguageModeling
otherwise), padding and truncation, gradient accumulation and how its loss is normalised, gradient
checkpointing, peft's modules_to_save and autocast_adapter_dtype, and the dtype the model is loaded in.
A recipe on the synthetic stream with none of them set prints what it always did
(tests/test_recommend_code.py). Pure."""

from nandoctor.cells import Cell
from nandoctor.config import Recipe, set_field
from nandoctor.recommend import recommendation

FIELDS = {
    "data.path": "chat.jsonl",
    "data.packing": "position_ids",
    "data.max_length": "128",
    "gradient_accumulation_steps": "4",
    "gradient_checkpointing": "non_reentrant",
    "adapter.type": "lora",
    "adapter.modules_to_save": "[lm_head]",
    "adapter.autocast_adapter_dtype": "false",
    "model.dtype_on_load": "bf16",
}


def recipe(**fields) -> Recipe:
    r = Recipe()
    for key, value in fields.items():
        r = set_field(r, key, value)
    return r.validate()


def recommended(cell="bf16-amp/sdpa/off", **fields) -> dict:
    r = recipe(**fields)
    return recommendation(Cell.parse(cell).to_dict(), r, r, [])


def test_a_packed_accumulated_checkpointed_lora_run_is_written_out_in_full():
    rec = recommended(**FIELDS)
    args = rec["training_arguments"]
    assert args["gradient_accumulation_steps"] == 4 and args["average_tokens_across_devices"] is True
    assert args["gradient_checkpointing"] is True and args["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    code = "\n".join(rec["python"])
    assert "gradient_checkpointing_kwargs={'use_reentrant': False}" in code
    assert "dtype=torch.bfloat16" in code  # the base loaded in bf16, autocast over it
    assert "LoraConfig(r=8, lora_alpha=16, target_modules=['q_proj', 'v_proj'], lora_dropout=0.0, " in code
    assert "use_dora=False, modules_to_save=['lm_head'])" in code
    assert "model = get_peft_model(model, lora_config, autocast_adapter_dtype=False)" in code
    assert "collator = DataCollatorWithFlattening()" in code and "model.config.use_cache = False" in code
    assert "max_length=128" in code and "num_items_in_batch" in code
    assert rec["data"] == {
        "collator": "DataCollatorWithFlattening",
        "packing": "position_ids",
        "padding_side": "right",
        "labels": "pad_id",
        "max_length": 128,
        "truncation_side": "right",
        "use_cache": False,
    }
    assert rec["training"] == {
        "gradient_accumulation_steps": 4,
        "loss_normalization": "tokens",
        "gradient_checkpointing": "non_reentrant",
        "dtype_on_load": "bf16",
        "modules_to_save": ["lm_head"],
        "autocast_adapter_dtype": False,
    }


def test_unpacked_rows_use_the_language_modeling_collator_with_their_padding_side():
    rec = recommended("fp32/sdpa/off", **{"data.path": "chat.jsonl", "data.padding_side": "left"})
    code = "\n".join(rec["python"])
    assert "tokenizer.padding_side, tokenizer.truncation_side = 'left', 'right'" in code
    assert "collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)" in code
    assert "DataCollatorWithFlattening" not in code and "use_cache" not in code
    assert rec["data"]["collator"] == "DataCollatorForLanguageModeling" and rec["data"]["use_cache"] is None


def test_per_micro_batch_normalisation_is_said_for_a_custom_loop():
    rec = recommended(**{"gradient_accumulation_steps": "2", "loss_normalization": "micro_batch"})
    assert "average_tokens_across_devices" not in rec["training_arguments"]
    assert any("each micro-batch's mean token loss / gradient_accumulation_steps" in line for line in rec["python"])


def test_the_synthetic_stream_names_no_collator():
    rec = recommended("fp32/sdpa/off")
    assert rec["data"] is None and not any("collator" in line for line in rec["python"])
