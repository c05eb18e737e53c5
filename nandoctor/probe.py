"""One probe: a few real training steps of one grid cell, inside its own OS process.

The runner starts `python -m nandoctor.probe SPEC.json RESULT.json`. The child reads its spec, trains,
appends each step to steps.jsonl as it goes (so a hang or a segfault still leaves the curve), and
writes one JSON result. Exit code 0: trained (whatever the numbers did); 1: it raised. When the
recipe asks for forensics, a probe that trained then replays its first steps with hooks (forensics.py).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
import traceback
from pathlib import Path

from .config import THRESHOLDS, Cell, recipe_from_dict
from .models import batches, build_model, plan_from_dict

AUTOCAST = {"bf16-amp": "bfloat16", "fp16-amp": "float16"}
SDPA_BACKENDS = {"sdpa:math": "MATH", "sdpa:flash": "FLASH_ATTENTION",
                 "sdpa:efficient": "EFFICIENT_ATTENTION", "sdpa:cudnn": "CUDNN_ATTENTION"}


def precision(cell: Cell, device: str):
    """(autocast context factory, GradScaler) for a cell. fp16-amp is the only cell with a live
    scaler: fp16's 5-bit exponent underflows small gradients unless the loss is scaled up first."""
    import torch
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cell.dtype == "tf32"
        torch.backends.cudnn.allow_tf32 = cell.dtype == "tf32"
    scaler = torch.amp.GradScaler(device, enabled=cell.dtype == "fp16-amp")
    if cell.dtype in AUTOCAST:
        dtype = getattr(torch, AUTOCAST[cell.dtype])
        return (lambda: torch.autocast(device, dtype=dtype)), scaler
    return contextlib.nullcontext, scaler


def attention(cell: Cell):
    """A context that pins the SDPA backend for the sdpa:* cells; the others dispatch as usual."""
    if cell.attn not in SDPA_BACKENDS:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, SDPA_BACKENDS[cell.attn])
    return lambda: sdpa_kernel([backend])


def train(model, data, optimizer, scaler, autocast, attend, grad_clip, steps, on_step, sync=lambda: None):
    """The training loop a probe runs: forward, backward, unscale, grad-norm, clip, step.
    on_step(step, loss, grad_norm, skipped, scale, seconds, tokens) returns False to stop early."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = grad_clip if grad_clip > 0 else math.inf
    for step in range(steps):
        batch = next(data)
        t0 = time.perf_counter()
        with attend():
            with autocast():
                loss = model(**batch).loss
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # total norm before clipping
        scale = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)  # skipped by the scaler when the unscaled grads hold inf/nan
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        sync()
        skipped = scale is not None and scaler.get_scale() < scale
        tokens = int(batch["attention_mask"].sum())
        if not on_step(step, loss.item(), grad_norm.item(), skipped, scale, time.perf_counter() - t0, tokens):
            break


def unrecoverable_at(step: dict, min_scale: float = THRESHOLDS.min_scale) -> str | None:
    """What made this step unrecoverable ('loss', 'grad' or 'scale'), or None. A GradScaler skip
    with a finite loss is calibration, not failure, until the scale would fall below min_scale."""
    if not math.isfinite(step["loss"]):
        return "loss"
    if step["scale"] is None and not math.isfinite(step["grad_norm"]):
        return "grad"  # without a scaler, a non-finite grad reaches the weights
    if step["scale"] is not None and step["skipped"] and step["scale"] / 2 < min_scale:
        return "scale"
    return None


class StepLog:
    """Collects per-step records, streams them to steps.jsonl, and decides when to stop early."""

    def __init__(self, path: Path | None, stop_on_nonfinite: bool):
        self.steps: list[dict] = []
        self.first_nonfinite: dict | None = None
        self.stopped_early = False
        self.stop_on_nonfinite = stop_on_nonfinite
        self.file = open(path, "a") if path else None

    def __call__(self, step, loss, grad_norm, skipped, scale, seconds, tokens) -> bool:
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "skipped": skipped, "scale": scale,
                  "time_s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else None}
        self.steps.append(record)
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        unrecoverable = unrecoverable_at(record)
        if unrecoverable and self.first_nonfinite is None:
            self.first_nonfinite = {"step": step, "what": unrecoverable}
        if unrecoverable and self.stop_on_nonfinite:
            self.stopped_early = step + 1 < self._planned
            return False
        return True

    def plan(self, steps: int):
        self._planned = steps


def build_optimizer(model, recipe):
    """AdamW over the trainable parameters, in their own dtype (so its state is half in the pure cells)."""
    import torch
    o = recipe.optimizer
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                             betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def peak_memory(device: str) -> tuple[int, str]:
    import torch
    if device == "cuda":
        return torch.cuda.max_memory_allocated(), "cuda-allocator-peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process-peak-rss"


def run_probe(spec: dict, result: dict, steps_path: Path | None) -> None:
    """Build the model and optimizer the spec names and train; fills `result` as it goes."""
    import torch
    from transformers.utils import logging as hf_logging
    from .env import collect_summary
    hf_logging.disable_progress_bar()  # keep log.txt to what a reader of a failed probe needs
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    device = spec["device"]
    recipe = recipe_from_dict(spec["recipe"], spec["recipe"]["name"])
    cell = Cell(**spec["cell"])
    plan = plan_from_dict(spec["model_plan"])
    seed = spec["seed"]
    result["env"] = collect_summary()
    t0 = time.perf_counter()
    model = build_model(plan, recipe, cell, seed).to(device)
    data = ({k: v.to(device) for k, v in b.items()} for b in batches(recipe, model.config, seed))
    optimizer = build_optimizer(model, recipe)
    autocast, scaler = precision(cell, device)
    forward = model if cell.compile == "off" else torch.compile(model, backend=cell.compile)
    result["load_s"] = time.perf_counter() - t0
    log = StepLog(steps_path, spec.get("stop_on_nonfinite", True))
    log.plan(spec["steps"])
    result["steps"] = log.steps
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t1 = time.perf_counter()
    try:
        train(forward, data, optimizer, scaler, autocast, attention(cell), recipe.grad_clip, spec["steps"], log, sync)
    finally:
        result["train_s"] = time.perf_counter() - t1
        result["first_nonfinite"] = log.first_nonfinite
        result["stopped_early"] = log.stopped_early
        result["peak_memory_bytes"], result["peak_memory_kind"] = peak_memory(device)


def forensics_of(spec: dict, result: dict) -> dict:
    """The replay with hooks, after the timed run has freed its model. Its failure is recorded, never
    turned into the probe's."""
    from .forensics import replay
    try:
        return replay(spec, result)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    steps_path = result_path.with_name("steps.jsonl")
    result: dict = {"steps": [], "error": None}
    code = 0
    try:
        run_probe(spec, result, steps_path)
    except BaseException as e:  # everything the probe raises becomes data for the verdict
        import torch
        result["error"] = {"type": type(e).__name__, "message": str(e)[:4000],
                           "traceback": traceback.format_exc()[-6000:],
                           "oom": isinstance(e, (MemoryError, torch.OutOfMemoryError))}
        traceback.print_exc()  # into log.txt, whose tail the record keeps
        code = 1
    if code == 0 and spec["recipe"].get("forensics_steps"):
        result["forensics"] = forensics_of(spec, result)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
