"""A checkpoint with its own code ships its own tokenizer class too (tokenizer_config.json auto_map):
with trust_remote_code the rows are tokenized with it, as its model is loaded, never behind
transformers' "Do you wish to run the custom code? [y/N]" prompt."""

from __future__ import annotations

import json

import pytest
from checkpoints import save_custom_llama
from conftest import run_main
from userdata_fixtures import save_chat_tokenizer, text_rows, write_jsonl

PLAIN_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class PlainLlamaConfig(LlamaConfig):
    model_type = "plain-llama"


class PlainLlamaForCausalLM(LlamaForCausalLM):
    config_class = PlainLlamaConfig
"""
TOKENIZER_CODE = """
from transformers import PreTrainedTokenizerFast


class PlainTokenizer(PreTrainedTokenizerFast):
    '''The checkpoint's own tokenizer class.'''
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("custom-tokenizer")
    ckpt = save_chat_tokenizer(save_custom_llama(d / "ckpt", "plain_llama", "Plain", PLAIN_CODE))
    (ckpt / "plain_tokenizer.py").write_text(TOKENIZER_CODE)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="PlainTokenizer", auto_map={"AutoTokenizer": [None, "plain_tokenizer.PlainTokenizer"]}
    )
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    return ckpt, write_jsonl(d / "rows.jsonl", text_rows(8))


@pytest.mark.parametrize("trust", [("--trust-remote-code",), ("--set", "model.trust_remote_code=true")])
def test_doctor_tokenizes_with_a_trusted_checkpoints_own_tokenizer_without_asking(checkpoint, trust):
    ckpt, rows = checkpoint
    proc = run_main("doctor", "--model", ckpt, *trust, "--data", rows, "--json", "--axis", "dtype=fp32")
    said = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), said  # 2: the tokenizer was refused
    assert "custom code" not in said and "[y/N]" not in said
    data = json.loads(proc.stdout)["data"]
    assert data["source"]["rows"] == 8 and data["measured"]["measured_on"].startswith("PlainLlamaForCausalLM")
