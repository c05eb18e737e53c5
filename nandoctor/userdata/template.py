"""What the tokenizer's chat template says beyond the rows it renders: which special tokens it writes
between turns (Llama 3's <|eot_id|> and header tokens, counted with bos, eos and pad), which template
TRL's assistant_only_loss trains a chat with (TRL's own training template in place of a stock one
without marks), and whether the `{% generation %}` marks that TRL's assistant_only_loss reads (through
transformers' apply_chat_template(return_assistant_tokens_mask=True)) label the same tokens as the
probe, which places its completion mask by rendering each turn's prefix (encode.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .encode import GENERATION_MARK, IGNORE

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


def trl_training_template(tokenizer) -> tuple[str, str] | None:
    """(name, text) of the chat template trl.SFTTrainer(assistant_only_loss=True) renders chats with in
    place of the tokenizer's own: for a template without `{% generation %}` marks, the training template
    that TRL's get_training_chat_template swaps in (sft_trainer.py: `if args.assistant_only_loss and not
    has_generation_markers(...)`), where the template is one of TRL's stock ones (qwen2_5, llama3, ...),
    named by its file in trl/chat_templates. None without TRL, for a template with marks (TRL uses it as
    it is) and for one TRL has no training template for (SFTTrainer then refuses assistant_only_loss)."""
    template = getattr(tokenizer, "chat_template", None)
    template = template.get("default") if isinstance(template, dict) else template
    if not isinstance(template, str) or GENERATION_MARK.search(template):
        return None
    # TRL compares the template with the stock ones it ships as text; importing it costs seconds of CPU
    # (trl.chat_template_utils loads transformers' modeling code and accelerate), so only a template that is
    # one of those files is handed to it
    spec = importlib.util.find_spec("trl")
    shipped = Path(spec.origin).parent / "chat_templates" if spec and spec.origin else None
    if shipped is None or not any(p.read_text(encoding="utf-8") == template for p in shipped.glob("*.jinja")):
        return None
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        return None

    try:
        swapped = get_training_chat_template(tokenizer)
    except ValueError:  # a stock template TRL has no training variant of
        return None
    if swapped is None:
        return None
    named = (p for p in sorted(shipped.glob("*_training.jinja")) if p.read_text(encoding="utf-8") == swapped)
    return next((p.name.removesuffix("_training.jinja") for p in named), "a stock template"), swapped


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
    {% generation %} marks, "trl_template": the name of TRL's training template the probe's labels
    follow (trl_training_template: SFTTrainer swaps it in for a stock template without marks) or None,
    "rows_checked", "rows_differing": rows (of the first MASK_ROWS) whose transformers assistant mask
    (of that training template where there is one), cut to max_length as the probe cut its row, differs
    from the probe's labels (None without marks nor training template: transformers returns all zeros),
    "first_differing": the first such row; without marks nor training template, "mark_after": where
    marks must go to give the probe's mask (generation_mark_places) and "trl_found": whether TRL is
    installed}. rows_checked is 0 when transformers could not return the mask (a slow tokenizer)."""
    tokenizer, enc = encoded.tokenizer, encoded.encoding
    marks = bool(GENERATION_MARK.search(template_text(tokenizer)))
    trl_name, trl_text = enc.trl_template or (None, None)
    n = min(MASK_ROWS, len(encoded.rows))
    check = {"generation_marks": marks, "trl_template": trl_name, "rows_checked": n}
    check.update(rows_differing=None, first_differing=None)
    if not marks and trl_text is None:
        trl_found = importlib.util.find_spec("trl") is not None  # without it, no stock template is recognised
        return {**check, "mark_after": generation_mark_places(tokenizer), "trl_found": trl_found}
    from jinja2 import TemplateError

    differing = []
    for i in range(n):
        row = encoded.rows[i]
        ids = row["input_ids"]
        probed = [t != IGNORE for t in (row["labels"] if row["labels"] is not None else ids)]
        try:
            out = tokenizer.apply_chat_template(
                raw_rows[i]["messages"],
                chat_template=trl_text,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
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
