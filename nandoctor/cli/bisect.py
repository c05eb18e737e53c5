"""`nandoctor bisect`: find the minimal set of settings that breaks training, and the stable
configuration nearest the one the user wants."""

from __future__ import annotations

import dataclasses

from ..api import FAIL_ON
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

SEARCH_FLAGS = ("bad", "good", "factor", "reruns", "data_seeds", "fail_on")


def register(sub) -> None:
    p = sub.add_parser(
        "bisect",
        help="isolate the settings that break training (delta debugging)",
        **examples(
            "nandoctor bisect --model tiny-llama --bad dtype=fp16-pure,attn=sdpa --steps 8",
            "nandoctor bisect --bad dtype=bf16-pure,optimizer.lr=2e-5 --reruns 2",
            "nandoctor bisect --resume reports/<run-id>",
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--bad",
        metavar="NAME=V,...",
        help="the target that fails, e.g. dtype=bf16-pure,optimizer.eps=1e-8 "
        "(default: the fastest configuration this device supports)",
    )
    p.add_argument(
        "--good", metavar="NAME=V,...", help="the baseline that passes (default: dtype=fp32,attn=eager,compile=off)"
    )
    p.add_argument(
        "--factor",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more target setting to consider, an axis or a dotted recipe field (repeatable)",
    )
    p.add_argument("--reruns", type=int, help="identical reruns of every decisive probe (default 1)")
    p.add_argument("--data-seeds", type=int, help="also rerun decisive probes on K other seeds (default 0)")
    add_jobs_arg(p)
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue an interrupted bisect: the probes DIR/results.jsonl holds are reused, not rerun",
    )
    p.add_argument(
        "--fail-on",
        default="",
        metavar="V,...",
        help=f"count these verdicts as failures instead of unresolved ({', '.join(FAIL_ON)}), to hunt a hang or a leak",
    )
    add_executor_args(p)
    p.set_defaults(func=run)


def model_flags(args) -> list[str]:
    """The flags that name the model and recipe, for the recommended command line (which names the data
    and tokenizer the recipe read itself: recommend.input_flags)."""
    flags = []
    for name in ("model", "recipe", "scale"):
        if getattr(args, name):
            flags += [f"--{name}", str(getattr(args, name))]
    if args.world_size is not None:
        flags += ["--world-size", str(args.world_size)]
    for item in args.set:
        flags += ["--set", item]
    return flags + (["--trust-remote-code"] if args.trust_remote_code else [])


def run(args) -> int:
    # imported here, not at the top: they pull in pandas, which `nandoctor --help` need not pay for
    from ..bisect.oracle import BisectRequest, resume_bisect, run_bisect
    from ..report.bisection import describe_step, probe_line
    from ..report.terminal import render_terminal

    hear = listener(lambda done, _, record, __: say(probe_line(done, record)))
    hear.step = lambda step: say(describe_step(dataclasses.asdict(step)))
    options = options_from_args(args, hear)
    if args.resume:
        refuse_with_resume(
            args, MODEL_FLAGS + SEARCH_FLAGS, "the recipe, --good, --bad, --fail-on, reruns, steps and run directory"
        )
        analysis, _ = resume_bisect(args.resume, options)
    else:
        search = {name: getattr(args, name) for name in ("reruns", "data_seeds") if getattr(args, name) is not None}
        request = BisectRequest(
            good=args.good,
            bad=args.bad,
            factors=tuple(args.factor),
            fail_on=tuple(v for v in args.fail_on.split(",") if v),
            model_flags=tuple(model_flags(args)),
            **search,
        )
        analysis, _ = run_bisect(recipe_from_args(args), request, options)
    print()
    print(render_terminal(analysis, analysis.meta.run_dir))
    return finish(analysis)
