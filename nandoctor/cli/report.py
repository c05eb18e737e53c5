"""`nandoctor report DIR`: re-render a finished or interrupted run from its results.jsonl."""
from __future__ import annotations

from ..api import render_run
from ..report.terminal import render_terminal


def register(sub) -> None:
    p = sub.add_parser("report", help="re-render the reports of a run directory")
    p.add_argument("run_dir", help="a run directory, e.g. reports/<run-id>")
    p.set_defaults(func=run)


def run(args) -> int:
    analysis = render_run(args.run_dir)
    print(render_terminal(analysis, args.run_dir))
    return analysis.exit_code
