"""The cell table: what every value of every grid axis means, in one place.

A cell is one point of the grid (precision x attention x compile x optimizer x parallel). Each axis value is one
row below, and every other module reads these rows: the probe builds its autocast, weights, GradScaler,
fp8 conversion, SDPA pin and optimizer from them, the planner checks their hardware and package needs,
the forensics read their compute dtype, and the recommendation (recommend.py) turns them into
TrainingArguments, `from_pretrained` and Lightning arguments and the code no flag writes. Adding a value is
adding a row (plus whatever code is truly new).

Foundation module: imports only errors, and no optional package (whether one is installed is an
environment fact, env.get_package). Dtypes are torch attribute names ("bfloat16"), so that nothing
here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .errors import NandoctorError, did_you_mean


@dataclass(frozen=True)
class Package:
    """An optional package an axis value needs."""

    module: str  # import name, as env.get_package reports it
    dist: str  # distribution name, for `pip install -U`
    min_version: str | None  # the oldest release nandoctor was checked with; None: not checked on any
    install: str


LOWP_EXTRA = "pip install 'nandoctor[lowp]'"
PACKAGES = {
    p.module: p
    for p in (
        # torchao 0.18 and bitsandbytes 0.50.2 trained a 4-layer Llama on an H100 (issue 11) and run their
        # optimizers on this project's CPU CI; bitsandbytes got CPU optimizer kernels with
        # bitsandbytes-foundation/bitsandbytes#1901 (merged 2026-03).
        Package("torchao", "torchao", "0.18.0", LOWP_EXTRA),
        Package("bitsandbytes", "bitsandbytes", "0.50.2", LOWP_EXTRA),
        # schedulefree 1.4.1 trains the tiny Llama here (tests/test_optimizer_axis.py); 1.4.0 added RAdamScheduleFree
        Package("schedulefree", "schedulefree", "1.4.1", "pip install 'nandoctor[optim]'"),
        # No CPU wheel: it builds against the CUDA toolkit, so it is an optional install on GPU hosts only.
        Package(
            "transformer_engine",
            "transformer-engine",
            None,
            "pip install --no-build-isolation 'transformer_engine[pytorch]' on a CUDA host "
            "(NVIDIA/TransformerEngine README)",
        ),
    )
}


@dataclass(frozen=True)
class AxisRow:
    """What every axis value row has: its place in bisect's fastest-first order on each kind of device
    (0 first; cells.FASTEST_FIRST is derived from it). No place: never a target there unless named (--bad):
    an opt-in value, one the device cannot run, or one a faster value of the same kind always precedes.
    - CUDA: lowest precision (tensor cores), fused attention, compile on, the fused AdamW (one kernel for
      all parameters; what TrainingArguments picks by default with torch >= 2.8).
    - CPU: no half-precision matmul units, so fp32 is fastest: tiny-llama steps on the 2-core dev machine
      took 0.15 s in fp32, 0.7 s in bf16-amp and 1.0 s in bf16-pure; the default grid ranked
      fp32/sdpa:flash and fp32/sdpa:math first by tokens/s. A first inductor step costs ~36 s there, more
      than a whole short probe, so compile comes last.
    The 8-bit and 4-bit optimizers save memory, not time, and the fp8 dtypes pay off only on large
    matmuls: like a parallel setup or a quantized base they are a target only when named
    (--bad dtype=fp8-rowwise,optimizer=ao-adamw8bit)."""

    speed_rank: dict = field(default_factory=dict, kw_only=True)  # device kind ("cuda" / "cpu") -> place


@dataclass(frozen=True)
class Fp8Recipe:
    """How an fp8 `dtype` value scales and casts. Only the linears fp8 can take run their matmuls in
    fp8, inside bf16 autocast with fp32 master weights."""

    package: str  # PACKAGES key
    scaling: str  # "tensorwise" / "rowwise": from the current tensor (torchao); "delayed": from an amax history (TE)
    forward_format: str  # "e4m3" or "e5m2", for activations and weights
    backward_format: str  # ... for gradients
    torchao_recipe: str | None = None  # torchao Float8LinearConfig.from_recipe_name(...)
    te_format: str | None = None  # transformer_engine.common.recipe.Format member


@dataclass(frozen=True)
class Precision(AxisRow):
    """A `dtype` axis value."""

    name: str
    autocast: str | None  # torch.autocast dtype; None: no autocast
    weights: str | None  # the dtype weights are hard-cast to; None: they keep the load dtype
    compute: str  # the dtype the matmuls run in (what headroom and underflow are measured against)
    scaler: bool  # a live GradScaler: fp16's 5-bit exponent underflows small gradients unless the loss is scaled
    tf32: bool = False  # TF32 tensor-core matmuls (torch.backends.cuda.matmul.allow_tf32)
    gpu_features: tuple = ()  # capabilities.GPU_FEATURES the cell needs natively
    cuda_only: str | None = None  # why it cannot run on a CPU, when it cannot
    training_args: dict = field(default_factory=dict)  # transformers.TrainingArguments flags
    lightning: str = "32-true"  # lightning.Trainer(precision=...)
    fp8: Fp8Recipe | None = None  # the fp8 recipe the probe converts the model's linears with
    default_grid: bool = True  # False: probed only when asked for (--axis dtype=...)


@dataclass(frozen=True)
class Attention(AxisRow):
    """An `attn` axis value."""

    name: str
    implementation: str  # from_pretrained(attn_implementation=...)
    sdpa_backend: str | None = None  # torch.nn.attention.SDPBackend member pinned around the step
    gpu_features: tuple = ()
    cuda_only: str | None = None
    half_only_cuda: str | None = None  # the CUDA kernel takes fp16/bf16 inputs only
    package: str | None = None  # an extra package the implementation needs (env fact name)


@dataclass(frozen=True)
class Compilation(AxisRow):
    """A `compile` axis value."""

    name: str
    backend: str | None  # torch.compile(backend=...); None: eager
    # Relative cost, to order cells (never used as a number): a first inductor step takes ~36 s on a
    # 2-core CPU, aot_eager traces without generating code.
    cost: int = 0


@dataclass(frozen=True)
class Optimizer(AxisRow):
    """An `optimizer` axis value: how the probe builds it, with the recipe's lr and weight_decay and, where the
    Trainer passes them to this class, its betas and eps (`hyper`)."""

    name: str
    import_path: str  # "module:attribute"
    package: str | None = None  # PACKAGES key; None: torch itself
    kwargs: tuple = ()  # extra constructor arguments, as (name, value) pairs
    cuda_only: str | None = None
    # TrainingArguments(optim=...): the first is what the recommendation writes, the others are aliases the
    # Trainer builds the same optimizer for; () where the Trainer has no value for it (it takes optimizers=)
    transformers_optim: tuple = ("adamw_torch",)
    compiles_step: bool = False  # the library torch.compiles its step, once per parameter shape
    default_grid: bool = True
    hyper: tuple = ("betas", "eps")  # the recipe's optimizer fields the Trainer passes besides lr (transformers 5.24)
    # schedule-free: the weights it trains on (train mode) are not those it evaluates (eval mode, the average);
    # the probe calls optimizer.train() before its steps, as the Trainer does (facebookresearch/schedule_free)
    eval_mode: bool = False
    split: str | None = None  # "muon": 2-D hidden matrices to this class, everything else to AdamW


FP8_CUDA_ONLY = (
    "fp8 matmuls need fp8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell); this device is a CPU"
)
PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp32", None, None, "float32", False, speed_rank={"cuda": 5, "cpu": 0}),
        Precision(
            "tf32",
            None,
            None,
            "float32",
            False,
            tf32=True,
            gpu_features=("tf32",),
            cuda_only="tf32 is a CUDA matmul mode; this device is a CPU",
            training_args={"tf32": True},
            speed_rank={"cuda": 4},
        ),
        Precision(
            "bf16-amp",
            "bfloat16",
            None,
            "bfloat16",
            False,
            gpu_features=("bf16",),
            training_args={"bf16": True},
            lightning="bf16-mixed",
            speed_rank={"cuda": 2, "cpu": 1},
        ),
        Precision(
            "fp16-amp",
            "float16",
            None,
            "float16",
            True,
            training_args={"fp16": True},
            lightning="16-mixed",
            speed_rank={"cuda": 3, "cpu": 2},
        ),
        Precision(
            "bf16-pure",
            None,
            "bfloat16",
            "bfloat16",
            False,
            gpu_features=("bf16",),
            lightning="bf16-true",
            speed_rank={"cuda": 0, "cpu": 3},
        ),
        Precision(
            "fp16-pure", None, "float16", "float16", False, lightning="16-true", speed_rank={"cuda": 1, "cpu": 4}
        ),
        # torchao float8 training: torchao's tensorwise recipe casts gradients to e5m2, rowwise keeps e4m3
        # throughout (torchao/float8/config.py Float8LinearConfig.from_recipe_name). Opt-in: a GPU grid
        # would grow from 126 cells, and fp8 pays off on large matmuls, not on a probe-scale model.
        Precision(
            "fp8-tensorwise",
            "bfloat16",
            None,
            "bfloat16",
            False,
            gpu_features=("bf16", "fp8"),
            cuda_only=FP8_CUDA_ONLY,
            training_args={"bf16": True},
            lightning="bf16-mixed",
            fp8=Fp8Recipe("torchao", "tensorwise", "e4m3", "e5m2", "tensorwise"),
            default_grid=False,
        ),
        Precision(
            "fp8-rowwise",
            "bfloat16",
            None,
            "bfloat16",
            False,
            gpu_features=("bf16", "fp8"),
            cuda_only=FP8_CUDA_ONLY,
            training_args={"bf16": True},
            lightning="bf16-mixed",
            fp8=Fp8Recipe("torchao", "rowwise", "e4m3", "e4m3", "rowwise"),
            default_grid=False,
        ),
        # Transformer Engine with DelayedScaling: Format.HYBRID is e4m3 forward, e5m2 backward; Format.E4M3
        # is e4m3 both ways (TE docs, common API). Lightning's "transformer-engine" precision is HYBRID.
        Precision(
            "fp8-te-hybrid",
            "bfloat16",
            None,
            "bfloat16",
            False,
            gpu_features=("bf16", "fp8"),
            cuda_only=FP8_CUDA_ONLY,
            training_args={"bf16": True},
            lightning="transformer-engine",
            fp8=Fp8Recipe("transformer_engine", "delayed", "e4m3", "e5m2", te_format="HYBRID"),
            default_grid=False,
        ),
        Precision(
            "fp8-te-e4m3",
            "bfloat16",
            None,
            "bfloat16",
            False,
            gpu_features=("bf16", "fp8"),
            cuda_only=FP8_CUDA_ONLY,
            training_args={"bf16": True},
            lightning="transformer-engine",
            fp8=Fp8Recipe("transformer_engine", "delayed", "e4m3", "e4m3", te_format="E4M3"),
            default_grid=False,
        ),
    )
}

ATTENTIONS = {
    a.name: a
    for a in (
        Attention("eager", "eager", speed_rank={"cuda": 5, "cpu": 3}),
        Attention("sdpa", "sdpa", speed_rank={"cuda": 4, "cpu": 1}),
        Attention("sdpa:math", "sdpa", "MATH", speed_rank={"cpu": 2}),  # CUDA: the fused kernels sdpa picks win
        Attention(
            "sdpa:flash",
            "sdpa",
            "FLASH_ATTENTION",
            gpu_features=("sdpa:flash",),
            half_only_cuda="the CUDA flash SDPA kernel takes fp16/bf16 inputs only",
            speed_rank={"cuda": 0, "cpu": 0},
        ),
        Attention(
            "sdpa:efficient",
            "sdpa",
            "EFFICIENT_ATTENTION",
            cuda_only="the memory-efficient SDPA kernel is CUDA-only",
            speed_rank={"cuda": 3},
        ),
        Attention(
            "sdpa:cudnn",
            "sdpa",
            "CUDNN_ATTENTION",
            gpu_features=("sdpa:cudnn",),
            cuda_only="cuDNN SDPA is CUDA-only",
            half_only_cuda="the cuDNN SDPA kernel takes fp16/bf16 inputs only",
            speed_rank={"cuda": 1},
        ),
        Attention(
            "flash_attention_2",
            "flash_attention_2",
            gpu_features=("flash_attention_2",),
            cuda_only="flash-attn 2 is CUDA-only",
            half_only_cuda="flash-attn 2 takes fp16/bf16 inputs only",
            package="flash_attn",
            speed_rank={"cuda": 2},
        ),
    )
}

COMPILATIONS = {
    c.name: c
    for c in (
        Compilation("off", None, 0, speed_rank={"cuda": 2, "cpu": 0}),
        Compilation("inductor", "inductor", 2, speed_rank={"cuda": 0, "cpu": 2}),
        Compilation("aot_eager", "aot_eager", 1, speed_rank={"cuda": 1, "cpu": 1}),
    )
}


@dataclass(frozen=True)
class Parallel(AxisRow):
    """A `parallel` axis value: how W ranks share one probe's global batch, and in which dtype their
    gradients are reduced. The recommendation writes it as FSDP2 / accelerate / Lightning /
    TrainingArguments settings."""

    name: str
    wrapper: str | None  # "ddp" (DistributedDataParallel) or "fsdp2" (fully_shard); None: one process
    # the dtype gradients are reduced in: a torch dtype name, "compute" (the dtype row's compute dtype)
    # or "weights" (the gradients' own dtype, which is the weights')
    reduce: str
    comm_hook: str | None = None  # torch.distributed.algorithms.ddp_comm_hooks.default_hooks member
    needs_half: str | None = None  # why the value makes no sense on a cell that computes in fp32, when it does not
    lightning_strategy: str | None = None  # lightning.Trainer(strategy=...)
    accelerate: dict = field(default_factory=dict)  # accelerate config keys (`accelerate config` YAML)
    training_args: dict = field(default_factory=dict)  # transformers.TrainingArguments flags


FSDP_ACCELERATE = {
    "distributed_type": "FSDP",
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    },
}
FSDP_TRAINING_ARGS = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}}
PARALLELS = {
    p.name: p
    for p in (
        Parallel("none", None, "none", speed_rank={"cuda": 0, "cpu": 0}),
        Parallel(
            "ddp",
            "ddp",
            "weights",
            lightning_strategy="ddp",
            accelerate={"distributed_type": "MULTI_GPU"},
        ),
        # The hooks compress each gradient bucket to 16 bits for the all-reduce and decompress it after:
        # they halve the traffic and round every reduced gradient (torch ddp_comm_hooks/default_hooks.py).
        Parallel(
            "ddp-bf16-hook",
            "ddp",
            "bfloat16",
            comm_hook="bf16_compress_hook",
            needs_half="a bf16 compress hook rounds an fp32 cell's gradients to bf16 for the all-reduce: "
            "it probes the hook, not a precision this cell trains in; pair it with a bf16 dtype",
            lightning_strategy="ddp",
            accelerate={"distributed_type": "MULTI_GPU"},
        ),
        Parallel(
            "fsdp2",
            "fsdp2",
            "float32",
            lightning_strategy="fsdp",
            accelerate=FSDP_ACCELERATE,
            training_args=FSDP_TRAINING_ARGS,
        ),
        # MixedPrecisionPolicy(reduce_dtype=None) reduces in param_dtype: "bf16 params" then silently means
        # a bf16 reduction (pytorch/pytorch#106395).
        Parallel(
            "fsdp2-reduce-low",
            "fsdp2",
            "compute",
            needs_half="an fp32 cell reduces in fp32 whatever reduce_dtype says: fsdp2-reduce-low is fsdp2 there",
            lightning_strategy="fsdp",
            accelerate=FSDP_ACCELERATE,
            training_args=FSDP_TRAINING_ARGS,
        ),
    )
}


# -- quantized bases (issue 36) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantization(AxisRow):
    """A `quant` axis value: how the base model's linears are loaded (bitsandbytes, through
    transformers' BitsAndBytesConfig). A quantized base is frozen: it trains adapters only. Its matmuls
    run in the cell's compute dtype (bnb_4bit_compute_dtype), the recipe's quant section says the rest."""

    name: str
    bits: int | None  # bits per base weight; None: the base is not quantized
    quant_type: str | None = None  # bnb_4bit_quant_type ("nf4" / "fp4"); None for the 8-bit and unquantized rows
    package: str | None = None  # PACKAGES key

    def bnb_kwargs(self, compute: str, double_quant: bool, storage: str) -> dict:
        """BitsAndBytesConfig(**kwargs) of this row, dtypes as torch attribute names ("bfloat16"); {} for none."""
        if self.bits == 4:
            return {
                "load_in_4bit": True,
                "bnb_4bit_quant_type": self.quant_type,
                "bnb_4bit_compute_dtype": compute,
                "bnb_4bit_use_double_quant": double_quant,
                "bnb_4bit_quant_storage": storage,
            }
        return {"load_in_8bit": True} if self.bits == 8 else {}


# bitsandbytes 0.50.2 runs all three on a CPU (device_map="cpu"): nf4 / fp4 Linear4bit and the 8-bit
# Linear8bitLt train LoRA forward and backward there (checked on this project's 2-core CI machine).
QUANTIZATIONS = {
    q.name: q
    for q in (
        Quantization("none", None, speed_rank={"cuda": 0, "cpu": 0}),
        Quantization("nf4", 4, "nf4", "bitsandbytes"),
        Quantization("fp4", 4, "fp4", "bitsandbytes"),
        Quantization("int8", 8, None, "bitsandbytes"),
    )
}
FP8_QUANT = (
    "fp8 converts the model's nn.Linear layers to fp8 training linears; a bitsandbytes-quantized base has "
    "Linear4bit / Linear8bitLt layers, which neither torchao nor Transformer Engine converts"
)

# the autocast dtype -> accelerate's `mixed_precision` (its config files and Accelerator(mixed_precision=...))
ACCELERATE_MIXED_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}
GRAD_REDUCE_OPS = ("avg", "sum")  # recipe grad_reduce; "sum" is the deliberately broken reduction (pytorch#162338)

DEFAULT_OPTIMIZER = "adamw"
BNB_PAGED = (
    "paging moves optimizer state between GPU and host memory (CUDA unified memory); "
    "on a CPU bitsandbytes falls back to the non-paged {plain}"
)
# transformers' schedule-free optimizers (trainer_optimizer._get_schedule_free_optimizer): warmup_steps from
# TrainingArguments (0 with the probe's constant schedule), weight_lr_power 2.0 and r 0.0 unless optim_args say
SCHEDULE_FREE = (("weight_lr_power", 2.0), ("r", 0.0))
OPTIMIZERS = {
    o.name: o
    for o in (
        Optimizer("adamw", "torch.optim:AdamW", speed_rank={"cuda": 1, "cpu": 0}),
        Optimizer(
            "adamw-fused",
            "torch.optim:AdamW",
            kwargs=(("fused", True),),
            transformers_optim=("adamw_torch_fused",),
            default_grid=False,
            speed_rank={"cuda": 0},
        ),
        # the Trainer passes these only lr (and weight decay through its parameter groups): torch's own
        # defaults for the rest (transformers 5.24 _get_sgd, _get_adagrad, _get_rmsprop, _get_adafactor)
        Optimizer("sgd", "torch.optim:SGD", transformers_optim=("sgd",), default_grid=False, hyper=()),
        Optimizer("adagrad", "torch.optim:Adagrad", transformers_optim=("adagrad",), default_grid=False, hyper=()),
        Optimizer("rmsprop", "torch.optim:RMSprop", transformers_optim=("rmsprop",), default_grid=False, hyper=()),
        Optimizer(
            "adafactor",
            "transformers.optimization:Adafactor",
            kwargs=(("scale_parameter", False), ("relative_step", False)),
            transformers_optim=("adafactor",),
            default_grid=False,
            hyper=(),
        ),
        Optimizer(
            "sf-adamw",
            "schedulefree:AdamWScheduleFree",
            "schedulefree",
            kwargs=(("warmup_steps", 0), *SCHEDULE_FREE),
            transformers_optim=("schedule_free_adamw",),
            default_grid=False,
            eval_mode=True,
        ),
        Optimizer(
            "sf-radam",
            "schedulefree:RAdamScheduleFree",
            "schedulefree",
            kwargs=SCHEDULE_FREE,
            transformers_optim=("schedule_free_radam",),
            default_grid=False,
            eval_mode=True,
        ),
        Optimizer(
            "sf-sgd",
            "schedulefree:SGDScheduleFree",
            "schedulefree",
            kwargs=(("warmup_steps", 0), *SCHEDULE_FREE),
            transformers_optim=("schedule_free_sgd",),
            default_grid=False,
            hyper=(),
            eval_mode=True,
        ),
        # torch.optim.Muon (torch 2.9+) takes 2-D parameters only: the usual split gives it the hidden matrices
        # and AdamW the rest (embeddings, head, norms, biases; Keller Jordan's Muon README, Moonlight). Its lr
        # is matched to AdamW's update RMS (adjust_lr_fn="match_rms_adamw", Moonlight), so one lr serves both.
        # The Trainer has no optim= for it: it takes the built optimizer (Trainer(optimizers=(optimizer, None))).
        Optimizer(
            "muon",
            "torch.optim:Muon",
            kwargs=(("adjust_lr_fn", "match_rms_adamw"),),
            transformers_optim=(),
            default_grid=False,
            hyper=(),
            split="muon",
        ),
        # bitsandbytes and torchao keep tensors under 4096 elements in fp32 state (bnb's min_8bit_size,
        # which torchao follows), so the saving on a small model is below the 8-bit ideal.
        Optimizer(
            "bnb-adamw8bit",
            "bitsandbytes.optim:AdamW8bit",
            "bitsandbytes",
            transformers_optim=("adamw_bnb_8bit", "adamw_8bit"),
            default_grid=False,
        ),
        Optimizer(
            "bnb-paged-adamw8bit",
            "bitsandbytes.optim:PagedAdamW8bit",
            "bitsandbytes",
            cuda_only=BNB_PAGED.format(plain="bnb-adamw8bit"),
            transformers_optim=("paged_adamw_8bit",),
            default_grid=False,
        ),
        Optimizer(
            "bnb-paged-adamw",
            "bitsandbytes.optim:PagedAdamW32bit",
            "bitsandbytes",
            cuda_only=BNB_PAGED.format(plain="AdamW"),
            transformers_optim=("paged_adamw_32bit",),
            default_grid=False,
        ),
        # Lion takes betas and no eps (transformers 5.24 _get_bitsandbytes_optimizer)
        Optimizer(
            "bnb-lion",
            "bitsandbytes.optim:Lion32bit",
            "bitsandbytes",
            transformers_optim=("lion_32bit",),
            default_grid=False,
            hyper=("betas",),
        ),
        Optimizer(
            "bnb-lion8bit",
            "bitsandbytes.optim:Lion8bit",
            "bitsandbytes",
            transformers_optim=("lion_8bit",),
            default_grid=False,
            hyper=("betas",),
        ),
        Optimizer(
            "bnb-paged-lion",
            "bitsandbytes.optim:PagedLion32bit",
            "bitsandbytes",
            cuda_only=BNB_PAGED.format(plain="bnb-lion"),
            transformers_optim=("paged_lion_32bit",),
            default_grid=False,
            hyper=("betas",),
        ),
        Optimizer(
            "bnb-paged-lion8bit",
            "bitsandbytes.optim:PagedLion8bit",
            "bitsandbytes",
            cuda_only=BNB_PAGED.format(plain="bnb-lion8bit"),
            transformers_optim=("paged_lion_8bit",),
            default_grid=False,
            hyper=("betas",),
        ),
        # RMSprop: lr only (the rest from optim_args); 32-bit is what rmsprop_bnb builds
        Optimizer(
            "bnb-rmsprop",
            "bitsandbytes.optim:RMSprop32bit",
            "bitsandbytes",
            transformers_optim=("rmsprop_bnb", "rmsprop_bnb_32bit"),
            default_grid=False,
            hyper=(),
        ),
        Optimizer(
            "bnb-rmsprop8bit",
            "bitsandbytes.optim:RMSprop8bit",
            "bitsandbytes",
            transformers_optim=("rmsprop_bnb_8bit",),
            default_grid=False,
            hyper=(),
        ),
        # AdEMAMix: betas (beta1, beta2, beta3 0.9999) and alpha 5.0 unless optim_args say
        Optimizer(
            "bnb-ademamix",
            "bitsandbytes.optim:AdEMAMix32bit",
            "bitsandbytes",
            kwargs=(("alpha", 5.0),),
            cuda_only="bitsandbytes 0.50.2's CPU step of 32-bit AdEMAMix raises (a state tensor of one parameter "
            "broadcast against another's shape); its 8-bit form runs: bnb-ademamix8bit",
            transformers_optim=("ademamix",),
            default_grid=False,
            hyper=("betas3", "eps"),
        ),
        Optimizer(
            "bnb-ademamix8bit",
            "bitsandbytes.optim:AdEMAMix8bit",
            "bitsandbytes",
            kwargs=(("alpha", 5.0),),
            transformers_optim=("ademamix_8bit",),
            default_grid=False,
            hyper=("betas3", "eps"),
        ),
        Optimizer(
            "bnb-paged-ademamix",
            "bitsandbytes.optim:PagedAdEMAMix32bit",
            "bitsandbytes",
            kwargs=(("alpha", 5.0),),
            cuda_only=BNB_PAGED.format(plain="bnb-ademamix"),
            transformers_optim=("paged_ademamix_32bit",),
            default_grid=False,
            hyper=("betas3", "eps"),
        ),
        Optimizer(
            "bnb-paged-ademamix8bit",
            "bitsandbytes.optim:PagedAdEMAMix8bit",
            "bitsandbytes",
            kwargs=(("alpha", 5.0),),
            cuda_only=BNB_PAGED.format(plain="bnb-ademamix8bit"),
            transformers_optim=("paged_ademamix_8bit",),
            default_grid=False,
            hyper=("betas3", "eps"),
        ),
        # torchao compiles its per-parameter step (torchao/optim/adam.py single_param_adam)
        Optimizer(
            "ao-adamw8bit",
            "torchao.optim:AdamW8bit",
            "torchao",
            transformers_optim=("adamw_torch_8bit",),
            compiles_step=True,
            default_grid=False,
        ),
        Optimizer(
            "ao-adamw4bit",
            "torchao.optim:AdamW4bit",
            "torchao",
            transformers_optim=("adamw_torch_4bit",),
            compiles_step=True,
            default_grid=False,
        ),
    )
}
ADEMAMIX_BETA3 = 0.9999  # transformers 5.24's default third beta for AdEMAMix


def optimizer_kwargs(row: Optimizer, lr: float, betas, eps: float, weight_decay: float) -> dict:
    """The constructor arguments of an optimizer row, from the recipe's hyper-parameters as the Trainer
    passes them to that class (lr and weight_decay always; betas and eps where `hyper` says) and the row's own."""
    kwargs = {"lr": lr}
    if "betas" in row.hyper:
        kwargs["betas"] = tuple(betas)
    if "betas3" in row.hyper:
        kwargs["betas"] = (*betas, ADEMAMIX_BETA3)
    if "eps" in row.hyper:
        kwargs["eps"] = eps
    return {**kwargs, "weight_decay": weight_decay, **dict(row.kwargs)}


