"""One judge for the probe's own setup: whether packed segments leak and whether accumulated
micro-batches are misweighted is decided once (verdicts.setup_judged, its bounds in Thresholds), and
the `misconfigured` verdict, the knowledge rules' facts and the reports' setup table all read that one
decision, so that a figure on either side of a bound gets one answer everywhere."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from test_setup_verdicts import LEAK, MISWEIGHTED, record

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.analysis.verdicts import judged_facts, setup_failures, setup_judged
from nandoctor.report.data import setup_check_rows
from nandoctor.thresholds import THRESHOLDS

PACKAGE = Path(__file__).resolve().parent.parent / "nandoctor"


def test_only_the_judge_applies_the_setup_bounds():
    callers = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "thresholds.py"
        and re.search(r"\.(packing_leaks|accumulation_misweighted|accumulation_bound)\(", p.read_text())
    ]
    assert callers == ["analysis/verdicts/setup.py"]


@pytest.mark.parametrize(
    "setup, fact, leaks",
    [
        (LEAK, "packing_leaks", True),
        ({**LEAK, "packing_max_logit_diff": 0.9 * THRESHOLDS.packing_leak_abs}, "packing_leaks", False),
        (MISWEIGHTED, "accumulation_misweighted", True),
        (
            {**MISWEIGHTED, "accumulation_error": 0.5 * THRESHOLDS.accumulation_error_abs},
            "accumulation_misweighted",
            False,
        ),
    ],
)
def test_the_verdict_the_rules_and_the_report_give_one_answer(setup, fact, leaks):
    r = record(setup=setup)
    (outcome,) = analyze_records({"kind": "grid", "recipe": {"name": "r"}}, [replace(r)]).outcomes
    (row,) = setup_check_rows([outcome])
    assert setup_judged(setup)[fact] is leaks
    assert judged_facts(r)[fact] is leaks
    assert bool(setup_failures(setup)) is leaks
    assert (outcome.verdict.name == "misconfigured") is leaks
    assert (row["result"] in ("leaks", "misweighted")) is leaks
