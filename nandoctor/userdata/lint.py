"""The data and setup lint: every row of the user's data measured, with no training, and the findings
of the rule table (knowledge/rules.yaml, scope data) that the figures fire, each with its measured
sentence, a public reference and a fix.

`doctor.data_lint` is what `nandoctor doctor --data` (and every grid, check and bisect) runs: `scan`
reads the encoded rows (encode.py) column by column from the memory-mapped Arrow file, so its memory
stays flat in the file's size:

- label coverage: supervised tokens per row (a histogram), the rows and in-order batches with none,
  and why (truncation, a chat the completion mask cannot be placed in, nothing to learn to begin with);
- rows whose last assistant turn is empty (they train the model to answer with nothing);
- pre-tokenized rows whose labels are already shifted by one (the model shifts them again);
- special tokens: how often each is content and how often a target (is EOS ever one?);
- pad token: a pad id that is also content, and padded positions that carry a label;
- token ids beyond the model's vocabulary;

and, measured on the user's model class by nandoctor/measure/lint.py: packing isolation, gradient
accumulation against the full batch, embedding rows the data uses that were never trained and that
nothing trains, and the trainable groups one backward leaves without a gradient. `findings` matches
the rules against the figures and what the judge (analysis/verdicts.setup_judged) makes of them.
"""

from __future__ import annotations

from ..config import Recipe
from ..knowledge import Rule, evaluate
from ..knowledge import finding as rule_finding
from .encode import IGNORE
from .rows import EncodedRows, scan_columns

HISTOGRAM_BINS = 12
EXAMPLES = 5  # rows named in a finding's figure


def finding(rule: Rule, figure: str) -> dict:
    """One fired rule as a doctor finding of the user's own setup, with the sentence of what was
    measured (`figure`)."""
    return {**rule_finding(rule, [], figure), "scope": "setup"}


def findings(facts: dict) -> list[dict]:
    """The data rules the figures fire, most severe first, as the doctor's findings (with `figure`)."""
    return [finding(r, r.figure.format(**facts)) for r in evaluate(facts, "data")]