# The TrainingArguments optim= values (transformers 5.24 OptimizerNames) no optimizer row probes, and why.
UNSUPPORTED_OPTIMS = {
    "adamw_torch_xla": "torch_xla's syncfree AdamW runs on XLA devices (TPU) only",
    "adamw_torch_npu_fused": "torch_npu's fused AdamW runs on Ascend NPUs only",
    "adamw_anyprecision": "needs torchdistx, which has no release built for torch 2.x",
    **dict.fromkeys(
        (
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
        ),
        "GaLore projects the gradients of the modules optim_target_modules names (galore_torch, installed from "
        "GitHub); the layerwise forms step inside backward hooks, not in optimizer.step()",
    ),
    **dict.fromkeys(
        ("apollo_adamw", "apollo_adamw_layerwise"),
        "APOLLO projects the gradients of the modules optim_target_modules names (apollo_torch); the layerwise "
        "form steps inside backward hooks, not in optimizer.step()",
    ),
    **dict.fromkeys(
        ("lomo", "adalomo"),
        "LOMO fuses the update into backward (lomo_optim: Trainer calls optimizer.fused_backward instead of "
        "loss.backward() and step()), so there is no unscale, grad-norm and step to probe",
    ),
    "grokadamw": "needs the grokadamw package, which nandoctor has not been checked with",
    "stable_adamw": "needs torch-optimi's StableAdamW, which nandoctor has not been checked with",
}


