"""`nandoctor doctor --data`: each public case of issue 30 reproduced on real rows, a real tokenizer and
a real tiny Llama, found by the lint with its measured figure and its reference; exit 1 for an error
(a packing leak, rows with no supervised token, ids the model has no row for), 0 with warnings only."""

import json

import pytest
from checkpoints import save_llama
from conftest import run_cli, run_main
from userdata_fixtures import (
    LAST_TURN_TEMPLATE,
    chat_rows,
    prompt_completion_rows,
    save_chat_tokenizer,
    write_jsonl,
)

from nandoctor.userdata.tokenizer import load_tokenizer

ONE_CELL = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--json")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lint")
    return {
        "tok": save_chat_tokenizer(d / "tok"),
        "ckpt": save_llama(d / "ckpt"),  # config.use_cache=True, as a saved default config has it
        "ckpt_no_cache": save_llama(d / "ckpt-no-cache", use_cache=False),
        "chat": write_jsonl(d / "chat.jsonl", chat_rows(24)),
        "dir": d,
    }


def doctor(*args):
    proc = run_main("doctor", *map(str, args), *ONE_CELL)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    return proc.returncode, {f["id"]: f for f in report["findings"]}, report


def test_truncation_that_cuts_every_completion_is_an_error(files):
    rows = write_jsonl(files["dir"] / "long-prompts.jsonl", prompt_completion_rows(16, prompt_words=(30, 40)))
    args = ("--data", rows, "--model", files["ckpt_no_cache"], "--tokenizer", files["tok"])
    args += ("--set", "data.labels=completion_only", "--set", "data.max_length=24")
    code, found, report = doctor(*args)
    figure = found["rows-without-supervised-token"]["figure"]
    assert code == 1 and "16 of 16 rows have no label left" in figure and "16 lost every target to truncation" in figure
    assert "4 of 4 batches of 4 rows" in figure
    assert "https://github.com/huggingface/trl/issues/6668" in " ".join(
        found["rows-without-supervised-token"]["evidence"]
    )
    assert report["data"]["histograms"]["supervised"]["counts"][0] == 16
    code, found, _ = doctor(*args, "--set", "data.truncation_side=left")  # keeps the completion
    assert code == 0 and "rows-without-supervised-token" not in found


def test_chats_whose_last_answer_is_empty_are_a_warning(files):
    """Two of 12 chats end with an empty assistant turn (one blank, one whitespace); a third only calls a
    tool. Under a completion-only mask the empty turns still train their end-of-turn token: the lint names
    the two rows, warns (exit 0), and leaves the tool call alone."""
    rows = chat_rows(12, turns=2)
    rows[3]["messages"][-1]["content"] = ""
    rows[7]["messages"][-1]["content"] = "  \n"
    rows[9]["messages"][-1].update(content="", tool_calls=[{"type": "function", "function": {"name": "add"}}])
    path = write_jsonl(files["dir"] / "empty-answers.jsonl", rows)
    args = ("--data", path, "--tokenizer", files["tok"], "--set", "data.labels=completion_only")
    code, found, report = doctor(*args, "--set", "data.max_length=256")
    empty = found["rows-with-empty-answer"]
    assert code == 0 and empty["severity"] == "warning" and report["data"]["rows_without_supervised"] == 0
    assert (
        empty["figure"].startswith("2 of 12 rows end with an empty assistant turn") and "rows: 3, 7)" in empty["figure"]
    )
    assert "https://github.com/allenai/open-instruct/issues/161" in " ".join(empty["evidence"])
    code, found, _ = doctor("--data", files["chat"], "--tokenizer", files["tok"])
    assert "rows-with-empty-answer" not in found


