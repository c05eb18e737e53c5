"""Renderers. Each takes a RunAnalysis (or, for diff.*, a RunDiff) and returns text; write_reports puts
them in the run dir."""

from __future__ import annotations

from pathlib import Path

from .. import jsonio
from ..analysis.outcomes import RunAnalysis
from ..run.store import write_atomic


def _summary_json(a: RunAnalysis) -> str:
    from .summary import render_summary

    return jsonio.dumps(render_summary(a), indent=2)


def _markdown(a: RunAnalysis) -> str:
    from .markdown import render_markdown

    return render_markdown(a)


def _html(a: RunAnalysis) -> str:
    from .html import render_html

    return render_html(a)


def _junit(a: RunAnalysis) -> str:
    from .junit import render_junit

    return render_junit(a)


def _diff_markdown(d) -> str:
    from .diff import render_diff_markdown

    return render_diff_markdown(d)


def _diff_html(d) -> str:
    from .diff import render_diff_html

    return render_diff_html(d)


def _diff_json(d) -> str:
    from .diff import render_diff_summary

    return jsonio.dumps(render_diff_summary(d), indent=2)


REPORT_FILES = {"report.md": _markdown, "report.html": _html, "junit.xml": _junit, "summary.json": _summary_json}
DIFF_FILES = {"diff.md": _diff_markdown, "diff.html": _diff_html, "diff.json": _diff_json}


def _write_each(files: dict, subject, out_dir: Path) -> list[tuple[str, str, bool]]:
    """Render and write each file on its own: one that fails never stops the others. Each is written
    to a temporary name and renamed, so a full disk leaves the previous file (or none), never a
    truncated one. Returns (file, why, is_output_error) for each file NOT written: is_output_error
    is True when the OS refused the write, False when its renderer failed."""
    failed = []
    for name, render in files.items():
        try:
            text = render(subject)
        except Exception as e:  # a renderer bug must not cost the user the other reports
            first = (str(e).strip().splitlines() or [""])[0]
            failed.append((name, f"its renderer failed ({type(e).__name__}: {first[:200]})", False))
            continue
        try:
            write_atomic(Path(out_dir) / name, text)
        except OSError as e:
            failed.append((name, f"{e.strerror or e} ({out_dir})", True))
    return failed


def write_reports(a: RunAnalysis, run_dir: Path) -> list[tuple[str, str, bool]]:
    """Every report file of the run, and the diff.* files when it was compared with a baseline; see
    _write_each for what is returned."""
    failed = _write_each(REPORT_FILES, a, run_dir)
    if a.comparison:
        failed += _write_each(DIFF_FILES, a.comparison, run_dir)
    return failed


def write_diff(d, out_dir: Path) -> list[tuple[str, str, bool]]:
    """diff.md, diff.html and diff.json of a comparison with a baseline run; see _write_each."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return _write_each(DIFF_FILES, d, out_dir)