def histogram(values, bins: int = HISTOGRAM_BINS) -> dict:
    """Integer-edged histogram of non-negative counts: {"edges": [b0, ..., bn], "counts": [...]}, bin i
    holding values in [edges[i], edges[i+1]) (the last bin closed)."""
    import numpy as np

    values = np.asarray(values)
    top = int(values.max()) if len(values) else 0
    width = max(1, -(-(top + 1) // bins))
    edges = list(range(0, top + width + 1, width))[: bins + 1]
    counts, _ = np.histogram(values, bins=edges)
    return {"edges": [int(e) for e in edges], "counts": [int(c) for c in counts]}


def _examples(mask) -> str:
    import numpy as np

    rows = np.flatnonzero(mask)[:EXAMPLES].tolist()
    return ", ".join(map(str, rows)) + (" ..." if int(mask.sum()) > EXAMPLES else "") if rows else "-"


def token_counts(encoded: EncodedRows, vocab: int) -> tuple:
    """(times each id < vocab occurs as content, times each is a target, tokens with ids >= vocab, the
    largest id), read chunk by chunk from the memory-mapped columns. A target is a label other than
    -100 after the causal shift (a row's first label never is); a null labels row is its input_ids."""
    import numpy as np

    content, targets = np.zeros(vocab, dtype=np.int64), np.zeros(vocab, dtype=np.int64)
    beyond, largest = 0, -1
    for batch in encoded.rows.data.to_batches():  # aligned slices of every column, memory-mapped
        ids, labels = batch.column("input_ids"), batch.column("labels")
        values = ids.flatten().to_numpy()
        if "attention_mask" in batch.schema.names:
            values = values[batch.column("attention_mask").flatten().to_numpy(zero_copy_only=False).astype(bool)]
        if len(values):
            largest = max(largest, int(values.max()))
            beyond += int((values >= vocab).sum())
            content += np.bincount(values[values < vocab], minlength=vocab)
        for part in (ids.filter(labels.is_null()), labels.filter(labels.is_valid())):
            ys = part.flatten().to_numpy()
            offsets = part.offsets.to_numpy()
            firsts = offsets[:-1][offsets[1:] > offsets[:-1]] - offsets[0]
            keep = np.ones(len(ys), dtype=bool)
            keep[firsts] = False
            ys = ys[keep & (ys != IGNORE)]
            targets += np.bincount(ys[ys < vocab], minlength=vocab)
    return content, targets, beyond, largest


def _token_text(tokenizer, token_id) -> str:
    if tokenizer is None or token_id is None:
        return f"id {token_id}"
    return repr(tokenizer.convert_ids_to_tokens(int(token_id)))


def scan(encoded: EncodedRows, recipe: Recipe, model_config) -> tuple[dict, dict, object]:
    """(facts, section, content counts): the figures the rules read, the data section's tables and
    histograms, and how often each id occurs as content (token_counts)."""
    import numpy as np

    c = scan_columns(
        encoded,
        (
            "length",
            "cut",
            "supervised",
            "supervised_before_cut",
            "content_pad",
            "pad_targets",
            "misaligned",
            "segments",
            "empty_answer",
            "pre_shifted",
        ),
    )
    n, B = len(c["length"]), recipe.batch_size
    none = c["supervised"] == 0
    cut_to_none = none & (c["supervised_before_cut"] > 0)
    misaligned = c["misaligned"].astype(bool)
    empty_answer = c["empty_answer"].astype(bool)
    pre_shifted = c["pre_shifted"].astype(bool)
    in_order = np.add.reduceat(c["supervised"], np.arange(0, n, B))  # supervised tokens per batch, in order
    vocab = model_config.vocab_size
    whole = c["length"] + c["cut"]  # each row's length before truncation
    p95 = int(np.ceil(np.percentile(whole, 95))) if n else 0
    content, target_counts, beyond, largest = token_counts(encoded, vocab)
    targets = {t: int(target_counts[t]) for t in encoded.encoding.special_ids if t < vocab}
    enc, tok = encoded.encoding, encoded.tokenizer
    facts = {
        "rows": n,
        "batch_size": B,
        "max_length": enc.max_length,
        "truncation_side": enc.truncation_side,
        "labels": enc.labels,
        "rows_without_supervised": int(none.sum()),
        "rows_without_supervised_examples": _examples(none),
        "rows_cut_to_none": int(cut_to_none.sum()),
        "rows_misaligned": int(misaligned.sum()),
        "rows_misaligned_examples": _examples(misaligned),
        "rows_never_supervised": int((none & ~cut_to_none & ~misaligned).sum()),
        "rows_empty_answer": int(empty_answer.sum()),
        "rows_empty_answer_examples": _examples(empty_answer),
        "rows_pre_shifted": int(pre_shifted.sum()),
        "rows_pre_shifted_examples": _examples(pre_shifted),
        "batches_in_order": len(in_order),
        "batches_without_supervised": int((in_order == 0).sum()),
        "rows_truncated": int((c["cut"] > 0).sum()),
        "rows_truncated_share": float((c["cut"] > 0).mean()) if n else 0.0,
        "rows_truncated_percent": round(100 * float((c["cut"] > 0).mean())) if n else 0,
        "tokens_cut": int(c["cut"].sum()),
        "length_p95": p95,
        "suggested_length": -(-p95 // 8) * 8,
        "pad_id": enc.pad_id,
        "pad_token": _token_text(tok, enc.pad_id),
        "content_pad_tokens": int(c["content_pad"].sum()),
        "content_pad_rows": int((c["content_pad"] > 0).sum()),
        "pad_targets": int(c["pad_targets"].sum()),
        "pad_target_rows": int((c["pad_targets"] > 0).sum()),
        "eos_id": enc.eos_id,
        "eos_token": _token_text(tok, enc.eos_id),
        "eos_in_content": int(content[enc.eos_id]) if enc.eos_id is not None and enc.eos_id < vocab else 0,
        "eos_targets": targets.get(enc.eos_id, 0) if enc.eos_id is not None else None,
        "ids_beyond_vocab": beyond,
        "max_id": largest,
        "vocab_size": vocab,
    }
    section = {
        "rows": n,
        "tokens": int(c["length"].sum()),
        "rows_truncated": facts["rows_truncated"],
        "tokens_cut": facts["tokens_cut"],
        "rows_without_supervised": facts["rows_without_supervised"],
        "histograms": {"length": histogram(c["length"]), "supervised": histogram(c["supervised"])},
        "special_tokens": [
            {
                "token": _token_text(tok, t),
                "id": t,
                "content": int(content[t]) if t < vocab else 0,
                "targets": targets.get(t, 0),
            }
            for t in enc.special_ids
        ],
    }
    return facts, section, content
