"""`nandoctor report DIR`: re-render a finished or interrupted run from its results.jsonl."""
from __future__ import annotations

from ..errors import NandoctorError


def register(sub) -> None:
    p = sub.add_parser("report", help="re-render the reports of a run directory")
    p.add_argument("run_dir", help="a run directory, e.g. reports/<run-id>")
    p.add_argument("--csv", metavar="FILE", help="also write the probe table (one row per probe, with its rank) as CSV")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..analysis.run import ranked_table  # pandas: imported by the command that uses it, not by `nandoctor --help`
    from ..api import render_run
    from ..report.terminal import render_terminal
    analysis = render_run(args.run_dir)
    print(render_terminal(analysis, args.run_dir))
    if args.csv:
        try:
            ranked_table(analysis).to_csv(args.csv, index=False)
        except OSError as e:
            raise NandoctorError(f"cannot write --csv {args.csv!r}: {e.strerror}") from None
        print(f"probe table: {args.csv}")
    return analysis.exit_code
