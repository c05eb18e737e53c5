"""One faulty setup, one verdict whichever door (STYLE rule 25): a checkpoint whose modeling code drops
position_ids (packed segments attend to each other) and num_items_in_batch (the accumulated gradient is
the four micro-batches' means added up, about 4x the full batch's), packed with position_ids and
accumulated over 4 micro-batches, is `misconfigured` by both step-0 setup checks in `grid`, in `check`
and in a real transformers Trainer run watched by NandoctorCallback, which stops at step 0 with a report
instead of watching the run to "stable"."""

import json
import random
import re
import warnings

import pytest
import torch
from checkpoints import save_ignores_both_llama
from conftest import run_main
from training_runs import QUIET_TRAINING_ARGS, nandoctor_transformers
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

pytestmark = pytest.mark.slow  # probes through the CLI, and a Trainer run

ONE_CELL = ("--dtype", "fp32", "--attn", "sdpa")
FAULTY_SETUP = (
    *("--set", "model.trust_remote_code=true", "--set", "data.packing=position_ids"),
    *("--set", "batch_size=2", "--set", "gradient_accumulation_steps=4"),
)


def failed_checks(reason: str) -> list[str]:
    """The step-0 setup checks a misconfigured verdict's reason names, in order."""
    return re.findall(r"(?:^|; )(packing|accumulation): ", reason)


def accumulation_error(reason: str) -> float:
    return float(re.search(r"differs from the full batch's by ([0-9.e+-]+) \(relative", reason).group(1))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    d = tmp_path_factory.mktemp("one-verdict")
    ckpt = save_ignores_both_llama(d / "ckpt")
    data = (
        "--data",
        write_jsonl(d / "chat.jsonl", chat_rows(16, seed=3)),
        "--tokenizer",
        save_chat_tokenizer(d / "tok"),
    )
    return ckpt, data, d


class Rows(torch.utils.data.Dataset):
    """Rows of 6 to 20 random token ids, as a tokenized data set holds them (lists, no padding)."""

    def __init__(self, n: int = 32):
        rng = random.Random(0)
        self.rows = [[rng.randrange(10, 250) for _ in range(rng.randint(6, 20))] for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def test_grid_check_and_the_trainer_callback_call_the_faulty_setup_misconfigured_by_both_checks(faulty):
    ckpt, data, d = faulty
    grid = run_main(
        "grid", "--model", ckpt, *data, *FAULTY_SETUP, "--axis", "dtype=fp32", "--axis", "attn=sdpa",
        "--axis", "compile=off", "--steps", "2", "--set", "retime_rounds=0", "--out", d / "grid",
    )  # fmt: skip
    assert grid.returncode in (0, 1), grid.stdout[-3000:] + grid.stderr[-3000:]
    probe = json.loads((d / "grid" / "summary.json").read_text())["probes"][0]
    assert probe["verdict"] == "misconfigured", probe["reason"]
    assert failed_checks(probe["reason"]) == ["packing", "accumulation"]
    assert accumulation_error(probe["reason"]) > 2.5  # four means added up: about 3

    check = run_main("check", "--model", ckpt, *data, *FAULTY_SETUP, *ONE_CELL, "--out", d / "check")
    assert check.returncode == 1, check.stdout[-3000:] + check.stderr[-3000:]
    said = next(line for line in check.stdout.splitlines() if "verdict: " in line)
    assert said.startswith("  FAIL verdict: misconfigured: "), said
    assert failed_checks(said.split("misconfigured: ", 1)[1]) == ["packing", "accumulation"]

    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

    callback = nandoctor_transformers().NandoctorCallback()
    args = {**QUIET_TRAINING_ARGS, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}
    trainer = Trainer(
        model=AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True),
        # its forward names neither input_ids nor labels (they go through **kwargs): keep the columns
        args=TrainingArguments(str(d / "trainer"), **args, max_steps=3, remove_unused_columns=False),
        train_dataset=Rows(),
        data_collator=DataCollatorWithFlattening(),  # packs each micro-batch's 2 rows with position_ids
        callbacks=[callback],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lint's and the step-0 check's warnings: the verdict is the point
        trainer.train()
    verdict = callback.watch.judging.verdict()
    assert verdict.name == "misconfigured" and verdict.step == 0, verdict
    assert failed_checks(verdict.reason) == ["packing", "accumulation"]
    assert accumulation_error(verdict.reason) > 2.5
    assert trainer.state.global_step == 1  # stopped at the failure, with its report
    report = (d / "trainer" / "nandoctor" / "report.md").read_text()
    assert "misconfigured" in report
    line = callback.watch.finish()
    assert "misconfigured (packing: one packed forward" in line and "report " in line, line
