"""Arguments several subcommands share: which model, which recipe, narrow overrides, where probes run;
and the recipe, executor and run options they describe."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..api import Listener, ProbeCache, RunOptions
from ..config import OBJECTIVES, SCALES, Recipe, set_field, with_paths_resolved
from ..errors import NandoctorError
from ..executors import EXECUTOR_OPTIONS, ExecutorConfig, executor_config
from ..knowledge.facts import TRAINER_KINDS, trainer_of, with_trainer
from ..recipes import executor_section, resolve_model

MODEL_FLAGS = (
    "model",
    "recipe",
    "steps",
    "scale",
    "set",
    "trust_remote_code",
    "out",
    "world_size",
    "objective",
    "data",
    "tokenizer",
    "trainer_args",
    "trainer",
)


def examples(*commands: str) -> dict:
    """add_parser keywords that end a subcommand's --help with example command lines, kept as written."""
    return {
        "epilog": "examples:\n" + "\n".join(f"  {c}" for c in commands),
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }


def positive_int(text: str) -> int:
    """argparse type of a count that must be > 0 (--jobs); a bad one is argparse's one-line usage error."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value {text!r}: expected a whole number > 0") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {number}")
    return number


def add_jobs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobs",
        type=positive_int,
        help="probes at once on this machine (default: on a GPU host as many as fit in the GPUs' memory, "
        "at most one per 2 cores; 1 on a CPU)",
    )


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        metavar="PATH",
        help="train the probes on this data file or directory (recipe fields data.path, data.source=file)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local tokenizer directory (recipe field data.tokenizer; default: the checkpoint's own)",
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="recipe name, local checkpoint directory, or hub id already in the local cache (default: tiny-llama)",
    )
    p.add_argument("--recipe", help="a recipe YAML file")
    p.add_argument("--steps", type=int, help="training steps per probe (default: the recipe's)")
    p.add_argument("--scale", choices=SCALES, help="full model, probe-scale twin, or auto (full when it fits)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field, VALUE read as YAML: optimizer.eps=1e-4, optimizer.betas=[0.9,0.95] "
        "(or 0.9,0.95), adapter.modules_to_save=[lm_head] (repeatable; docs/recipes.md)",
    )
    p.add_argument("--trust-remote-code", action="store_true", help="allow a local checkpoint's own modeling code")
    p.add_argument("--out", help="run directory, new or empty (default: reports/<run-id>)")
    p.add_argument(
        "--world-size",
        type=int,
        metavar="W",
        help="ranks of each parallel probe (the `parallel` axis; recipe field world_size, default 2)",
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        help="what each probe step optimizes: the supervised loss (sft, the default) or GRPO on completions "
        "the probe samples, with the rollout's log-prob mismatch measured (recipe fields objective, rollout.*; "
        "docs/rl.md)",
    )
    p.add_argument(
        "--trainer-args",
        metavar="FILE",
        help="train each probe with your trainer: a TrainingArguments, TRL SFTConfig or TRL GRPOConfig as JSON "
        "(to_json_string()) or YAML; each cell's precision, attention and compile are set on it, the rest kept "
        "(docs/training-options.md)",
    )
    p.add_argument(
        "--trainer",
        choices=TRAINER_KINDS,
        help="the trainer of --trainer-args: hf (transformers.Trainer), sft (trl.SFTTrainer) or grpo "
        "(trl.GRPOTrainer); default: read from the file's keys",
    )
    add_data_args(p)


def trainer_from_args(args) -> dict | None:
    """The user's trainer of --trainer-args / --trainer ({"kind", "args"}), or None: nandoctor's own loop."""
    if getattr(args, "trainer", None) and not getattr(args, "trainer_args", None):
        raise NandoctorError("--trainer names the trainer of --trainer-args FILE; add --trainer-args")
    return (
        trainer_of(args.trainer_args, getattr(args, "trainer", None)) if getattr(args, "trainer_args", None) else None
    )


def add_executor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor",
        choices=tuple(EXECUTOR_OPTIONS),
        help="where probes run: this machine (local, the default), "
        "a SLURM cluster (job arrays through submitit) or a Ray cluster (one task per probe)",
    )
    p.add_argument(
        "--executor-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a scheduler setting (repeatable). slurm: "
        + ", ".join(EXECUTOR_OPTIONS["slurm"])
        + "; ray: "
        + ", ".join(EXECUTOR_OPTIONS["ray"]),
    )


def executor_from_args(args) -> ExecutorConfig:
    """--executor and --executor-opt over the `executor:` section of the --recipe file, if any."""
    kind, options = executor_section(args.recipe) if getattr(args, "recipe", None) else (None, [])
    if args.executor and args.executor != kind:
        options = []  # the file's options belong to another kind
    executor = executor_config(args.executor or kind, options + args.executor_opt)
    if executor.remote and args.jobs is not None:
        raise NandoctorError(
            f"--jobs sets this machine's slots; "
            f"with --executor {executor.kind} pass --executor-opt parallel={args.jobs}"
        )
    return executor


def options_from_args(args, listener: Listener) -> RunOptions:
    """The run options the flags describe, built once: --out, --steps, and where the subcommand has them
    --jobs, --cold, --cache, --executor / --executor-opt, --baseline and --roundtrip."""
    return RunOptions(
        out=args.out,
        jobs=getattr(args, "jobs", None),
        steps=args.steps,
        warm=not getattr(args, "cold", False),
        cache=ProbeCache() if getattr(args, "cache", False) else None,
        executor=executor_from_args(args) if hasattr(args, "executor") else None,
        listener=listener,
        baseline=getattr(args, "baseline", None),
        roundtrip=getattr(args, "roundtrip", False),
        trainer=trainer_from_args(args),
    )


def recipe_from_args(args) -> Recipe:
    """The recipe of --model / --recipe with --set and the flags that name a recipe field applied, validated."""
    recipe = resolve_model(args.model, args.recipe)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise NandoctorError(f"bad --set {item!r}: expected KEY=VALUE, e.g. optimizer.eps=1e-4")
        try:
            recipe = set_field(recipe, key.strip(), value.strip())
        except NandoctorError as e:
            raise NandoctorError(f"--set {item}: {e}") from None
    recipe = with_paths_resolved(recipe, Path.cwd())  # a --set path is the user's, from where they are
    for flag, key, value in field_flags(args):
        try:
            recipe = set_field(recipe, key, value)
        except NandoctorError as e:
            raise NandoctorError(f"{flag}: {e}") from None
    if args.steps is not None and args.steps <= 0:
        raise NandoctorError(f"--steps must be > 0, got {args.steps}")
    trainer = trainer_from_args(args)
    if trainer and trainer["kind"] == "grpo":
        objective = getattr(args, "objective", None)
        if objective not in (None, "grpo"):
            raise NandoctorError(
                f"--objective {objective} with a GRPOConfig (--trainer-args): trl.GRPOTrainer trains GRPO; "
                "drop --objective or pass --objective grpo"
            )
        if objective is None:
            print(
                "nandoctor: note: --trainer-args is a GRPOConfig: every probe runs trl.GRPOTrainer (objective grpo)",
                file=sys.stderr,
                flush=True,
            )
    return with_trainer(recipe, trainer) if trainer else recipe.validate()


def field_flags(args) -> list[tuple[str, str, object]]:
    """(flag, recipe field, typed value) of each flag given that sets a recipe field; applied after --set."""
    out = []
    if args.scale:
        out.append(("--scale", "model.scale", args.scale))
    if args.trust_remote_code:
        out.append(("--trust-remote-code", "model.trust_remote_code", True))
    if args.world_size is not None:
        out.append(("--world-size", "world_size", args.world_size))
    if getattr(args, "objective", None):
        out.append(("--objective", "objective", args.objective))
    if getattr(args, "data", None):
        path = str(Path(args.data).expanduser().resolve())  # a probe's working directory is not the user's
        out += [("--data", "data.source", "file"), ("--data", "data.path", path)]
    if getattr(args, "tokenizer", None):
        out.append(("--tokenizer", "data.tokenizer", str(Path(args.tokenizer).expanduser().resolve())))
    return out


def _given(value) -> bool:
    """A flag the user passed: not its unset default (None, False, [], ""); a 0 counts (--reruns 0)."""
    return value is not None and value is not False and value not in ([], "")


def refuse_with_resume(args, shaping: tuple[str, ...], taken: str) -> None:
    """--resume takes everything that shapes the run (`taken`) from DIR/run.json; a flag that would change
    it is an error."""
    given = [f"--{name.replace('_', '-')}" for name in shaping if _given(getattr(args, name))]
    if given:
        raise NandoctorError(f"--resume takes {taken} from DIR/run.json; drop {', '.join(given)}")
