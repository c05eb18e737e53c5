"""junit.xml: one test case per probe, so CI systems show failing configurations as failed tests; with
a --baseline, one more per cell against the baseline, failed where the cell regressed."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from ..analysis.outcomes import RunAnalysis
from ..analysis.verdicts import HARNESS_FAILURES, UNSUPPORTED
from . import bisection
from .charts import as_float
from .formatting import label


def _seconds(x) -> str:
    """A JUnit time attribute: seconds with 3 decimals; one that is no finite number (unknown, nan, inf, an
    int beyond float range) is 0.000, as JUnit readers parse the attribute as a number."""
    x = as_float(x)
    return f"{x:.3f}" if x is not None and math.isfinite(x) else "0.000"


def render_junit(a: RunAnalysis) -> str:
    suite = ET.Element(
        "testsuite",
        name=f"nandoctor {a.meta.kind} {a.meta.recipe['name']}",
        tests=str(len(a.outcomes)),
        failures=str(sum(o.verdict.failed and o.verdict.name not in HARNESS_FAILURES for o in a.outcomes)),
        errors=str(sum(o.verdict.name in HARNESS_FAILURES for o in a.outcomes)),
        skipped=str(sum(o.verdict.name == UNSUPPORTED for o in a.outcomes)),
    )
    for o in a.outcomes:
        case = ET.SubElement(
            suite, "testcase", classname=f"nandoctor.{a.meta.kind}", name=label(o), time=_seconds(o.record.wall_s)
        )
        if o.verdict.name == UNSUPPORTED:
            ET.SubElement(case, "skipped", message=o.verdict.reason)
        elif o.verdict.failed:
            tag = "error" if o.verdict.name in HARNESS_FAILURES else "failure"
            node = ET.SubElement(case, tag, type=o.verdict.name, message=o.verdict.reason)
            node.text = o.record.log_tail or (o.record.error or {}).get("traceback") or o.verdict.reason
    if a.meta.kind == "bisect" and a.bisection:
        bisection_cases(suite, a.bisection)
    if a.comparison:
        baseline_cases(suite, a.comparison)
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def bisection_cases(suite: ET.Element, b: dict) -> None:
    """A failed case per culprit (its evidence as the message) and a case for the recommendation, which
    fails when no configuration held up; the suite's counts are updated to include them."""
    for c in b["culprits"]:
        case = ET.SubElement(
            suite, "testcase", classname="nandoctor.bisect.culprit", name=bisection.factor_text(b, c["factors"])
        )
        ET.SubElement(
            case,
            "failure",
            type="culprit",
            message=f"{bisection.culprit_kind(c)}: fails alone at bisection step "
            f"{c['evidence']}, passes without each factor at bisection steps {c['minimality']}",
        )
    case = ET.SubElement(suite, "testcase", classname="nandoctor.bisect", name="recommended configuration")
    lines = bisection.recommendation_lines(b)
    if lines:
        ET.SubElement(case, "system-out").text = "\n".join(lines)
    else:
        ET.SubElement(case, "failure", type="no-stable-configuration", message=b["message"])
    suite.set("tests", str(int(suite.get("tests")) + len(b["culprits"]) + 1))
    suite.set("failures", str(int(suite.get("failures")) + len(b["culprits"]) + (0 if lines else 1)))


def baseline_cases(suite: ET.Element, d) -> None:
    """A case per cell compared with the baseline run (classname nandoctor.baseline): failed where the
    cell regressed, with what moved as the message; the suite's counts include them."""
    for c in d.cells:
        case = ET.SubElement(suite, "testcase", classname="nandoctor.baseline", name=c.probe_id)
        if c.regressed:
            ET.SubElement(case, "failure", type="regressed", message=f"{c.verdicts} against the baseline: {c.why}")
        else:
            ET.SubElement(case, "system-out").text = f"{c.change}: {c.why}"
    suite.set("tests", str(int(suite.get("tests")) + len(d.cells)))
    suite.set("failures", str(int(suite.get("failures")) + len(d.regressions)))