def test_a_template_that_moves_the_last_turn_is_an_error(files):
    tok = save_chat_tokenizer(files["dir"] / "tok-last-turn", template=LAST_TURN_TEMPLATE)
    rows = write_jsonl(files["dir"] / "two-turns.jsonl", chat_rows(8, turns=2))
    code, found, _ = doctor(
        "--data", rows, "--model", files["ckpt_no_cache"], "--tokenizer", tok, "--set", "data.labels=completion_only"
    )
    assert code == 1 and "In 8 of 8 chats" in found["completion-mask-misaligned"]["figure"]
    code, found, _ = doctor(
        "--data",
        rows,
        "--model",
        files["ckpt_no_cache"],
        "--tokenizer",
        files["tok"],
        "--set",
        "data.labels=completion_only",
        "--set",
        "data.max_length=256",  # whole chats: nothing truncated
    )
    assert code == 0 and not found


def test_packing_is_measured_as_the_trainer_trains_and_a_2d_mask_beside_it_leaks(files):
    """The checkpoint's config says use_cache=True; the Trainer (and every probe) trains with
    use_cache=False, and so the lint measures: position_ids alone are isolated, the same rows with a
    2-D all-ones mask beside them leak, an explicit 4-D mask isolates them."""
    args = ("--data", files["chat"], "--tokenizer", files["tok"], "--model", files["ckpt"])
    code, found, report = doctor(*args, "--set", "data.packing=position_ids")
    assert code == 0 and not found and report["data"]["measured"]["packing_max_logit_diff"] < 1e-5
    code, found, _ = doctor(*args, "--set", "data.packing=position_ids_with_mask")
    leak = found["packing-leaks-across-segments"]
    assert code == 1 and "a 2-D attention mask is passed beside the position_ids" in leak["figure"]
    assert "https://github.com/huggingface/transformers/pull/46634" in leak["evidence"][0]
    diff = float(leak["figure"].split("max logit difference ")[1].split(" ")[0])
    assert diff > 0.1  # the issue: 0.68 on its tiny Llama
    code, found, _ = doctor(*args, "--set", "data.packing=block_mask")
    assert code == 0 and not found


def test_rows_packed_by_the_user_with_a_2d_mask_leak(files):
    row = {
        "input_ids": list(range(10, 27)),
        "position_ids": list(range(10)) + list(range(7)),
        "attention_mask": [1] * 17,
    }
    rows = write_jsonl(files["dir"] / "prepacked.jsonl", [row] * 4)
    code, found, _ = doctor("--data", rows, "--model", files["ckpt_no_cache"])
    assert (
        code == 1
        and "a 2-D attention mask is passed beside the position_ids" in found["packing-leaks-across-segments"]["figure"]
    )


def test_a_pad_token_that_is_a_real_word_masks_its_targets(files):
    tok = save_chat_tokenizer(files["dir"] / "tok-pad-the", pad="the")
    code, found, _ = doctor("--data", files["chat"], "--model", files["ckpt_no_cache"], "--tokenizer", tok)
    assert code == 0 and "('the') occurs" in found["pad-masks-real-targets"]["figure"]
    code, found, _ = doctor(
        "--data",
        files["chat"],
        "--model",
        files["ckpt_no_cache"],
        "--tokenizer",
        tok,
        "--set",
        "data.labels=attention_mask",
    )
    assert "pad-masks-real-targets" not in found


def test_pad_as_eos_masked_by_pad_id_never_trains_eos(files):
    tok = save_chat_tokenizer(files["dir"] / "tok-pad-eos", pad="</s>")
    code, found, report = doctor("--data", files["chat"], "--model", files["ckpt_no_cache"], "--tokenizer", tok)
    assert code == 0 and "is a target in none" in found["eos-never-a-target"]["figure"]
    eos = next(s for s in report["data"]["special_tokens"] if s["token"] == "'</s>'")
    assert eos["content"] == 48 and eos["targets"] == 0  # two turns per chat, each ends with </s>


def end_of_turn_setup(d, resize: bool):
    """A tokenizer whose chat turns end with an added <|end|> (id 320), and a checkpoint of the base
    vocabulary (320 rows), resized for it (resize_token_embeddings: the vocabulary's mean) or not."""
    base = load_tokenizer(save_chat_tokenizer(d / "base-tok"))
    base.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]})
    base.chat_template = base.chat_template.replace("</s>", "<|end|>")
    tok = d / "tok-end"
    base.save_pretrained(tok)
    ckpt = save_llama(d / "ckpt-320", vocab_size=320, use_cache=False)
    if resize:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt)
        model.resize_token_embeddings(len(base))
        model.save_pretrained(ckpt)
    return tok, ckpt


