"""The data and setup lint on a live run's own first batches, at train start: the trainer's dataset
collated by its own collator, measured as `nandoctor doctor --data` measures the user's rows
(userdata/lint.py, measure/), with the live model:

- label coverage: rows and batches with no supervised token;
- the pad token: a pad id that is content and gets label -100, padded positions that carry a label,
  an EOS that is content and never a target;
- packing isolation: rows packed with position_ids that restart, one packed forward of the live
  model against each segment run alone (measure/packing.py);
- gradient accumulation: with several micro-batches a step, step 0's gradient accumulated over the
  first micro-batches through the model's own loss, weighted as the framework weights it, against the
  full batch's gradient (measure/accumulation.py);
- gradient checkpointing x adapters: with checkpointing on, one backward of the first batch, and the
  trainable groups that got no gradient.

The packing and accumulation figures are the probes' step-0 setup checks (child/setup_checks.py) on the
live model: the watch judges them with the grid's verdict (analysis/verdicts setup_verdict), and a
failed one makes the run `misconfigured`. Each finding is a rule of knowledge/rules.yaml of scope live
(its condition, severity, title, fix and public evidence) with the figure measured here (LIVE_RULES).
The measured checks run the live model with dropout off and the RNG state restored, so the user's
training is unchanged; on several ranks they are skipped (a forward of a sharded model is a collective
the other ranks would not join), and the batch figures stay.

Importing this module needs torch, not a framework.
"""

from __future__ import annotations

import contextlib
import itertools
import random

from ..analysis.verdicts import setup_failures, setup_judged
from ..child.setup_checks import ACCUMULATION_ELEMENTS
from ..knowledge import evaluate
from ..measure.accumulation import accumulation_figures
from ..measure.packing import packing_isolation
from ..measure.reach import gradient_reach
from ..userdata.encode import IGNORE, segments
from ..userdata.lint import finding

LINT_BATCHES = 2  # the trainer's first batches the lint reads

# The rules of scope live (knowledge/rules.yaml) the live figures are judged by, each with the sentence
# that says its figure here: the rule (its own `when`, severity, title, fix and evidence) decides, as it
# does for `doctor --data`.
LIVE_RULES = {
    "rows-without-supervised-token": (
        "{rows_without_supervised} of the {rows} rows in the trainer's first {batches} batches have no supervised "
        "token (every label -100 after the shift; first: row {first_unsupervised}); "
        "{batches_without_supervised} of those batches have none: their mean loss is 0/0"
    ),
    "rows-without-supervised-token-in-full-batches": (
        "{rows_without_supervised} of the {rows} rows in the trainer's first {batches} batches have no supervised "
        "token (every label -100 after the shift; first: row {first_unsupervised}); "
        "{batches_without_supervised} of those batches have none"
    ),
    "pad-masks-real-targets": (
        "the pad id {pad_id} is content {content_pad_tokens} times in the first {batches} batches (attention_mask "
        "1) and {content_pad_masked} of those positions have label -100: the model never learns to predict it"
    ),
    "padding-supervised": (
        "{pad_targets} padded positions (attention_mask 0) in the first {batches} batches carry a label other than -100"
    ),
    "eos-never-a-target": (
        "EOS (id {eos_id}) is content {eos_in_content} times in the first {batches} batches and a target in none"
    ),
    "packing-leaks-across-segments": "on the live {model}: {packing_reason}",
    "accumulation-normalised-per-micro-batch": "on the live {model}: {accumulation_reason}",
    "trainable-group-without-gradient": (
        "with the live model's gradient checkpointing, one backward of the first batch gave no gradient to "
        "{groups_without_gradient_names}: {gradient_reach_outcome}"
    ),
}


