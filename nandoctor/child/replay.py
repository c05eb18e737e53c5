"""Numerics forensics, the replay (in the probe process): after its timed steps, the probe's child
restores the model's initial state from the snapshot taken before them (snapshot.py), takes a fresh
optimizer, GradScaler and data stream, and replays the first steps eagerly with the instruments
(instruments.py) hung off the unchanged training loop. The timed steps run without any of this, so
throughput stays honest; the replay measures its own cost. Each rank of a parallel probe replays its
own steps on its wrapper, with the watches its strategy adds (ranks.py, reduction_watch.py).

A probe whose steps all stay finite has no offender to find, and replaying it only re-measures its
margin. So when the cell runs eagerly in one process (no torch.compile, no fp8 casts to watch) the same
ModuleWatch and update-loss hooks hang off its timed step 0 instead (instruments.StepZeroWatch), and
come off after it; the fp32 shadow backward runs after the timed steps on the restored initial
weights, as in the replay. Step 0 is a warm-up step that no throughput figure uses
(record.warmup_steps). A probe that went non-finite is replayed, hooks on every step up to its failure.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback

from ..cells import weight_dtype
from ..config import load_dtype
from ..record import ProbeRecord, ProbeSpec, Step
from .build import Setup, first_step, restart
from .fp8 import fp8_watch
from .instruments import StepZeroWatch, gradient_underflow, hooked_steps
from .ranks import ONE_PROCESS, Ranks
from .snapshot import Snapshot


def replayed_steps(spec: ProbeSpec, timed: ProbeRecord) -> int:
    """How many steps the replay runs: up to the timed run's first non-finite step, else forensics_steps."""
    first_bad = timed.first_nonfinite
    return first_bad["step"] + 1 if first_bad else min(len(timed.steps), spec.recipe.forensics_steps)


def restored(spec: ProbeSpec, s: Setup, snapshot: Snapshot, n_steps: int) -> tuple[Setup, dict]:
    """The model back at its state before the timed steps, with a fresh optimizer, GradScaler and data
    stream; and the head of the forensics record."""
    seconds = snapshot.restore(s.model)
    s = restart(spec, s)
    cell = spec.cell
    out = {
        "compute_dtype": cell.precision.compute,
        "weight_dtype": weight_dtype(cell, load_dtype(spec.recipe)),
        "replayed_steps": n_steps,
        "compile": "off",
        "snapshot": {**snapshot.describe(), "restore_seconds": seconds},
    }
    if cell.compile != "off":
        out["note"] = f"replayed without torch.compile ({cell.compile}): module hooks need eager execution"
    return s, out


def underflow(spec: ProbeSpec, timed: ProbeRecord, s: Setup) -> dict:
    """gradient_underflow on the first micro-batch of the probe's stream, at the timed run's last loss scale."""
    t1 = time.perf_counter()
    scales = [st.scale for st in timed.steps if st.scale]
    first = first_step(spec, s)[0][0]
    out = gradient_underflow(s.model, first, spec.cell.precision.compute, scales[-1] if scales else 1.0)
    out["seconds"] = time.perf_counter() - t1
    return out


def finished(spec: ProbeSpec, timed: ProbeRecord, out: dict, t0: float) -> dict:
    """The forensics record completed: reproduced, cost, peak memory, steps as dicts."""
    out["reproduced"] = reproduced(timed.steps, out["steps"])
    out["cost"] = replay_cost(timed.steps, out["steps"], time.perf_counter() - t0)
    if spec.device == "cuda":  # the whole process's allocator peak, replay included: what packing probes must allow for
        import torch

        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    out["steps"] = [st.to_dict() for st in out["steps"]]
    return out


def replay(spec: ProbeSpec, timed: ProbeRecord, s: Setup, snapshot: Snapshot, ranks: Ranks = ONE_PROCESS) -> dict:
    """Restore the probe's model to its state before the timed steps, replay its first steps with hooks
    on a fresh optimizer, GradScaler and data stream, and return the forensics record. `timed` is the
    record of the timed run (steps, first_nonfinite); `ranks` how the probe's processes share it (a
    rank replays its own rows on its wrapper, with its reduction watch, and stops where its peers do)."""
    t0 = time.perf_counter()
    n_steps = replayed_steps(spec, timed)
    recipe = spec.recipe
    budget = max(recipe.forensics_share * sum(st.time_s or 0.0 for st in timed.steps), recipe.forensics_min_s)
    s, out = restored(spec, s, snapshot, n_steps)
    if spec.cell.precision.compute != "float32":
        if ranks.underflow_note:
            out["underflow_note"] = ranks.underflow_note
        else:
            out["underflow"] = underflow(spec, timed, s)  # on the whole first global batch, as one process
    casts = fp8_watch(s.model, spec.cell, spec.recipe)
    s, more = ranks.replay_watches(s)
    try:
        out.update(
            hooked_steps(
                ranks.model(s),
                s,
                spec.recipe.grad_clip,
                n_steps,
                watched=s.model,
                more=more,
                agree=ranks.agree,
                # ranks stop together (agree), never one of them alone on its own clock
                deadline=t0 + budget if budget > 0 and ranks is ONE_PROCESS else None,
            )
        )
    finally:
        if casts:
            casts.remove()
    if casts:
        out["fp8"] = {"recipe": spec.cell.dtype, "casts": casts.stats, "excluded": s.fp8_excluded}
    if "stopped_at" in out:
        out["budget"] = {
            "share": recipe.forensics_share,
            "min_s": recipe.forensics_min_s,
            "seconds": budget,
            "stopped_at": out.pop("stopped_at"),
        }
    return finished(spec, timed, ranks.mark(out), t0)


