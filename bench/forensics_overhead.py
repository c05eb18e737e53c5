"""Cost of the forensics hooks, as a ratio measured in one run: tiny-llama training steps with and
without ModuleWatch + OptimizerWatch, in alternating blocks on the same model (the first block of
each kind is warm-up and left out). Usage: python bench/forensics_overhead.py [DTYPE] [ROUNDS]"""
from __future__ import annotations

import statistics
import sys
import time

from nandoctor.config import Cell
from nandoctor.env import collect_summary
from nandoctor.forensics import ModuleWatch, OptimizerWatch
from nandoctor.models import batches, build_model, plan_model
from nandoctor.probe import attention, build_optimizer, precision, train
from nandoctor.recipes import resolve_model

STEPS_PER_BLOCK = 4


def block_seconds(model, data, optimizer, scaler, autocast, attend, grad_clip, hooked: bool) -> float:
    """Wall time per step of one block, the hooks' per-step bookkeeping (end_step) included."""
    watches = (ModuleWatch(model), OptimizerWatch(model, optimizer)) if hooked else None

    def on_step(step, *_):
        if watches:
            watches[0].end_step(step)
            watches[1].take()
        return True

    t0 = time.perf_counter()
    train(model, data, optimizer, scaler, autocast, attend, grad_clip, STEPS_PER_BLOCK, on_step)
    seconds = (time.perf_counter() - t0) / STEPS_PER_BLOCK
    for w in watches or ():
        w.remove()
    return seconds


def main(dtype: str = "fp32", rounds: int = 6) -> None:
    recipe = resolve_model("tiny-llama")
    cell = Cell(dtype, "sdpa", "off")
    model = build_model(plan_model(recipe, collect_summary()), recipe, cell, recipe.seed)
    optimizer = build_optimizer(model, recipe)
    autocast, scaler = precision(cell, "cpu")
    data = batches(recipe, model.config, recipe.seed)
    times = {False: [], True: []}
    for _ in range(rounds):
        for hooked in (False, True):
            times[hooked].append(block_seconds(model, data, optimizer, scaler, autocast, attention(cell), recipe.grad_clip, hooked))
    plain, hooked = statistics.median(times[False][1:]), statistics.median(times[True][1:])
    print(f"{dtype}: {plain * 1e3:.1f} ms/step plain, {hooked * 1e3:.1f} ms/step hooked: overhead {hooked / plain:.2f}x "
          f"(median of {rounds - 1} blocks of {STEPS_PER_BLOCK} steps each)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp32", int(sys.argv[2]) if len(sys.argv) > 2 else 6)
