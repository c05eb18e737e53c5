"""Cost of the forensics hooks, as a ratio measured in one run: tiny-llama training steps with and
without ModuleWatch + OptimizerWatch, in alternating blocks on the same model (the first block of
each kind is warm-up and left out). Usage: python bench/forensics_overhead.py [DTYPE] [ROUNDS]"""

from __future__ import annotations

import statistics
import sys
import time

from nandoctor.cells import Cell
from nandoctor.child.build import setup
from nandoctor.child.instruments import ModuleWatch, OptimizerWatch
from nandoctor.child.train import train
from nandoctor.env import collect_summary
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model
from nandoctor.record import ProbeSpec

STEPS_PER_BLOCK = 4


def block_seconds(s, grad_clip, hooked: bool) -> float:
    """Wall time per step of one block, the hooks' per-step bookkeeping (end_step) included."""
    watches = (ModuleWatch(s.model), OptimizerWatch(s.model, s.optimizer)) if hooked else None

    def on_step(step):
        if watches:
            watches[0].end_step(step.step)
            watches[1].take()
        return True

    t0 = time.perf_counter()
    train(s.model, s, grad_clip, STEPS_PER_BLOCK, on_step)
    seconds = (time.perf_counter() - t0) / STEPS_PER_BLOCK
    for w in watches or ():
        w.remove()
    return seconds


def main(dtype: str = "fp32", rounds: int = 6) -> None:
    recipe = resolve_model("tiny-llama")
    device = collect_summary()
    spec = ProbeSpec(
        "bench",
        recipe,
        Cell(dtype, "sdpa", "off"),
        plan_model(recipe, device),
        0,
        recipe.seed,
        device["device"],
        device["cpu_count"],
    )
    s = setup(spec)
    times = {False: [], True: []}
    for _ in range(rounds):
        for hooked in (False, True):
            times[hooked].append(block_seconds(s, recipe.grad_clip, hooked))
    plain, hooked = statistics.median(times[False][1:]), statistics.median(times[True][1:])
    print(
        f"{dtype}: {plain * 1e3:.1f} ms/step plain, {hooked * 1e3:.1f} ms/step hooked: overhead {hooked / plain:.2f}x "
        f"(median of {rounds - 1} blocks of {STEPS_PER_BLOCK} steps each)"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fp32", int(sys.argv[2]) if len(sys.argv) > 2 else 6)
