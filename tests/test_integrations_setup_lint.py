"""The training callback lints the trainer's own first batches at train start (its dataset through its
collator, on the live model): a real transformers Trainer on the tiny Llama whose collator packs rows
with position_ids and the usual 2-D all-ones attention mask beside them is warned, with the measured
logit difference, and judged `misconfigured` as the grid judges it: stopped at step 0 with a report; under
strict=True the leak stops it before its first step; the
flattening collator alone (no mask) is not warned. The batch figures (label coverage, the pad token)
are read from collated batches in a fast test, and a collator the lint cannot run leaves the watch on."""

import random
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from training_runs import QUIET_LIGHTNING, QUIET_TRAINING_ARGS, tiny_llama

from nandoctor.config import Recipe
from nandoctor.integrations.judge import CheckFailed
from nandoctor.integrations.watch import Watch


class Rows(torch.utils.data.Dataset):
    """Rows of 6 to 20 random token ids, as a tokenized data set holds them (lists, no padding)."""

    def __init__(self, n: int = 16):
        rng = random.Random(0)
        self.rows = [[rng.randrange(10, 1000) for _ in range(rng.randint(6, 20))] for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


class PackedWithMask:
    """DataCollatorWithFlattening, then the usual 2-D all-ones attention mask beside its position_ids:
    what a collator that packs and keeps the tokenizer's mask hands the model."""

    def __init__(self, mask: bool = True):
        from transformers import DataCollatorWithFlattening

        self.flatten, self.mask = DataCollatorWithFlattening(), mask

    def __call__(self, features):
        batch = self.flatten(features)
        if self.mask:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


def train(tmp_path, collator, strict: bool = False):
    from transformers import Trainer, TrainingArguments

    from nandoctor.integrations.transformers import NandoctorCallback

    callback = NandoctorCallback(strict=strict)
    trainer = Trainer(
        model=tiny_llama(),
        args=TrainingArguments(str(tmp_path), **{**QUIET_TRAINING_ARGS, "max_steps": 2}),
        train_dataset=Rows(),
        data_collator=collator,
        callbacks=[callback],
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    lint = [str(w.message) for w in said if "data and setup lint" in str(w.message)]
    return trainer, callback, lint


@pytest.mark.slow
def test_a_trainer_whose_collator_packs_beside_a_2d_mask_is_warned_with_the_figure(tmp_path):
    trainer, callback, lint = train(tmp_path, PackedWithMask())
    assert len(lint) == 1 and "error packing-leaks-across-segments: on the live LlamaForCausalLM: packing:" in lint[0]
    leak = float(re.search(r"differs from each segment run alone by ([0-9.e-]+) max logit", lint[0]).group(1))
    assert leak > 0.1 and "(a 2-D attention mask is passed beside the position_ids)" in lint[0]
    assert "Fix: Pass position_ids without an attention mask (DataCollatorWithFlattening" in lint[0]
    assert "packing-leaks-across-segments" in [f["id"] for f in callback.watch.findings]
    # the grid's verdict on the leak: misconfigured, so the run stops at step 0 with its report
    verdict = callback.watch.judging.verdict()
    assert verdict.name == "misconfigured" and verdict.reason.startswith("packing: one packed forward"), verdict
    assert trainer.state.global_step == 1 and not callback.watch.off
    assert (tmp_path / "nandoctor" / "report.md").exists()


@pytest.mark.slow
def test_strict_stops_a_leaking_packed_run_before_its_first_step_and_a_clean_one_is_not_warned(tmp_path):
    with pytest.raises(CheckFailed, match="packing-leaks-across-segments"):
        train(tmp_path / "strict", PackedWithMask(), strict=True)
    trainer, _, lint = train(tmp_path / "clean", PackedWithMask(mask=False))
    assert lint == [] and trainer.state.global_step == 2


@pytest.mark.slow
def test_a_lightning_fit_on_a_packing_loader_with_a_2d_mask_is_warned_with_the_figure(tmp_path):
    import lightning as L

    from nandoctor.integrations.lightning import NandoctorCallback

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callback = NandoctorCallback()
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        **QUIET_LIGHTNING,
        callbacks=[callback],
        default_root_dir=str(tmp_path),
    )
    loader = torch.utils.data.DataLoader(Rows(), batch_size=4, collate_fn=PackedWithMask())
    with pytest.warns(UserWarning, match="data and setup lint") as said:
        trainer.fit(CausalLM(), loader)
    lint = [str(w.message) for w in said if "data and setup lint" in str(w.message)]
    assert "error packing-leaks-across-segments: on the live LlamaForCausalLM: packing: one packed forward" in lint[0]
    assert callback.watch.judging.verdict().name == "misconfigured" and trainer.global_step == 1


def test_rows_with_no_label_and_supervised_padding_are_found_in_the_collated_batches():
    from nandoctor.integrations.setup_lint import batch_figures, live_findings

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    labels = torch.tensor([[5, 6, 7, 0], [8, -100, -100, -100]])  # row 0's padding labelled; row 1 has no target
    figures = batch_figures([{"input_ids": ids, "attention_mask": mask, "labels": labels}], pad_id=0, eos_id=None)
    assert (figures["rows_without_supervised"], figures["first_unsupervised"], figures["pad_targets"]) == (1, 1, 1)
    found = {f["id"]: f for f in live_findings(figures)}
    # the batch keeps row 0's targets: no step divides by zero, a warning, as `doctor --data` says it
    # (tests/test_userdata_lint_cli.py), not the error of a batch with none
    assert "rows-without-supervised-token" not in found
    unsupervised = found["rows-without-supervised-token-in-full-batches"]
    assert unsupervised["severity"] == "warning"
    assert unsupervised["figure"].startswith(
        "1 of the 2 rows in the trainer's first 1 batches have no supervised token"
    )
    assert unsupervised["figure"].endswith("0 of those batches have none")
    assert found["padding-supervised"]["figure"].startswith("1 padded positions (attention_mask 0)")
    assert "https://github.com/huggingface/trl/issues/6668" in " ".join(unsupervised["evidence"])


def test_the_live_rules_are_the_rules_of_scope_live():
    from nandoctor.integrations.setup_lint import LIVE_RULES
    from nandoctor.knowledge import rules

    assert set(LIVE_RULES) == {r.id for r in rules("live")}


def test_a_batch_with_no_supervised_token_is_an_error():
    from nandoctor.integrations.setup_lint import batch_figures, live_findings

    ids = torch.tensor([[5, 6, 7], [8, 9, 4]])
    labels = torch.full_like(ids, -100)
    found = {f["id"]: f for f in live_findings(batch_figures([{"input_ids": ids, "labels": labels}], None, None))}
    assert found["rows-without-supervised-token"]["severity"] == "error"
    assert found["rows-without-supervised-token"]["figure"].endswith(
        "1 of those batches have none: their mean loss is 0/0"
    )
    assert "rows-without-supervised-token-in-full-batches" not in found


def test_a_collator_the_lint_cannot_run_leaves_the_watch_on(capsys):
    def broken(rows):
        raise KeyError("text")

    watch = Watch()
    watch.run = SimpleNamespace(model=None, recipe=Recipe())
    loader = torch.utils.data.DataLoader(Rows(4), batch_size=2, collate_fn=broken)
    assert watch._lint(loader, 2, None, None) == ([], {}) and watch.off is None
    assert "the data and setup lint could not run (KeyError: 'text'); watching goes on" in capsys.readouterr().err


def test_the_lint_reading_the_first_batches_leaves_the_users_random_draws_as_they_were():
    # issue 34: the dataset and collator ran outside any RNG fork, so a collator that draws (a random
    # crop, MLM masking) shifted every draw of the training after it
    import numpy as np

    from nandoctor.integrations.setup_lint import first_batches

    def drawing(rows):
        torch.rand(1), random.random(), np.random.rand()  # what a random crop or masking draws
        ids = torch.tensor([r["input_ids"][:6] for r in rows])
        return {"input_ids": ids, "labels": ids}

    def draws():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    loader = torch.utils.data.DataLoader(Rows(8), batch_size=2, collate_fn=drawing)
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = draws()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert len(first_batches(loader, 2)) == 2
    assert draws() == expected
