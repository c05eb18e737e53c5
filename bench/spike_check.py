"""Cost of the loss-spike rule on a long curve, as ratios measured in one run: a live run's callback and a
long grid judge every step against the spike_window steps before it, so judging a curve four times as
long should cost about four times as much (steps x window), not sixteen (steps squared). Each length is
timed over ROUNDS interleaved rounds and the median kept. Usage: python bench/spike_check.py [ROUNDS]"""

from __future__ import annotations

import statistics
import sys
import time

from nandoctor.analysis.verdicts.curve import loss_spike
from nandoctor.record import Step

LENGTHS = (2_500, 5_000, 10_000, 20_000)


def curve(n: int) -> list[Step]:
    """n steps of a flat, slightly noisy loss with no spike (the whole curve is read), of two batch kinds."""
    return [Step(i, 2.0 + 0.01 * (i % 7), 1.0, supervised=256, batch=("first", "longest")[i % 2]) for i in range(n)]


def main(rounds: int = 5) -> None:
    curves = {n: curve(n) for n in LENGTHS}
    times: dict[int, list[float]] = {n: [] for n in LENGTHS}
    for _ in range(rounds):
        for n, steps in curves.items():
            start = time.process_time()
            assert loss_spike(steps) is None
            times[n].append(time.process_time() - start)
    base = statistics.median(times[LENGTHS[0]])
    print(f"{'steps':>7}  {'median CPU s':>12}  {'x the shortest':>14}  {'x steps':>8}")
    for n in LENGTHS:
        t = statistics.median(times[n])
        print(f"{n:>7}  {t:>12.4f}  {t / base:>14.1f}  {n / LENGTHS[0]:>8.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
