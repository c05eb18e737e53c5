"""junit.xml: one test case per probe, so CI systems show failing configurations as failed tests."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from ..analysis import RunAnalysis
from ..verdicts import HARNESS_FAILURES, UNSUPPORTED
from .common import label


def render_junit(a: RunAnalysis) -> str:
    suite = ET.Element("testsuite", name=f"nandoctor {a.meta['kind']} {a.meta['recipe']['name']}",
                       tests=str(len(a.outcomes)),
                       failures=str(sum(o.verdict.failed and o.verdict.name not in HARNESS_FAILURES for o in a.outcomes)),
                       errors=str(sum(o.verdict.name in HARNESS_FAILURES for o in a.outcomes)),
                       skipped=str(sum(o.verdict.name == UNSUPPORTED for o in a.outcomes)))
    for o in a.outcomes:
        case = ET.SubElement(suite, "testcase", classname=f"nandoctor.{a.meta['kind']}", name=label(o),
                             time=f"{o.record.get('wall_s') or 0:.3f}")
        if o.verdict.name == UNSUPPORTED:
            ET.SubElement(case, "skipped", message=o.verdict.reason)
        elif o.verdict.failed:
            tag = "error" if o.verdict.name in HARNESS_FAILURES else "failure"
            node = ET.SubElement(case, tag, type=o.verdict.name, message=o.verdict.reason)
            node.text = o.record.get("log_tail") or (o.record.get("error") or {}).get("traceback") or o.verdict.reason
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)
