"""docs/recipes.md says what the recipe tree holds: every field of a section is in its table or
sentence, and the advice for a tokenizer without a pad token names the token Llama 3.1 / 3.2 ship."""

import dataclasses
from pathlib import Path

import pytest

from nandoctor.config import DataConfig, PadTokenConfig
from nandoctor.knowledge import rule_by_id

RECIPES = Path(__file__).parent.parent / "docs" / "recipes.md"


@pytest.mark.parametrize("section, fields", [("data", DataConfig), ("pad_token", PadTokenConfig)])
def test_recipes_md_lists_every_field_of_a_section(section, fields):
    text = RECIPES.read_text().split(f"\n`{section}`", 1)[1].split("\n\n`", 1)[0]  # up to the next section
    missing = [f.name for f in dataclasses.fields(fields) if f"`{f.name}`" not in text]
    assert missing == [], f"docs/recipes.md's `{section}` section lacks {missing}"


def test_the_dedicated_pad_policy_is_described_as_the_tokenizers_pad_token():
    text = RECIPES.read_text().split("`pad_token`: `policy`", 1)[1].split("\n\n", 1)[0]
    assert "the tokenizer's own pad token" in text and "reserved" not in text


def test_the_no_pad_token_advice_names_llama_3s_own_pad_token():
    fix = rule_by_id("tokenizer-without-pad-token").fix
    assert "<|finetune_right_pad_id|>" in fix and "reserved_special_token" not in fix
