"""The cell table: what every value of every grid axis means, in one place.

A cell is one point of the grid (precision x attention x compile). Each axis value is one row below,
and every other module reads these rows: the probe builds its autocast, weights, GradScaler and SDPA
pin from them, the planner checks their hardware needs, the forensics read their compute dtype, and
the recommendation turns them into TrainingArguments, `from_pretrained` and Lightning arguments.
Adding a value is adding a row (plus whatever code is truly new).

Foundation module: imports only errors. Dtypes are torch attribute names ("bfloat16"), so that
nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import NandoctorError


@dataclass(frozen=True)
class Precision:
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


@dataclass(frozen=True)
class Attention:
    """An `attn` axis value."""
    name: str
    implementation: str  # from_pretrained(attn_implementation=...)
    sdpa_backend: str | None = None  # torch.nn.attention.SDPBackend member pinned around the step
    gpu_features: tuple = ()
    cuda_only: str | None = None
    half_only_cuda: str | None = None  # the CUDA kernel takes fp16/bf16 inputs only
    package: str | None = None  # an extra package the implementation needs (env fact name)


@dataclass(frozen=True)
class Compilation:
    """A `compile` axis value."""
    name: str
    backend: str | None  # torch.compile(backend=...); None: eager
    # Relative cost, to order cells (never used as a number): a first inductor step takes ~36 s on a
    # 2-core CPU, aot_eager traces without generating code.
    cost: int = 0


PRECISIONS = {p.name: p for p in (
    Precision("fp32", None, None, "float32", False),
    Precision("tf32", None, None, "float32", False, tf32=True, gpu_features=("tf32",),
              cuda_only="tf32 is a CUDA matmul mode; this device is a CPU", training_args={"tf32": True}),
    Precision("bf16-amp", "bfloat16", None, "bfloat16", False, gpu_features=("bf16",),
              training_args={"bf16": True}, lightning="bf16-mixed"),
    Precision("fp16-amp", "float16", None, "float16", True, training_args={"fp16": True}, lightning="16-mixed"),
    Precision("bf16-pure", None, "bfloat16", "bfloat16", False, gpu_features=("bf16",), lightning="bf16-true"),
    Precision("fp16-pure", None, "float16", "float16", False, lightning="16-true"),
)}

ATTENTIONS = {a.name: a for a in (
    Attention("eager", "eager"),
    Attention("sdpa", "sdpa"),
    Attention("sdpa:math", "sdpa", "MATH"),
    Attention("sdpa:flash", "sdpa", "FLASH_ATTENTION", gpu_features=("sdpa:flash",),
              half_only_cuda="the CUDA flash SDPA kernel takes fp16/bf16 inputs only"),
    Attention("sdpa:efficient", "sdpa", "EFFICIENT_ATTENTION", cuda_only="the memory-efficient SDPA kernel is CUDA-only"),
    Attention("sdpa:cudnn", "sdpa", "CUDNN_ATTENTION", gpu_features=("sdpa:cudnn",), cuda_only="cuDNN SDPA is CUDA-only",
              half_only_cuda="the cuDNN SDPA kernel takes fp16/bf16 inputs only"),
    Attention("flash_attention_2", "flash_attention_2", gpu_features=("flash_attention_2",),
              cuda_only="flash-attn 2 is CUDA-only", half_only_cuda="flash-attn 2 takes fp16/bf16 inputs only",
              package="flash_attn"),
)}

COMPILATIONS = {c.name: c for c in (
    Compilation("off", None, 0),
    Compilation("inductor", "inductor", 2),
    Compilation("aot_eager", "aot_eager", 1),
)}

# The weight dtypes a model can be loaded in (recipe field model.dtype_on_load) -> torch dtype name.
LOAD_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SHORT_DTYPES = {torch_name: short for short, torch_name in LOAD_DTYPES.items()}  # "bfloat16" -> "bf16"

AXES = {"dtype": tuple(PRECISIONS), "attn": tuple(ATTENTIONS), "compile": tuple(COMPILATIONS)}


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
    """One point of the grid: precision x attention x compile."""
    dtype: str = "fp32"
    attn: str = "sdpa"
    compile: str = "off"

    @property
    def id(self) -> str:
        return f"{self.dtype}/{self.attn}/{self.compile}"

    @property
    def precision(self) -> Precision:
        return PRECISIONS[self.dtype]

    @property
    def attention(self) -> Attention:
        return ATTENTIONS[self.attn]

    @property
    def compilation(self) -> Compilation:
        return COMPILATIONS[self.compile]

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "attn": self.attn, "compile": self.compile}

    @classmethod
    def parse(cls, text: str) -> "Cell":
        parts = text.split("/")
        if len(parts) != 3:
            raise NandoctorError(f"bad cell {text!r}: expected dtype/attn/compile, e.g. bf16-amp/sdpa/off")
        return cls(*(parse_axis_values(axis, [value])[0] for axis, value in zip(AXES, parts)))


REFERENCE_CELL = Cell("fp32", "eager", "off")  # the fidelity reference: no reduced precision, no fused kernels


def weight_dtype(cell: Cell, dtype_on_load: str) -> str:
    """The dtype weights are held in: the pure cells hard-cast, the others keep the load dtype."""
    return cell.precision.weights or LOAD_DTYPES[dtype_on_load]


def precision_of_training_args(args: dict) -> str:
    """The dtype value a TrainingArguments dict amounts to: the row whose flags it sets, autocast rows
    before tf32 (bf16=True with tf32=True is bf16 autocast), table order among autocast rows."""
    matching = [p for p in PRECISIONS.values() if p.training_args and all(args.get(k) == v for k, v in p.training_args.items())]
    return min(matching, key=lambda p: p.autocast is None).name if matching else "fp32"


def compile_of_training_args(args: dict) -> str:
    if not args.get("torch_compile"):
        return "off"
    backend = args.get("torch_compile_backend") or "inductor"
    return next((c.name for c in COMPILATIONS.values() if c.backend == backend), "inductor")


def parse_axis_values(axis: str, values) -> list[str]:
    """Validate one axis ('dtype', 'attn', 'compile') and its values, aliases resolved; returns the
    values as a list."""
    if axis not in AXES:
        raise NandoctorError(f"unknown axis {axis!r}; valid axes: {', '.join(AXES)}")
    if isinstance(values, str):
        values = [v for v in values.split(",") if v]
    values = [ALIASES.get(axis, {}).get(v, v) for v in values]
    if not values:
        raise NandoctorError(f"axis {axis!r} has no values; valid: {', '.join(AXES[axis])}")
    for v in values:
        if v not in AXES[axis]:
            aliases = ALIASES.get(axis)
            also = f" (or Lightning's {', '.join(aliases)})" if aliases else ""
            raise NandoctorError(f"unknown {axis} value {v!r}; valid: {', '.join(AXES[axis])}{also}")
    return values


def parse_axis_flag(text: str) -> tuple[str, list[str]]:
    """'dtype=bf16-amp,fp16-amp' -> ('dtype', ['bf16-amp', 'fp16-amp'])."""
    if "=" not in text:
        raise NandoctorError(f"bad --axis {text!r}: expected NAME=V1,V2 with NAME one of {', '.join(AXES)}")
    name, values = text.split("=", 1)
    return name.strip(), parse_axis_values(name.strip(), values)
