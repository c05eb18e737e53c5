"""The one exception type for errors the user caused, and how its messages suggest a valid choice.
Foundation module: imports nothing from nandoctor."""

from __future__ import annotations

import difflib


class NandoctorError(Exception):
    """An error the user caused (bad model, axis, recipe, run directory). The CLI prints it as one line
    and exits 2; nothing else should catch it."""


def did_you_mean(word: str, valid, n: int = 1) -> str:
    """' did you mean X?' for the valid choice closest to a mistyped word (' did you mean X or Y?' for the
    n closest), or '' when none is close; meant to sit between '...;' and ' valid: ...' in a message.
    Close: difflib's similarity of 0.75 or more, which a typo reaches (bf16amp / bf16-amp 0.93, optimiser
    / optimizer 0.89) and another word does not (precision / partition 0.67: naming it would mislead)."""
    close = difflib.get_close_matches(str(word), [str(v) for v in valid], n=n, cutoff=0.75)
    return f" did you mean {' or '.join(close)}?" if close else ""
