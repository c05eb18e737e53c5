"""Which tokenizer reads the user's rows, and which id pads them.

The tokenizer is a local directory: `data.tokenizer`, else the local checkpoint's own. Nothing is
downloaded (local_files_only), so a wrong path says so in one line.
"""

from __future__ import annotations

from pathlib import Path

from ..config import Recipe
from ..errors import NandoctorError

# The files a transformers tokenizer directory is loaded from (fast, config, BPE, WordPiece, SentencePiece)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


def has_tokenizer(path: str | Path | None) -> bool:
    return bool(path) and any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_of(recipe) -> str | None:
    """The tokenizer directory a recipe's rows are read with: data.tokenizer, else the local checkpoint's
    own when it has one; None for none (pre-tokenized rows only)."""
    if recipe.data.tokenizer:
        return recipe.data.tokenizer
    return recipe.model.path if has_tokenizer(recipe.model.path) else None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """A tokenizer from a local directory; never a hub lookup, so a wrong path says so. trust_remote_code:
    the recipe's model.trust_remote_code, so that a checkpoint's own tokenizer class (auto_map) loads as
    its model does, never behind transformers' "run the custom code? [y/N]" prompt."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise NandoctorError(
            f"tokenizer directory {str(path)!r} does not exist; pass a local directory (nothing is downloaded)"
        )
    if not has_tokenizer(path):
        raise NandoctorError(f"tokenizer directory {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise NandoctorError(f"cannot load a tokenizer from {str(path)!r}: {' '.join(str(e).split())}") from None


def tokenizer_dir(recipe: Recipe) -> str | None:
    """The directory the recipe's tokenizer loads from: data.tokenizer, else the local checkpoint's
    own when it has tokenizer files; None for a model without one (a hub twin, a recipe's arch)."""
    if recipe.data.tokenizer:
        return recipe.data.tokenizer
    return recipe.model.path if has_tokenizer(recipe.model.path) else None


def pad_id(policy: str, tokenizer=None, config=None, config_pad: bool = True) -> tuple[int, str]:
    """(the id that pads, how it was chosen, in words) under pad_token.policy: the one pad policy, for
    the user's rows and the synthetic stream alike.

    With a tokenizer: `dedicated` is its own pad token, or its EOS when it has none (as TRL's
    SFTTrainer falls back); `eos` its EOS; `id0` id 0. Without one (pre-tokenized rows, the synthetic
    stream), from the model config: `dedicated` is the config's pad_token_id when `config_pad` and it
    has one, else the last id of the vocabulary (which no synthetic row uses: the synthetic stream
    passes config_pad=False); `eos` the config's (first) EOS id, vocab_size - 2 when it has none."""
    if policy == "id0":
        return 0, "id 0 (pad_token.policy=id0)"
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        if policy == "eos" or tokenizer.pad_token_id is None:
            if eos is None:
                raise NandoctorError(
                    "the tokenizer has neither a pad token nor an EOS token to pad with; "
                    "add a pad token to it, or set pad_token.policy=id0"
                )
            why = "its EOS (pad_token.policy=eos)" if policy == "eos" else "its EOS: the tokenizer has no pad token"
            return eos, why
        return tokenizer.pad_token_id, "the tokenizer's pad token"
    if policy == "eos":
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return (eos, "pad_token.policy=eos") if eos is not None else (config.vocab_size - 2, "pad_token.policy=eos")
    own = getattr(config, "pad_token_id", None)
    if config_pad and own is not None:
        return own, "the model config's pad_token_id"
    return config.vocab_size - 1, "pad_token.policy=dedicated"
