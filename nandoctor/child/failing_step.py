"""The replay of a failing step in the process that trained it: what is kept when a step fails (the
batch, and a copy of the weights and optimizer state the step started from), and that step trained again
on the model with the forensics hooks of instruments.py, after which the run's own state is put back.
Two kinds of run use it: a user's run watched by a training callback (integrations/watch.py), and a probe
that trains with the user's trainer (trainer.py), whose steps nandoctor's own loop cannot replay.

Every read of a parameter here is this rank's own (its FSDP2 shard, `live.local`): a rank never
starts a collective that the others do not join.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass

from ..measure.trainer_step import local
from ..record import Step
from .build import Setup
from .instruments import hooked_steps, update_event
from .replay import replay_cost, reproduced


def parameter_extremes(named: list) -> object:
    """[min, max] per parameter (this rank's shard) as one float tensor, without a device sync (read only
    after a failure)."""
    import torch

    return torch.stack([torch.stack(torch.aminmax(local(p).detach())).float() for _, p in named])


def state_copy(named: list, optimizer) -> dict:
    """The trainable weights and the optimizer state, copied to the CPU."""
    import torch

    def to_cpu(x):
        return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else copy.deepcopy(x)

    state = optimizer.state_dict()
    return {
        "weights": [to_cpu(local(p)) for _, p in named],
        "optimizer": {
            "state": {k: {n: to_cpu(v) for n, v in s.items()} for k, s in state["state"].items()},
            "param_groups": copy.deepcopy(state["param_groups"]),
        },
    }


def state_restore(named: list, optimizer, saved: dict) -> None:
    import torch

    with torch.no_grad():
        for (_, p), w in zip(named, saved["weights"]):
            local(p).copy_(w)
    optimizer.load_state_dict(saved["optimizer"])


@dataclass
class Failure:
    """The first failing step of a live run, as kept for its replay and report."""

    verdict: object  # what stopped the run, read for its .step: the watch's Verdict, or a probe's Step
    batch: dict
    before: dict  # state_copy() of the weights and optimizer state the failing step started from
    entering: object  # parameter_extremes() of those weights, or None
    earlier: object  # parameter_extremes() one check before, or None
    scale: float | None


def replay(run, named: list, failure: Failure, judged: Step, every: int) -> dict:
    """The failing step again (`judged`, as the watch judged it), from the weights and optimizer state
    it started from, with the forensics hooks on the live model; `run` is what trained it (its
    step_loss, optimizer, autocast, device, recipe.grad_clip and cell: an integrations.live.LiveRun, or
    trainer.TrainerRun), `named` its trainable (name, parameter) pairs, `every` the steps between two
    judged ones. Returns the forensics of a probe record; the model and optimizer are left as the run
    left them."""
    import torch

    k = failure.verdict.step
    t0 = time.perf_counter()
    after = state_copy(named, run.optimizer)
    state_restore(named, run.optimizer, failure.before)
    scaler = torch.amp.GradScaler(run.device, init_scale=failure.scale or 1.0, enabled=failure.scale is not None)
    devices = [torch.cuda.current_device()] if run.device == "cuda" else []
    sync = torch.cuda.synchronize if run.device == "cuda" else (lambda: None)
    # no SDPA backend pin: the replay runs the model's attention as the live run does
    step = ([failure.batch], None)  # one micro-batch, its loss as the live run computed it
    s = Setup(run.step_loss, iter([step]), run.optimizer, run.autocast, scaler, contextlib.nullcontext, sync)
    try:
        earlier = earlier_update(run, named, failure, k - every)
        with torch.random.fork_rng(devices=devices):
            out = hooked_steps(run.step_loss, s, run.recipe.grad_clip, 1, first_step=k)
    finally:
        state_restore(named, run.optimizer, after)
    out["events"] = earlier + out["events"]
    replayed = out.pop("steps")
    return {
        "compute_dtype": run.cell.precision.compute,
        "weight_dtype": str(named[0][1].dtype).replace("torch.", ""),
        "replayed_steps": 1,
        "compile": "off",
        **out,
        "steps": [st.to_dict() for st in replayed],
        "reproduced": reproduced([judged], replayed),
        "cost": replay_cost([judged], replayed, time.perf_counter() - t0),
        "note": f"step {k} replayed in process on the live model, from the weights and optimizer state it started from",
    }


def earlier_update(run, named: list, failure: Failure, step: int) -> list[dict]:
    """When the weights the failing step read were already non-finite, an optimizer step before it
    (the judged `step`) made them so: the first such parameter, its extremes one check earlier, and the
    optimizer state that update left (the live state is restored to where the failing step started)."""
    bad = [
        i for i, (lo, hi) in enumerate(failure.entering.cpu().tolist()) if not (math.isfinite(lo) and math.isfinite(hi))
    ]
    if not bad:
        return []
    name, p = named[bad[0]]
    return [{"step": step, **update_event(name, p, run.optimizer, failure.earlier.cpu().tolist()[bad[0]])}]
