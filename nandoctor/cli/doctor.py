"""`nandoctor doctor`: what this machine can run, and which known issues a planned setup walks into.
Exit 0 when no finding is an error, 1 otherwise."""

from __future__ import annotations

from ..cells import AXES, parse_axis_flag, parse_axis_values
from ..doctor import exit_code, run_doctor
from .args import add_data_args, examples, recipe_from_args


def register(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="environment and capability report; with --model / --trainer-args / --accelerate-config, "
        "lint a planned setup; with --data, lint your training rows (docs/data.md)",
        **examples(
            "nandoctor doctor",
            "nandoctor doctor --model gemma-2-2b --axis dtype=bf16-amp,fp16-amp",
            "nandoctor doctor --model ./my-checkpoint --trainer-args args.json --json",
            "nandoctor doctor --model ./my-checkpoint --accelerate-config fsdp.yaml",
            "nandoctor doctor --data chat.jsonl --model ./my-checkpoint",
            "nandoctor doctor --data rows.parquet --tokenizer ./my-tokenizer --set data.packing=position_ids",
        ),
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", help="recipe name, local checkpoint directory, or cached hub id to lint")
    p.add_argument("--recipe", help="a recipe YAML file to lint")
    p.add_argument(
        "--trainer-args",
        help="a TrainingArguments JSON (as to_json_string() writes it): lints its precision and torch_compile",
    )
    p.add_argument(
        "--accelerate-config",
        help="an accelerate config YAML (as `accelerate config` writes it): lints its "
        "mixed_precision, distributed_type (DDP, FSDP and its reduce dtype) and dynamo backend",
    )
    add_data_args(p)
    p.add_argument(
        "--attn",
        default="sdpa",
        help=f"attention of the --trainer-args setup, one of {', '.join(AXES['attn'])} (default sdpa)",
    )
    p.add_argument(
        "--axis", action="append", default=[], metavar="NAME=V1,V2", help="restrict the linted grid axes, as for grid"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field, VALUE read as YAML, e.g. model.dtype_on_load=bf16 (repeatable)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a local checkpoint's own modeling and tokenizer code (recipe field model.trust_remote_code)",
    )
    p.set_defaults(func=run, steps=None, scale=None, world_size=None)


def run(args) -> int:
    from ..report.doctor import (
        render_doctor_json,
        render_doctor_text,
    )  # the report package loads pandas: not for --help

    parse_axis_values("attn", [args.attn])
    linted = args.model or args.recipe or args.set or args.data
    recipe = recipe_from_args(args) if linted or args.trainer_args or args.accelerate_config else None
    report = run_doctor(
        recipe,
        args.trainer_args,
        args.tokenizer,
        args.attn,
        dict(parse_axis_flag(a) for a in args.axis),
        accelerate_config_path=args.accelerate_config,
    )
    print(render_doctor_json(report) if args.json else render_doctor_text(report))
    return exit_code(report)
