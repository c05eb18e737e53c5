"""Rows to token ids and labels, with the figures the batch selection and the lint read.

One batched `Dataset.map` over every row: texts are rendered (chat template) and tokenized in
batches by the fast tokenizer, truncated to max_length on the chosen side, labelled by the
data.labels policy, and measured. The result is a memory-mapped Arrow file in the datasets cache,
keyed by the rows, the options, the tokenizer and this code, so that every probe of a run (and the
next run) reads it instead of tokenizing again.

Columns written per row:
  input_ids, labels           after truncation (labels: -100 where no loss is taken; null where they
                              are the input_ids themselves, the common case, written once)
  attention_mask, position_ids  only for pre-tokenized rows that carry them
  length, cut                 tokens kept, tokens truncation removed
  supervised, supervised_before_cut
                              targets: labels other than -100 after the shift (position 0 is never one)
  content_pad                 content tokens equal to the pad id
  pad_targets                 padded positions (attention_mask 0) that still carry a label
  misaligned                  a chat whose template output for a prefix of its turns is not a prefix
                              of the whole (the completion mask cannot be placed)
  segments                    sequences in the row (position_ids restarting at 0), 1 for most rows
  empty_answer                the row's last assistant turn (a chat's, a completion, an Alpaca output)
                              has no content and no tool call: it trains the model to answer with nothing
  pre_shifted                 a pre-tokenized row whose given labels are its input_ids shifted by one
                              (the model shifts them again and learns the token two ahead)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import NandoctorError

IGNORE = -100  # the label cross-entropy skips (transformers' and torch's ignore_index)


def segments(positions) -> list[tuple[int, int]]:
    """The [start, end) spans of the sequences packed in one row, from its position_ids (a list or a
    1-D tensor): a sequence starts at the row's first token and wherever the position restarts at 0.
    The one reading of packed position_ids: the collators, the encoded rows' segment count, a rank's
    share of a packed row, the packing check and the live lint all split a row here."""
    positions = positions.tolist() if hasattr(positions, "tolist") else list(positions)
    starts = [i for i, p in enumerate(positions) if p == 0 or i == 0] + [len(positions)]
    return [(a, b) for a, b in zip(starts, starts[1:]) if b > a]


@dataclass(frozen=True)
class Encoding:
    """How rows become token ids and labels: the recipe's data options, resolved."""

    kind: str  # read.ROW_KINDS
    max_length: int
    truncation_side: str
    labels: str  # config.LABEL_MASKS
    pad_id: int
    mask_pad_labels: bool  # pad_token.mask_labels: with labels=pad_id, pad ids get -100
    eos_id: int | None
    special_ids: tuple  # ids whose use as a target is counted
    # chat rows labelled completion_only: (name, text) of the template TRL's assistant_only_loss renders them
    # with in place of the tokenizer's own (template.trl_training_template), None where it uses that one
    trl_template: tuple[str, str] | None = None


def _render(tokenizer, messages: list, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _chat_spans(tokenizer, messages: list) -> tuple[str, list, bool]:
    """(the rendered chat, the character spans of its assistant turns, whether every prefix rendered as
    a prefix of the whole). A turn's span runs from the end of the conversation before it with the
    generation prompt, to the end of the conversation up to it."""
    full = _render(tokenizer, messages)
    spans, aligned = [], True
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[: i + 1])
        if not (full.startswith(before) and full.startswith(through)):
            aligned = False
            continue
        spans.append((len(before), len(through)))
    return full, spans, aligned


def alpaca_prompt(instruction: str, given: str | None, chat: bool):
    """An Alpaca row's instruction and optional input as the prompt its output completes: one user
    turn (a chat template renders it) where the tokenizer has a chat template, else plain text that
    ends in a blank line before the output."""
    text = instruction + (f"\n\n{given}" if given else "")
    return [{"role": "user", "content": text}] if chat else text + "\n\n"


