"""A chat labelled completion_only trains, in the probe, the tokens trl.SFTTrainer(assistant_only_loss=True)
trains. For a stock template without `{% generation %}` marks (Qwen2.5's and Qwen3's, as TRL ships them),
SFTTrainer renders the chats with TRL's own training template instead, and the probe's labels follow that
template: checked on the SFTConfig the recommendation prints, run as pasted, against the labels column of the
dataset SFTTrainer prepares from the same rows. In a process where TRL cannot be imported, the probe keeps
its own prefix-span rule, which trains other tokens than TRL does, and the advice says TRL was not found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import save_llama
from conftest import needs
from test_pasted_code import pasted
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

from nandoctor.cells import Cell
from nandoctor.config import recipe_from_dict
from nandoctor.models import model_config
from nandoctor.recommend import recommendation
from nandoctor.userdata.encode import IGNORE
from nandoctor.userdata.rows import encoded_rows

# slow: SFTTrainer prepares the rows under the pasted imports (Lightning, TRL, bitsandbytes: 20-30 s of import on
# a 2-core host), and a fresh interpreter without TRL encodes them again
pytestmark = [pytest.mark.slow, needs("lightning", "trl", "bitsandbytes")]
ROWS = 4  # chats of two user / assistant exchanges

# The probe's labels where TRL cannot be imported (its None in sys.modules: `import trl` fails, find_spec
# answers None), as one JSON line: each row's ids and labels, and the advice's comment
WITHOUT_TRL = """
import json, sys
sys.modules["trl"] = None
from nandoctor.config import recipe_from_dict
from nandoctor.models import model_config
from nandoctor.recommend import completion_setting
from nandoctor.userdata.rows import encoded_rows
from nandoctor.userdata.template import assistant_mask_check

recipe = recipe_from_dict(json.loads(sys.argv[1]), "r")
encoded = encoded_rows(recipe, model_config(recipe))
check = assistant_mask_check(encoded, [json.loads(line) for line in open(recipe.data.path)])
_, said = completion_setting({"source": {"kind": "messages"}, "assistant_mask": check})
rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in encoded.rows]
print(json.dumps({"rows": rows, "said": said}))
"""


def stock_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("trl-template") / "ckpt")


def recipe_dict(tmp_path, ckpt, name: str) -> dict:
    tok = save_chat_tokenizer(tmp_path / name, template=stock_template(name))
    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(ROWS, turns=2))
    data = {"source": "file", "path": str(rows), "tokenizer": str(tok), "labels": "completion_only", "max_length": 256}
    return {"model": {"path": str(ckpt)}, "data": data}


def sft_trained(recipe, tmp_path) -> tuple[list[dict], list[str], object]:
    """(each row's {input_ids, labels} as SFTTrainer prepares them, the recommendation's lines, the trainer):
    SFTTrainer built from the pasted SFTConfig, model and tokenizer on the recipe's rows, not trained."""
    from datasets import Dataset
    from trl import SFTTrainer

    from nandoctor.doctor import data_lint

    lint = json.loads(json.dumps(data_lint(recipe)))  # as run.json holds it
    lines = recommendation(Cell.parse("fp32/sdpa/off").to_dict(), recipe, recipe, [], lint=lint, device="cpu")["python"]
    scope = pasted({"python": lines}, tmp_path)
    rows = [json.loads(line) for line in open(recipe.data.path)]
    trainer = SFTTrainer(
        model=scope["model"],
        args=scope["args"],
        train_dataset=Dataset.from_list(rows),
        processing_class=scope["tokenizer"],
    )
    prepared = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in trainer.train_dataset]
    return prepared, lines, trainer


def probed(recipe) -> tuple[list[dict], str]:
    """(each row's {input_ids, labels} as the probe trains them, the Data section's sentence on them)."""
    from nandoctor.report.data import source_sentence

    encoded = encoded_rows(recipe, model_config(recipe))
    return [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in encoded.rows], source_sentence(
        encoded.describe()
    )


def without_trl(recipe: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRL, json.dumps(recipe)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3"])
def test_a_stock_template_without_marks_is_labelled_as_sft_trainer_trains_it(tmp_path, ckpt, name):
    from trl.chat_template_utils import get_training_chat_template

    recipe = recipe_from_dict(recipe_dict(tmp_path, ckpt, name), "r")
    trl_rows, lines, trainer = sft_trained(recipe, tmp_path)
    assert trainer.chat_template == get_training_chat_template(trainer.processing_class)  # TRL swapped its own in
    assert lines[0].startswith("args = trl.SFTConfig(") and "assistant_only_loss=True" in lines[0], lines
    assert f"labels follow TRL's training template for {name}, which trl.SFTTrainer swaps in" in lines[0]
    assert not any("{% generation %} right after" in line for line in lines)  # no marks to add: TRL adds its own
    probe_rows, said = probed(recipe)
    assert probe_rows == trl_rows  # ids and labels, token for token
    assert f"labels by completion_only (following TRL's training template for {name}, which SFTTrainer" in said
    assert all(IGNORE in r["labels"] and set(r["labels"]) != {IGNORE} for r in probe_rows)


def test_without_trl_the_qwen2_5_labels_miss_the_newline_after_each_assistant_header(tmp_path, ckpt):
    """The prefix-span rule starts each assistant turn after its generation prompt '<|im_start|>assistant\\n';
    TRL's qwen2_5 training template opens {% generation %} before that newline: one token per assistant turn,
    the rest equal."""
    recipe = recipe_dict(tmp_path, ckpt, "qwen2_5")
    trl_rows, _, trainer = sft_trained(recipe_from_dict(recipe, "r"), tmp_path)
    before = without_trl(recipe)
    assert "TRL is not installed where nandoctor ran" in before["said"], before["said"]
    assert "{% generation %} right after '<|im_start|>assistant\\n'" in before["said"], before["said"]
    decode = trainer.processing_class.decode
    missed = []
    for ours, theirs in zip(before["rows"], trl_rows):
        assert ours["input_ids"] == theirs["input_ids"]
        ids = ours["input_ids"]
        differ = [j for j, (a, b) in enumerate(zip(ours["labels"], theirs["labels"])) if a != b]
        assert all(ours["labels"][j] == IGNORE for j in differ)  # TRL trains them, the prefix-span rule does not
        missed += [(decode(ids[j]), decode(ids[: j + 1]).endswith("<|im_start|>assistant\n")) for j in differ]
    assert missed == [("\n", True)] * 2 * ROWS, missed


def test_without_trl_the_qwen3_chats_render_other_ids_and_leave_the_first_answer_untrained(tmp_path, ckpt):
    """Qwen3's stock template writes an empty <think></think> in the last assistant turn only, so the chat up
    to the first one is not a prefix of the whole and the prefix-span rule labels the last turn alone; TRL's
    qwen3 training template writes it in every turn and labels both."""
    recipe = recipe_dict(tmp_path, ckpt, "qwen3")
    trl_rows, _, _ = sft_trained(recipe_from_dict(recipe, "r"), tmp_path)
    before = without_trl(recipe)

    def targets(rows):
        return [sum(y != IGNORE for y in r["labels"][1:]) for r in rows]

    assert all(len(t["input_ids"]) > len(o["input_ids"]) for o, t in zip(before["rows"], trl_rows))
    assert all(o < t for o, t in zip(targets(before["rows"]), targets(trl_rows)))
