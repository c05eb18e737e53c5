"""Which of the user's rows a probe trains on: the first batches in the data's order (what a training
run sees first), then the worst batches a scan of every row finds, each a batch the run will meet
sooner or later:

- longest: the batch_size longest rows (the most memory, the longest attention);
- most_padded: the longest row with the shortest ones (the most padding a batch of these rows can
  carry; not for packed batches, which have none);
- fewest_supervised: the rows with the fewest loss terms (a batch of rows with none has a 0/0 loss).

Ties are broken by a permutation drawn from the seed, so the same seed picks the same rows. A worst
batch holding the same rows as an earlier batch is not repeated. Pure numpy over the scan's columns.
"""

from __future__ import annotations

WORST = ("longest", "most_padded", "fewest_supervised")


def choose_batches(length, supervised, batch_size: int, first: int, seed: int, packed: bool) -> list[tuple[str, tuple]]:
    """[(kind, row indices)]: `first` batches of batch_size rows in order, then the worst ones.
    length / supervised: per-row numpy arrays from the scan."""
    import numpy as np

    n = len(length)
    size = min(batch_size, n)
    chosen = [("first", tuple(range(start, min(start + size, n)))) for start in range(0, min(first * size, n), size)]
    tie = np.random.default_rng(seed).permutation(n)  # lexsort: the last key sorts first, ties by the permutation
    by_length = np.lexsort((tie, -np.asarray(length)))
    worst = {
        "longest": by_length[:size],
        "most_padded": None if packed else np.concatenate([by_length[:1], by_length[::-1][: size - 1]]),
        "fewest_supervised": np.lexsort((tie, np.asarray(supervised)))[:size],
    }
    seen = {frozenset(rows) for _, rows in chosen}
    for kind in WORST:
        rows = worst[kind]
        if rows is None or len(set(rows.tolist())) < size or frozenset(rows.tolist()) in seen:
            continue
        seen.add(frozenset(rows.tolist()))
        chosen.append((kind, tuple(int(r) for r in rows)))
    return chosen
