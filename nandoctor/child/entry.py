"""One probe: a few real training steps of one grid cell, inside its own OS process.

The runner starts `python -m nandoctor.child SPEC.json RESULT.json` (or a warm worker forks a child
that calls `main`); a parallel cell's main starts its W ranks instead (launch.py, parallel.py).
The child reads its ProbeSpec, trains, appends each step to steps.jsonl as it goes (so a hang or a
segfault still leaves the curve), and writes one ProbeRecord as JSON holding what it measured. Exit code
0: trained (whatever the numbers did); 1: it raised. When the recipe asks for forensics, a probe that
trained then replays its first steps with hooks (hooks.py): its result is written before the replay,
with `forensics` set to REPLAY_RUNNING, and again once the replay is done, so that the timed steps alone
decide the verdict (the runner gives the replay a budget of its own). A probe of an eager cell whose
steps stay finite is not replayed: read-only hooks on its timed step 0 measured the same figures
(hooks.StepZeroWatch). A spec with replay_failed_only (`nandoctor check`) replays only a probe that hit
a non-finite step.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from .. import jsonio
from ..capabilities import cell_packages
from ..cells import PACKAGES
from ..env import get_host_sample, host_load
from ..optional import hidden
from ..record import BUILT_FILE, REPLAY_RUNNING, ProbeRecord, ProbeSpec, Throughput
from .build import Setup, setup
from .hooks import StepZeroWatch, eager_forensics, measured_in_run, replay
from .memory import split_after_first_step
from .outcome import WarningLog, built, error_of, write
from .snapshot import Snapshot
from .train import StepLog, peak_memory, step_times, train


def run_probe(
    spec: ProbeSpec, record: ProbeRecord, steps_path: Path | None
) -> tuple[Setup, Snapshot | None, StepZeroWatch | None]:
    """Build what the spec names and train; fills `record` as it goes. Returns the setup and, when the
    recipe asks for forensics, the snapshot of the model's state before the timed steps and the watch
    that measured step 0 (None where a stable probe is replayed instead)."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..env import collect_summary

    hf_logging.disable_progress_bar()  # keep log.txt to what a reader of a failed probe needs
    torch.set_num_threads(spec.threads)
    record.env = collect_summary()
    t0 = time.perf_counter()
    with hidden(p for p in PACKAGES if p not in cell_packages(spec.cell)):  # and not their import noise
        s = setup(spec)
    record.build_s = s.build_s
    snapshot = Snapshot.take(s.model, spec.device) if spec.recipe.forensics_steps else None
    backend = spec.cell.compilation.backend
    forward = s.model if backend is None else torch.compile(s.model, backend=backend)
    record.load_s = time.perf_counter() - t0 - (snapshot.seconds if snapshot else 0.0)
    if steps_path is not None:
        built(steps_path.with_name(BUILT_FILE))
    record.fp8_excluded = s.fp8_excluded if spec.cell.precision.fp8 else None
    record.optimizer_eager = s.optimizer_eager
    log = StepLog(steps_path, spec.steps)
    record.steps = log.steps
    watch = StepZeroWatch(s.model, s.optimizer, snapshot) if snapshot and eager_forensics(spec) else None
    # after the watch: this step post-hook removes itself while torch iterates the hooks, so it must be the last
    split = split_after_first_step(s.model, s.optimizer)
    t1 = time.perf_counter()
    before = get_host_sample()
    try:
        train(forward, s, spec.recipe.grad_clip, spec.steps, watch.on_step(log) if watch else log)
    finally:
        if watch:
            watch.remove()
        record.train_s = time.perf_counter() - t1
        record.host_load = host_load(before)
        record.throughput = Throughput.of(log.steps)
        record.first_nonfinite = log.first_nonfinite
        record.stopped_early = log.stopped_early
        record.compile_s, record.steady_step_s = step_times(
            log.steps, backend is not None, record.throughput.warmup if record.throughput else 1
        )
        record.peak_memory_bytes, record.peak_memory_kind = peak_memory(spec.device)
        record.weights_bytes = split.get("weights_bytes")
        record.grads_bytes = split.get("grads_bytes")
        record.optimizer_state_bytes = split.get("optimizer_state_bytes")
        if snapshot and snapshot.where == "cuda":
            record.peak_memory_bytes -= snapshot.bytes  # allocated before training and held through it: not training's
    return s, snapshot, watch


def forensics_of(
    spec: ProbeSpec, record: ProbeRecord, s: Setup, snapshot: Snapshot, watch: StepZeroWatch | None
) -> dict:
    """Step 0's measurements when the timed steps stayed finite, else the replay with hooks, on the
    timed run's model restored from its snapshot. Its failure is recorded, never turned into the probe's."""
    try:
        if watch and watch.step is not None and not record.first_nonfinite:
            return measured_in_run(spec, record, s, snapshot, watch)
        return replay(spec, record, s, snapshot)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = ProbeSpec.from_dict(jsonio.loads(spec_path.read_text()))
    if spec.cell.parallel_row.wrapper:  # W ranks, one probe
        from .launch import launch

        return launch(spec, spec_path, result_path)
    record = ProbeRecord(spec.probe_id, spec.cell)
    emitted = WarningLog()
    code = 0
    try:
        s, snapshot, watch = run_probe(spec, record, result_path.with_name("steps.jsonl"))
    except BaseException as e:  # everything the probe raises becomes data for the verdict
        record.error = error_of(e, emitted)
        code = 1
    if code == 0 and snapshot is not None and (record.first_nonfinite or not spec.replay_failed_only):
        record.forensics = REPLAY_RUNNING
        write(record, result_path)  # the timed result: the verdict stands whatever the replay does
        record.forensics = forensics_of(spec, record, s, snapshot, watch)
    write(record, result_path)
    return code
