"""One probe: a few real training steps of one grid cell, inside its own OS process.

The runner starts `python -m nandoctor.child SPEC.json RESULT.json` (or a warm worker forks a child
that calls `main`). The child reads its ProbeSpec, trains, appends each step to steps.jsonl as it goes
(so a hang or a segfault still leaves the curve), and writes one ProbeRecord as JSON holding what it
measured. Exit code 0: trained (whatever the numbers did); 1: it raised. When the recipe asks for
forensics, a probe that trained then replays its first steps with hooks (hooks.py).
"""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from ..record import ProbeRecord, ProbeSpec
from .build import setup
from .memory import split_after_first_step
from .train import StepLog, peak_memory, train


def run_probe(spec: ProbeSpec, record: ProbeRecord, steps_path: Path | None) -> None:
    """Build what the spec names and train; fills `record` as it goes."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..env import collect_summary
    hf_logging.disable_progress_bar()  # keep log.txt to what a reader of a failed probe needs
    torch.set_num_threads(spec.threads)
    record.env = collect_summary()
    t0 = time.perf_counter()
    s = setup(spec)
    backend = spec.cell.compilation.backend
    forward = s.model if backend is None else torch.compile(s.model, backend=backend)
    record.load_s = time.perf_counter() - t0
    record.fp8_excluded = s.fp8_excluded if spec.cell.precision.fp8 else None
    record.optimizer_eager = s.optimizer_eager
    log = StepLog(steps_path, spec.steps)
    record.steps = log.steps
    split = split_after_first_step(s.model, s.optimizer)
    t1 = time.perf_counter()
    try:
        train(forward, s, spec.recipe.grad_clip, spec.steps, log)
    finally:
        record.train_s = time.perf_counter() - t1
        record.first_nonfinite = log.first_nonfinite
        record.stopped_early = log.stopped_early
        record.peak_memory_bytes, record.peak_memory_kind = peak_memory(spec.device)
        record.weights_bytes = split.get("weights_bytes")
        record.grads_bytes = split.get("grads_bytes")
        record.optimizer_state_bytes = split.get("optimizer_state_bytes")


def forensics_of(spec: ProbeSpec, record: ProbeRecord) -> dict:
    """The replay with hooks, after the timed run has freed its model. Its failure is recorded, never
    turned into the probe's."""
    from .hooks import replay
    try:
        return replay(spec, record)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = ProbeSpec.from_dict(json.loads(spec_path.read_text()))
    record = ProbeRecord(spec.probe_id, spec.cell)
    code = 0
    try:
        run_probe(spec, record, result_path.with_name("steps.jsonl"))
    except BaseException as e:  # everything the probe raises becomes data for the verdict
        import torch
        record.error = {"type": type(e).__name__, "message": str(e)[:4000], "traceback": traceback.format_exc()[-6000:],
                        "oom": isinstance(e, (MemoryError, torch.OutOfMemoryError))}
        traceback.print_exc()  # into log.txt, whose tail the record keeps
        code = 1
    if code == 0 and spec.recipe.forensics_steps:
        record.forensics = forensics_of(spec, record)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record.to_dict()))
    os.replace(tmp, result_path)
    return code
