"""Renderers. Each takes a RunAnalysis and returns text; write_reports puts them in the run dir."""
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
