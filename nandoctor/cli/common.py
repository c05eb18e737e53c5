"""Arguments several subcommands share: which model, which recipe, and narrow overrides."""
from __future__ import annotations

import argparse

from ..config import SCALES, Recipe, set_field
from ..errors import NandoctorError
from ..recipes import resolve_model


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="recipe name, local checkpoint directory, or hub id already in the local cache (default: tiny-llama)")
    p.add_argument("--recipe", help="a recipe YAML file")
    p.add_argument("--steps", type=int, help="training steps per probe (default: the recipe's)")
    p.add_argument("--scale", choices=SCALES, help="full model, probe-scale twin, or auto (full when it fits)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe field, e.g. optimizer.eps=1e-4 (repeatable)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a local checkpoint's own modeling code")
    p.add_argument("--out", help="run directory (default: reports/<run-id>)")


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