@contextlib.contextmanager
def rng_untouched():
    """Python's, NumPy's global and torch's CPU random states as they were on entry, on exit: what the
    user's dataset or collator draws while the lint reads it (a random crop, a masking collator) must
    not shift the draws of the training that follows."""
    import numpy as np
    import torch

    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def first_batches(loader, batch_size: int, n: int = LINT_BATCHES) -> list[dict]:
    """The first `n` batches of the loader's dataset, in order, collated by its own collate_fn; no
    sampler is drawn from and the random states are restored afterwards (rng_untouched), so the user's
    data order and RNG are untouched. [] when the batches are not dicts (a training_step of the user's
    own reads them)."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if dataset is None or collate is None:
        return []
    size = max(1, batch_size or 1)
    with rng_untouched():
        if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            rows = [dataset[i] for i in range(min(len(dataset), n * size))]
        else:  # an iterable dataset: a fresh iterator starts at its beginning
            rows = list(itertools.islice(iter(dataset), n * size))
        batches = [collate(rows[i : i + size]) for i in range(0, len(rows), size)]
    return [b for b in batches if isinstance(b, dict) and "input_ids" in b]


def batch_figures(batches: list[dict], pad_id: int | None, eos_id: int | None) -> dict:
    """Label coverage and the pad token, read from the collated batches (labels aligned with input_ids,
    as transformers' models shift them)."""
    import torch

    rows = unsupervised = empty = content_pad = content_pad_masked = pad_targets = eos_content = eos_targets = 0
    first = None
    for batch in batches:
        ids, labels, mask = batch["input_ids"], batch.get("labels"), batch.get("attention_mask")
        if labels is None:
            continue
        supervised = (labels[:, 1:] != IGNORE).sum(dim=1)
        none = (supervised == 0).nonzero().flatten().tolist()
        if none and first is None:
            first = rows + none[0]
        rows, unsupervised, empty = rows + len(labels), unsupervised + len(none), empty + int(supervised.sum() == 0)
        content = mask.bool() if mask is not None and mask.dim() == 2 else torch.ones_like(ids, dtype=torch.bool)
        if pad_id is not None and mask is not None and mask.dim() == 2:
            is_pad = content & (ids == pad_id)
            content_pad += int(is_pad.sum())
            content_pad_masked += int((is_pad & (labels == IGNORE)).sum())
            pad_targets += int((~content & (labels != IGNORE)).sum())
        if eos_id is not None:
            eos_content += int((content & (ids == eos_id)).sum())
            eos_targets += int((labels[:, 1:] == eos_id).sum())
    return {
        "batches": len(batches),
        "rows": rows,
        "rows_without_supervised": unsupervised,
        "first_unsupervised": first,
        "batches_without_supervised": empty,
        "pad_id": pad_id,
        "content_pad_tokens": content_pad,
        "content_pad_masked": content_pad_masked,
        # the labels mask the pad id (the rule's `labels: pad_id`): a content pad position got label -100
        "labels": "pad_id" if content_pad_masked else "as collated",
        "pad_targets": pad_targets,
        "eos_id": eos_id,
        "eos_in_content": eos_content if eos_id is not None else None,
        "eos_targets": eos_targets if eos_id is not None else None,
    }


def packed(batch: dict) -> bool:
    """Rows packed with position_ids: a position 0 after a row's first token."""
    positions = batch.get("position_ids")
    return positions is not None and any(len(segments(row)) > 1 for row in positions)


def joined(batches: list[dict]) -> dict | None:
    """The rows of several collated batches as one batch, each 2-D tensor right-padded to the longest
    (labels with -100, the attention mask with 0, ids with 0: a causal model's logits before a trailing pad
    do not see it) and stacked; None when a batch holds anything else (the rows cannot be joined)."""
    import torch

    keys = set(batches[0])
    if any(set(b) != keys for b in batches) or any(
        not isinstance(v, torch.Tensor) or v.dim() != 2 for b in batches for v in b.values()
    ):
        return None
    length = max(b["input_ids"].shape[1] for b in batches)
    fill = {"labels": IGNORE, "attention_mask": 0}

    def padded(key, v):
        return torch.nn.functional.pad(v, (0, length - v.shape[1]), value=fill.get(key, 0))

    return {k: torch.cat([padded(k, b[k]) for b in batches]) for k in keys}


def setup_check_figures(model, batches: list[dict], micro: int, normalization: str) -> dict:
    """The probes' step-0 setup checks (child/setup_checks.py) on the live model: packing isolation of
    the first batch when it is packed, and with `micro` micro-batches a step, the accumulated gradient of
    the first `micro` batches (their losses weighted as `normalization` says, as the framework weights
    them) against the full batch's. {} when neither applies."""
    out = {}
    if packed(batches[0]):
        out.update(packing_isolation(model, batches[0]))
    group = batches[:micro]
    full = joined(group) if micro > 1 and len(group) == micro and all("labels" in b for b in group) else None
    if full is not None:
        out.update(accumulation_figures(model, group, full, normalization, ACCUMULATION_ELEMENTS))
    return out


def measured_figures(model, batches: list[dict], micro: int = 1, normalization: str = "tokens") -> tuple[dict, dict]:
    """The figures that need the live model, and of those the setup checks' (setup_check_figures): with
    gradient checkpointing on, the trainable groups one backward of the first batch leaves without a
    gradient. On the live model in train mode, dropout off, the RNG state and the model's mode restored,
    its gradients unset afterwards."""
    import torch

    device = next(model.parameters()).device
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    out = {"model": type(model).__name__}
    training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.train()  # checkpointing recomputes only in training
        try:
            checks = setup_check_figures(model, batches, micro, normalization)
            failures = setup_failures(checks)
            out.update(checks, **setup_judged(checks))
            out["packing_reason"] = next((f for f in failures if f.startswith("packing:")), "")
            out["accumulation_reason"] = next((f for f in failures if f.startswith("accumulation:")), "")
            if getattr(model, "is_gradient_checkpointing", False) and "labels" in batches[0]:
                out.update(gradient_reach(model, batches[0]))
        finally:
            model.train(training)
    return out, checks


def live_findings(figures: dict) -> list[dict]:
    """The rules of scope live whose own condition holds on the figures, most severe first, as findings
    with their LIVE_RULES figure."""
    return [finding(rule, LIVE_RULES[rule.id].format(**figures)) for rule in evaluate(figures, "live")]


def lint_live(
    model,
    batches: list[dict],
    pad_id: int | None,
    eos_id: int | None,
    measured: bool = True,
    micro: int = 1,
    normalization: str = "tokens",
) -> tuple[list[dict], dict]:
    """The findings of the lint on a live run's first batches (module docstring), and the figures of the
    probes' step-0 setup checks ({} when none applied). measured: run the checks that need the model
    (packing isolation, accumulation over the first `micro` batches weighted by `normalization` as
    measure/accumulation.normalized resolves it for the model, gradient reach)."""
    if not batches:
        return [], {}
    figures, checks = batch_figures(batches, pad_id, eos_id), {}
    if measured:
        found, checks = measured_figures(model, batches, micro, normalization)
        figures.update(found)
    return live_findings(figures), checks
