"""What trl.SFTTrainer takes that transformers.Trainer does not, built for a probe (child/trainer.py): a
`datasets.Dataset` of the probe's own rows and a tokenizer (`processing_class`).

The rows are the probe's batches in its step order, each row without its padding, pre-tokenized with
`input_ids` and the stream's `labels`: SFTTrainer then does no tokenizing and builds no labels of its own
(a `labels` column is kept as given), and its collator pads each micro-batch again. The tokenizer is
the recipe's (--tokenizer, or the checkpoint's own) where the rows came from the user's data; for the
synthetic stream, a word-level tokenizer with one token per id of the model's vocabulary and the
stream's pad id as its pad token, which is all SFTTrainer reads of it here (pad and eos ids, the vocab).

What SFTTrainer then trains differently from the own loop is measured on its prepared dataset and said
in the record (`sft_trains`): its loss is its fused LM head's (chunked log-probs of the labelled
positions), its collator re-pads, and the user's max_length / packing / padding_free apply.
"""

from __future__ import annotations

from ..record import ProbeSpec
from .build import Setup

# The SFTConfig's token fields as to_json_string() writes them: masked (`<PAD_TOKEN>`), so unknowable
MASKED_TOKENS = {"pad_token": "<PAD_TOKEN>", "eos_token": "<EOS_TOKEN>"}


def probe_rows(spec: ProbeSpec, s: Setup) -> list[dict]:
    """The rows of every micro-batch the probe's steps train, in order, each {input_ids, labels} without
    the positions its attention mask leaves out (the collator pads them again)."""
    micro_batches = spec.recipe.gradient_accumulation_steps
    out = []
    for step in range(spec.steps):
        for batch in s.stream.step_batches(step, micro_batches):
            t = batch.tensors
            mask = t.get("attention_mask")
            for i, ids in enumerate(t["input_ids"]):
                keep = mask[i].bool() if mask is not None and mask.dim() == 2 else slice(None)
                out.append({"input_ids": ids[keep].tolist(), "labels": t["labels"][i][keep].tolist()})
    return out


def vocab_tokenizer(vocab_size: int, pad: int):
    """A tokenizer whose vocabulary is the model's ids (`<t{id}>`), pad (and eos) the stream's pad id; a
    text of such tokens separated by spaces is tokenized back to its ids, adding none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token=f"<t{pad}>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token=f"<t{pad}>", eos_token=f"<t{pad}>")


def processing_class(spec: ProbeSpec, s: Setup, args):
    """The tokenizer SFTTrainer is given, and `args` without the token fields it cannot take: the masked
    ones always, the user's pad_token / eos_token too for the synthetic stream (no text to name them)."""
    from ..data import pad_id
    from ..userdata.tokenizer import load_tokenizer, tokenizer_of

    for field, masked in MASKED_TOKENS.items():
        if getattr(args, field, None) == masked:
            setattr(args, field, None)
    args.chat_template_path = None  # the rows are tokenized already
    path = tokenizer_of(spec.recipe) if spec.recipe.data.source == "file" else None
    if path:
        return load_tokenizer(path, spec.recipe.model.trust_remote_code)
    args.pad_token = args.eos_token = None
    return vocab_tokenizer(s.model.config.vocab_size, pad_id(spec.recipe, s.model.config))


def sft_trainer(trainer_class, spec: ProbeSpec, s: Setup, args, callbacks: list):
    """An SFTTrainer of `s.model` over the probe's rows (`probe_rows`), and what it trains differently
    from the own loop, measured on its prepared dataset (`sft_trains`)."""
    from datasets import Dataset

    rows = probe_rows(spec, s)
    tokenizer = processing_class(spec, s, args)
    trainer = trainer_class(
        model=s.model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    return trainer, sft_trains(rows, trainer)


def supervised(labels: list) -> int:
    """A row's loss terms: labels other than -100 after the causal shift."""
    return sum(y != -100 for y in labels[1:])


def sft_trains(rows: list[dict], trainer) -> dict:
    """What SFTTrainer trains against the own loop's rows: its loss, collator, the options that reshape
    the rows, and the rows, tokens and loss terms before and after its dataset preparation."""
    args, prepared = trainer.args, trainer.train_dataset
    after = prepared["labels"] if "labels" in prepared.column_names else prepared["input_ids"]
    return {
        "loss": "trl fused LM head: chunked log-probs of the labelled positions, summed over num_items_in_batch",
        "collator": type(trainer.data_collator).__name__,
        "max_length": args.max_length,
        "packing": bool(args.packing),
        "padding_free": bool(trainer.padding_free),
        "order": "the probe's (train_sampling_strategy=sequential, shuffle_dataset=False)",
        "rows": {"own": len(rows), "trainer": len(prepared)},
        "tokens": {"own": sum(len(r["input_ids"]) for r in rows), "trainer": sum(len(y) for y in after)},
        "supervised": {"own": sum(supervised(r["labels"]) for r in rows), "trainer": sum(supervised(y) for y in after)},
    }