def _texts(batch: dict, kind: str, tokenizer, completion_only: bool) -> tuple[list, list, list, bool]:
    """(texts, supervised character spans per text or None for all, aligned flags, add_special_tokens)."""
    if kind == "alpaca":
        chat = tokenizer.chat_template is not None
        given = batch.get("input") or [None] * len(batch["instruction"])
        prompts = [alpaca_prompt(i, g, chat) for i, g in zip(batch["instruction"], given)]
        completions = [[{"role": "assistant", "content": o}] if chat else o for o in batch["output"]]
        return _texts({"prompt": prompts, "completion": completions}, "prompt_completion", tokenizer, completion_only)
    if kind == "text":
        return batch["text"], [None] * len(batch["text"]), [True] * len(batch["text"]), True
    if kind == "messages" and not completion_only:  # one call renders the batch
        n = len(batch["messages"])
        return _render(tokenizer, batch["messages"]), [None] * n, [True] * n, False
    if kind == "messages":
        rendered = [_chat_spans(tokenizer, m) for m in batch["messages"]]
        return [r[0] for r in rendered], [r[1] for r in rendered], [r[2] for r in rendered], False
    texts, spans, aligned = [], [], []
    conversational = isinstance(batch["prompt"][0], list)
    for prompt, completion in zip(batch["prompt"], batch["completion"]):
        if conversational:
            start, full = _render(tokenizer, prompt, generation_prompt=True), _render(tokenizer, prompt + completion)
        else:
            start, full = prompt, prompt + completion
        texts.append(full)
        aligned.append(full.startswith(start))
        spans.append([(len(start), len(full))] if aligned[-1] else [])
    return texts, spans, aligned, not conversational


GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # a template's {% generation %} block


