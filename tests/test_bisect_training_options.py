"""A bisection whose target adds one training option to a stable cell names that option, through the
CLI, on a tiny local checkpoint with its own tokenizer and chat template and a chat JSONL: packing
with a 2-D mask beside the position_ids, reentrant checkpointing under a LoRA adapter with a trained
lm_head copy, and per-micro-batch loss normalisation over uneven rows. Each target's loss falls; its
own step-0 setup check (misconfigured) or its starved LoRA group (no-learning) is the failure, so the
fp32 reference, which shares the setup, is no yardstick. Two probes each (--reruns 0)."""

import json

import pytest
from checkpoints import save_llama
from conftest import run_cli
from userdata_fixtures import chat_rows, save_chat_tokenizer, sentence, write_jsonl

pytestmark = pytest.mark.slow  # bisections through the CLI, each probe a process


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import random

    d = tmp_path_factory.mktemp("bisect-options")
    ckpt = save_llama(d / "ckpt", use_cache=False)
    save_chat_tokenizer(ckpt)
    rng = random.Random(5)
    # one long chat then short ones, again and again: micro-batches of one row with very unequal tokens
    uneven = [
        {
            "messages": [
                {"role": "user", "content": sentence(rng, 24 if i % 4 == 0 else 1)},
                {"role": "assistant", "content": sentence(rng, 24 if i % 4 == 0 else 1)},
            ]
        }
        for i in range(16)
    ]
    return {
        "ckpt": ckpt,
        "chat": write_jsonl(d / "chat.jsonl", chat_rows(16, seed=2)),
        "uneven": write_jsonl(d / "uneven.jsonl", uneven),
        "dir": d,
    }


def bisect(files, name, data, good, bad, *sets):
    out = files["dir"] / name
    args = ["bisect", "--model", files["ckpt"], "--data", files[data], "--good", good, "--bad", bad]
    args += ["--steps", "3", "--reruns", "0", "--set", "forensics_steps=0", "--out", out]
    for item in sets:
        args += ["--set", item]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bisect.json").read_text())
    verdicts = {step["outcome"]: step["verdicts"] for step in result["path"]}
    return result, verdicts, proc


def test_bisect_names_packing_with_a_2d_mask(files):
    result, verdicts, _ = bisect(
        files, "packing", "chat", "data.packing=position_ids", "data.packing=position_ids_with_mask"
    )
    assert result["status"] == "bisected" and [c["factors"] for c in result["culprits"]] == [["data.packing"]]
    assert verdicts["fail"] == ["misconfigured"] and verdicts["pass"] == ["stable"]
    assert result["recommended"]["data.packing"] == "position_ids"


def test_bisect_names_reentrant_checkpointing(files):
    result, verdicts, _ = bisect(
        files,
        "checkpointing",
        "chat",
        "gradient_checkpointing=non_reentrant",
        "gradient_checkpointing=reentrant",
        "adapter.type=lora",
        "adapter.modules_to_save=[lm_head]",
    )
    assert [c["factors"] for c in result["culprits"]] == [["gradient_checkpointing"]]
    assert verdicts["fail"] == ["no-learning"] and verdicts["pass"] == ["stable"]


def test_bisect_names_per_micro_batch_normalisation(files):
    result, verdicts, proc = bisect(
        files,
        "accumulation",
        "uneven",
        "loss_normalization=tokens",
        "loss_normalization=micro_batch",
        "gradient_accumulation_steps=4",
        "batch_size=1",
    )
    assert [c["factors"] for c in result["culprits"]] == [["loss_normalization"]]
    assert verdicts["fail"] == ["misconfigured"] and verdicts["pass"] == ["stable"]
    md = (files["dir"] / "accumulation" / "report.md").read_text()
    assert "accumulation: step 0's gradient over 4 micro-batches" in md


def test_bisect_repairs_the_normalisation_and_keeps_the_accumulation(files):
    result, _, _ = bisect(
        files,
        "accumulation-kept",
        "uneven",
        "loss_normalization=tokens",
        "gradient_accumulation_steps=4,loss_normalization=micro_batch",
        "batch_size=1",
    )
    culprits = [sorted(c["factors"]) for c in result["culprits"]]
    assert culprits == [["gradient_accumulation_steps", "loss_normalization"]], result["message"]
    # both one-factor repairs train stably; the one that keeps the user's 4 micro-batches is recommended
    assert result["recommended"]["gradient_accumulation_steps"] == 4
    assert result["recommended"]["loss_normalization"] == "tokens"
    command = result["recommendation"]["command"]
    assert "--set gradient_accumulation_steps=4" in command and f"--data {files['uneven']}" in command