def test_a_resized_pad_row_that_lora_never_trains_is_found(tmp_path, files):
    tok, ckpt = end_of_turn_setup(tmp_path, resize=True)
    args = ("--data", files["chat"], "--model", ckpt, "--tokenizer", tok)
    code, found, _ = doctor(*args, "--set", "adapter.type=lora")
    figure = found["untrained-embedding-rows"]["figure"]
    assert (
        code == 0
        and "'<|end|>' id 320" in figure
        and "the vocabulary's mean" in figure
        and "lora on q_proj, v_proj" in figure
    )
    code, found, _ = doctor(*args)  # a full fine-tune trains the row
    assert "untrained-embedding-rows" not in found
    code, found, _ = doctor(
        *args, "--set", "adapter.type=lora", "--set", "adapter.modules_to_save=[embed_tokens,lm_head]"
    )
    assert "untrained-embedding-rows" not in found


def test_ids_beyond_the_vocabulary_are_an_error(tmp_path, files):
    tok, ckpt = end_of_turn_setup(tmp_path, resize=False)
    code, found, _ = doctor("--data", files["chat"], "--model", ckpt, "--tokenizer", tok)
    assert (
        code == 1
        and "ids >= the model's vocab_size 320 (the largest is 320)" in found["token-ids-beyond-vocabulary"]["figure"]
    )


def test_per_micro_batch_accumulation_on_uneven_rows_is_an_error(files):
    rows = write_jsonl(files["dir"] / "uneven.jsonl", [{"input_ids": list(range(10, 10 + n))} for n in (32, 4, 4, 4)])
    args = (
        "--data",
        rows,
        "--model",
        files["ckpt_no_cache"],
        "--set",
        "batch_size=1",
        "--set",
        "gradient_accumulation_steps=4",
    )
    code, found, _ = doctor(*args, "--set", "loss_normalization=micro_batch")
    figure = found["accumulation-normalised-per-micro-batch"]["figure"]
    assert code == 1 and "loss_normalization=micro_batch differs from the full batch's by " in figure, figure
    code, found, _ = doctor(*args, "--set", "loss_normalization=tokens")
    assert code == 0 and "accumulation-normalised-per-micro-batch" not in found


def test_reentrant_checkpointing_that_starves_the_lora_weights_is_an_error(files):
    """One backward through the recipe's adapter and checkpointing, applied as a probe applies them:
    with reentrant checkpointing and a trained lm_head copy, all 8 LoRA tensors get no gradient."""
    args = ("--data", files["chat"], "--model", files["ckpt_no_cache"], "--tokenizer", files["tok"])
    args += ("--set", "adapter.type=lora", "--set", "adapter.modules_to_save=[lm_head]")
    code, found, _ = doctor(*args, "--set", "gradient_checkpointing=reentrant")
    starved = found["trainable-group-without-gradient"]
    assert code == 1 and "gave no gradient to adapter (all 8 tensors)" in starved["figure"]
    assert "the loss still falls through modules_to_save" in starved["figure"]
    assert "https://github.com/huggingface/transformers/issues/26221" in starved["evidence"]
    code, found, _ = doctor(*args, "--set", "gradient_checkpointing=non_reentrant")
    assert code == 0 and "trainable-group-without-gradient" not in found
    code, found, _ = doctor(*args[:-2], "--set", "gradient_checkpointing=reentrant")  # only the adapter trains
    assert code == 1 and "the backward raised" in found["trainable-group-without-gradient"]["figure"]