def generation_marked(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks the assistant's tokens ({% generation %}), so that one
    render says which they are (return_assistant_tokens_mask)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and GENERATION_MARK.search(template) is not None


def _marked_chats(tokenizer, chats: list, template: str | None) -> tuple[list, list]:
    """(token ids, supervised flags) of each chat, from one render and one tokenization of the batch with
    the generation marks of `template` (None: the tokenizer's own), as TRL's assistant-only loss reads
    them: each assistant turn's prefix is not rendered again (_chat_spans does that for templates without
    marks)."""
    out = tokenizer.apply_chat_template(
        chats, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return out["input_ids"], [[bool(m) for m in mask] for mask in out["assistant_masks"]]


def _supervised_mask(offsets: list, spans: list | None) -> list[bool]:
    """Which tokens begin inside one of the spans (None: every token)."""
    if spans is None:
        return [True] * len(offsets)
    return [any(a <= start < b for a, b in spans) and end > start for start, end in offsets]


# what each kind of row holds, per column: (the types a value may have, in words)
ROW_TYPES = {
    "tokens": {"input_ids": ((list,), "a list of token ids")},
    "messages": {"messages": ((list,), "a list of {role, content} messages")},
    "prompt_completion": {
        "prompt": ((str, list), "a string, or a list of {role, content} messages"),
        "completion": ((str, list), "a string, or a list of {role, content} messages"),
    },
    "alpaca": {"instruction": ((str,), "a string"), "output": ((str,), "a string")},
    "text": {"text": ((str,), "a string")},
}


def check_rows(batch: dict, indices: list, kind: str, path: str) -> None:
    """A NandoctorError naming the first row (its index, counting from 0) whose value is missing or
    of the wrong type for its kind: rendering or tokenizing it would fail deep inside transformers."""
    for column, (types, valid) in ROW_TYPES[kind].items():
        for i, value in zip(indices, batch[column]):
            if value is None or not isinstance(value, types):
                what = "missing (null)" if value is None else f"a {type(value).__name__}, {_short(value)}"
            elif kind != "tokens" and isinstance(value, list) and not all(isinstance(m, dict) for m in value):
                what = f"a list holding {_short(value)}"
            else:
                continue
            raise NandoctorError(f"data {path!r} row {i} (counting from 0): `{column}` is {what}; it must be {valid}")
    if kind == "prompt_completion":
        forms = {isinstance(v, list) for column in ("prompt", "completion") for v in batch[column]}
        if len(forms) > 1:
            raise NandoctorError(f"data {path!r}: rows mix plain-text and message-list prompts or completions; use one")


def _blank(content) -> bool:
    """No text: None, whitespace, or an empty list of content parts."""
    return not content.strip() if isinstance(content, str) else content is None or content == []


def _empty_answer(batch: dict, i: int, kind: str) -> bool:
    """Whether row i's last assistant turn is empty (_blank) and calls no tool (an assistant turn that only
    calls a tool has no content by design)."""
    if kind == "alpaca":
        return _blank(batch["output"][i])
    if kind == "prompt_completion" and isinstance(batch["completion"][i], str):
        return _blank(batch["completion"][i])
    if kind not in ("messages", "prompt_completion"):
        return False
    turns = batch["messages"][i] if kind == "messages" else batch["completion"][i]
    last = next((m for m in reversed(turns) if m.get("role") == "assistant"), None)
    return last is not None and _blank(last.get("content")) and not last.get("tool_calls")


def _pre_shifted(ids: list, labels: list | None) -> bool:
    """Whether a row's given labels are its input_ids already shifted by one: label i is token i + 1 at
    nine in ten supervised positions or more, and token i itself at fewer than half (a row of one repeated
    token matches both, and says nothing). At least 4 supervised positions."""
    if labels is None:
        return False
    pairs = [(i, y) for i, y in enumerate(labels[:-1]) if y != IGNORE]
    if len(pairs) < 4:
        return False
    ahead = sum(y == ids[i + 1] for i, y in pairs)
    same = sum(y == ids[i] for i, y in pairs)
    return ahead >= 0.9 * len(pairs) and same < 0.5 * len(pairs)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def encode_rows(batch: dict, indices: list, tokenizer, enc: Encoding, path: str = "") -> dict:
    """A batch of rows (columns of lists, as Dataset.map passes them, and their row indices) to the
    encoded columns."""
    completion_only = enc.labels == "completion_only"
    n = len(next(iter(batch.values())))
    check_rows(batch, indices, enc.kind, path)
    if enc.kind == "tokens":
        ids_rows = batch["input_ids"]
        given_labels = batch.get("labels") or [None] * n
        masks = batch.get("attention_mask") or [None] * n
        positions = batch.get("position_ids") or [None] * n
        chosen = [None] * n
        aligned = [True] * n
        if completion_only and batch.get("labels") is None:
            raise NandoctorError(
                "data.labels=completion_only on pre-tokenized rows needs their `labels` column "
                "(nandoctor cannot tell the completion from the ids alone)"
            )
    elif enc.kind == "messages" and completion_only and (enc.trl_template or generation_marked(tokenizer)):
        ids_rows, chosen = _marked_chats(tokenizer, batch["messages"], enc.trl_template and enc.trl_template[1])
        aligned = [True] * n
        given_labels = masks = positions = [None] * n
    else:
        texts, spans, aligned, special = _texts(batch, enc.kind, tokenizer, completion_only)
        encoded = tokenizer(
            texts, add_special_tokens=special, return_offsets_mapping=completion_only, return_attention_mask=False
        )
        ids_rows = encoded["input_ids"]
        chosen = (
            [_supervised_mask(offsets, s) for offsets, s in zip(encoded["offset_mapping"], spans)]
            if completion_only
            else [None] * n
        )
        if enc.kind in ("prompt_completion", "alpaca") and special and enc.eos_id is not None:
            # a plain-text completion ends with EOS, as TRL appends it, so that the model learns to stop
            for i, ids in enumerate(ids_rows):
                if not ids or ids[-1] != enc.eos_id:
                    ids_rows[i] = ids + [enc.eos_id]
                    if chosen[i] is not None:
                        chosen[i] = chosen[i] + [bool(spans[i])]
        given_labels = masks = positions = [None] * n
    cols = ("input_ids", "labels", "length", "cut", "supervised", "supervised_before_cut", "content_pad", "pad_targets")
    out = {key: [] for key in cols}
    given = [k for k in ("attention_mask", "position_ids") if enc.kind == "tokens" and batch.get(k) is not None]
    out.update({k: [] for k in given})
    keep_at_most, left, pad = enc.max_length, enc.truncation_side == "left", enc.pad_id
    for i in range(n):
        ids, mask, pos = ids_rows[i], masks[i], positions[i]
        labels = _labels(ids, given_labels[i], mask, chosen[i], enc)
        total = len(ids)
        before = after = _targets(labels)
        if total > keep_at_most:
            cut = (lambda v: v[-keep_at_most:]) if left else (lambda v: v[:keep_at_most])
            same = labels is ids
            ids = cut(ids)
            labels = ids if same else cut(labels)
            mask, pos = (cut(mask) if mask is not None else None), (cut(pos) if pos is not None else None)
            after = _targets(labels)
        out["input_ids"].append(ids)
        out["labels"].append(None if labels is ids else labels)  # null: the labels are the input_ids
        out["length"].append(len(ids))
        out["cut"].append(total - len(ids))
        out["supervised"].append(after)
        out["supervised_before_cut"].append(before)
        if mask is None:
            out["content_pad"].append(ids.count(pad))
            out["pad_targets"].append(0)
        else:
            out["content_pad"].append(sum(1 for t, m in zip(ids, mask) if m and t == pad))
            out["pad_targets"].append(sum(1 for m, y in zip(mask, labels) if not m and y != IGNORE))
        if "attention_mask" in out:
            out["attention_mask"].append(mask)
        if "position_ids" in out:
            out["position_ids"].append(pos)
    out["misaligned"] = [not a for a in aligned]
    out["empty_answer"] = [_empty_answer(batch, i, enc.kind) for i in range(n)]
    out["pre_shifted"] = [_pre_shifted(ids_rows[i], given_labels[i]) for i in range(n)]
    out["segments"] = [len(segments(p)) or 1 if p is not None else 1 for p in positions]
    return out


def _labels(ids: list, given: list | None, mask: list | None, chosen: list | None, enc: Encoding) -> list:
    """A row's labels: the given ones, else by the data.labels policy. Padding the collator adds later
    is labelled there."""
    if given is not None:
        if len(given) != len(ids):
            raise NandoctorError(
                f"a pre-tokenized row has {len(ids)} input_ids and {len(given)} labels; they must match"
            )
        return list(given)
    if chosen is not None:
        return [t if c else IGNORE for t, c in zip(ids, chosen)]
    if enc.labels == "pad_id" and enc.mask_pad_labels and enc.pad_id in ids:
        return [IGNORE if t == enc.pad_id else t for t in ids]
    if enc.labels == "attention_mask" and mask is not None and 0 in mask:
        return [t if m else IGNORE for t, m in zip(ids, mask)]
    return ids  # every token a label: the same list serves both columns


def _targets(labels: list) -> int:
    """Loss terms of a row: its labels after the causal shift (labels[1:]) that are not ignored."""
    return max(0, len(labels) - 1 - labels.count(IGNORE) + (labels[0] == IGNORE if labels else 0))


def _features(kind: str, columns: list[str]):
    from datasets import Features, List, Value

    ids = List(Value("int32"))
    features = {"input_ids": ids, "labels": ids}
    features.update({k: Value("int32") for k in ("length", "cut", "supervised", "supervised_before_cut")})
    features.update({"content_pad": Value("int32"), "pad_targets": Value("int32")})
    features.update({"misaligned": Value("bool"), "segments": Value("int32"), "empty_answer": Value("bool")})
    features["pre_shifted"] = Value("bool")
    if kind == "tokens":
        features.update({k: ids for k in ("attention_mask", "position_ids") if k in columns})
    return Features(features)


def cache_root() -> Path:
    """Where encoded rows are kept: the datasets cache (HF_DATASETS_CACHE, read at call time)."""
    import datasets

    return Path(os.environ.get("HF_DATASETS_CACHE") or datasets.config.HF_DATASETS_CACHE) / "nandoctor-encoded"


def encode(rows, tokenizer, enc: Encoding, path: str = ""):
    """The encoded rows (columns above) as a memory-mapped Dataset, computed once per (rows, options,
    tokenizer, this code) and read from the datasets cache afterwards. A chat template that fails on a
    row, a row missing its text or holding the wrong type, or rows the options cannot label, is a
    NandoctorError saying what failed; `path` names the data in it."""
    from datasets.fingerprint import Hasher
    from jinja2 import TemplateError

    if enc.kind == "messages" or (enc.kind == "prompt_completion" and isinstance(rows[0]["prompt"], list)):
        if tokenizer.chat_template is None:
            raise NandoctorError(
                "the tokenizer has no chat template; chat rows (messages, or prompt/completion turns) are "
                "rendered with it: pass a tokenizer directory whose tokenizer_config.json has one"
            )
    # datasets hashes a module's functions by name, not by code: this file's text keys the cache instead;
    # _fingerprint is how datasets itself identifies a data set's content (no public accessor)
    fingerprint = Hasher.hash((rows._fingerprint, enc, tokenizer, Path(__file__).read_bytes()))
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    try:
        return rows.map(
            encode_rows,
            batched=True,
            with_indices=True,
            fn_kwargs={"tokenizer": tokenizer, "enc": enc, "path": path},
            remove_columns=rows.column_names,
            features=_features(enc.kind, rows.column_names),
            cache_file_name=str(root / f"{fingerprint}.arrow"),
            new_fingerprint=fingerprint,
            load_from_cache_file=True,
        )
    except TemplateError as e:
        raise NandoctorError(f"the tokenizer's chat template fails on a row of {path!r}: {e}") from None
