"""The data lint's own logic: its rules (scopes data and live of knowledge/rules.yaml: public evidence,
a reproducing test for each), its histograms, and findings on rows no CLI case covers; a clean data set
fires nothing."""

import re
from pathlib import Path

import pytest
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

from nandoctor.config import recipe_from_dict
from nandoctor.doctor import data_lint
from nandoctor.knowledge import rules
from nandoctor.userdata.lint import histogram

TESTS = Path(__file__).parent


def test_every_rule_has_public_evidence_and_a_test_that_reproduces_it():
    for rule in rules("data", "live"):
        assert rule.evidence and all(e.startswith("https://") for e in rule.evidence), rule.id
        assert rule.verified_by, rule.id
        for test in rule.verified_by:
            path, _, name = test.partition("::")
            assert re.search(rf"^def {name}\(", (TESTS.parent / path).read_text(), re.M), test


def test_histogram_bins_hold_every_row():
    h = histogram([0, 0, 3, 7, 12, 12, 40], bins=4)
    assert h["edges"][0] == 0 and h["edges"][-1] > 40 and sum(h["counts"]) == 7 and h["counts"][0] == 4
    assert histogram([5] * 3)["counts"] == [0, 0, 0, 0, 0, 3]


def lint(tmp_path, rows, **data):
    r = recipe_from_dict({"data": {"path": str(write_jsonl(tmp_path / "rows.jsonl", rows)), **data}}, "r")
    return data_lint(r)


def test_pre_tokenized_rows_that_label_their_padding_are_found(tmp_path):
    row = {
        "input_ids": list(range(10, 20)) + [0] * 4,
        "labels": list(range(10, 20)) + [0] * 4,
        "attention_mask": [1] * 10 + [0] * 4,
    }
    section = lint(tmp_path, [row] * 6)
    found = {f["id"]: f for f in section["findings"]}
    assert found["padding-supervised"]["figure"].startswith("24 padded positions (attention_mask 0) in 6 rows")
    assert found["padding-supervised"]["severity"] == "warning"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def test_a_clean_chat_set_fires_nothing_and_says_what_it_read(tmp_path, tok):
    section = lint(tmp_path, chat_rows(12), tokenizer=str(tok), labels="completion_only")
    assert section["findings"] == []
    assert section["source"]["kind"] == "messages" and section["rows"] == 12
    assert sum(section["histograms"]["length"]["counts"]) == 12 and section["rows_without_supervised"] == 0
    assert [b["kind"] for b in section["batches"][:3]] == ["first"] * 3 and section["batches"][0]["rows"] == [
        0,
        1,
        2,
        3,
    ]
    assert "measured_on" not in section["measured"]  # nothing packed, one micro-batch, no weights: no model built
