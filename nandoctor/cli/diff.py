"""`nandoctor diff RUN_A RUN_B`: what changed from run A (the baseline) to run B; exit 1 when a cell regressed."""

from __future__ import annotations

from ..api import diff_runs
from .args import examples


def register(sub) -> None:
    p = sub.add_parser(
        "diff",
        help="compare a run with a baseline run: environment, settings, verdicts, numbers",
        **examples(
            "nandoctor diff reports/last-main reports/this-branch",
            "nandoctor diff reports/a/summary.json reports/b --out diff-out",
        ),
    )
    p.add_argument("run_a", metavar="RUN_A", help="the baseline: a run directory or its summary.json")
    p.add_argument("run_b", metavar="RUN_B", help="the run to judge against it")
    p.add_argument("--out", metavar="DIR", help="also write diff.md, diff.html and diff.json to DIR")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..report.diff import render_diff_terminal  # the report package loads pandas: not for --help

    d = diff_runs(args.run_a, args.run_b, out=args.out)
    print(render_diff_terminal(d))
    if args.out:
        print(f"reports: {args.out}/diff.md, diff.html, diff.json")
    return d.exit_code
