"""The analysis joins the doctor's planned findings with the rules that fire on what probes showed."""

from nandoctor.analysis.outcomes import findings_of
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step


def record(probe_id, scales):
    return ProbeRecord(probe_id, Cell(), steps=[Step(i, 8.0, 1.0, skipped, s) for i, (s, skipped) in enumerate(scales)])


def test_a_scale_that_falls_below_1_in_a_probe_becomes_a_finding():
    records = [
        record("fp16-amp/sdpa/off", [(4.0, True), (2.0, True), (1.0, True)]),
        record("fp32/eager/off", [(None, False)]),
    ]
    (f,) = findings_of({}, records)
    assert f["id"] == "grad-scale-falls-below-1" and f["cells"] == ["fp16-amp/sdpa/off"]


def test_planned_findings_are_kept_and_a_healthy_scaler_adds_nothing():
    planned = {
        "id": "trainer-nan-inf-filter-hides-nan",
        "severity": "warning",
        "title": "t",
        "why": "w",
        "fix": "f",
        "evidence": ["e"],
        "cells": ["fp16-amp/sdpa/off"],
    }
    records = [record("fp16-amp/sdpa/off", [(65536.0, True), (32768.0, False)])]
    assert findings_of({"doctor": {"findings": [planned]}}, records) == [planned]


def test_a_probe_named_by_a_warning_is_flagged_and_advice_flags_nothing():
    from nandoctor.analysis.outcomes import flags_of

    warning = {"id": "bf16-weights-without-fp32-master", "severity": "warning", "cells": ["bf16-pure/sdpa/off"]}
    advice = {"id": "some-advice", "severity": "advice", "cells": ["bf16-pure/sdpa/off"]}
    probe = ProbeRecord("bf16-pure/sdpa/off", Cell("bf16-pure", "sdpa", "off"))
    assert flags_of(probe, [warning, advice]) == ["bf16-weights-without-fp32-master"]
    assert flags_of(ProbeRecord("fp32/sdpa/off", Cell()), [warning]) == []


def test_a_merged_rules_old_id_in_an_older_run_json_is_read_as_the_kept_one():
    """packed-segments-not-isolated was merged into packing-leaks-across-segments: an older run.json
    that names it joins the probe's finding of the kept rule, once."""
    planned = {"id": "packed-segments-not-isolated", "severity": "error", "fix": "f", "cells": ["a"]}
    leaking = ProbeRecord(
        "fp32/sdpa/off",
        Cell(),
        steps=[Step(0, 6.9, 1.0)],
        setup_checks={"packing_max_logit_diff": 0.77, "packing_floor": 0.0},
    )
    (f,) = findings_of({"doctor": {"findings": [planned]}}, [leaking])
    assert f["id"] == "packing-leaks-across-segments" and f["cells"] == ["a", "fp32/sdpa/off"]