def optimizer_of_training_args(args: dict) -> str:
    """The optimizer value a TrainingArguments dict's `optim` amounts to (adamw_torch when it sets none);
    an optim= no row probes is a NandoctorError that says why."""
    optim = args.get("optim") or "adamw_torch"
    for o in OPTIMIZERS.values():
        if optim in o.transformers_optim:
            return o.name
    if optim in UNSUPPORTED_OPTIMS:
        raise NandoctorError(f"optim={optim!r} is not probed: {UNSUPPORTED_OPTIMS[optim]}")
    known = [n for o in OPTIMIZERS.values() for n in o.transformers_optim]
    raise NandoctorError(f"unknown optim={optim!r};{did_you_mean(optim, known)} valid: {', '.join(known)}")


# The weight dtypes a model can be loaded in (recipe field model.dtype_on_load) -> torch dtype name.
LOAD_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SHORT_DTYPES = {torch_name: short for short, torch_name in LOAD_DTYPES.items()}  # "bfloat16" -> "bf16"

TABLES = {
    "dtype": PRECISIONS,
    "attn": ATTENTIONS,
    "compile": COMPILATIONS,
    "optimizer": OPTIMIZERS,
    "parallel": PARALLELS,
    "quant": QUANTIZATIONS,
}
AXES = {axis: tuple(table) for axis, table in TABLES.items()}
# The hardware axes: a kind of machine, named as the executor that places probes on it names it
# (Cell.hardware). Axis -> (the executor that knows it, what its values are).
HARDWARE_AXES = {"partition": ("slurm", "SLURM partition"), "node_type": ("ray", "Ray custom resource")}
HARDWARE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# The values a grid probes unless told otherwise: opt-in rows (default_grid=False) stay out, and every
# probe is one process (a parallel probe is W of them).
DEFAULT_AXES = {
    **AXES,
    "dtype": tuple(n for n, p in PRECISIONS.items() if p.default_grid),
    "optimizer": tuple(n for n, o in OPTIMIZERS.items() if o.default_grid),
    "parallel": ("none",),
    "quant": ("none",),  # a quantized base trains an adapter only: the user names it (--axis quant=none,nf4)
}


