"""Axes, recipes and overrides: the user-facing validation, pure and fast."""

import pytest

from nandoctor.cells import Cell, parse_axis_flag
from nandoctor.config import Recipe, dotted_fields, get_field, recipe_from_dict, set_field
from nandoctor.errors import NandoctorError
from nandoctor.recipes import recipe_by_name, recipe_names, resolve_model


def test_axis_flag_parses_known_values():
    assert parse_axis_flag("dtype=bf16-amp,fp16-amp") == ("dtype", ["bf16-amp", "fp16-amp"])


@pytest.mark.parametrize(
    "flag, words",
    [
        ("dtype=bf17", "unknown dtype value 'bf17'"),
        ("precision=fp32", "unknown axis 'precision'"),
        ("attn", "expected NAME=V1,V2"),
    ],
)
def test_bad_axis_flags_name_what_is_valid(flag, words):
    with pytest.raises(NandoctorError, match=words) as e:
        parse_axis_flag(flag)
    assert "\n" not in str(e.value)


def test_set_field_types_the_value_like_its_default():
    r = set_field(Recipe(), "optimizer.eps", "1e-4")
    assert r.optimizer.eps == 1e-4 and isinstance(r.optimizer.eps, float)
    assert set_field(r, "model.trust_remote_code", "true").model.trust_remote_code is True
    assert set_field(r, "steps", "7").steps == 7
    assert get_field(r, "optimizer.eps") == 1e-4


def test_set_field_rejects_unknown_keys_and_bad_types():
    with pytest.raises(NandoctorError, match="unknown recipe field 'optimizer.epsilon'"):
        set_field(Recipe(), "optimizer.epsilon", "1")
    with pytest.raises(NandoctorError, match="cannot read 'abc' as int"):
        set_field(Recipe(), "steps", "abc")
    assert "optimizer.eps" in dotted_fields() and "grad_clip" in dotted_fields()


def test_recipe_rejects_unknown_keys_and_invalid_values():
    with pytest.raises(NandoctorError, match="unknown key 'optimizer.beta'"):
        recipe_from_dict({"optimizer": {"beta": 0.9}}, "r")
    with pytest.raises(NandoctorError, match="adapter.type='qlora' is not valid; valid: none, lora, dora"):
        recipe_from_dict({"adapter": {"type": "qlora"}}, "r")
    with pytest.raises(NandoctorError, match="steps must be > 0"):
        recipe_from_dict({"steps": 0}, "r")


def test_cell_parse_round_trips_and_validates():
    assert Cell.parse("bf16-amp/sdpa:flash/off") == Cell("bf16-amp", "sdpa:flash", "off")
    with pytest.raises(NandoctorError):
        Cell.parse("bf16-amp/sdpa")


def test_shipped_recipes_all_load():
    assert {"tiny-llama", "llama-3.1-8b", "gpt2", "mistral-7b", "qwen2.5-7b", "gemma-2-2b"} <= set(recipe_names())
    llama = recipe_by_name("llama-3.1-8b")
    arch = llama.model.arch
    assert (
        arch["hidden_size"],
        arch["num_hidden_layers"],
        arch["num_attention_heads"],
        arch["num_key_value_heads"],
        arch["intermediate_size"],
        arch["vocab_size"],
    ) == (4096, 32, 32, 8, 14336, 128256)
    assert arch["rope_parameters"]["rope_type"] == "llama3" and arch["rope_parameters"]["rope_theta"] == 500000.0
    assert (llama.adapter.type, llama.adapter.r, llama.adapter.alpha) == ("dora", 32, 64)
    assert llama.steps >= 50


def test_unknown_model_lists_the_valid_kinds():
    with pytest.raises(NandoctorError, match="unknown model 'llama-9'.*tiny-llama.*local checkpoint directory"):
        resolve_model("llama-9")


def test_hub_id_not_in_cache_is_refused_without_download():
    with pytest.raises(NandoctorError, match="not in the local Hugging Face cache"):
        resolve_model("someone/not-a-cached-model")


def test_lightning_precision_names_are_dtype_aliases():
    from nandoctor.cells import Cell, parse_axis_values

    assert parse_axis_values("dtype", "32-true,bf16-mixed,16-mixed,bf16-true,16-true") == [
        "fp32",
        "bf16-amp",
        "fp16-amp",
        "bf16-pure",
        "fp16-pure",
    ]
    assert Cell.parse("bf16-mixed/sdpa/off") == Cell("bf16-amp", "sdpa", "off")
    assert recipe_from_dict({"axes": {"dtype": ["16-mixed"]}}, "r").axes == {"dtype": ["16-mixed"]}
    with pytest.raises(NandoctorError, match="or Lightning's 32-true, bf16-mixed"):
        parse_axis_values("dtype", ["64-true"])
