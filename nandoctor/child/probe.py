"""The probe body: build, train, time and record one probe, then replay it, written once for a
one-process probe (entry.py) and for each rank of a W-rank one (parallel.py). What differs between
them is `ranks` (ranks.py): how many processes share the probe and how the model is wrapped.

The body builds what the spec names, measures its own setup where an option can break it
(setup_checks.py), lets the strategy prepare it (a rank: the step-0 gradient agreement, then DDP or
FSDP2), snapshots the model for the forensics, and trains. Each step goes to steps.jsonl as it ends
(so a hang or a segfault still leaves the curve; a W-rank probe's rank 0 writes the steps agreed over
the ranks), with each trainable parameter group's gradient norm (groups.py). The record says which of
the data set's rows each batch held (`data`). It is written whole: before the replay with `forensics`
set to REPLAY_RUNNING, so that the timed steps alone decide the verdict (the runner gives the replay
a budget of its own), and again once the replay is done. A spec with replay_failed_only (`nandoctor
check`) replays only a probe that hit a non-finite step. A probe under the user's trainer replays its
failing step in process, from the state it started from (trainer.py); a stable one is not replayed, and
its forensics hold only step 0's update loss, measured on the trainer's own optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from ..capabilities import cell_packages
from ..cells import PACKAGES, weight_dtype
from ..config import load_dtype
from ..models import trainable_groups
from ..optional import hidden
from ..record import BUILT_FILE, REPLAY_RUNNING, ProbeRecord, ProbeSpec, Step, Throughput
from . import threads
from .build import Setup, first_step, kept_dtypes, setup
from .groups import GroupNorms, describe
from .instruments import StepZeroWatch
from .memory import split_after_first_step
from .moe import router_watch
from .outcome import WarningLog, built, error_of, write
from .quant import base_facts
from .ranks import Ranks, host_sample, probe_load
from .replay import MEASURED_ON, eager_forensics, forensics_of
from .roundtrip import roundtrip
from .setup_checks import setup_checks
from .snapshot import Snapshot
from .train import StepLog, peak_memory, step_times, train
from .trainer import FailingStep, train_with_trainer

# Under the user's trainer only a failing step is replayed (trainer.py): nandoctor's own loop from the initial
# snapshot would not retrace the steps the trainer took; its step 0 has only the optimizer's hooks on it
TRAINER_STABLE = "the probe trained with the user's trainer and stayed finite: only a failing step is replayed"
TRAINER_ROLLOUTS = "a GRPOConfig probe's steps train on their rollouts, which a replay cannot take again"


def run_probe(
    spec: ProbeSpec, record: ProbeRecord, ranks: Ranks, folder: Path | None
) -> tuple[Setup, Snapshot | None, StepZeroWatch | None, FailingStep | None]:
    """Build what the spec names, prepare it as `ranks` says and train; fills `record` as it goes.
    `folder` takes steps.jsonl and the built marker (None: neither, as on a rank other than 0). Returns
    the setup and, when the recipe asks for forensics, the snapshot of the model's state before the
    timed steps and the watch that measured step 0 (None where a stable probe is replayed instead), and
    under the user's trainer its failing step kept for the replay (None where none failed)."""
    import torch
    from transformers.utils import logging as hf_logging

    from ..env import collect_summary

    hf_logging.disable_progress_bar()  # keep log.txt to what a reader of a failed probe needs
    planned, sample = threads.start(spec, ranks.world_size)  # the ranks share the probe's cores
    ranks.join(spec)
    if ranks.rank == 0:
        record.env = collect_summary()
    t0 = time.perf_counter()
    with hidden(p for p in PACKAGES if p not in cell_packages(spec.cell)):  # and not their import noise
        s = setup(spec)
    record.build_s = s.build_s
    record.kept_dtypes = kept_dtypes(s.model, weight_dtype(spec.cell, load_dtype(spec.recipe)))
    if spec.recipe.adapter.type != "none":  # the base as stored, before any wrapper
        record.quant = base_facts(s.model, spec.cell, spec.recipe)
    record.data = {**s.stream.describe(), "micro_batches_per_step": spec.recipe.gradient_accumulation_steps}
    if ranks.rank == 0:  # on the model before any rank wraps it: every rank's is the same
        record.setup_checks = setup_checks(spec, s)
    mark_built = partial(built, folder / BUILT_FILE) if folder else (lambda: None)
    s = ranks.prepare(spec, s, record, mark_built)
    groups = trainable_groups(s.model)  # after the wrapping: FSDP2 replaces the parameters
    record.trainable_groups = describe(groups)
    norms = GroupNorms(s.scaler, groups)
    s = replace(s, scaler=norms)
    replayed = spec.recipe.forensics_steps and not spec.trainer
    snapshot = Snapshot.take(s.model, spec.device) if replayed else None  # FSDP2: this rank's shards
    backend = spec.cell.compilation.backend
    # under the user's trainer, torch_compile compiles (child/trainer.py)
    forward = ranks.model(s) if backend is None or spec.trainer else torch.compile(ranks.model(s), backend=backend)
    checked = (record.setup_checks or {}).get("seconds", 0.0)
    record.load_s = time.perf_counter() - t0 - (snapshot.seconds if snapshot else 0.0) - checked
    mark_built()
    record.fp8_excluded = s.fp8_excluded if spec.cell.precision.fp8 else None
    record.optimizer_eager = s.optimizer_eager
    record.optimizer_split = getattr(s.optimizer, "split", None)
    log = StepLog(folder / "steps.jsonl" if folder else None, spec.steps)
    record.steps = log.steps

    router = router_watch(s.model, spec.steps - 1)  # a mixture of experts: its routing, step by step

    def on_step(step: Step) -> bool:
        if step.groups is None:  # the user's trainer measured them itself (child/trainer.py)
            step.groups = norms.take()
        if router:
            step.aux_loss = router.aux.get(step.step)
            router.step = step.step + 1
        if s.rollouts:
            s.rollouts.annotate(step)
        ranks.agree(step)  # every rank decides to stop on the same numbers
        return log(step)

    watch = StepZeroWatch(s.model, s.optimizer, snapshot) if snapshot and eager_forensics(spec) else None
    # after the watch: this step post-hook removes itself while torch iterates the hooks, so it must be the last
    split = split_after_first_step(s.model, s.optimizer)
    record.cpu_threads = threads.settle(planned, sample)  # sized to the cores other processes left free
    t1 = time.perf_counter()
    before = host_sample(ranks)
    failing = None
    try:
        if spec.trainer:
            if ranks.world_size > 1:
                raise RuntimeError(
                    "--trainer-args probes run one process; the parallel cells take nandoctor's own loop"
                )
            record.trainer, failing, updates = train_with_trainer(spec, s, groups, on_step)
            if spec.recipe.forensics_steps and failing is None:
                grpo = spec.trainer["kind"] == "grpo"
                step0 = {**updates, "measured_on": MEASURED_ON} if updates else {}
                record.forensics = {**step0, "not_run": TRAINER_ROLLOUTS if grpo else TRAINER_STABLE}
        else:
            train(forward, s, spec.recipe.grad_clip, spec.steps, watch.on_step(on_step) if watch else on_step)
    finally:
        if watch:
            watch.remove()
        if router:
            router.remove()
            record.moe = router.figures()
        if s.rollouts:
            record.rollout_mismatch = s.rollouts.figures()
        record.train_s = time.perf_counter() - t1
        record.host_load = probe_load(before)
        measured(record, spec, log, split, ranks.world_size)
        if snapshot and snapshot.where == "cuda":
            record.peak_memory_bytes -= snapshot.bytes  # allocated before training and held through it: not training's
    return s, snapshot, watch, failing


