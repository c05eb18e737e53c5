"""`nandoctor report DIR`: re-render a finished or interrupted run from its results.jsonl."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import NandoctorError
from .args import examples
from .lines import finish


def register(sub) -> None:
    p = sub.add_parser(
        "report",
        help="re-render the reports of a run directory",
        **examples("nandoctor report reports/<run-id>", "nandoctor report reports/<run-id> --csv probes.csv"),
    )
    p.add_argument("run_dir", help="a run directory, e.g. reports/<run-id>")
    p.add_argument("--csv", metavar="FILE", help="also write the probe table (one row per probe, with its rank) as CSV")
    p.set_defaults(func=run)


def refuse_unwritable_csv(csv: str) -> None:
    """Before anything prints: --csv must name a file whose folder exists and is writable."""
    path = Path(csv)
    if path.is_dir():
        raise NandoctorError(f"--csv {csv!r} is a directory; pass a file name, e.g. {str(path / 'probes.csv')!r}")
    folder = path.parent
    if not folder.is_dir():
        raise NandoctorError(f"--csv {csv!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise NandoctorError(f"--csv {csv!r} cannot be written: {str(folder)!r} is not writable")


def run(args) -> int:
    if args.csv:
        refuse_unwritable_csv(args.csv)
    from ..analysis.outcomes import (
        ranked_table,
    )  # pandas: imported by the command that uses it, not by `nandoctor --help`
    from ..api import render_run
    from ..report.diff import render_diff_terminal
    from ..report.terminal import render_terminal

    analysis = render_run(args.run_dir)
    print(render_terminal(analysis, args.run_dir))
    if analysis.comparison:
        print()
        print(render_diff_terminal(analysis.comparison))
    elif analysis.meta.baseline:
        print(f"baseline {analysis.meta.baseline} is gone: the reports were written without the comparison")
    if args.csv:
        try:
            ranked_table(analysis).to_csv(args.csv, index=False)
        except OSError as e:
            raise NandoctorError(f"cannot write --csv {args.csv!r}: {e.strerror}") from None
        print(f"probe table: {args.csv}")
    return finish(analysis)