def forensics_of(
    spec: ProbeSpec, timed: ProbeRecord, s: Setup, snapshot: Snapshot, watch: StepZeroWatch | None, ranks: Ranks
) -> dict:
    """Step 0's measurements when the timed steps stayed finite, else the replay with hooks, on the
    timed run's model restored from its snapshot. Its failure is recorded, never turned into the probe's."""
    try:
        if watch and watch.step is not None and not timed.first_nonfinite:
            return measured_in_run(spec, timed, s, snapshot, watch)
        return replay(spec, timed, s, snapshot, ranks)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}


MEASURED_ON = "timed step 0"  # forensics["measured_on"] of a probe measured without a replay


def eager_forensics(spec: ProbeSpec) -> bool:
    """Whether a stable probe of this spec is measured on its timed step 0 rather than replayed: the
    cell runs eagerly without fp8 casts to watch, in one process (a rank's replay also watches its
    reduction), and step 0 is a warm-up step (at least 2 steps). A check (replay_failed_only) is measured
    so too: read-only hooks on a step it trains anyway, so that it judges a stall as the grid does."""
    cell = spec.cell
    return (
        spec.recipe.forensics_steps > 0
        and not cell.parallel_row.wrapper
        and cell.compilation.backend is None
        and not cell.precision.fp8
        and spec.steps >= 2
    )


def _header(spec: ProbeSpec, s: Setup, timed: ProbeRecord, snapshot: Snapshot) -> dict:
    """The head of a forensics record measured in the timed run: the dtypes, the snapshot restored, and
    for a half-precision cell the gradient underflow of the initial weights on the first batch."""
    cell = spec.cell
    out = {
        "compute_dtype": cell.precision.compute,
        "weight_dtype": weight_dtype(cell, load_dtype(spec.recipe)),
        "snapshot": {**snapshot.describe(), "restore_seconds": snapshot.restore(s.model)},
    }
    if cell.precision.compute != "float32":
        out["underflow"] = underflow(spec, timed, s)
    return out


def measured_in_run(spec: ProbeSpec, timed: ProbeRecord, s: Setup, snapshot: Snapshot, watch: StepZeroWatch) -> dict:
    """The forensics record of a probe whose timed steps stayed finite, from its hooked step 0: the
    same fields as a replay's (a one-step 'steps'), with measured_on saying where they came from."""
    t0 = time.perf_counter()
    out = _header(spec, s, timed, snapshot)
    out.update(
        {
            "measured_on": MEASURED_ON,
            "replayed_steps": 0,
            "compile": "off",
            "events": watch.events,
            "steps": [watch.step.to_dict()],
            "activation_absmax": watch.modules.activation_absmax,
            "gradient_absmax": watch.modules.gradient_absmax,
            "reproduced": None,
        }
    )
    out["cost"] = {"seconds": time.perf_counter() - t0, "hooked_step_overhead": None}
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def reproduced(timed: list[Step], replayed: list[Step]) -> bool:
    """Did the replay retrace the timed run: the same loss, bit for bit, at every replayed step?"""
    return bool(replayed) and all(_same(a.loss, b.loss) for a, b in zip(timed, replayed))


def replay_cost(timed: list[Step], replayed: list[Step], seconds: float) -> dict:
    """The replay's wall time and how much slower a hooked step is than the same timed step (median of
    the per-step ratios, step 0 left out when there are others: it carries allocator warm-up)."""
    pairs = [(b.time_s, a.time_s) for a, b in zip(timed, replayed) if a.time_s and b.time_s]
    pairs = pairs[1:] or pairs
    return {"seconds": seconds, "hooked_step_overhead": statistics.median(h / t for h, t in pairs) if pairs else None}
