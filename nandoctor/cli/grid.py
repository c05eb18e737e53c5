"""`nandoctor grid`: probe every cell of dtype x attention x compile x optimizer x parallel and rank the stable ones."""

from __future__ import annotations

from ..api import resume_grid, run_grid
from ..cells import parse_axis_flag
from ..run.cache import ProbeCache, default_cache_dir
from .common import (
    MODEL_FLAGS,
    add_executor_args,
    add_jobs_arg,
    add_model_args,
    examples,
    executor_from_args,
    finish,
    listener,
    recipe_from_args,
    refuse_with_resume,
    say,
)


def register(sub) -> None:
    p = sub.add_parser(
        "grid",
        help="run the probe grid and write the ranked report",
        **examples(
            "nandoctor grid --model tiny-llama",
            "nandoctor grid --model llama-3.1-8b --axis dtype=bf16-amp,fp16-amp --axis attn=sdpa,eager --steps 50",
            "nandoctor grid --resume reports/<run-id>",
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--axis",
        action="append",
        default=[],
        metavar="NAME=V1,V2",
        help="choose an axis' values: dtype, attn, compile, optimizer or parallel (repeatable); "
        "opt-in values such as dtype=fp8-rowwise, optimizer=ao-adamw8bit or parallel=fsdp2 are probed only when named",
    )
    add_jobs_arg(p)
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="finish an interrupted grid run: probe only the cells missing from DIR/results.jsonl",
    )
    p.add_argument(
        "--cache",
        action="store_true",
        help="reuse probe results with an identical fingerprint from earlier runs, and keep this run's "
        f"(in $NANDOCTOR_CACHE_DIR, default {default_cache_dir()})",
    )
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="compare with an earlier run (a run directory or its summary.json): "
        "diff.md / diff.html / diff.json in the run directory, a JUnit case per cell, exit 1 when a cell regressed",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="start a fresh Python process per probe instead of forking from warm workers",
    )
    add_executor_args(p)
    p.set_defaults(func=run)


def progress(*args) -> None:
    from ..report.terminal import progress_line  # pandas: loaded by then (api.open_session), not before the first line

    say(progress_line(*args))


def run(args) -> int:
    cache = ProbeCache() if args.cache else None
    executor = executor_from_args(args)
    hear = listener(progress)
    if args.resume:
        refuse_with_resume(
            args, MODEL_FLAGS + ("axis", "baseline"), "the recipe, axes, steps, baseline and run directory"
        )
        analysis = resume_grid(
            args.resume, jobs=args.jobs, listener=hear, warm=not args.cold, cache=cache, executor=executor
        )
    else:
        axes = dict(parse_axis_flag(a) for a in args.axis)
        recipe = recipe_from_args(args)
        analysis = run_grid(
            recipe,
            axes=axes,
            steps=args.steps,
            jobs=args.jobs,
            out=args.out,
            listener=hear,
            warm=not args.cold,
            cache=cache,
            baseline=args.baseline,
            executor=executor,
        )
    from ..report.diff import render_diff_terminal
    from ..report.terminal import render_terminal

    print()
    print(render_terminal(analysis, analysis.meta["run_dir"]))
    if analysis.comparison:
        print()
        print(render_diff_terminal(analysis.comparison))
    if cache:
        reused = sum(1 for o in analysis.outcomes if o.record.cached_from)
        print(f"cache: {reused} probe(s) reused from {cache.path}")
    return finish(analysis)
