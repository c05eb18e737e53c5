"""Renderers. Each takes a RunAnalysis (or, for diff.*, a RunDiff) and returns text; write_reports puts them in the run dir."""
from __future__ import annotations

import json
from pathlib import Path

from ..analysis.run import RunAnalysis


def write_reports(a: RunAnalysis, run_dir: Path) -> None:
    from .html import render_html
    from .junit import render_junit
    from .markdown import render_markdown
    from .summary import render_summary
    (run_dir / "report.md").write_text(render_markdown(a))
    (run_dir / "report.html").write_text(render_html(a))
    (run_dir / "junit.xml").write_text(render_junit(a))
    (run_dir / "summary.json").write_text(json.dumps(render_summary(a), indent=2, default=str))
    if a.comparison:
        write_diff(a.comparison, run_dir)


def write_diff(d, out_dir: Path) -> None:
    """diff.md, diff.html and diff.json of a comparison with a baseline run."""
    from .diff import render_diff_html, render_diff_markdown, render_diff_summary
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "diff.md").write_text(render_diff_markdown(d))
    (out_dir / "diff.html").write_text(render_diff_html(d))
    (out_dir / "diff.json").write_text(json.dumps(render_diff_summary(d), indent=2, default=str))
