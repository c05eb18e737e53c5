"""The judge's rules for faults that are not the configuration's, on curves as probes record them: a
step with no target, a spike within one kind of batch, a GradScaler that never let the optimizer step."""

from __future__ import annotations

import math

from nandoctor.analysis.verdicts import DIVERGED, NO_TARGET, NONFINITE, STABLE, classify, numeric_verdict
from nandoctor.bisect.oracle import resolved
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step

KINDS = ["first", "first", "first", "first", "longest", "most_padded", "fewest_supervised"]


def curve(losses, kinds=None, supervised=None, **kw) -> list[Step]:
    kinds = kinds or [None] * len(losses)
    supervised = supervised or [None] * len(losses)
    return [Step(i, x, 1.0, batch=k, supervised=n, **kw) for i, (x, k, n) in enumerate(zip(losses, kinds, supervised))]


def test_a_step_with_no_target_is_no_target_and_says_nothing_of_the_configuration():
    steps = curve([6.9, 6.8, math.nan], KINDS[4:7], [40, 12, 0])
    v = numeric_verdict(steps, None)
    assert (v.name, v.step) == (NO_TARGET, 2)
    assert v.reason.startswith("step 2's fewest_supervised batch has no supervised token")
    assert not resolved(v.name, ())  # bisect neither passes nor fails it: no factor is blamed
    assert numeric_verdict(curve([6.9, math.nan], supervised=[40, 3]), None).name == NONFINITE


def test_no_target_names_the_rows_of_the_step_from_the_records_data():
    data = {
        "path": "chats.jsonl",
        "micro_batches_per_step": 1,
        "batches": [
            {"kind": "first", "rows": [0, 1], "supervised": 30},
            {"kind": "fewest_supervised", "rows": [7, 9], "supervised": 0},
        ],
    }
    record = ProbeRecord(
        "fp32/eager/off", Cell.parse("fp32/eager/off"), "ok", steps=curve([6.9, math.nan], None, [30, 0])
    )
    record.data = data
    v = classify(record)
    assert v.name == NO_TARGET and "rows 7, 9 of chats.jsonl have no label left" in v.reason


def test_a_spike_is_judged_against_the_same_kind_of_batch():
    # the memorised first batches fall fast; the short rows stay high every time they come round
    losses = (
        [6.9, 6.0, 5.0, 4.0, 3.6, 5.5, 6.0] + [3.0, 2.5, 2.0, 1.6, 1.5, 4.8, 5.5] + [1.2, 1.0, 0.9, 0.8, 0.8, 4.5, 5.2]
    )
    losses += [0.7, 0.6, 0.6, 0.5, 0.5, 4.4, 5.0]
    v = numeric_verdict(curve(losses), None)  # the rule over any kind: a spike at step 19
    assert (v.name, v.step) == (DIVERGED, 19)
    assert numeric_verdict(curve(losses, KINDS * 4), None).name == STABLE
    jumped = losses[:-1] + [13.0]  # the short rows themselves jump: 13.0 against their 6.0, 5.5, 5.2
    v = numeric_verdict(curve(jumped, KINDS * 4), None)
    assert (v.name, v.step) == (DIVERGED, 27) and v.reason.endswith("of fewest_supervised batches")


def test_a_gradscaler_that_skipped_every_step_never_trained():
    scales = [65536.0 / 2**i for i in range(6)]
    steps = [Step(i, 6.9 - 0.01 * i, math.inf, skipped=True, scale=s) for i, s in enumerate(scales)]
    record = ProbeRecord("fp16-amp/sdpa/off", Cell.parse("fp16-amp/sdpa/off"), "ok", steps=steps)
    v = classify(record)
    assert v.name == NONFINITE and v.reason.startswith(
        "GradScaler skipped every one of the 6 steps (scale 65536 -> 1024)"
    )
    assert numeric_verdict(steps, None).name == STABLE  # a live run's first steps: still calibrating
    calibrated = steps[:3] + [Step(3, 6.8, 1.0, scale=8192.0)]
    assert classify(ProbeRecord("fp16-amp/sdpa/off", record.cell, "ok", steps=calibrated)).name == STABLE


def test_a_checks_one_skipped_step_is_the_scaler_calibrating():
    step0 = [Step(0, 6.9, math.inf, skipped=True, scale=65536.0)]
    assert classify(ProbeRecord("fp16-amp/sdpa/off", Cell.parse("fp16-amp/sdpa/off"), "ok", steps=step0)).name == STABLE
