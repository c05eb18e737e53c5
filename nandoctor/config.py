"""Typed configuration: the recipe tree, narrow dotted overrides, and the verdict thresholds.

Foundation module: imports only errors, cells (what the axis values mean) and typed (how a value takes its
field's type). Every other stage reads these frozen dataclasses; YAML files and CLI flags are only ways to
fill them, and both go through typed.typed_value, driven by the field annotations below.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from .cells import GRAD_REDUCE_OPS, HARDWARE_AXES, LOAD_DTYPES, parse_axis_values
from .errors import NandoctorError, did_you_mean
from .typed import field_types, typed_value

ADAPTER_TYPES = ("none", "lora", "dora")
DATA_SOURCES = ("synthetic", "file")
TRUNCATION_SIDES = ("right", "left")
PADDING_SIDES = ("right", "left")
# which positions get label -100: pad ids (DataCollatorForLanguageModeling), padding by the attention
# mask, or everything but the completion / the assistant turns (TRL's completion-only loss)
LABEL_MASKS = ("pad_id", "attention_mask", "completion_only")
# none: rows padded to the longest of their batch; position_ids: a batch's rows flattened into one row,
# position_ids restarting per row and no attention mask (DataCollatorWithFlattening); block_mask: the
# same row with an explicit 4-D block-diagonal causal mask; position_ids_with_mask: the same row with the
# usual 2-D all-ones mask beside the position_ids, which transformers then reads as one sequence
# (the segments attend to each other: huggingface/transformers PR #46634, huggingface/trl#3067)
PACKINGS = ("none", "position_ids", "block_mask", "position_ids_with_mask")
PAD_POLICIES = ("dedicated", "eos", "id0")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SCALES = ("auto", "probe", "full")
# how the loss of gradient_accumulation_steps micro-batches is averaged: per micro-batch then over the
# steps, or over the supervised tokens of the whole step (transformers' num_items_in_batch)
LOSS_NORMALIZATIONS = ("micro_batch", "tokens")
GRADIENT_CHECKPOINTING = ("off", "reentrant", "non_reentrant")  # torch.utils.checkpoint's use_reentrant


@dataclass(frozen=True)
class ModelConfig:
    hub_id: str | None = None  # looked up in the local Hugging Face cache only, never downloaded
    path: str | None = None  # a local checkpoint directory (config.json + safetensors)
    arch: dict = field(default_factory=dict)  # config values for AutoConfig.for_model(model_type, **arch)
    dtype_on_load: str = "fp32"  # dtype of the master weights for the -amp cells
    scale: str = "auto"  # auto: full size when it fits this machine, else a probe-scale twin
    trust_remote_code: bool = False  # local checkpoints with their own modeling code


@dataclass(frozen=True)
class AdapterConfig:
    type: str = "none"
    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()  # peft: modules trained in full beside the adapter, e.g. lm_head
    autocast_adapter_dtype: bool = True  # peft: adapter weights in fp32 under a bf16/fp16 base (its default)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class DataConfig:
    """What the probes train on: the synthetic stream, or the user's rows (docs/data.md).

    A path makes the source `file`: JSONL / JSON / Parquet / CSV, a `datasets.save_to_disk` directory,
    or plain text, read through Hugging Face `datasets`; rows of `text`, `messages`, `prompt` +
    `completion`, or pre-tokenized `input_ids`. The tokenizer is `tokenizer` (a local directory), else
    the local checkpoint's own; nothing is downloaded."""

    source: str = "synthetic"  # synthetic: a deterministic, learnable token stream from the seed
    path: str | None = None  # the user's rows (source=file)
    batches: int = 4  # synthetic: distinct batches cycled through; file: the first batches, in order
    pad_fraction: float = 0.0  # synthetic only: fraction of each sequence's tail that is padding
    tokenizer: str | None = None  # a local tokenizer directory (--tokenizer); never downloaded
    max_length: int = 0  # tokens a row keeps after truncation; 0: seq_len
    truncation_side: str = "right"
    padding_side: str = "right"
    labels: str = "pad_id"  # LABEL_MASKS
    packing: str = "none"  # PACKINGS

    def __post_init__(self):
        if self.path and self.source == "synthetic":  # a path given is the user's data
            object.__setattr__(self, "source", "file")


