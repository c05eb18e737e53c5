"""Axes, recipes and overrides: the user-facing validation, pure and fast."""

from pathlib import Path

import pytest
from conftest import run_main

from nandoctor.cells import Cell, parse_axis_flag
from nandoctor.cli import build_parser
from nandoctor.cli.args import recipe_from_args
from nandoctor.config import Recipe, dotted_fields, get_field, recipe_from_dict, set_field
from nandoctor.errors import NandoctorError
from nandoctor.executors import executor_config
from nandoctor.recipes import load_recipe, recipe_by_name, recipe_names, resolve_model


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


def test_set_field_types_the_value_by_its_field():
    r = set_field(Recipe(), "optimizer.eps", "1e-4")
    assert r.optimizer.eps == 1e-4 and isinstance(r.optimizer.eps, float)
    assert set_field(r, "model.trust_remote_code", "true").model.trust_remote_code is True
    assert set_field(r, "steps", "7").steps == 7
    assert get_field(r, "optimizer.eps") == 1e-4


@pytest.mark.parametrize("text", ["0.9,0.95", "[0.9, 0.95]", "[0.9,0.95]"])
def test_set_betas_as_a_list_gives_a_tuple_of_floats(text):
    betas = set_field(Recipe(), "optimizer.betas", text).optimizer.betas
    assert betas == (0.9, 0.95) and all(type(b) is float for b in betas)


