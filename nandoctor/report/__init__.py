"""Renderers. Each takes a RunAnalysis and returns text; write_reports puts them in the run dir."""
from __future__ import annotations

import json
from pathlib import Path

from ..analysis.run import RunAnalysis
from ..run.store import write_atomic


def _summary_json(a: RunAnalysis) -> str:
    from .summary import render_summary
    return json.dumps(render_summary(a), indent=2, default=str)


def _markdown(a: RunAnalysis) -> str:
    from .markdown import render_markdown
    return render_markdown(a)


def _html(a: RunAnalysis) -> str:
    from .html import render_html
    return render_html(a)


def _junit(a: RunAnalysis) -> str:
    from .junit import render_junit
    return render_junit(a)


REPORT_FILES = {"report.md": _markdown, "report.html": _html, "junit.xml": _junit, "summary.json": _summary_json}


def write_reports(a: RunAnalysis, run_dir: Path) -> list[tuple[str, str, bool]]:
    """Render and write every report file of the run; one that fails never stops the others. Each
    file is written to a temporary name and renamed, so a full disk leaves the previous file (or none),
    never a truncated one. Returns (file, why, is_output_error) for each file NOT written:
    is_output_error is True when the OS refused the write, False when its renderer failed."""
    failed = []
    for name, render in REPORT_FILES.items():
        try:
            text = render(a)
        except Exception as e:  # a renderer bug must not cost the user the other reports
            first = (str(e).strip().splitlines() or [""])[0]
            failed.append((name, f"its renderer failed ({type(e).__name__}: {first[:200]})", False))
            continue
        try:
            write_atomic(Path(run_dir) / name, text)
        except OSError as e:
            failed.append((name, f"{e.strerror or e} ({run_dir})", True))
    return failed
