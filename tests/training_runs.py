"""Real training runs with real frameworks on the tiny Llama, as a user would write them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from checkpoints import TINY


# nandoctor's callback modules, imported when a test first asks for one: a test module that reaches its
# callback this way (never as a module-level name, which pytest inspects while it collects) is collected
# without `import lightning` or peft (seconds each, in every xdist worker), and only the worker that runs
# its tests pays for them.
def nandoctor_lightning():
    return importlib.import_module("nandoctor.integrations.lightning")


def nandoctor_transformers():
    return importlib.import_module("nandoctor.integrations.transformers")


# A Lightning Trainer that writes and prints nothing of its own: what every test fit passes
QUIET_LIGHTNING = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
QUIET_TRAINING_ARGS = dict(
    report_to=[],
    save_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    logging_steps=1,
    per_device_train_batch_size=4,
    seed=0,
)


class MotifRows(torch.utils.data.Dataset):
    """Rows that repeat a random 8-token motif, like the probes' synthetic stream: learnable in a few steps."""

    def __init__(self, rows: int = 32, vocab: int = TINY["vocab_size"], seq_len: int = 64, labels: str = "labels"):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab - 1, (rows, 8), generator=g).repeat(1, seq_len // 8)
        self.labels = labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], self.labels: self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


class JsonlRows(torch.utils.data.Dataset):
    """Pre-tokenized rows of a JSONL file (input_ids, labels), as `grid --data` reads the same file: each
    row a dict of tensors with an attention mask of ones."""

    def __init__(self, path: Path):
        self.rows = [json.loads(line) for line in Path(path).read_text().splitlines()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids, labels = (torch.tensor(self.rows[i][k]) for k in ("input_ids", "labels"))
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def tiny_llama(dtype=torch.float32, path: Path | None = None, attn: str = "sdpa", trust_remote_code: bool = False):
    """The tiny Llama: random-init from its config, or loaded from a checkpoint directory (one with its own
    modeling code: trust_remote_code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
        )
    else:
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("llama", **TINY), dtype=dtype, attn_implementation=attn
        )
    model.config.use_cache = False
    return model


def hf_trainer(model, out: Path, callbacks=(), data=None, data_collator=None, **args):
    """A transformers Trainer of `model` on `data` (a Dataset; default MotifRows) through `data_collator`
    (default: the Trainer's) with QUIET_TRAINING_ARGS and `args` over them."""
    from transformers import Trainer, TrainingArguments

    return Trainer(
        model=model,
        args=TrainingArguments(str(out), **{**QUIET_TRAINING_ARGS, **args}),
        train_dataset=MotifRows() if data is None else data,
        data_collator=data_collator,
        callbacks=list(callbacks),
    )


def lightning_fit(
    model,
    out: Path,
    precision: str | None,
    callbacks=(),
    max_steps: int = 6,
    lr: float = 1e-3,
    plugins=(),
    loss_weight: float = 1.0,
    fused: bool | None = None,
    data=None,
):
    """Trainer.fit() of a LightningModule that wraps the model and logs its loss (times loss_weight) on
    `data` (a Dataset, in order, 4 rows a batch; default MotifRows); returns (trainer, module). plugins:
    e.g. a precision plugin, with precision=None."""
    import lightning as L

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.losses = []  # every loss training_step computed, as the module saw it

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss * loss_weight
            self.log("train_loss", loss)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr, eps=1e-8, fused=fused)

    module = CausalLM()
    trainer = L.Trainer(
        max_steps=max_steps,
        precision=precision,
        plugins=list(plugins),
        accelerator="cpu",
        devices=1,
        **QUIET_LIGHTNING,
        callbacks=list(callbacks),
        default_root_dir=str(out),
    )
    trainer.fit(module, torch.utils.data.DataLoader(MotifRows() if data is None else data, batch_size=4))
    return trainer, module


def saved_arguments(config, path, **settings):
    """A real TrainingArguments or TRL config (`config`, the class) as the user saves it
    (to_json_string()), written to `path`: the own loop's optimizer settings (lr 1e-3 unless given, no
    schedule, clipping at 1), no reports, `settings` over them."""
    own_loop = {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "max_grad_norm": 1.0, "report_to": "none"}
    args = config(output_dir=str(path.parent / "user-output"), **{**own_loop, **settings})
    path.write_text(args.to_json_string())
    return path