@pytest.mark.parametrize(
    "key, text, value",
    [
        ("model.hub_id", "org/model", "org/model"),  # a None default: typed by its annotation, str | None
        ("data.path", "null", None),
        ("model.path", "", None),
        ("adapter.type", "none", "none"),  # a plain str field keeps the text as written
        ("adapter.target_modules", "q_proj,v_proj,o_proj", ("q_proj", "v_proj", "o_proj")),
        ("adapter.target_modules", "[q_proj]", ("q_proj",)),
        ("adapter.modules_to_save", "[]", ()),
        ("model.trust_remote_code", "yes", True),
        ("pad_token.mask_labels", "false", False),
        ("grad_clip", "0", 0.0),
        ("axes", "{compile: [off], dtype: [fp32, bf16-amp]}", {"compile": ["off"], "dtype": ["fp32", "bf16-amp"]}),
        ("model.arch", "{hidden_size: 64, rms_norm_eps: 1e-6}", {"hidden_size": 64, "rms_norm_eps": 1e-6}),
    ],
)
def test_set_reads_the_value_as_yaml_typed_by_the_annotation(key, text, value):
    got = get_field(set_field(Recipe(), key, text), key)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "key, text, words",
    [
        ("steps", "abc", "steps must be an integer, got 'abc'"),
        ("optimizer.betas", "0.9", "optimizer.betas must be a list of 2 numbers, got [0.9]"),
        ("optimizer.betas", "0.9,abc", "optimizer.betas must be a list of 2 numbers, got [0.9, 'abc']"),
        ("model.trust_remote_code", "maybe", "model.trust_remote_code must be true or false, got 'maybe'"),
        ("model.arch", "[1, 2]", "model.arch must be a mapping, got [1, 2]"),
        ("adapter.target_modules", "[q_proj, [v]]", "adapter.target_modules must be a list of strings"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_field_and_its_type(key, text, words):
    with pytest.raises(NandoctorError) as e:
        set_field(Recipe(), key, text)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_set_field_rejects_unknown_keys_with_the_closest_one():
    with pytest.raises(NandoctorError, match="unknown recipe field 'optimizer.epsilon'; did you mean optimizer.eps?"):
        set_field(Recipe(), "optimizer.epsilon", "1")
    assert "optimizer.eps" in dotted_fields() and "grad_clip" in dotted_fields()


def test_a_recipe_file_and_set_type_alike(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "optimizer:\n  betas: [0.9, 0.95]\n  eps: 1e-6\n"
        "gradient_checkpointing: off\naxes:\n  compile: [off]\nadapter:\n  modules_to_save: [lm_head]\n"
    )
    recipe = load_recipe(path)
    assert recipe.optimizer.betas == (0.9, 0.95) and recipe.optimizer.eps == 1e-6
    assert recipe.gradient_checkpointing == "off" and recipe.axes == {"compile": ["off"]}  # YAML 1.2: off is text
    assert recipe.adapter.modules_to_save == ("lm_head",)
    from_set = Recipe(name="r")
    for key, text in [
        ("optimizer.betas", "0.9,0.95"),
        ("optimizer.eps", "1e-6"),
        ("gradient_checkpointing", "off"),
        ("axes", "{compile: [off]}"),
        ("adapter.modules_to_save", "lm_head"),
    ]:
        from_set = set_field(from_set, key, text)
    assert from_set == recipe


def test_new_training_fields_default_to_todays_behaviour_and_are_validated():
    r = Recipe()
    assert (r.gradient_accumulation_steps, r.loss_normalization, r.gradient_checkpointing) == (1, "tokens", "off")
    assert (r.adapter.modules_to_save, r.adapter.autocast_adapter_dtype) == ((), True)
    r = set_field(set_field(r, "gradient_accumulation_steps", "4"), "gradient_checkpointing", "non_reentrant")
    r = set_field(set_field(r, "loss_normalization", "micro_batch"), "adapter.autocast_adapter_dtype", "false")
    assert r.validate() == r and r.adapter.autocast_adapter_dtype is False
    with pytest.raises(NandoctorError, match="gradient_accumulation_steps must be > 0"):
        set_field(Recipe(), "gradient_accumulation_steps", "0").validate()
    with pytest.raises(NandoctorError, match="loss_normalization='token' is not valid; did you mean tokens?"):
        set_field(Recipe(), "loss_normalization", "token").validate()
    with pytest.raises(NandoctorError, match="valid: off, reentrant, non_reentrant"):
        set_field(Recipe(), "gradient_checkpointing", "on").validate()


def test_a_bad_set_value_is_one_line_exit_2_naming_the_field_and_its_type():
    proc = run_main("doctor", "--model", "tiny-llama", "--set", "optimizer.betas=0.9,abc")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "nandoctor: error: --set optimizer.betas=0.9,abc: optimizer.betas must be a list of 2 numbers, got [0.9, 'abc']"
    ]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--axis", "dtype=bf16amp"], "unknown dtype value 'bf16amp'; did you mean bf16-amp? valid: fp32, tf32"),
        (["--axis", "dtypes=fp32"], "unknown axis 'dtypes'; did you mean dtype? valid axes: dtype, attn"),
        (["--set", "optimizer.epsilon=1"], "unknown recipe field 'optimizer.epsilon'; did you mean optimizer.eps?"),
        (["--set", "gradient_checkpointing=reentrnt"], "is not valid; did you mean reentrant? valid: off, reentrant"),
    ],
)
def test_a_mistyped_name_is_one_line_exit_2_with_the_closest_valid_one(args, words):
    proc = run_main("doctor", "--model", "tiny-llama", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr


def test_a_mistyped_model_name_is_one_line_exit_2_naming_the_closest_recipes():
    proc = run_main("grid", "--model", "lama-3.1-8b")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "unknown model 'lama-3.1-8b'; did you mean llama-3.1-8b or llama-3.2-3b? valid: a recipe name" in lines[0]


@pytest.mark.parametrize("command", ["grid", "bisect"])
@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_is_validated_by_the_parser_of_every_command_that_has_it(command, jobs):
    with pytest.raises(NandoctorError, match=f"argument --jobs: must be > 0, got {jobs}"):
        build_parser().parse_args([command, "--jobs", jobs])
    assert build_parser().parse_args([command, "--jobs", "3"]).jobs == 3


def test_a_negative_retries_is_refused_in_one_line():
    with pytest.raises(NandoctorError, match="retries must be >= 0") as e:
        executor_config("slurm", ["retries=-1"])
    assert "\n" not in str(e.value)
    assert executor_config("ray", ["retries=0"]).option("retries") == 0


@pytest.mark.parametrize("command", ["grid", "check", "bisect", "doctor"])
def test_data_flag_sets_the_recipes_data_file(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("rows.txt").write_text("some text " * 20)
    recipe = recipe_from_args(build_parser().parse_args([command, "--model", "tiny-llama", "--data", "rows.txt"]))
    assert (recipe.data.source, recipe.data.path) == ("file", str(tmp_path / "rows.txt"))


def test_relative_paths_given_by_set_or_a_recipe_file_are_made_absolute(tmp_path, monkeypatch):
    # issue 34: only --data was resolved; a --set data.path or a recipe's own relative path reached the
    # probes (another working directory: a worker's, a node's) and run.json as the user wrote it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes" / "data").mkdir(parents=True)
    recipe_file = tmp_path / "recipes" / "mine.yaml"
    recipe_file.write_text("model: {arch: {model_type: llama}}\ndata: {path: data/rows.jsonl, tokenizer: ../tok}\n")
    mine = load_recipe(recipe_file)
    assert (mine.data.path, mine.data.tokenizer) == (
        str(tmp_path / "recipes" / "data" / "rows.jsonl"),
        str(tmp_path / "tok"),
    )
    args = ["grid", "--model", "tiny-llama", "--set", "data.path=rows.jsonl", "--set", "model.path=ckpt/"]
    recipe = recipe_from_args(build_parser().parse_args(args))
    assert (recipe.data.path, recipe.model.path) == (str(tmp_path / "rows.jsonl"), str(tmp_path / "ckpt"))
    home = recipe_from_args(build_parser().parse_args(["grid", "--set", "data.path=~/rows.jsonl"]))
    assert home.data.path == str(Path.home() / "rows.jsonl")


@pytest.mark.parametrize("command", ["grid", "check", "bisect", "doctor"])
def test_tokenizer_flag_sets_the_recipes_tokenizer(command, tmp_path):
    args = build_parser().parse_args([command, "--model", "tiny-llama", "--tokenizer", str(tmp_path)])
    assert recipe_from_args(args).data.tokenizer == str(tmp_path)


def test_recipe_rejects_unknown_keys_and_invalid_values():
    with pytest.raises(NandoctorError, match="unknown key 'optimizer.beta'; did you mean optimizer.betas?"):
        recipe_from_dict({"optimizer": {"beta": 0.9}}, "r")
    with pytest.raises(NandoctorError, match="unknown key 'optimiser'; did you mean optimizer?"):
        recipe_from_dict({"optimiser": {"lr": 1e-3}}, "r")
    with pytest.raises(NandoctorError, match="adapter.type='qlora' is not valid; did you mean lora"):
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
