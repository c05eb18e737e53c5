"""`nandoctor check`: one configuration, step-0 sanity (and, with --baseline, step-0 golden values), exit 0
(pass) or 1 (fail). Made for CI."""

from __future__ import annotations

from ..analysis.twin import twin_caveat
from ..api import run_check
from ..cells import AXES, DEFAULT_OPTIMIZER, Cell
from ..record import ModelPlan
from .args import add_model_args, examples, options_from_args, recipe_from_args
from .lines import finish, listener


def register(sub) -> None:
    p = sub.add_parser(
        "check",
        help="quick step-0 sanity check of one configuration",
        **examples(
            "nandoctor check --model tiny-llama --dtype bf16-amp --attn sdpa",
            "nandoctor check --model ./my-checkpoint --dtype fp16-amp --steps 4",
            "nandoctor check --model ./my-checkpoint --set adapter.type=lora --quant nf4 --steps 8 --roundtrip",
        ),
    )
    add_model_args(p)
    p.add_argument("--dtype", default="bf16-amp", help=f"one of {', '.join(AXES['dtype'])} (default bf16-amp)")
    p.add_argument("--attn", default="sdpa", help=f"one of {', '.join(AXES['attn'])} (default sdpa)")
    p.add_argument("--compile", default="off", help=f"one of {', '.join(AXES['compile'])} (default off)")
    p.add_argument(
        "--optimizer",
        default=DEFAULT_OPTIMIZER,
        help=f"one of {', '.join(AXES['optimizer'])} (default {DEFAULT_OPTIMIZER})",
    )
    p.add_argument(
        "--parallel", default="none", help=f"one of {', '.join(AXES['parallel'])} (default none: one process)"
    )
    p.add_argument("--quant", default="none", help=f"one of {', '.join(AXES['quant'])} (default none: a 16-bit base)")
    p.add_argument(
        "--roundtrip",
        action="store_true",
        help="after the steps, merge the adapter, save and load back the model, and compare the loss and "
        "logits of one batch: live, merged, reloaded (fails when they differ beyond the threshold)",
    )
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="an earlier run with this cell (a check or grid run directory): its "
        "step-0 loss and grad-norm are golden values this run must match within the cell dtype's tolerance",
    )
    p.set_defaults(func=run, steps=None)


def run(args) -> int:
    cell = Cell.parse(f"{args.dtype}/{args.attn}/{args.compile}/{args.optimizer}/{args.parallel}/{args.quant}")
    recipe = recipe_from_args(args)
    analysis, checks = run_check(recipe, cell, options_from_args(args, listener(None)))
    for name, passed, detail in checks:
        print(f"  {'ok  ' if passed else 'FAIL'} {name}: {detail}")
    caveat = twin_caveat(ModelPlan.from_dict(analysis.meta.model_plan), [cell])
    if caveat:
        print(f"  note {caveat}")
    if analysis.comparison:
        # the report package (pandas) is loaded by now; imported here, not before the run starts its worker
        from ..report.diff import render_diff_terminal

        print(render_diff_terminal(analysis.comparison))
    ok = all(passed for _, passed, _ in checks) and not (analysis.comparison and analysis.comparison.regressions)
    print(f"check {cell.id} on {recipe.name}: {'PASS' if ok else 'FAIL'}  (run directory: {analysis.meta.run_dir})")
    return finish(analysis, 0 if ok else 1)
