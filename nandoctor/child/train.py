"""The training loop a probe runs, and the log that streams its steps to disk as they happen."""

from __future__ import annotations

import math
import resource
import statistics
import time
from pathlib import Path

from .. import jsonio
from ..measure.accumulation import micro_loss as trainer_micro_loss
from ..record import Step
from .build import Setup


def train(model, s: Setup, grad_clip: float, steps: int, on_step) -> None:
    """Forward and backward per micro-batch, unscale, grad-norm, clip, step. `model` is the module to
    call (the compiled one in compile cells, a rank's DDP/FSDP2 wrapper); `next(s.data)` is one
    optimizer step: (its micro-batches, each a dict of the model's keyword arguments; its loss terms).
    The step's loss is the sum of the micro-batches' shares, as Trainer logs it. on_step(Step)
    returns False to stop early."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = grad_clip if grad_clip > 0 else math.inf
    for step in range(steps):
        micro_batches, items = next(s.data)
        t0 = time.perf_counter()
        losses = []
        for batch in micro_batches:
            with s.attend():
                with s.autocast():
                    loss = micro_loss(model, batch, items, len(micro_batches), s)
                s.scaler.scale(loss).backward()
            losses.append(loss.detach())
        s.scaler.unscale_(s.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # total norm before clipping
        scale = s.scaler.get_scale() if s.scaler.is_enabled() else None
        s.scaler.step(s.optimizer)  # skipped by the scaler when the unscaled grads hold inf/nan
        s.scaler.update()
        s.optimizer.zero_grad(set_to_none=True)
        s.sync()
        seconds = time.perf_counter() - t0
        skipped = scale is not None and s.scaler.get_scale() < scale
        tokens = step_tokens(micro_batches)
        rate = tokens / seconds if tokens is not None and seconds > 0 else None
        measured = Step(step, sum(losses).item(), grad_norm.item(), skipped, scale, seconds, tokens, rate)
        if s.stream is not None:  # what the step trained on: its loss terms (0: a batch with no target) and kind
            trained = s.stream.step_batches(step, len(micro_batches))
            measured.supervised = min(b.supervised for b in trained)
            measured.batch = "+".join(b.kind for b in trained)
        if not on_step(measured):
            break


def micro_loss(model, batch: dict, items, micro_batches: int, s: Setup):
    """One micro-batch's share of its step's loss, as Trainer computes it (measure/accumulation.py
    micro_loss, which the accumulation check runs too), under the probe's normalisation and ranks; an
    objective=grpo probe's is GRPO's loss of the step's completions (rollout.Rollouts.loss)."""
    if s.rollouts is not None:
        return s.rollouts.loss(model, batch)
    return trainer_micro_loss(model, batch, items, micro_batches, s.normalization, s.world_size)


def batch_tokens(batch: dict) -> int | None:
    """The tokens a batch trains on: its 2-D attention mask's ones; every position of a packed row
    (position_ids, with no mask or a 4-D one); None for a batch with neither (a live run's, replayed
    by the training callbacks), which then has no tokens/s."""
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return int(mask.sum())
    return batch["input_ids"].numel() if "position_ids" in batch else None


def step_tokens(micro_batches: list[dict]) -> int | None:
    """The tokens of a step's micro-batches together (None when one of them cannot say)."""
    counts = [batch_tokens(b) for b in micro_batches]
    return None if None in counts else sum(counts)


class StepLog:
    """Collects the steps, streams them to steps.jsonl (a hang or a segfault still leaves the curve),
    and stops the run at the first unrecoverable step."""

    def __init__(self, path: Path | None, planned: int):
        self.steps: list[Step] = []
        self.first_nonfinite: dict | None = None
        self.stopped_early = False
        self.planned = planned
        self.file = open(path, "a") if path else None

    def __call__(self, step: Step) -> bool:
        self.steps.append(step)
        if self.file:
            self.file.write(jsonio.dumps(step.to_dict()) + "\n")
            self.file.flush()
        what = step.unrecoverable()
        if what:
            self.first_nonfinite = {"step": step.step, "what": what}
            self.stopped_early = step.step + 1 < self.planned
            return False
        return True


def step_times(steps: list[Step], compiled: bool, warmup: int = 1) -> tuple[float | None, float | None]:
    """(compile_s, steady_step_s): the median time of the steps after the `warmup` ones (the first, and
    any slow ones right after it: record.warmup_steps), and for a compiled cell what the warm-up steps
    took beyond steady ones (tracing, code generation, autotuning; small on an inductor cache hit).
    Eager cells have no compile time; their warm-up is allocator growth and kernel choice."""
    times = [s.time_s for s in steps if s.time_s is not None]
    warmup = max(1, warmup)
    steady = statistics.median(times[warmup:]) if len(times) > warmup else None
    if not compiled or not times:
        return None, steady
    return max(0.0, sum(times[:warmup]) - warmup * (steady or 0.0)), steady


def peak_memory(device: str) -> tuple[int, str]:
    """(bytes, kind): the CUDA allocator's peak, or on a CPU the process's peak resident set since its
    start or the last reset_peak_memory (Linux's VmHWM; getrusage's ru_maxrss where there is no procfs)."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated(), "cuda-allocator-peak"
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024, "process-peak-rss"
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process-peak-rss"


def reset_peak_memory(device: str) -> None:
    """Start the peak over from what the process holds now, so that what ran before (nandoctor's own
    step-0 setup checks) is not counted as the training's. On a CPU: freed heap goes back to the system
    first (glibc's malloc_trim), then Linux resets the high-water mark (/proc/self/clear_refs, "5");
    without procfs the peak stays the whole process's."""
    import ctypes

    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
