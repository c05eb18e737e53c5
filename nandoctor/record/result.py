"""What every probe leaves in results.jsonl: a ProbeRecord of Steps. Records are built here only: from a
child's result (`ProbeRecord.finished`), for a cell the device cannot run (`ProbeRecord.unsupported`), or
from the probe cache (`ProbeRecord.reused`)."""

from __future__ import annotations

import dataclasses
import signal as signals
from dataclasses import dataclass, field

from ..cells import Cell
from ..config import recipe_to_dict
from ..device import DeviceFacts
from .fields import ints_as_floats, known_fields
from .spec import ProbeSpec
from .steps import Step
from .throughput import Throughput


@dataclass
class ProbeRecord:
    """One line of results.jsonl: a probe's configuration, how its process ended, and what it measured.

    status: ok (trained to the end or stopped at an unrecoverable step), error (raised), timeout,
    signal (died of one), unsupported (never spawned: `reason` says why), lost (the scheduler lost it
    every time it was placed: `reason` says how; nothing is known about the configuration)."""

    probe_id: str
    cell: Cell
    status: str = "ok"
    steps: list[Step] = field(default_factory=list)
    seed: int = 0
    recipe: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # the ModelPlan, as data
    overrides: dict = field(default_factory=dict)  # dotted recipe fields set for this probe (bisect)
    reason: str | None = None  # why an unsupported cell was not run
    error: dict | None = None  # type, message, traceback, oom
    signal: str | None = None
    exit_code: int | None = None
    log_tail: str | None = None
    device: str | None = None
    steps_planned: int | None = None
    timeout_s: float | None = None
    timed_out_in: str | None = None  # a timeout's phase: "build" (build_timeout_s ran out) or "steps" (timeout_s)
    wall_s: float | None = None
    fingerprint: str | None = None
    launch: str | None = None  # "warm" (forked from a worker), "cold" (a fresh interpreter), "slurm" or "ray"
    worker_pid: int | None = None
    job_id: str | None = None  # the scheduler's id of the job or task that ran it (slurm, ray)
    node: str | None = None  # the host an executor placed it on (its hostname, read on that host)
    gpu: str | None = None  # the GPUs the scheduler gave it there, as NVML names them on that host; None: no GPU
    cached_from: str | None = None  # the run directory a reused record was first measured in
    env: DeviceFacts | None = None  # env.collect_summary() where the probe ran
    load_s: float | None = None  # setup: model, data, optimizer, numerics (build_s included)
    build_s: float | None = None  # constructing the model on its device (init or weight load)
    train_s: float | None = None
    compile_s: float | None = None  # compiled cells: what the first step took beyond a steady step
    steady_step_s: float | None = None  # median time of the steady steps (after the warm-up ones)
    throughput: Throughput | None = None  # tokens/s of the steady steps, with its spread (what the ranking reads)
    host_load: dict | None = None  # other processes' use of the host during the timed steps (env.host_load)
    # {"torch": intra-op threads it trained with, and its process's OpenMP settings (env.get_openmp_env),
    # None where unset}; records before it: None
    cpu_threads: dict | None = None
    first_nonfinite: dict | None = None
    stopped_early: bool = False
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    # Real storage after the first optimizer step, while the gradients exist (quantized and subclass
    # optimizer state opened to the tensors it is made of): child/memory.py
    weights_bytes: int | None = None
    grads_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    optimizer_eager: str | None = None  # why the optimizer step ran eagerly though its library compiles it
    # a split optimizer (muon): how many tensors each part steps, and the embeddings and head AdamW steps
    optimizer_split: dict | None = None
    fp8_excluded: dict | None = None  # fp8 cells: {module: why it stayed in high precision}
    forensics: dict | None = None
    # Parallel cells: what the W ranks measured (child/parallel.py): world size, backend, master weight
    # dtype, reduce dtype, step-0 gradient agreement with the one-process gradient of the same batch
    parallel: dict | None = None
    ranks: list | None = None  # per rank: {"rank", "exit", "signal", "peak_memory_bytes"} (child/launch.py)
    failed_rank: int | None = None  # the first rank that died or raised, when one did
    # What the probe trained on (data.DataStream.describe): the source (synthetic, or the user's file
    # and options) and each batch it cycles through with the data set's rows it holds (first, longest,
    # most_padded, fewest_supervised), and micro_batches_per_step; step i trains batches
    # i*k .. i*k+k-1 (mod their number). Records before it: None
    data: dict | None = None
    # The probe's own setup measured at step 0 where an option can break it (child/setup_checks.py):
    # packing_max_logit_diff / packing_floor for packed batches, accumulation_error / accumulation_floor
    # (with accumulation_cosine, accumulation_norm_ratio, ...) for gradient_accumulation_steps > 1,
    # seconds (nandoctor/measure/). None when no such option is on
    setup_checks: dict | None = None
    # {group: {"tensors", "elements", "first"}}: what each trainable group of Step.groups holds
    trainable_groups: dict | None = None
    # An adapter probe's base (child/quant.py): its quantization settings (type "none" for a 16-bit base)
    # and bytes as stored, quantization constants included (base_bytes, constants_bytes). None: no adapter
    quant: dict | None = None
    # check --roundtrip (child/roundtrip.py): the loss and logits of one fixed batch on the live model, the
    # merged one and the one saved and loaded back, and the tensors that differ between them
    roundtrip: dict | None = None
    # A mixture of experts' routing as the timed steps measured it (child/moe.py RouterWatch.figures):
    # experts, top_k, router_dtype, aux_loss_on / _coef / _in_loss, per layer the tokens per expert at
    # step 0 and the last step, and step 0's token -> expert choices. None for a dense model
    moe: dict | None = None
    # objective=grpo: how far the rollout's log-probs of the sampled tokens are from the training path's,
    # over all the timed steps' tokens together (child/rollout.py Rollouts.figures): engine, steps,
    # sequences, tokens, logp_diff_mean, logp_diff_max, k3_kl, ratio {min, p10, median, p90, max} of the
    # per-sequence importance ratio, masked_share (above mask_cap, TRL's default sequence mask),
    # per_position and per_step_logp_diff_mean. None for an sft probe
    rollout_mismatch: dict | None = None
    # The model's floating parameters and buffers whose dtype is not the cell's weight dtype, as built
    # (child/build.py cast_as_loaded), {name: dtype}: in a pure cell RoPE's inv_freq and the modules
    # transformers keeps in fp32, as from_pretrained(dtype=...) leaves them. Records before it: None
    kept_dtypes: dict | None = None
    # --trainer-args: the trainer class that trained the probe and the library versions (child/trainer.py:
    # {"class": "transformers.Trainer", "transformers": ..., "trl": ... or None}, and for trl.SFTTrainer
    # "sft_trains": what it trains differently from the own loop, child/sft.py); None: nandoctor's own loop
    trainer: dict | None = None

    def __post_init__(self):
        ints_as_floats(self, ("timeout_s", "wall_s", "load_s", "build_s", "train_s", "compile_s", "steady_step_s"))

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["cell"] = self.cell.to_dict()
        out["steps"] = [s.to_dict() for s in self.steps]
        out["throughput"] = self.throughput.to_dict() if self.throughput else None
        out["env"] = self.env.to_dict() if self.env is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ProbeRecord:
        kwargs = known_fields(cls, data)
        kwargs["cell"] = Cell(**data["cell"])
        kwargs["steps"] = [Step.from_dict(s) for s in data.get("steps") or []]
        kwargs["throughput"] = Throughput.from_dict(data.get("throughput"))
        kwargs["env"] = DeviceFacts.of(data.get("env"))
        return cls(**kwargs)

    @classmethod
    def unsupported(cls, spec: ProbeSpec, reason: str, overrides: dict) -> ProbeRecord:
        return cls(
            spec.probe_id,
            spec.cell,
            "unsupported",
            seed=spec.seed,
            recipe=recipe_to_dict(spec.recipe),
            model=spec.plan.to_dict(),
            overrides=overrides,
            reason=reason,
        )

    @classmethod
    def finished(
        cls,
        spec: ProbeSpec,
        result: dict,
        steps: list[dict],
        returncode: int | None,
        timed_out: bool,
        wall_s: float,
        timeout_s: float,
        log_tail: str,
        worker_died: int | None = None,
        ended_by: dict | None = None,
        **run_facts,
    ) -> ProbeRecord:
        """The record of a probe process from whatever it left behind: its result.json (`result`, empty
        when it wrote none), the steps it streamed, and how it exited. worker_died: the exit status of
        a warm worker that died while this probe ran (the probe died with it). ended_by: the error a
        scheduler reported for a probe it ended without a result (an error dict, e.g. its memory limit)."""
        record = cls.from_dict(
            {**result, "probe_id": spec.probe_id, "cell": spec.cell.to_dict(), "steps": result.get("steps") or steps}
        )
        record.seed, record.device, record.steps_planned = spec.seed, spec.device, spec.steps
        record.recipe, record.model = recipe_to_dict(spec.recipe), spec.plan.to_dict()
        record.wall_s, record.timeout_s, record.exit_code = wall_s, timeout_s, returncode
        for name, value in run_facts.items():
            setattr(record, name, value)
        if timed_out:
            record.status = "timeout"
        elif returncode is not None and returncode < 0:
            record.status, record.signal = "signal", signals.Signals(-returncode).name
        elif result.get("error"):
            record.status = "error"
        elif returncode == 0 and result:
            record.status, record.error = "ok", None
        elif ended_by is not None and not result:
            record.status, record.error = "error", ended_by
        elif worker_died is not None:
            record.status = "error"
            record.error = {
                "type": "WorkerDied",
                "message": f"the warm worker running this probe exited {worker_died}; the probe was killed with it",
                "traceback": "",
                "oom": False,
            }
        else:
            record.status = "error"
            record.error = {
                "type": "ProbeExit",
                "message": f"probe process exited {returncode} without a result",
                "traceback": "",
                "oom": False,
            }
        if record.status != "error":
            record.error = None
        if record.status != "ok":
            record.log_tail = log_tail
        return record

    @classmethod
    def lost(cls, spec: ProbeSpec, why: str, wall_s: float, timeout_s: float, **run_facts) -> ProbeRecord:
        """A probe the scheduler lost on every attempt (node failure, preemption, never started)."""
        record = cls(
            spec.probe_id,
            spec.cell,
            "lost",
            seed=spec.seed,
            recipe=recipe_to_dict(spec.recipe),
            model=spec.plan.to_dict(),
            reason=why,
            device=spec.device,
            steps_planned=spec.steps,
            wall_s=wall_s,
            timeout_s=timeout_s,
        )
        for name, value in run_facts.items():
            setattr(record, name, value)
        return record

    def reused(self, probe_id: str, cached_from: str, **run_facts) -> ProbeRecord:
        """This cached record under another run's probe id."""
        return dataclasses.replace(self, probe_id=probe_id, cached_from=cached_from, **run_facts)
