"""`nandoctor grid`: probe every cell of dtype x attention x compile and rank the stable ones."""
from __future__ import annotations

from ..api import run_grid
from ..config import parse_axis_flag
from ..report.terminal import progress_line, render_terminal
from .common import add_model_args, recipe_from_args


def register(sub) -> None:
    p = sub.add_parser("grid", help="run the probe grid and write the ranked report")
    add_model_args(p)
    p.add_argument("--axis", action="append", default=[], metavar="NAME=V1,V2",
                   help="restrict an axis: dtype, attn or compile (repeatable)")
    p.add_argument("--jobs", type=int, help="probes at once (default: number of GPUs, or 1 on CPU)")
    p.set_defaults(func=run)


def run(args) -> int:
    axes = dict(parse_axis_flag(a) for a in args.axis)
    recipe = recipe_from_args(args)
    analysis = run_grid(recipe, axes=axes, steps=args.steps, jobs=args.jobs, out=args.out,
                        progress=lambda *a: print(progress_line(*a), flush=True))
    print()
    print(render_terminal(analysis, analysis.meta["run_dir"]))
    return analysis.exit_code