def test_one_truncated_row_in_full_batches_is_a_warning(files):
    """One chat in 24 whose long question leaves its answer past max_length: every batch still has
    targets, so the doctor warns (exit 0); the error is kept for a batch left with none."""
    rows = chat_rows(24)
    rows[5]["messages"][0]["content"] = " ".join(["the"] * 80)
    path = write_jsonl(files["dir"] / "one-long.jsonl", rows)
    args = ("--data", path, "--tokenizer", files["tok"], "--set", "data.labels=completion_only")
    code, found, _ = doctor(*args)
    warning = found["rows-without-supervised-token-in-full-batches"]
    assert code == 0 and warning["severity"] == "warning" and "rows-without-supervised-token" not in found
    assert "1 of 24 rows have no label left" in warning["figure"] and "0 of 6 batches" in warning["figure"]
    code, found, _ = doctor(*args, "--set", "batch_size=1")  # the row is a batch of its own: 0/0
    assert code == 1 and found["rows-without-supervised-token"]["severity"] == "error"


def test_a_large_share_of_truncated_rows_suggests_a_seq_len(files):
    rows = chat_rows(20, question_words=(20, 30), answer_words=(20, 30))
    path = write_jsonl(files["dir"] / "long-chats.jsonl", rows)
    code, found, report = doctor("--data", path, "--tokenizer", files["tok"])  # seq_len 64
    figure = found["rows-truncated-at-max-length"]["figure"]
    assert code == 0 and found["rows-truncated-at-max-length"]["severity"] == "warning"
    suggested = int(figure.split("--set seq_len=")[1].split()[0])
    tokenizer = load_tokenizer(files["tok"])
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    lengths = sorted(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    # the 95th percentile of 20 lengths (between the two longest), rounded up to a multiple of 8
    assert lengths[-2] <= suggested < lengths[-1] + 8 and suggested % 8 == 0
    assert f"{report['data']['rows_truncated']} of 20 rows" in figure and "are longer than max_length 64" in figure
    code, found, _ = doctor("--data", path, "--tokenizer", files["tok"], "--set", f"seq_len={suggested}")
    assert "rows-truncated-at-max-length" not in found


@pytest.mark.slow  # a process of its own: what a user's terminal shows
def test_the_lint_model_prints_no_third_party_lines(tmp_path, files):
    """The lint builds a model for the accumulation check: transformers and peft import no optional
    package (torchao's "Failed to load ...so", torch's _pytree lines), and stderr holds only nandoctor's."""
    args = ("doctor", "--data", files["chat"], "--tokenizer", files["tok"], "--set", "gradient_accumulation_steps=2")
    proc = run_cli(*args, *ONE_CELL, process=True)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if not line.startswith("nandoctor:")] == []


def test_pre_tokenized_labels_shifted_by_one_are_an_error(files):
    """Issue 44: rows whose labels are input_ids[1:] passed the lint and the grid; the model shifts them again
    and learns the token two ahead. Two such rows of eight are an error naming them; labels equal to the ids
    (some masked) and a row of one repeated token (both readings fit) are not."""
    rows = [{"input_ids": list(range(10 + r, 30 + r)), "labels": list(range(10 + r, 30 + r))} for r in range(8)]
    rows[0]["labels"][:5] = [-100] * 5
    for r in (2, 5):
        rows[r]["labels"] = rows[r]["input_ids"][1:] + [-100]
    rows[6] = {"input_ids": [7] * 20, "labels": [7] * 19 + [-100]}
    path = write_jsonl(files["dir"] / "shifted.jsonl", rows)
    code, found, _ = doctor("--data", path, "--model", files["ckpt_no_cache"])
    shifted = found["labels-already-shifted"]
    assert code == 1 and shifted["severity"] == "error"
    assert shifted["figure"].startswith("2 of 8 pre-tokenized rows") and "rows: 2, 5)" in shifted["figure"]
    for r in (2, 5):
        rows[r]["labels"] = list(rows[r]["input_ids"])
    code, found, _ = doctor(
        "--data", write_jsonl(files["dir"] / "unshifted.jsonl", rows), "--model", files["ckpt_no_cache"]
    )
    assert "labels-already-shifted" not in found
