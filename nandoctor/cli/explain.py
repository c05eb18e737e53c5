"""`nandoctor explain DIR [--probe ID]`: the numerics forensics of a run's probes, in the terminal."""

from __future__ import annotations

from .args import examples


def register(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="where and why a probe broke, and the headroom of the stable ones",
        **examples(
            "nandoctor explain reports/<run-id>", "nandoctor explain reports/<run-id> --probe fp16-pure/sdpa/off"
        ),
    )
    p.add_argument("run_dir", help="a run directory, e.g. reports/<run-id>")
    p.add_argument("--probe", help="one probe id, e.g. fp16-amp/sdpa/off (default: every probe that ran)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..api import explain_run
    from ..report.forensics import explain_text  # pandas: imported by the command that uses it, not by --help

    _, outcomes = explain_run(args.run_dir, args.probe)
    print("\n\n".join(explain_text(o) for o in outcomes))
    return 0
