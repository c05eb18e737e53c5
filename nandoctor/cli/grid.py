"""`nandoctor grid`: probe every cell of dtype x attention x compile x optimizer x parallel and rank the stable ones."""

from __future__ import annotations

from ..api import UNSUPPORTED, default_cache_dir, resume_grid, run_grid
from ..cells import parse_axis_flag
from .args import (
    MODEL_FLAGS,
    add_executor_args,
    add_jobs_arg,
    add_model_args,
    examples,
    options_from_args,
    recipe_from_args,
    refuse_with_resume,
)
from .lines import finish, listener, say


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
        help="choose an axis' values: dtype, attn, compile, optimizer, parallel or quant (repeatable); "
        "opt-in values such as dtype=fp8-rowwise, optimizer=ao-adamw8bit, parallel=fsdp2 or quant=nf4 are probed "
        "only when named",
    )
    p.add_argument(
        "--roundtrip",
        action="store_true",
        help="after the grid, train the recommended cell once more, merge its adapter, save and load it back, "
        "and compare live, merged and reloaded loss and logits (docs/quantization.md)",
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


class GridProgress:
    """What a grid prints per probe: a line per probe that ran. The cells the device cannot run are
    recorded before any probe runs; they are held back and said in one line (report/terminal.py
    unsupported_line) before the first probe that ran, or before anything else is said."""

    def __init__(self):
        self.held: list = []  # the unsupported records not said yet
        self.counts = (0, 0)  # (done, planned) at the last of them
        self.ran = False

    def probe(self, done, total, record, verdict) -> None:
        from ..report.terminal import progress_line  # pandas: loaded by then (api.open_session), not before

        if verdict.name == UNSUPPORTED and not self.ran:
            self.held.append(record)
            self.counts = (done, total)
            return
        self.flush()
        self.ran = True
        say(progress_line(done, total, record, verdict))

    def flush(self, *_) -> None:
        """Say the held unsupported cells, if any (also called before a heartbeat, a queue line, the
        re-timing line and the final report)."""
        if self.held:
            from ..report.terminal import unsupported_line

            say(unsupported_line(*self.counts, self.held))
            self.held = []


def probe_grid(args, options):
    """Run or resume the grid the arguments describe; its analysis."""
    if args.resume:
        refuse_with_resume(
            args, MODEL_FLAGS + ("axis", "baseline"), "the recipe, axes, steps, baseline and run directory"
        )
        return resume_grid(args.resume, options)
    axes = dict(parse_axis_flag(a) for a in args.axis)
    return run_grid(recipe_from_args(args), axes, options)


def run(args) -> int:
    printer = GridProgress()
    hear = listener(printer.probe)
    for hook in ("alive", "queue", "retiming", "note"):  # anything else said goes after the held line
        said = getattr(hear, hook)
        setattr(hear, hook, lambda *a, said=said: (printer.flush(), said(*a)))
    options = options_from_args(args, hear)
    try:
        analysis = probe_grid(args, options)
    finally:  # an interrupted grid says its unsupported cells too
        printer.flush()
    from ..report.diff import render_diff_terminal
    from ..report.terminal import render_terminal

    print()
    print(render_terminal(analysis, analysis.meta.run_dir))
    if analysis.comparison:
        print()
        print(render_diff_terminal(analysis.comparison))
    if options.cache:
        reused = sum(1 for o in analysis.outcomes if o.record.cached_from)
        print(f"cache: {reused} probe(s) reused from {options.cache.path}")
    return finish(analysis)
