"""The verdict table: each verdict is declared once (analysis/verdicts VERDICTS: its name, whether it fails
or is unresolved, its colour, mark and advice), and every list of verdicts is read from it, so that a new
verdict is one new row."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import parsed

import nandoctor.analysis.verdicts as verdicts
from nandoctor.analysis.outcomes import PROBE_COLUMNS
from nandoctor.analysis.verdicts import (
    FAIL_ON,
    HARNESS_FAILURES,
    UNRESOLVED_VERDICTS,
    VERDICT,
    VERDICTS,
    Verdict,
)
from nandoctor.bisect.oracle import UNRESOLVED_ADVICE
from nandoctor.report.markdown import MARK
from nandoctor.report.matrix import PENDING, VERDICT_COLORS

PACKAGE = Path(__file__).resolve().parent.parent / "nandoctor"
NAMES = {v.name for v in VERDICTS}
TABLE = PACKAGE / "analysis" / "verdicts" / "table.py"


def verdicts_made() -> set[str]:
    """The name of every Verdict(...) the package constructs, resolved through the verdicts module."""
    made = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Verdict" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Name) and first.id.isupper():
                    made.add(getattr(verdicts, first.id))
                elif isinstance(first, ast.Constant):
                    made.add(first.value)
    return made


def test_every_verdict_the_package_gives_has_a_row():
    made = verdicts_made()
    assert len(made) >= 10  # the scan sees the judge
    assert made <= NAMES, made - NAMES
    assert len(NAMES) == len(VERDICTS)  # one row each


def test_every_row_is_in_every_list_it_belongs_to():
    for v in VERDICTS:
        assert VERDICT_COLORS[v.name] == v.color and MARK[v.name] == v.mark, v.name
        assert Verdict(v.name, "").failed is v.failed, v.name
        assert (v.name in UNRESOLVED_VERDICTS) is v.unresolved, v.name
        assert (v.name in HARNESS_FAILURES) is v.harness, v.name
        assert (v.name in FAIL_ON) is (v.harness and v.unresolved), v.name
        if v.unresolved:  # a bisection left unresolved by it says what to do
            assert UNRESOLVED_ADVICE[v.name] == v.advice and v.advice, v.name
        else:
            assert v.name not in UNRESOLVED_ADVICE
    assert PROBE_COLUMNS["verdict"].replace(" or ", ", ").split(", ") == [v.name for v in VERDICTS]
    assert set(VERDICT_COLORS) == NAMES | {PENDING} and set(MARK) == NAMES | {PENDING}


def test_a_stable_probe_passes_and_a_crash_is_resolved():
    """The rows that decide what the lists hold: the pass, the failures a bisection can blame, the ones it skips."""
    assert [v.name for v in VERDICTS if not v.failed] == ["stable", "unsupported"]
    assert set(UNRESOLVED_VERDICTS) == {"unsupported", "timeout", "oom", "killed", "no-target"}
    assert set(HARNESS_FAILURES) == {"crash", "oom", "timeout", "killed"}
    assert VERDICT["crash"].failed and not VERDICT["crash"].unresolved


def _names_in(node: ast.AST) -> int:
    """How many verdict names a literal spells out: string constants, the verdicts module's upper-case
    constants, and the names a longer string lists (a column's description)."""
    count = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            if sub.value in NAMES:
                count += 1
            else:
                words = {w.strip(" ,.") for w in sub.value.split()}
                count += len(words & NAMES) if len(words & NAMES) >= 3 else 0
        elif isinstance(sub, ast.Name) and sub.id.isupper() and getattr(verdicts, sub.id, None) in NAMES:
            count += 1
    return count


def test_no_module_keeps_a_list_of_verdicts_of_its_own():
    """A module-level collection that names two verdicts or more is a list a new verdict could miss:
    only the table's module declares one."""
    own = []
    for path in PACKAGE.rglob("*.py"):
        if path == TABLE:
            continue
        for node in parsed(path).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                if isinstance(node.value, (ast.Dict, ast.Tuple, ast.List, ast.Set)) and _names_in(node.value) >= 2:
                    own.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert own == []
