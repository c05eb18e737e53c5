"""The recommendation trains what was probed: its printed `nandoctor check` command runs as printed (the
data and tokenizer included), its collator is the packing that was probed, its TRL setting labels the
same tokens as the probe (checked against transformers' own assistant mask, on a real tokenizer with
and without `{% generation %}` marks), and the special-token table counts the chat template's turn
tokens and the generation config's eos ids."""

import json
import shlex

import pytest
from checkpoints import save_llama
from conftest import run_cli, run_main, summary
from userdata_fixtures import (
    CHAT_TEMPLATE,
    CHATML_GENERATION_TEMPLATE,
    CHATML_TEMPLATE,
    chat_rows,
    save_chat_tokenizer,
    sentence,
    write_jsonl,
)

from nandoctor.config import recipe_from_dict
from nandoctor.doctor import data_lint
from nandoctor.models import model_config
from nandoctor.recipes import resolve_model
from nandoctor.recommend import recommendation
from nandoctor.userdata.encode import IGNORE
from nandoctor.userdata.rows import encoded_rows

# CHAT_TEMPLATE with each assistant turn's content and end-of-turn inside {% generation %} marks, as
# TRL's own templates mark them
MARKED_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}</s>"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# CHATML_TEMPLATE marked as transformers' own test of return_assistant_tokens_mask marks it (and training code
# copies): the content and <|im_end|> inside, the newline that ends the turn outside
CHATML_NEWLINE_OUTSIDE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ONE_CELL = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off")


def completion_recipe(tmp_path, template: str):
    tmp_path.mkdir(exist_ok=True)
    tok = save_chat_tokenizer(tmp_path / "tok", template=template)
    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12, turns=2))
    data = {"source": "file", "path": str(rows), "tokenizer": str(tok), "labels": "completion_only", "max_length": 256}
    return recipe_from_dict({"data": data}, "r")


def advice(recipe) -> list[str]:
    lint = json.loads(json.dumps(data_lint(recipe)))  # as run.json holds it
    cell = {"dtype": "fp32", "attn": "sdpa", "compile": "off"}
    return recommendation(cell, recipe, recipe, ["--model", "tiny-llama"], lint)["python"]


def transformers_masks(recipe) -> tuple[list, list]:
    """(the probe's supervised flags, transformers' assistant mask) per row, as TRL's assistant_only_loss
    reads it: apply_chat_template(return_assistant_tokens_mask=True)."""
    encoded = encoded_rows(recipe, model_config(resolve_model(None)))
    rows = [json.loads(line) for line in open(recipe.data.path)]
    probed, theirs = [], []
    for i, row in enumerate(rows):
        labels = encoded.rows[i]["labels"]
        probed.append([t != IGNORE for t in labels])
        out = encoded.tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(out["input_ids"]) == encoded.rows[i]["input_ids"]
        theirs.append([bool(m) for m in out["assistant_masks"]])
    return probed, theirs


def test_a_template_with_generation_marks_gets_assistant_only_loss_and_it_gives_the_probes_mask(tmp_path):
    recipe = completion_recipe(tmp_path, MARKED_TEMPLATE)
    probed, theirs = transformers_masks(recipe)
    assert theirs == probed and any(any(m) for m in probed)
    lines = advice(recipe)
    assert lines[0].startswith("args = trl.SFTConfig(") and "assistant_only_loss=True)  # " in lines[0], lines


def test_a_template_without_generation_marks_is_told_what_to_add(tmp_path):
    recipe = completion_recipe(tmp_path, CHAT_TEMPLATE)
    probed, theirs = transformers_masks(recipe)
    assert not any(any(m) for m in theirs) and all(any(m) for m in probed)  # transformers: all zeros
    lines = advice(recipe)
    assert lines[0].startswith("args = TrainingArguments("), lines  # no TRL setting that trains nothing
    (said,) = [line for line in lines if "assistant_only_loss" in line]
    assert "no {% generation %} marks" in said and "completion_only_loss=True" in said


def test_a_chatml_template_without_marks_is_told_the_marks_that_give_the_probes_mask(tmp_path):
    unmarked = completion_recipe(tmp_path / "unmarked", CHATML_TEMPLATE)
    (said,) = [line for line in advice(unmarked) if "assistant_only_loss" in line]
    assert "{% generation %} right after '<|im_start|>assistant\\n'" in said, said
    assert "{% endgeneration %} right after '<|im_end|>\\n'" in said, said
    probed, _ = transformers_masks(unmarked)
    _, advised = transformers_masks(completion_recipe(tmp_path / "advised", CHATML_GENERATION_TEMPLATE))
    assert advised == probed  # the marks as the advice places them: TRL's mask is the probe's, token for token

    # marks before the newline that ends the turn: that newline, after each assistant turn's <|im_end|>, is the
    # one difference (12 chats of 2 assistant turns)
    outside = completion_recipe(tmp_path / "outside", CHATML_NEWLINE_OUTSIDE)
    _, theirs = transformers_masks(outside)
    encoded = encoded_rows(outside, model_config(resolve_model(None)))
    missed = [
        encoded.tokenizer.convert_ids_to_tokens(row["input_ids"][j - 1 : j + 1])
        for row, p, t in zip(encoded.rows, probed, theirs)
        for j in range(len(p))
        if p[j] != t[j]
    ]
    assert missed == [["<|im_end|>", "Ċ"]] * 24, missed


