"""Typed contracts at the process and file boundaries: what the child reads (ProbeSpec, with the
ModelPlan the parent decided) and what every probe leaves in results.jsonl (ProbeRecord of Steps).

Each has `to_dict` / `from_dict`; `from_dict` ignores keys it does not know, so that records written
by earlier versions still read. Records are built here only: from a child's result
(`ProbeRecord.finished`), for a cell the device cannot run (`ProbeRecord.unsupported`), or from the
probe cache (`ProbeRecord.reused`).

Foundation module: imports only config, thresholds, cells and device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal as signals
import statistics
from dataclasses import dataclass, field

from .cells import Cell
from .config import Recipe, recipe_from_dict, recipe_to_dict
from .device import DeviceFacts
from .thresholds import THRESHOLDS

# `forensics` of a result written after the timed steps, while the replay still runs. A record that
# still says so when its process ended had its replay cut short (the runner notes why).
REPLAY_RUNNING = {"status": "running"}
# The file a probe writes once its model is built (imports, load, wrapping done): from then on its
# timed steps have timeout_s; before it, the build has build_timeout_s.
BUILT_FILE = "built"
STALE_FILES = ("result.json", "steps.jsonl", BUILT_FILE)  # what a rerun of a probe in the same folder clears first
# The pid of the process that starts a probe process (`python -m nandoctor.child`): a cold slot's
# runner, or run/placed.py inside an executor's job or task; the probe dies with it (child/__main__.py).
PARENT_ENV = "NANDOCTOR_PARENT_PID"
# the Unix socket of a zygote that forks warm workers already imported (child/zygote.py, run/zygote.py)
ZYGOTE_ENV = "NANDOCTOR_ZYGOTE"


def _as_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _ints_as_floats(obj, names: tuple[str, ...]) -> None:
    """Each named figure of obj given as a Python int as a float from here on, an int too large for a
    float as +-inf (a user's loss computed in ints, a hand-written record), so that every later stage
    does float arithmetic on it without overflowing (and pandas gets floats)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(obj, name, _as_float(value))


def _known(cls, data: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class ModelPlan:
    """What a run probes, decided once per run (models.plan_model) and read by every child."""

    source: str  # "local-weights" or "architecture-twin"
    scale: str  # "full" or "probe"
    model_type: str
    params: int  # parameters of the model actually probed
    full_params: int  # parameters of the model the recipe names
    trainable_params: int
    path: str | None  # weights directory when source is local-weights
    why: str
    shape: dict  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab (experts, top_k) of the probed model
    refuses: dict = field(default_factory=dict)  # attn_implementation -> why the architecture refuses it
    named_shape: dict = field(default_factory=dict)  # the shape of the model the recipe names

    def stand_in(self) -> str | None:
        """What makes the probed model a stand-in: 'the probes train 32 of the named model's 128 routed experts
        (top-8 kept) and 2 of its 48 layers', the fewer routed experts or layers than the named one with
        both numbers; None when it has as many (a full-scale probe, a recipe this small, an older run)."""
        s, named = self.shape, self.named_shape
        fewer = [
            (k, what)
            for k, what in (("experts", "routed experts"), ("layers", "layers"))
            if s.get(k) and named.get(k) and s[k] < named[k]
        ]
        if not fewer:
            return None
        owners = ["the named model's"] + ["its"] * (len(fewer) - 1)
        parts = [
            f"{s[k]} of {owner} {named[k]} {what}"
            + (f" (top-{s['top_k']} kept)" if k == "experts" and s.get("top_k") else "")
            for owner, (k, what) in zip(owners, fewer)
        ]
        return f"the probes train {' and '.join(parts)}"

    def describe(self) -> str:
        s = self.shape
        return (
            f"{self.model_type} {self.source} at {self.scale} scale, {self.params / 1e6:.2f}M params "
            f"(hidden {s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, "
            f"vocab {s['vocab']})"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelPlan:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ProbeSpec:
    """What one probe process is asked to do (its spec.json)."""

    probe_id: str
    recipe: Recipe
    cell: Cell
    plan: ModelPlan
    steps: int
    seed: int
    device: str  # "cpu" or "cuda"
    threads: int  # torch intra-op threads, so that K probes at once do not oversubscribe the cores
    replay_failed_only: bool = False  # the forensics replay only after a non-finite step (`check`: a quick pass)
    roundtrip: bool = False  # after the timed steps: merge, save, reload and compare (check --roundtrip)

    def to_dict(self) -> dict:
        return {
            "probe_id": self.probe_id,
            "recipe": recipe_to_dict(self.recipe),
            "cell": self.cell.to_dict(),
            "model_plan": self.plan.to_dict(),
            "steps": self.steps,
            "seed": self.seed,
            "device": self.device,
            "threads": self.threads,
            "replay_failed_only": self.replay_failed_only,
            **({"roundtrip": True} if self.roundtrip else {}),  # absent when off: older fingerprints stay
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProbeSpec:
        recipe = data["recipe"]
        return cls(
            data["probe_id"],
            recipe_from_dict({k: v for k, v in recipe.items() if k != "name"}, recipe["name"]),
            Cell(**data["cell"]),
            ModelPlan.from_dict(data["model_plan"]),
            data["steps"],
            data["seed"],
            data["device"],
            data.get("threads") or 1,
            data.get("replay_failed_only", False),
            data.get("roundtrip", False),
        )


@dataclass
class Step:
    """One training step as measured: loss and grad-norm (before clipping), and the GradScaler's say."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool = False  # the GradScaler skipped the optimizer step (inf/nan in the unscaled grads)
    scale: float | None = None  # the loss scale the step ran at; None without a GradScaler
    time_s: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    update_loss: float | None = None  # forensics replay only: share of meant updates that rounded away
    # each trainable parameter group's gradient norm after unscaling, before clipping (child/groups.py;
    # models.GROUPS: adapter, modules_to_save, embeddings, rest); None for a group no parameter of which
    # got a gradient. Records before it, and replayed steps: None
    groups: dict | None = None
    # the loss terms (labels other than -100 after the shift) of the step's micro-batch that has the
    # fewest: 0 when a batch has no target, whose mean loss is 0/0. None where unknown (records before
    # it, a live run's steps)
    supervised: int | None = None
    # the kind of batch the step trained (data.Batch.kind: synthetic, first, longest, most_padded,
    # fewest_supervised; a step of several micro-batches joins theirs with "+"): a loss spike is judged
    # against earlier steps of the same kind. None where unknown
    batch: str | None = None
    # a mixture of experts: the load-balancing loss the model added to this step's loss, before its
    # router_aux_loss_coef (summed over the step's micro-batches); None where the loss held none
    aux_loss: float | None = None
    # objective=grpo (child/rollout.py): the mean toy reward of the step's completions, and the policy's
    # mean entropy over their tokens as the training path computed it. None for an sft step
    reward: float | None = None
    entropy: float | None = None

    def __post_init__(self):
        _ints_as_floats(self, ("loss", "grad_norm", "scale", "time_s", "tokens_per_s", "update_loss"))

    def unrecoverable(self, min_scale: float = THRESHOLDS.min_scale) -> str | None:
        """What made this step unrecoverable ('loss', 'grad' or 'scale'), or None. A GradScaler skip
        with a finite loss is calibration, not failure, until the scale would fall below min_scale."""
        if not math.isfinite(self.loss):
            return "loss"
        if self.scale is None and not math.isfinite(self.grad_norm):
            return "grad"  # without a scaler, a non-finite grad reaches the weights
        if self.scale is not None and self.skipped and self.scale / 2 < min_scale:
            return "scale"
        return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Step:
        return cls(**_known(cls, data))


# A leading step slower than this share of the later steps' median rate is still warming up
# (allocator growth, lazy kernel choice, a compile or recompile); a step that is merely noisy is not.
WARMUP_RATE_SHARE = 0.5


def warmup_steps(rates: list[float]) -> int:
    """How many leading per-step rates (tokens/s) are warm-up: always the first, when there are
    others, then each next one slower than WARMUP_RATE_SHARE of the median of the steps after it,
    leaving at least half of them steady."""
    if len(rates) < 2:
        return 0
    n = 1
    while n < len(rates) // 2 and rates[n] < WARMUP_RATE_SHARE * statistics.median(rates[n + 1 :]):
        n += 1
    return n


@dataclass(frozen=True)
class Throughput:
    """Tokens/s of a probe's steady steps: the median and the spread of the per-step rates (quartiles,
    min, max), warm-up steps left out. The spread is what the ranking calls noise. A W-rank probe's
    rates count every rank's tokens (`devices` = W); `per_device` is what one of its devices did."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    steps: int  # steady steps measured
    warmup: int  # leading steps left out
    devices: int = 1  # the devices (ranks) whose tokens the rates count; records before it: one process

    @classmethod
    def of_rates(cls, rates: list[float], warmup: int = 0, devices: int = 1) -> Throughput | None:
        """From steady per-step rates (already without warm-up); None when there are none."""
        if not rates:
            return None
        q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive") if len(rates) > 1 else rates * 3
        return cls(statistics.median(rates), q1, q3, min(rates), max(rates), len(rates), warmup, devices)

    @classmethod
    def of(cls, steps: list[Step], devices: int = 1) -> Throughput | None:
        rates = steady_rates(steps)
        return cls.of_rates(rates[0], rates[1], devices)

    @classmethod
    def pooled(cls, runs: list[list[Step]], devices: int = 1) -> Throughput | None:
        """One figure from several probes of the same cell (re-timing rounds): their steady rates
        together, so that the spread covers the differences between rounds too."""
        steady = [steady_rates(steps) for steps in runs]
        return cls.of_rates([r for rates, _ in steady for r in rates], sum(w for _, w in steady), devices)

    @property
    def per_device(self) -> Throughput:
        """The same rates divided among the devices: what compares a W-rank probe with a one-process one."""
        rates = {name: getattr(self, name) / self.devices for name in ("median", "q1", "q3", "low", "high")}
        return dataclasses.replace(self, **rates, devices=1)

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median else math.inf

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Throughput | None:
        return cls(**_known(cls, data)) if data else None


def steady_rates(steps: list[Step]) -> tuple[list[float], int]:
    """(the steady steps' tokens/s, how many leading steps were warm-up); steps without a rate (a live
    run's batch without an attention mask) are left out."""
    rates = [s.tokens_per_s for s in steps if s.tokens_per_s]
    warmup = warmup_steps(rates)
    return rates[warmup:], warmup


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

    def __post_init__(self):
        _ints_as_floats(self, ("timeout_s", "wall_s", "load_s", "build_s", "train_s", "compile_s", "steady_step_s"))

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["cell"] = self.cell.to_dict()
        out["steps"] = [s.to_dict() for s in self.steps]
        out["throughput"] = self.throughput.to_dict() if self.throughput else None
        out["env"] = self.env.to_dict() if self.env is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict) -> ProbeRecord:
        kwargs = _known(cls, data)
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


# The warm worker's protocol (child/worker.py, run/slots.py WarmSlot): one JSON object per line, on two
# pipes of their own (never the worker's stdout, where any import may print). The parent sends Preload
# and Fork; the worker answers Ready once it has imported, then Started and Exited per fork.


@dataclass
class Preload:
    """Import this model type's modeling code (and peft, for an adapter) before the next fork."""

    model_type: str | None
    adapter: bool = False


@dataclass
class Fork:
    """Fork a child that runs a probe (kind "spec": child/entry.py) or plans the run (kind "plan":
    child/plan.py) from `path`, its output in `log`. env: variables the child sets before anything
    else runs (CUDA_VISIBLE_DEVICES: the GPUs this probe was given)."""

    kind: str
    path: str
    result: str
    log: str
    env: dict = field(default_factory=dict)


@dataclass
class Ready:
    """The worker has imported everything; `threads` it holds (None where procfs cannot count them)."""

    pid: int
    threads: int | None


@dataclass
class Started:
    """A forked child runs; the worker held `threads` threads when it forked."""

    pid: int
    threads: int | None


@dataclass
class Exited:
    """A forked child ended: returncode n < 0 means killed by signal -n."""

    pid: int
    returncode: int


WORKER_MESSAGES = {cls.__name__: cls for cls in (Preload, Fork, Ready, Started, Exited)}


def message_line(message) -> str:
    """The one line a worker message travels as (the writer)."""
    return json.dumps({"type": type(message).__name__, **dataclasses.asdict(message)}) + "\n"


def read_message(line: str):
    """The worker message of one line (the reader), or None for a line that is not one."""
    try:
        data = json.loads(line)
        kind = WORKER_MESSAGES[data.pop("type")]
        return kind(**data)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