def _fastest_first(kind: str) -> dict[str, tuple[str, ...]]:
    """axis -> the values that have a place on this kind of device ("cuda" / "cpu"), fastest first."""
    out = {}
    for axis, table in TABLES.items():
        place = {name: row.speed_rank[kind] for name, row in table.items() if kind in row.speed_rank}
        out[axis] = tuple(sorted(place, key=place.get))
    return out


# What a user would like to train with on each kind of device (AxisRow): bisect's default target is the
# first combination the device supports (bisect/factors.fastest_cell).
FASTEST_FIRST = {kind: _fastest_first(kind) for kind in ("cuda", "cpu")}


def _lightning_aliases() -> dict[str, str]:
    """Lightning's precision names as dtype values: each names the first row that has it ("32-true" is
    fp32; tf32 also trains under "32-true", with TF32 matmuls switched on in code)."""
    aliases: dict[str, str] = {}
    for p in PRECISIONS.values():
        aliases.setdefault(p.lightning, p.name)
    return aliases


ALIASES = {"dtype": _lightning_aliases()}


@dataclass(frozen=True)
class Cell:
    """One point of the grid: precision x attention x compile x optimizer x parallel, on a kind of
    hardware. The default optimizer and parallel=none stay out of the id and the dict, so that runs
    written before those axes keep their probe ids and cache fingerprints.

    `hardware` is the kind of machine the executor places the probe on (a SLURM partition, a Ray custom
    resource: the --axis partition= / node_type= values), "" for wherever the executor puts it. It is
    part of the cell, not of the placement, because a configuration's verdict is a fact about the
    hardware: fp32/sdpa/off on two partitions is two probes, two verdicts, two fp32 references and a
    ranking per kind. Its values are names the scheduler knows, not rows of a table."""

    dtype: str = "fp32"
    attn: str = "sdpa"
    compile: str = "off"
    optimizer: str = DEFAULT_OPTIMIZER
    parallel: str = "none"
    hardware: str = ""
    quant: str = "none"  # after hardware: cells written positionally keep their meaning

    @property
    def id(self) -> str:
        parts = [self.dtype, self.attn, self.compile]
        parts += [self.optimizer] if self.optimizer != DEFAULT_OPTIMIZER else []
        parts += [self.parallel] if self.parallel != "none" else []
        text = "/".join(parts + ([self.quant] if self.quant != "none" else []))
        return f"{text}@{self.hardware}" if self.hardware else text

    @property
    def precision(self) -> Precision:
        return PRECISIONS[self.dtype]

    @property
    def attention(self) -> Attention:
        return ATTENTIONS[self.attn]

    @property
    def compilation(self) -> Compilation:
        return COMPILATIONS[self.compile]

    @property
    def optimizer_row(self) -> Optimizer:
        return OPTIMIZERS[self.optimizer]

    @property
    def parallel_row(self) -> Parallel:
        return PARALLELS[self.parallel]

    @property
    def quantization(self) -> Quantization:
        return QUANTIZATIONS[self.quant]

    @property
    def single(self) -> Cell:
        """The same cell in one process: a parallel probe's exact reference (same global batch)."""
        return replace(self, parallel="none")

    @property
    def anywhere(self) -> Cell:
        """The same configuration, whatever hardware it runs on."""
        return replace(self, hardware="")

    def to_dict(self) -> dict:
        out = {"dtype": self.dtype, "attn": self.attn, "compile": self.compile}
        out.update({"optimizer": self.optimizer} if self.optimizer != DEFAULT_OPTIMIZER else {})
        out.update({"parallel": self.parallel} if self.parallel != "none" else {})
        out.update({"quant": self.quant} if self.quant != "none" else {})
        return {**out, "hardware": self.hardware} if self.hardware else out

    @classmethod
    def of(cls, config: dict) -> Cell:
        """The cell of a configuration (axis values, plus recipe fields it may carry); an axis it lacks
        (a configuration written before the optimizer axis) takes its default."""
        return cls(**{axis: config[axis] for axis in (*AXES, "hardware") if axis in config})

    @classmethod
    def parse(cls, text: str) -> Cell:
        """'bf16-amp/sdpa/off[/optimizer][/parallel][/quant][@hardware]': the optional parts are told apart
        by their values."""
        text, _, hardware = text.partition("@")
        parts = text.split("/")
        if not 3 <= len(parts) <= 6:
            raise NandoctorError(
                f"bad cell {text!r}: expected dtype/attn/compile[/optimizer][/parallel][/quant], e.g. bf16-amp/sdpa/off"
            )
        values = {axis: parse_axis_values(axis, [value])[0] for axis, value in zip(("dtype", "attn", "compile"), parts)}
        for value in parts[3:]:
            if value in PARALLELS and "parallel" not in values:
                axis = "parallel"
            else:
                axis = "quant" if value in QUANTIZATIONS and "quant" not in values else "optimizer"
            values[axis] = parse_axis_values(axis, [value])[0]
        return cls(**values, hardware=hardware)