@pytest.mark.slow
def test_the_grids_printed_command_runs_and_its_collator_is_the_probed_block_mask(tmp_path):
    ckpt = save_llama(tmp_path / "ckpt", use_cache=False)  # no tokenizer of its own: --tokenizer is needed
    tok = save_chat_tokenizer(tmp_path / "tok")
    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    out = tmp_path / "run"
    args = ("--model", ckpt, "--data", rows, "--tokenizer", tok, *ONE_CELL, "--steps", "2")
    args += ("--set", "data.packing=block_mask", "--set", "retime_rounds=0", "--jobs", "1")
    grid = run_cli("grid", *args, "--out", out)
    assert grid.returncode == 0, grid.stdout + grid.stderr
    (rec,) = summary(out)["recommendation"]
    assert rec["data"]["collator"] == "DataCollatorWithFlattening + a 4-D block-diagonal attention_mask"
    assert any("batch['attention_mask'] = torch.zeros(keep.shape" in line for line in rec["python"])
    assert rec["command"] in grid.stdout  # the command the user reads

    words = shlex.split(rec["command"])
    assert words[:2] == ["nandoctor", "check"]
    check = run_cli(*words[1:], "--out", tmp_path / "check")
    assert check.returncode in (0, 1), check.stdout + check.stderr  # run as printed: never a usage error (2)
    assert "check fp32/sdpa/off" in check.stdout


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def save_llama3_checkpoint(path):
    """A tiny Llama beside a tokenizer laid out like Llama 3 Instruct's: <|eot_id|> ends each turn and is
    a special added token, but not the tokenizer's eos (<|end_of_text|>) nor one of its named specials;
    generation_config.json lists both as eos ids."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    save_llama(path, use_cache=False)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=LLAMA3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(0)
    core.train_from_iterator([sentence(rng, 12) for _ in range(400)], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", chat_template=LLAMA3_TEMPLATE
    )
    tok.save_pretrained(path)
    eot, end = tok.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert eot not in tok.all_special_ids  # what the table counted alone before
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [end, eot]}))
    return path


def test_a_llama3_chats_turn_token_is_in_the_special_token_table(tmp_path):
    ckpt = save_llama3_checkpoint(tmp_path / "ckpt")
    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    proc = run_main("doctor", "--data", rows, "--model", ckpt, "--set", "data.max_length=200", "--json", *ONE_CELL[:4])
    assert proc.returncode in (0, 1), proc.stderr
    table = {s["token"]: s for s in json.loads(proc.stdout)["data"]["special_tokens"]}
    eot = table["'<|eot_id|>'"]
    assert eot["content"] == 16  # each of 8 chats: a user and an assistant turn, each ended by <|eot_id|>
    assert eot["targets"] == 16  # labels=pad_id: every token a target
    assert "'<|start_header_id|>'" in table and "'<|end_of_text|>'" in table


def test_the_block_mask_code_builds_the_mask_the_probe_trained_with():
    import types

    import torch
    from transformers import DataCollatorWithFlattening

    from nandoctor.recommend import PACKED_CODE
    from nandoctor.userdata.collate import block_mask

    scope = {
        "torch": torch,
        "DataCollatorWithFlattening": DataCollatorWithFlattening,
        "model": types.SimpleNamespace(dtype=torch.bfloat16),
    }
    exec("\n".join(PACKED_CODE["block_mask"]), scope)  # as pasted
    batch = scope["collator"]([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 2, 3, 4]}])
    position_ids = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])  # three rows packed into one
    assert torch.equal(batch["position_ids"][0], position_ids)
    assert torch.equal(batch["attention_mask"], block_mask(position_ids, torch.bfloat16))


def test_generation_marks_that_differ_from_the_probed_mask_are_named():
    from nandoctor.recommend import completion_setting

    check = {"generation_marks": True, "rows_checked": 32, "rows_differing": 5, "first_differing": 3}
    setting, said = completion_setting({"source": {"kind": "messages"}, "assistant_mask": check})
    assert setting is None and "differ from the probed mask" in said and "in 5 of 32" in said
    assert completion_setting({"source": {"kind": "prompt_completion"}})[0] == {"completion_only_loss": True}