@dataclass(frozen=True)
class PadTokenConfig:
    policy: str = "dedicated"  # dedicated: a reserved id; eos: pad is the eos id; id0: pad is id 0
    mask_labels: bool = True  # pad positions get label -100


@dataclass(frozen=True)
class Fp8Config:
    """Delayed scaling of the fp8-te-* cells: each fp8 tensor's scale comes from the largest ('max') or
    the latest ('most_recent') amax of its last amax_history_len steps. The defaults are Transformer
    Engine's DelayedScaling defaults (transformer_engine.common.recipe); torchao's dynamic recipes
    scale from the current tensor and read neither."""

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"


@dataclass(frozen=True)
class Recipe:
    name: str = "tiny-llama"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pad_token: PadTokenConfig = field(default_factory=PadTokenConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    grad_clip: float = 1.0  # 0 disables clipping; the grad-norm is recorded before clipping either way
    batch_size: int = 4
    seq_len: int = 64
    gradient_accumulation_steps: int = 1  # micro-batches of batch_size rows per optimizer step
    loss_normalization: str = "tokens"  # LOSS_NORMALIZATIONS
    gradient_checkpointing: str = "off"  # GRADIENT_CHECKPOINTING
    steps: int = 24
    seed: int = 0
    timeout_s: float = 600.0  # the timed steps' budget, counted from the end of the build
    # the build's budget: imports, model load or build, wrapping; until the probe writes BUILT_FILE
    build_timeout_s: float = 600.0
    # steps replayed with hooks after the timed ones (a failing probe: up to its failure); 0: off
    forensics_steps: int = 4
    # The replay's own budget, counted from the timed result: an overrun is noted on the record, and the
    # verdict stays the timed steps' (timeout_s covers the timed steps only).
    forensics_timeout_s: float = 300.0
    # A grid re-times the cells speed decides between, back to back and interleaved (retime.py), in this
    # many rounds; 0: off (a CI run where speed is not the question), speed then comes from each cell's
    # own grid probe, and the report says so.
    retime_rounds: int = 2
    axes: dict = field(default_factory=dict)  # default axis values for this recipe, e.g. {"compile": ["off"]}
    # Parallel cells (the `parallel` axis): W ranks, each training its batch_size / W rows of the same
    # global batch of batch_size, so that the parallel=none probe is their exact reference.
    world_size: int = 2
    # "sum": the ranks' gradients are summed, not averaged (a broken reduction, pytorch#162338)
    grad_reduce: str = "avg"

    def validate(self) -> Recipe:
        checks = [
            ("adapter.type", self.adapter.type, ADAPTER_TYPES),
            ("data.source", self.data.source, DATA_SOURCES),
            ("data.truncation_side", self.data.truncation_side, TRUNCATION_SIDES),
            ("data.padding_side", self.data.padding_side, PADDING_SIDES),
            ("data.labels", self.data.labels, LABEL_MASKS),
            ("data.packing", self.data.packing, PACKINGS),
            ("pad_token.policy", self.pad_token.policy, PAD_POLICIES),
            ("model.dtype_on_load", self.model.dtype_on_load, LOAD_DTYPES),
            ("model.scale", self.model.scale, SCALES),
            ("fp8.amax_compute_algo", self.fp8.amax_compute_algo, AMAX_COMPUTE_ALGOS),
            ("grad_reduce", self.grad_reduce, GRAD_REDUCE_OPS),
            ("loss_normalization", self.loss_normalization, LOSS_NORMALIZATIONS),
            ("gradient_checkpointing", self.gradient_checkpointing, GRADIENT_CHECKPOINTING),
        ]
        for key, value, valid in checks:
            if value not in valid:
                raise NandoctorError(
                    f"recipe {self.name!r}: {key}={value!r} is not valid;{did_you_mean(value, valid)} "
                    f"valid: {', '.join(valid)}"
                )
        positive = {
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "steps": self.steps,
            "timeout_s": self.timeout_s,
            "build_timeout_s": self.build_timeout_s,
            "forensics_timeout_s": self.forensics_timeout_s,
            "optimizer.lr": self.optimizer.lr,
            "data.batches": self.data.batches,
            "fp8.amax_history_len": self.fp8.amax_history_len,
            "world_size": self.world_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        for key, value in positive.items():
            if not value > 0:
                raise NandoctorError(f"recipe {self.name!r}: {key} must be > 0, got {value!r}")
        if self.retime_rounds < 0:
            raise NandoctorError(
                f"recipe {self.name!r}: retime_rounds must be >= 0 (0: off), got {self.retime_rounds!r}"
            )
        if self.forensics_steps < 0:
            raise NandoctorError(f"recipe {self.name!r}: forensics_steps must be >= 0, got {self.forensics_steps!r}")
        if not 0.0 <= self.data.pad_fraction < 1.0:
            raise NandoctorError(
                f"recipe {self.name!r}: data.pad_fraction must be in [0, 1), got {self.data.pad_fraction!r}"
            )
        if self.data.source == "file" and not self.data.path:
            raise NandoctorError(f"recipe {self.name!r}: data.source=file needs data.path")
        if self.data.max_length < 0:
            raise NandoctorError(
                f"recipe {self.name!r}: data.max_length must be >= 0 (0: seq_len), got {self.data.max_length!r}"
            )
        if self.data.source == "file" and self.data.pad_fraction:
            raise NandoctorError(
                f"recipe {self.name!r}: data.pad_fraction shapes the synthetic stream only; "
                "the rows of data.path are padded to the longest row of their batch"
            )
        if self.data.source == "synthetic" and self.data.labels == "completion_only":
            raise NandoctorError(
                f"recipe {self.name!r}: data.labels=completion_only needs rows with a completion "
                "(prompt + completion, or messages): pass data.path"
            )
        for axis, values in self.axes.items():
            parse_axis_values(axis, values)
        return self


def dotted_fields(obj=None, prefix: str = "") -> list[str]:
    """Every settable dotted path of a Recipe ('optimizer.eps', 'grad_clip', ...)."""
    obj = obj if obj is not None else Recipe()
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += dotted_fields(value, prefix + f.name + ".")
        elif f.name != "name":
            out.append(prefix + f.name)
    return out


def get_field(recipe: Recipe, key: str):
    obj = recipe
    for part in key.split("."):
        if not dataclasses.is_dataclass(obj) or not any(f.name == part for f in dataclasses.fields(obj)):
            valid = dotted_fields()
            raise NandoctorError(f"unknown recipe field {key!r};{did_you_mean(key, valid)} valid: {', '.join(valid)}")
        obj = getattr(obj, part)
    return obj


@functools.cache
def _hints(cls) -> dict:
    return field_types(cls)


def set_field(recipe: Recipe, key: str, value) -> Recipe:
    """A copy of recipe with the dotted field set. value: typed data, or the text of a `--set KEY=VALUE`
    (read as YAML); either is typed by the field's annotation (typed.typed_value). An unknown key or a
    value of the wrong type is one NandoctorError naming the field."""
    current = get_field(recipe, key)
    if dataclasses.is_dataclass(current):
        raise NandoctorError(
            f"{key!r} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(current)[0].name}"
        )
    return _set_at(recipe, key.split("."), key, value)


def _set_at(obj, parts: list[str], key: str, value):
    head, rest = parts[0], parts[1:]
    if rest:
        return dataclasses.replace(obj, **{head: _set_at(getattr(obj, head), rest, key, value)})
    typed = typed_value(key, value, _hints(type(obj))[head], text=isinstance(value, str))
    return dataclasses.replace(obj, **{head: typed})


def recipe_from_dict(data: dict, name: str) -> Recipe:
    """Build a Recipe from plain data (a YAML file, run.json), each value typed by its field's annotation;
    an unknown key (with the closest valid one) or a value of the wrong type is one NandoctorError."""
    if not isinstance(data, dict):
        raise NandoctorError(f"recipe {name!r}: expected a mapping at the top level")
    return _build(Recipe, {"name": name, **data}, name, "").validate()


def _build(cls, data: dict, name: str, prefix: str):
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            valid = [prefix + k for k in hints]
            raise NandoctorError(
                f"recipe {name!r}: unknown key {prefix + key!r};{did_you_mean(prefix + key, valid)} "
                f"valid: {', '.join(valid)}"
            )
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise NandoctorError(f"recipe {name!r}: {prefix + key} must be a mapping")
            kwargs[key] = _build(hints[key], value, name, prefix + key + ".")
            continue
        try:
            kwargs[key] = typed_value(prefix + key, value, hints[key])
        except NandoctorError as e:
            raise NandoctorError(f"recipe {name!r}: {e}") from None
    return cls(**kwargs)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)


@dataclass(frozen=True)
class Thresholds:
    """Every number that turns a loss / grad-norm curve into a verdict, in one place.

    - min_scale: a GradScaler whose scale falls below 1.0 has stopped calibrating: at scale < 1 the
      gradients overflow fp16 even unscaled, so every further step is skipped.
    - spike_factor / spike_window: a loss above 2x the mean of the previous 10 steps is a spike
      (the rule of llm-foundry's loss-spike callback, which uses a running window and a multiplier).
    - grad_explode_factor: a grad-norm 10x above the largest seen so far is an explosion (Megatron's
      rerun machinery flags values more than 10x the running maximum as unexpectedly large).
    - rise_nats: a run that ends more than 0.5 nats above where it started has diverged.
    - drift_rel / drift_abs: a finite run whose mean |loss - reference loss| over its last quarter
      exceeds 25% of the reference's own loss drop plus 0.02 nats has left the fp32 curve (a stall
      is the common cause); bf16-amp stays within ~0.005 nats of fp32 on the default recipe.
    - init_loss_band: a random-init model's first loss should sit within max(1 nat, 10%) of ln(vocab).
    - fidelity_bucket: fidelities within 0.5% are treated as equal when ranking, so speed decides.
    - speed_margin: inside a bucket, a probe is faster only by more than 5% of the other's median
      tokens/s, and beyond both spreads (analysis/ranking.py): a few percent is what one idle core more
      or less makes, not a reason to prefer a less plain configuration.
    - loaded_speed_margin: the same, 25%, when other processes loaded the host while the probes were
      timed (analysis/load.py: a quarter of the cores, or another process on a GPU). Measured here: a
      busy loop sharing the probe's core made fp32/eager measure 17% and 25% faster than fp32/sdpa in
      the two interleaved re-timing rounds, where a quiet host measured them 1% and -9% apart.
    - spike_min_history: a spike needs at least 3 earlier steps to compare with (steps 0-2 of a fresh
      model fall fast, and a mean of one or two of them is noise).
    - rise_min_steps: a rise is judged only on curves of 4 steps or more.
    - tail_fraction: the end of a curve is its last quarter (at least one step), for rise and drift.
    - min_probe_steps: a grid or bisect probe trains at least 2 steps: step 0's loss and grad-norm come
      from the initial weights, so a 1-step probe never sees what its optimizer update did (fp16-pure
      with eps 1e-8 is finite at step 0 and non-finite at step 1). `check` is a step-0 check by design.
    - no_learning_loss_rel / no_learning_min_steps: a loss that stays within 1e-6 (relative) of its
      first value for every step of a curve of 4 steps or more has not moved: nothing trains. 1e-6 is a
      few fp32 ulps (reduction-order noise); a model that learns moves by orders of magnitude more per
      step, and even one that does not learn sees a different loss on each of the data's batches
      unless its output ignores its input (zero weights). A grad-norm of exactly 0 at every step is
      judged from the first step: no parameter receives a gradient.
    - grad_ratio_rel: a parallel probe whose step-0 gradient norm is within 5% of W (or 1/W) times the
      one-process norm sums (or divides twice) instead of averaging (pytorch#162338 summed W-fold).
    - grad_agreement: the largest relative error of a parameter's step-0 gradient a parallel probe may
      show against the one-process gradient of the same global batch, by the coarsest dtype its
      gradients go through (compute or reduce). Measured on tiny-llama over 2 gloo ranks: bf16-amp
      0.0024 with DDP and 0.014 with FSDP2 (its bf16 param_dtype casts the norms too, autocast does
      not); fp16-amp 0.016 with FSDP2 under both reduce dtypes alike (its fp16 param_dtype, not the
      reduction: scaling bf16's bound by the unit roundoffs, 0.006, called that a mismatch); fp32 1e-6
      or less. Each bound is about 3x the largest seen.

    Comparing a run with a baseline (analysis/diff.py, `nandoctor diff`, `--baseline`):
    - golden_loss_eps / golden_grad_eps / golden_floor: how far a step's loss and grad-norm may move
      from the baseline's, relative, before the numerics count as changed: 1 machine epsilon of the
      cell's matmul dtype for the loss (a mean over the batch, in which a kernel that rounds differently
      moves each logit by about one unit of the last place) and 4 for the grad-norm (a sum over every
      parameter's gradient, through the whole backward), never below 1e-5 (fp32 kernels that merely
      reorder a reduction move a loss by ~1e-6). bf16: 0.78% / 3.1%; fp16 and tf32: 0.098% / 0.39%.
    - fidelity_regression: a cell stable in both runs regressed when its fidelity to the fp32
      reference got worse by more than one ranking bucket (0.5 percentage points).
    - throughput_noise: the relative tokens/s band for a probe whose own steps cannot measure its noise
      (fewer than 4 timed steps: a `check`); otherwise the band is the interquartile range of the probe's
      own per-step rates over their median (analysis/diff.py throughput_noise).
    - memory_noise: peak-memory changes below 5% are noise: two identical CPU grids here moved a probe's
      RSS peak by up to 1.6% (the CUDA allocator's peak is steadier).

    The probe's own setup, measured at step 0 (record.setup_checks; the `misconfigured` verdict):
    - packing_leak_abs / packing_leak_factor: a packed segment's logits must be the segment's own, run
      alone, up to the model's rounding: a packed forward leaks when its largest logit difference
      exceeds the larger of 1e-4 and 10x what the same packed batch moves them with no mask and no
      cache (packing_clean_diff, the model's own rounding in its dtype). position_ids alone gave 2e-7
      on a 2-layer tiny Llama in fp32; the usual 2-D all-ones mask beside them gave 0.77, because
      transformers builds the per-segment mask only when no mask is passed and no cache exists
      (huggingface/transformers PR #46634, huggingface/trl#3067).
    - accumulation_min_cosine: the gradient a step accumulates over its micro-batches must point where
      the full batch's does: a cosine below 0.99 weights the micro-batches' tokens unequally. By the
      step's token count (num_items_in_batch) it was 1.000003 on rows of 32, 4, 4 and 4 tokens; averaged
      per micro-batch, 0.666 (huggingface/transformers PR #34191, #37766). The bound is scaled by the
      token-normalised cosine of the same step when it is below 1 (accumulation_cosine_tokens: the
      model's own rounding), since a bf16-pure probe measures its gradients in bf16: by tokens 0.996
      on the rows above, per micro-batch 0.719.
    """

    min_scale: float = 1.0
    spike_factor: float = 2.0
    spike_window: int = 10
    grad_explode_factor: float = 10.0
    rise_nats: float = 0.5
    drift_rel: float = 0.25
    drift_abs: float = 0.02
    init_loss_band_nats: float = 1.0
    init_loss_band_rel: float = 0.10
    fidelity_bucket: float = 0.005
    speed_margin: float = 0.05
    loaded_speed_margin: float = 0.25
    spike_min_history: int = 3
    rise_min_steps: int = 4
    tail_fraction: float = 0.25
    no_learning_loss_rel: float = 1e-6
    no_learning_min_steps: int = 4
    grad_ratio_rel: float = 0.05
    grad_agreement: tuple = (("float32", 1e-4), ("float16", 0.05), ("bfloat16", 0.05))
    min_probe_steps: int = 2
    golden_loss_eps: float = 1.0
    golden_grad_eps: float = 4.0
    golden_floor: float = 1e-5
    fidelity_regression: float = 0.005
    throughput_noise: float = 0.10
    memory_noise: float = 0.05
    packing_leak_abs: float = 1e-4
    packing_leak_factor: float = 10.0
    accumulation_min_cosine: float = 0.99

    def packing_leaks(self, max_diff, clean_diff) -> bool:
        """Whether a packed forward's largest logit difference to its segments run alone is a leak
        (False for a figure that is absent or not finite: nothing measured, nothing judged)."""
        floor = self.packing_leak_factor * clean_diff if _finite(clean_diff) else 0.0
        return _finite(max_diff) and max_diff > max(self.packing_leak_abs, floor)

    def accumulation_bound(self, by_tokens=None) -> float:
        """The lowest cosine an accumulated step-0 gradient may have to the full batch's:
        accumulation_min_cosine times the token-normalised cosine `by_tokens` when that is below 1 (the
        rounding of the dtype the gradients were measured in)."""
        return self.accumulation_min_cosine * (min(1.0, by_tokens) if _finite(by_tokens) and by_tokens > 0 else 1.0)

    def accumulation_misweighted(self, cosine, by_tokens=None) -> bool:
        """Whether an accumulated step-0 gradient's cosine to the full batch's is below accumulation_bound."""
        return _finite(cosine) and cosine < self.accumulation_bound(by_tokens)

    def unjudged(self, steps: int) -> list[str]:
        """The verdict rules a probe of `steps` training steps is too short to apply."""
        rules = {"a loss spike": self.spike_min_history + 1, "a rising loss": self.rise_min_steps}
        return [f"{rule} (needs {n} steps)" for rule, n in rules.items() if steps < n]


THRESHOLDS = Thresholds()


def _finite(x) -> bool:
    """A measured figure: a number, not None, NaN or inf (nor an int too large for a float)."""
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def refuse_short_probes(kind: str, steps: int, t: Thresholds = THRESHOLDS) -> str | None:
    """A grid or bisect of too few steps: refused (NandoctorError) below t.min_probe_steps, else a
    warning naming the rules it cannot apply, or None."""
    if steps < t.min_probe_steps:
        raise NandoctorError(
            f"--steps {steps} is too few for {kind}: a {steps}-step probe never trains on its own "
            f"optimizer update, so a configuration that fails at step 1 would be called stable; pass "
            f"--steps {t.min_probe_steps} or more "
            f"(every verdict rule: {max(t.spike_min_history + 1, t.rise_min_steps)}), "
            "or use `nandoctor check` for a step-0 check"
        )
    unjudged = t.unjudged(steps)
    if unjudged:
        return (
            f"--steps {steps} is too short to judge {' or '.join(unjudged)}: those verdicts cannot be given; "
            f"pass --steps {max(t.spike_min_history + 1, t.rise_min_steps)} or more to judge every rule"
        )
    return None


# Where probes run, and the scheduler's own settings for each kind (--executor, --executor-opt KEY=VALUE).
# Not part of the Recipe: where a probe ran does not change what it measures, so a probe's fingerprint
# (and the cache, and --resume) stays the same across executors.
EXECUTOR_OPTIONS = {
    "local": {},
    "slurm": {
        "partition": str,
        "account": str,
        "qos": str,
        "constraint": str,
        "time": int,
        "gpus": int,
        "cpus": int,
        "mem": str,
        "parallel": int,
        "retries": int,
        "queue_wait": int,
    },
    "ray": {
        "address": str,
        "resources": str,
        "gpus": float,
        "cpus": int,
        "parallel": int,
        "retries": int,
        "queue_wait": int,
    },
}
# queue_wait: seconds a placed probe may wait for the scheduler to start it. Past it the job is cancelled
# and placed again (an hour: a busy partition's queue is normal, a held job or resources no node has
# is not, and either way the wait is bounded by (retries + 1) hours, never a verdict).
EXECUTOR_DEFAULTS = {"cpus": 1, "parallel": 64, "retries": 2, "queue_wait": 3600}


@dataclass(frozen=True)
class ExecutorConfig:
    """Which engine places the probes: `local` (this machine's slots), `slurm` (submitit job arrays) or
    `ray` (one task per probe). options: the scheduler's settings, typed by EXECUTOR_OPTIONS.
    cpus: cores per probe (its threads); gpus: GPUs per probe; both per rank for a parallel probe (size);
    parallel: probes in flight at most; retries: how many times a probe the scheduler lost (node failure,
    preemption, never started) is placed again; queue_wait: seconds a probe may wait to be started."""

    kind: str = "local"
    options: dict = field(default_factory=dict)
    hardware: tuple = ()  # the kinds of machine the grid probes on (its hardware axis): partitions, Ray resources

    def option(self, name: str):
        return self.options.get(name, EXECUTOR_DEFAULTS.get(name))

    @property
    def remote(self) -> bool:
        return self.kind != "local"

    def size(self, ranks: int = 1) -> tuple:
        """(cpus, gpus) one probe of `ranks` ranks asks the scheduler for: the per-probe options times
        its ranks, since a parallel probe's launcher (child/launch.py) forks all W ranks in its one job
        or task. gpus is 0 where no GPUs were asked for."""
        return self.option("cpus") * ranks, (self.option("gpus") or 0) * ranks


def executor_config(kind: str | None, items: list[str] | tuple = ()) -> ExecutorConfig:
    """--executor KIND and its --executor-opt KEY=VALUE items as an ExecutorConfig; a kind or key that
    does not exist, or a value of the wrong type, is one NandoctorError."""
    kind = kind or "local"
    if kind not in EXECUTOR_OPTIONS:
        raise NandoctorError(f"--executor {kind!r} is not valid; valid: {', '.join(EXECUTOR_OPTIONS)}")
    valid = EXECUTOR_OPTIONS[kind]
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in valid:
            names = ", ".join(valid) or "none (it runs on this machine)"
            raise NandoctorError(
                f"bad --executor-opt {item!r} for --executor {kind}: expected KEY=VALUE with KEY one of {names}"
            )
        try:
            options[key] = valid[key](value.strip())
        except ValueError:
            raise NandoctorError(f"bad --executor-opt {item!r}: {key} takes a {valid[key].__name__}") from None
        if key == "retries" and options[key] < 0:
            raise NandoctorError(f"bad --executor-opt {item!r}: retries must be >= 0 (0: never place a probe again)")
        if valid[key] in (int, float) and options[key] <= 0 and key != "retries":
            raise NandoctorError(f"bad --executor-opt {item!r}: {key} must be > 0")
    return ExecutorConfig(kind, options)


def with_hardware(executor: ExecutorConfig, axes: dict | None) -> ExecutorConfig:
    """The executor that places a grid with these axes: its hardware axis (--axis partition= for slurm,
    node_type= for ray) becomes `hardware`, which the placement checks against the cluster before any
    probe runs. A hardware axis the executor cannot place is one NandoctorError."""
    named = [axis for axis in (axes or {}) if axis in HARDWARE_AXES]
    if not named:
        return executor
    if len(named) > 1:
        raise NandoctorError(f"--axis {' and --axis '.join(named)}: a grid has one hardware axis; pass one of them")
    axis = named[0]
    kind, noun = HARDWARE_AXES[axis]
    if executor.kind != kind:
        other = {k: a for a, (k, _) in HARDWARE_AXES.items()}.get(executor.kind)
        instead = f"; with --executor {executor.kind} the hardware axis is {other}" if other else ""
        raise NandoctorError(f"--axis {axis} names {noun}s: it needs --executor {kind}{instead}")
    if axis == "partition" and executor.option("partition") is not None:
        raise NandoctorError(
            "--axis partition and --executor-opt partition both choose the partition; pass one of them"
        )
    return replace(executor, hardware=tuple(parse_axis_values(axis, axes[axis])))