def measured(record: ProbeRecord, spec: ProbeSpec, log: StepLog, split: dict, devices: int) -> None:
    """Fill what the timed steps measured: their throughput over `devices` (with the warm-up it found),
    the steady step time past that warm-up, where they stopped, peak memory and its split (this
    process's: a rank under FSDP2 holds a shard)."""
    record.throughput = Throughput.of(log.steps, devices)
    record.first_nonfinite, record.stopped_early = log.first_nonfinite, log.stopped_early
    record.compile_s, record.steady_step_s = step_times(
        log.steps, spec.cell.compilation.backend is not None, record.throughput.warmup if record.throughput else 1
    )
    record.peak_memory_bytes, record.peak_memory_kind = peak_memory(spec.device)
    record.weights_bytes = split.get("weights_bytes")
    record.grads_bytes = split.get("grads_bytes")
    record.optimizer_state_bytes = split.get("optimizer_state_bytes")


def probe(spec: ProbeSpec, ranks: Ranks, result: Path, folder: Path | None) -> int:
    """Run the probe in this process, write its record to `result` (before the replay, and after it)
    and return the exit code: 0 trained (whatever the numbers did), 1 raised; after a replay, the
    strategy's (a rank whose replay raised ends with 1, so that its peers are stopped at once)."""
    record = ProbeRecord(spec.probe_id, spec.cell)
    emitted = WarningLog()
    code = 0
    try:
        s, snapshot, watch, failing = run_probe(spec, record, ranks, folder)  # held until the process ends
    except BaseException as e:  # everything the probe raises becomes data for the verdict
        record.error = error_of(e, emitted)
        code, snapshot, watch, failing = 1, None, None, None
    # a check's step 0 measured in the run (no replay); not under --roundtrip, which merges the trained model
    # (the forensics restore the initial weights)
    step0_measured = watch is not None and watch.step is not None and not spec.roundtrip
    if failing is not None:  # under the user's trainer
        record.forensics = REPLAY_RUNNING
        write(record, result)
        record.forensics = failing.forensics(s.attend)
    elif snapshot is not None and (record.first_nonfinite or not spec.replay_failed_only or step0_measured):
        record.forensics = REPLAY_RUNNING
        write(record, result)  # the timed result: the verdict stands whatever the replay does
        record.forensics = forensics_of(spec, record, s, snapshot, watch, ranks)
        code = ranks.exit_code(record.forensics)
    elif spec.roundtrip and code == 0 and not record.first_nonfinite:  # it merges the model: nothing runs after it
        record.roundtrip = roundtrip_of(spec, s)
    write(record, result)
    return code


def roundtrip_of(spec: ProbeSpec, s: Setup) -> dict:
    """The round trip of the trained model (roundtrip.py) on the first micro-batch; a failure in it is
    data, {"error": ...}, as any probe failure."""
    import torch

    batch = first_step(spec, s)[0][0]
    dtype = getattr(torch, weight_dtype(spec.cell, load_dtype(spec.recipe)))
    try:
        schedule_free = s.optimizer if spec.cell.optimizer_row.eval_mode else None
        return roundtrip(
            s.model,
            batch,
            s.autocast,
            s.attend,
            dtype,
            spec.device,
            spec.recipe.model.trust_remote_code,
            schedule_free,
            spec.recipe.optimizer.eval_before_save,
        )
    except Exception as e:  # noqa: BLE001 -- recorded, judged as a failed round trip
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
