"""What the tokenizer's chat template says beyond the rows it renders: which special tokens it writes
between turns (Llama 3's <|eot_id|> and header tokens, counted with bos, eos and pad), and whether the
`{% generation %}` marks that TRL's assistant_only_loss reads (through transformers'
apply_chat_template(return_assistant_tokens_mask=True)) label the same tokens as the probe, which
places its completion mask by rendering each turn's prefix (encode.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .encode import IGNORE

GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Rows whose two masks are compared: the first ones of the file (each check renders one chat).
MASK_ROWS = 32


def template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one string ("" for none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def turn_token_ids(tokenizer) -> set[int]:
    """The special added tokens the chat template writes itself (an end of turn, a role header)."""
    text = template_text(tokenizer)
    if not text:
        return set()
    return {i for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content in text}


def generation_eos_ids(model_dir: str | None) -> set[int]:
    """The eos_token_id(s) of a checkpoint's generation_config.json (Llama 3.1 Instruct lists
    <|end_of_text|>, <|eom_id|> and <|eot_id|>); empty without one."""
    path = Path(model_dir) / "generation_config.json" if model_dir else None
    if path is None or not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    ids = eos if isinstance(eos, list) else [eos]
    return {i for i in ids if isinstance(i, int)}


# the assistant turn a template is rendered with to find where its marks go (generation_mark_places)
_ANSWER = "nandoctor answer"


def generation_mark_places(tokenizer) -> list[str] | None:
    """[the text `{% generation %}` goes right after, the text `{% endgeneration %}` goes right after] in
    an assistant turn, for the template's marks to give exactly the probe's mask (encode._chat_spans): the
    generation prompt (ChatML's '<|im_start|>assistant\\n') and what the turn renders after its content
    ('<|im_end|>\\n', the newline included). None where the template fails on a user / assistant chat or
    renders the prompt otherwise than as a prefix of the turn."""
    from jinja2 import TemplateError

    user = [{"role": "user", "content": "nandoctor question"}]
    try:
        plain = tokenizer.apply_chat_template(user, tokenize=False)
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        turn = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": _ANSWER}], tokenize=False)
    except (TemplateError, ValueError, TypeError):
        return None
    if not (prompt.startswith(plain) and turn.startswith(prompt) and _ANSWER in turn[len(prompt) :]):
        return None
    return [prompt[len(plain) :], turn[turn.rindex(_ANSWER) + len(_ANSWER) :]]


def assistant_mask_check(encoded, raw_rows) -> dict:
    """For chat rows labelled completion_only: {"generation_marks": whether the template has
    {% generation %} marks, "rows_checked", "rows_differing": rows (of the first MASK_ROWS) whose
    transformers assistant mask, cut to max_length as the probe cut its row, differs from the probe's
    labels (None without marks: transformers returns all zeros), "first_differing": the first such row,
    "mark_after": where marks must go to give the probe's mask (generation_mark_places), without marks};
    rows_checked is 0 when transformers could not return the mask (a slow tokenizer)."""
    tokenizer, enc = encoded.tokenizer, encoded.encoding
    marks = bool(GENERATION_MARK.search(template_text(tokenizer)))
    n = min(MASK_ROWS, len(encoded.rows))
    check = {"generation_marks": marks, "rows_checked": n, "rows_differing": None, "first_differing": None}
    if not marks:
        return {**check, "mark_after": generation_mark_places(tokenizer)}
    from jinja2 import TemplateError

    differing = []
    for i in range(n):
        row = encoded.rows[i]
        ids = row["input_ids"]
        probed = [t != IGNORE for t in (row["labels"] if row["labels"] is not None else ids)]
        try:
            out = tokenizer.apply_chat_template(
                raw_rows[i]["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except (TemplateError, ValueError, TypeError):  # a slow tokenizer cannot return the mask
            return {**check, "rows_checked": 0}
        theirs, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if len(theirs) > enc.max_length:
            keep = slice(-enc.max_length, None) if enc.truncation_side == "left" else slice(enc.max_length)
            theirs, mask = theirs[keep], mask[keep]
        if theirs != ids or [bool(m) for m in mask] != probed:
            differing.append(i)
    check.update(rows_differing=len(differing), first_differing=differing[0] if differing else None)
    return check