REFERENCE_CELL = Cell("fp32", "eager", "off")  # the fidelity reference: no reduced precision, no fused kernels


def reference_of(cell: Cell) -> Cell:
    """The fp32 reference a cell's drift is measured against, on its hardware: REFERENCE_CELL over the
    same base (a quantized base's weights are not the 16-bit base's: its own fp32 cell is its reference)."""
    return replace(REFERENCE_CELL, quant=cell.quant, hardware=cell.hardware)


def weight_dtype(cell: Cell, dtype_on_load: str) -> str:
    """The dtype weights are held in: the pure cells hard-cast, an fp32 cell (no autocast, fp32 matmuls:
    the reference, tf32) holds fp32 weights whatever the load dtype (a bf16 load would make the reference
    itself a bf16-weights run), the autocast cells keep the load dtype."""
    p = cell.precision
    if p.weights:
        return p.weights
    return "float32" if p.autocast is None and p.compute == "float32" else LOAD_DTYPES[dtype_on_load]


def precision_of_training_args(args: dict) -> str:
    """The dtype value a TrainingArguments dict amounts to: the row whose flags it sets, autocast rows
    before tf32 (bf16=True with tf32=True is bf16 autocast), table order among autocast rows."""
    matching = [
        p for p in PRECISIONS.values() if p.training_args and all(args.get(k) == v for k, v in p.training_args.items())
    ]
    return min(matching, key=lambda p: p.autocast is None).name if matching else "fp32"


