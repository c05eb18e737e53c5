"""The user's data as tests and benchmarks write it: a real BPE tokenizer trained offline with the
`tokenizers` library and saved as a PreTrainedTokenizerFast with a chat template, and rows in the
formats users keep them in (JSONL, JSON, Parquet, CSV, plain text, save_to_disk)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the cat sat on a mat and the dog ran to the park while birds sang over green hills "
    "what is two plus two four three five seven numbers add answer question please tell me "
    "why does water boil at one hundred degrees because heat moves molecules faster"
).split()
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
# Each turn is its role tag, its content and </s>; a prompt for the assistant ends with its tag.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# CHAT_TEMPLATE with the assistant's tokens marked for return_assistant_tokens_mask, as TRL's
# assistant-only loss needs: the same text, each assistant turn's content and </s> in {% generation %}.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}</s>"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# ChatML, as Qwen's templates write each turn: <|im_start|>role, a newline, the content, <|im_end|>, a newline.
# <|im_start|> and <|im_end|> become special tokens of a tokenizer saved with it.
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# CHATML_TEMPLATE with {% generation %} where the recommendation says to put it: after the generation prompt
# '<|im_start|>assistant\n', and after the turn's '<|im_end|>\n' (as TRL's Qwen3 training template places them)
CHATML_GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template that renders the last assistant turn otherwise than earlier ones, as Qwen3's does (empty
# <think></think> in the last turn only): in a chat of several turns, the conversation up to an
# earlier assistant turn is then not a prefix of the whole.
LAST_TURN_TEMPLATE = (
    "{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<|assistant|><think></think>"
    "{{ m['content'] }}</s>{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def save_chat_tokenizer(path: Path, pad: str | None = "<pad>", template: str = CHAT_TEMPLATE, vocab: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on WORDS in milliseconds, saved with transformers'
    save_pretrained: ids 0-6 are SPECIALS, EOS is </s>. pad: the pad token's text ("<pad>", a
    dedicated special; "</s>", the EOS; an ordinary word such as "the", a real token; None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(0)
    core.train_from_iterator([sentence(rng, 12) for _ in range(400)], trainer)
    special = {"pad_token": pad} if pad is not None else {}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=template,
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"]
        + [t for t in CHATML_TOKENS if t in (template or "")],
        **special,
    )
    fast.save_pretrained(path)
    return path


def chat_rows(n: int, seed: int = 0, answer_words: tuple = (3, 12), question_words: tuple = (3, 12), turns: int = 1):
    """n chats of `turns` user / assistant exchanges."""
    rng = random.Random(seed)
    return [
        {
            "messages": [
                {
                    "role": role,
                    "content": sentence(rng, rng.randint(*(question_words if role == "user" else answer_words))),
                }
                for _ in range(turns)
                for role in ("user", "assistant")
            ]
        }
        for _ in range(n)
    ]


def prompt_completion_rows(n: int, seed: int = 0, prompt_words: tuple = (3, 12), completion_words=(2, 8)) -> list:
    rng = random.Random(seed)
    return [
        {
            "prompt": sentence(rng, rng.randint(*prompt_words)) + "?",
            "completion": " " + sentence(rng, rng.randint(*completion_words)),
        }
        for _ in range(n)
    ]


def text_rows(n: int, seed: int = 0, words: tuple = (4, 30)) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": sentence(rng, rng.randint(*words))} for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    """rows written in the format path's suffix names: .jsonl, .json (a list), .parquet, .csv, .txt
    (one text per line), or a save_to_disk directory (no suffix)."""
    import datasets

    suffix = path.suffix
    if suffix == ".jsonl":
        return write_jsonl(path, rows)
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".txt":
        path.write_text("".join(r["text"] + "\n" for r in rows))
    elif suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif suffix == ".csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path
