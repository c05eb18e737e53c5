"""A model whose forward returns loss=None (custom code that drops `labels`) is a classified result with
its reason, in the data lint and in the probe, never a TypeError's traceback."""

from __future__ import annotations

import pytest
from checkpoints import save_no_loss_llama
from conftest import run_cli
from userdata_fixtures import save_chat_tokenizer, text_rows, write_jsonl

pytestmark = pytest.mark.slow
NO_LOSS = (
    "the model returned loss=None (CausalLMOutputWithPast) for a batch with labels: its forward computes none "
    "from them (custom code that drops `labels`, or no LM head)"
)


def test_a_model_that_returns_no_loss_is_a_crash_verdict_with_its_reason(tmp_path):
    ckpt = save_no_loss_llama(tmp_path / "ckpt")
    data = write_jsonl(tmp_path / "rows.jsonl", text_rows(16))
    proc = run_cli(
        *("check", "--model", ckpt, "--trust-remote-code", "--dtype", "fp32", "--attn", "sdpa"),
        *("--data", data, "--tokenizer", save_chat_tokenizer(tmp_path / "tok")),
        # two micro-batches: the data lint trains on the loss too (its accumulation check)
        *("--set", "gradient_accumulation_steps=2", "--out", tmp_path / "run"),
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1, said
    assert "Traceback" not in said
    assert f"WARNING: the data lint could not measure the checks that train on the loss: {NO_LOSS}" in said
    assert f"FAIL probe ran: crash: NoLoss: {NO_LOSS}" in proc.stdout
    assert "check fp32/sdpa/off on ckpt: FAIL" in proc.stdout