def compile_of_training_args(args: dict) -> str:
    if not args.get("torch_compile"):
        return "off"
    backend = args.get("torch_compile_backend") or "inductor"
    return next((c.name for c in COMPILATIONS.values() if c.backend == backend), "inductor")


def reduce_dtype(cell: Cell, dtype_on_load: str) -> str | None:
    """The dtype a parallel cell is meant to reduce gradients in (a torch dtype name); None for one process."""
    row = cell.parallel_row
    if row.wrapper is None:
        return None
    return {"compute": cell.precision.compute, "weights": weight_dtype(cell, dtype_on_load)}.get(row.reduce, row.reduce)


def parse_axis_values(axis: str, values) -> list[str]:
    """Validate one axis ('dtype', 'attn', 'compile', 'optimizer', 'parallel', or a HARDWARE_AXES name) and its
    values, aliases resolved; returns the values as a list. Hardware values are the scheduler's names: only
    their spelling is checked here; the placement checks that they exist (executors.with_hardware hands
    them to it)."""
    if axis not in AXES and axis not in HARDWARE_AXES:
        names = (*AXES, *HARDWARE_AXES)
        raise NandoctorError(f"unknown axis {axis!r};{did_you_mean(axis, names)} valid axes: {', '.join(names)}")
    if isinstance(values, str):
        values = [v for v in values.split(",") if v]
    if axis in HARDWARE_AXES:
        bad = [v for v in values if not HARDWARE_NAME.fullmatch(str(v))]
        if bad or not values:
            raise NandoctorError(
                f"bad --axis {axis}={','.join(map(str, values))}: expected the {HARDWARE_AXES[axis][1]} names, "
                f"e.g. {axis}=h100,a100 (letters, digits, '_', '-', '.')"
            )
        return list(dict.fromkeys(values))
    values = [ALIASES.get(axis, {}).get(v, v) for v in values]
    if not values:
        raise NandoctorError(f"axis {axis!r} has no values; valid: {', '.join(AXES[axis])}")
    for v in values:
        if v not in AXES[axis]:
            aliases = ALIASES.get(axis)
            also = f" (or Lightning's {', '.join(aliases)})" if aliases else ""
            raise NandoctorError(
                f"unknown {axis} value {v!r};{did_you_mean(v, (*AXES[axis], *(aliases or ())))} "
                f"valid: {', '.join(AXES[axis])}{also}"
            )
    return values


def parse_axis_flag(text: str) -> tuple[str, list[str]]:
    """'dtype=bf16-amp,fp16-amp' -> ('dtype', ['bf16-amp', 'fp16-amp'])."""
    if "=" not in text:
        raise NandoctorError(
            f"bad --axis {text!r}: expected NAME=V1,V2 with NAME one of {', '.join((*AXES, *HARDWARE_AXES))}"
        )
    name, values = text.split("=", 1)
    return name.strip(), parse_axis_values(name.strip(), values)
