"""The user's rows, read, tokenized and measured once: what the probe's stream and the lint share.

`encoded_rows` resolves the recipe's data options against the tokenizer and the model config (which
id pads, how long a row may be) and returns the encoded, memory-mapped rows; `user_batches` picks
the batches a probe trains on from them and collates each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Recipe
from ..errors import NandoctorError
from .collate import Collation, collate
from .encode import IGNORE, Encoding, check_rows, encode
from .read import bad_line, builder_of, open_rows, row_kind
from .select import choose_batches
from .template import generation_eos_ids, trl_training_template, turn_token_ids
from .tokenizer import load_tokenizer, pad_id, tokenizer_dir


@dataclass
class EncodedRows:
    """The user's rows after the scan: `rows` holds the encoded columns (encode.py) of every row."""

    path: str
    kind: str  # read.ROW_KINDS
    rows: Any  # datasets.Dataset
    encoding: Encoding
    collation: Collation
    tokenizer: Any  # None for pre-tokenized rows read without one
    tokenizer_path: str | None
    pad_why: str  # how the pad id was chosen, in words

    def describe(self) -> dict:
        return {
            "source": "file",
            "path": self.path,
            "kind": self.kind,
            "rows": len(self.rows),
            "tokenizer": self.tokenizer_path,
            "pad_id": self.encoding.pad_id,
            "pad": self.pad_why,
            "max_length": self.encoding.max_length,
            "truncation_side": self.encoding.truncation_side,
            "labels": self.encoding.labels,
            "labels_template": self.encoding.trl_template[0] if self.encoding.trl_template else None,
            "padding_side": self.collation.padding_side,
            "packing": self.collation.packing,
        }


def resolve_tokenizer(recipe: Recipe, kind: str, tokenizer=None):
    """(tokenizer, its directory): the one given, else the recipe's (data.tokenizer, then the local
    checkpoint's). Rows other than pre-tokenized ones without any is one NandoctorError."""
    path = tokenizer_dir(recipe)
    if tokenizer is not None:
        return tokenizer, getattr(tokenizer, "name_or_path", None) or path
    if path is not None:
        return load_tokenizer(path, recipe.model.trust_remote_code), path
    if kind != "tokens":
        raise NandoctorError(
            f"data {recipe.data.path!r} holds {kind.replace('_', ' + ')} rows and the model "
            f"({recipe.model.hub_id or recipe.model.path or recipe.name}) has no local tokenizer: pass --tokenizer DIR "
            "(data.tokenizer, a local directory; nothing is downloaded), or give pre-tokenized input_ids"
        )
    return None, None


def readable_rows(recipe: Recipe) -> None:
    """A NandoctorError when the recipe's data.path cannot be read or one of its rows lacks a value of its
    kind: the error encoded_rows would raise, found without a tokenizer or a model, so that a run says it
    before it starts any worker."""
    d = recipe.data
    rows = open_rows(d.path)
    kind = row_kind(rows.column_names, d.path)
    start = 0
    try:
        for batch in rows.iter(batch_size=1000):
            size = len(next(iter(batch.values())))
            check_rows(batch, range(start, start + size), kind, str(d.path))
            start += size
    except UnicodeDecodeError as e:  # text pyarrow kept as it was read decodes only now
        raise not_utf8(d.path, e) from None


def not_utf8(path, error: UnicodeDecodeError) -> NandoctorError:
    """The one line for a file whose text pyarrow read without decoding it: the line that is not UTF-8."""
    where = bad_line(Path(path).expanduser(), builder_of(Path(path)))
    return NandoctorError(f"cannot read data {str(path)!r}: {where or f'text is not UTF-8 ({error})'}")


def encoded_rows(recipe: Recipe, model_config, tokenizer=None) -> EncodedRows:
    """Read, tokenize and measure the recipe's data.path (cached by datasets after the first time)."""
    d = recipe.data
    rows = open_rows(d.path)
    kind = row_kind(rows.column_names, d.path)
    tokenizer, path = resolve_tokenizer(recipe, kind, tokenizer)
    if tokenizer is not None:
        pad, why = pad_id(recipe.pad_token.policy, tokenizer)
        # bos, eos, pad and the like, the tokens the chat template writes between turns, and the
        # generation config's eos ids: the tokens whose use as content and as a target the lint counts
        turns = turn_token_ids(tokenizer) | generation_eos_ids(recipe.model.path)
        special = tuple(sorted(set(tokenizer.all_special_ids) | turns))
        eos = tokenizer.eos_token_id
    else:
        pad, why = pad_id(recipe.pad_token.policy, config=model_config)
        eos = getattr(model_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        own = {t for t in (getattr(model_config, "bos_token_id", None), eos, pad) if t is not None}
        special = tuple(sorted(own | generation_eos_ids(recipe.model.path)))
    encoding = Encoding(
        kind=kind,
        max_length=d.max_length or recipe.seq_len,
        truncation_side=d.truncation_side,
        labels=d.labels,
        pad_id=pad,
        mask_pad_labels=recipe.pad_token.mask_labels,
        eos_id=eos,
        special_ids=special,
        # the chats TRL's assistant_only_loss trains: its training template's where it swaps one in
        trl_template=trl_training_template(tokenizer) if kind == "messages" and d.labels == "completion_only" else None,
    )
    pad_label = IGNORE if d.labels != "pad_id" or recipe.pad_token.mask_labels else pad
    collation = Collation(padding_side=d.padding_side, packing=d.packing, pad_id=pad, pad_label=pad_label)
    try:
        encoded = encode(rows, tokenizer, encoding, str(d.path))
    except UnicodeDecodeError as e:  # text pyarrow kept as it was read decodes only when a row is rendered
        raise not_utf8(d.path, e) from None
    return EncodedRows(str(d.path), kind, encoded, encoding, collation, tokenizer, path, why)


def row_dicts(encoded: EncodedRows, indices) -> list[dict]:
    """The encoded rows at these indices, as dicts of lists (what collate takes)."""
    keys = ("input_ids", "labels", "attention_mask", "position_ids")
    picked = encoded.rows.select(list(indices)).select_columns([k for k in keys if k in encoded.rows.column_names])
    rows = [dict(r) for r in picked]
    for r in rows:
        r["labels"] = r["input_ids"] if r["labels"] is None else r["labels"]  # null: the ids are the labels
    return rows


def scan_columns(encoded: EncodedRows, names: tuple) -> dict:
    """Per-row figures as numpy arrays, read from the memory-mapped columns."""
    return {name: encoded.rows.data.column(name).to_numpy() for name in names}


def user_batches(encoded: EncodedRows, batch_size: int, first: int, seed: int) -> list[tuple[str, tuple, dict]]:
    """[(kind, row indices, tensors)] of the batches a probe trains on (select.py); without block_mask
    packing's dense mask (data.make_batch keeps it out; data.Batch builds it when asked)."""
    columns = scan_columns(encoded, ("length", "supervised"))
    packed = encoded.collation.packing != "none"
    chosen = choose_batches(columns["length"], columns["supervised"], batch_size, first, seed, packed)
    return [(kind, rows, collate(row_dicts(encoded, rows), encoded.collation, False)) for kind, rows in chosen]
