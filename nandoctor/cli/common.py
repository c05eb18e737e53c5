"""Arguments several subcommands share: which model, which recipe, and narrow overrides; and the
lines every run prints while it goes."""
from __future__ import annotations

import argparse
import sys

from ..api import Listener
from ..config import SCALES, Recipe, set_field
from ..errors import NandoctorError
from ..recipes import resolve_model

MODEL_FLAGS = ("model", "recipe", "steps", "scale", "set", "trust_remote_code", "out")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="recipe name, local checkpoint directory, or hub id already in the local cache (default: tiny-llama)")
    p.add_argument("--recipe", help="a recipe YAML file")
    p.add_argument("--steps", type=int, help="training steps per probe (default: the recipe's)")
    p.add_argument("--scale", choices=SCALES, help="full model, probe-scale twin, or auto (full when it fits)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field, e.g. optimizer.eps=1e-4 (repeatable)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a local checkpoint's own modeling code")
    p.add_argument("--out", help="run directory, new or empty (default: reports/<run-id>)")


def recipe_from_args(args) -> Recipe:
    recipe = resolve_model(args.model, args.recipe)
    overrides = list(args.set)
    if args.scale:
        overrides.append(f"model.scale={args.scale}")
    if args.trust_remote_code:
        overrides.append("model.trust_remote_code=true")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise NandoctorError(f"bad --set {item!r}: expected KEY=VALUE, e.g. optimizer.eps=1e-4")
        recipe = set_field(recipe, key.strip(), value.strip())
    if args.steps is not None and args.steps <= 0:
        raise NandoctorError(f"--steps must be > 0, got {args.steps}")
    return recipe.validate()


def _given(value) -> bool:
    """A flag the user passed: not its unset default (None, False, [], ""); a 0 counts (--reruns 0)."""
    return value is not None and value is not False and value not in ([], "")


def refuse_with_resume(args, shaping: tuple[str, ...], taken: str) -> None:
    """--resume takes everything that shapes the run (`taken`) from DIR/run.json; a flag that would change it is an error."""
    given = [f"--{name.replace('_', '-')}" for name in shaping if _given(getattr(args, name))]
    if given:
        raise NandoctorError(f"--resume takes {taken} from DIR/run.json; drop {', '.join(given)}")


def say(line: str) -> None:
    print(line, flush=True)


def opened(run_dir) -> None:
    """The first line, at once: where the run goes."""
    say(f"run directory: {run_dir}")


def started(run_dir, plan, warnings: list[str]) -> None:
    """Before any probe runs: which model is built and why, and what the user must know."""
    say(f"model: {plan.describe()}; {plan.why}")
    for warning in warnings:
        print(f"nandoctor: WARNING: {warning}", file=sys.stderr, flush=True)


def alive_line(probe_id: str, elapsed_s: float, step: dict | None) -> str:
    last = f"step {step['step']} loss {step['loss']:.4g}" if step else "no step yet"
    return f"  ... {probe_id} running {elapsed_s:.0f} s, {last}"


def retiming_line(cells: list[str], rounds: int, steps: int) -> str:
    return (f"re-timing {', '.join(cells)} back to back, interleaved ({rounds} rounds of {steps} steps): "
            "speed decides between them")


def listener(probe) -> Listener:
    """What a run prints: the run directory, the model line, `probe(...)` per finished probe, a heartbeat
    per running one, and a line before a grid re-times its leading cells."""
    return Listener(opened=opened, started=started, probe=probe, alive=lambda *a: say(alive_line(*a)),
                    retiming=lambda *a: say(retiming_line(*a)))
