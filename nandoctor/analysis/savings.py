"""Low-precision savings: each low-precision probe (an fp8 dtype, or an optimizer other than adamw)
against its baseline in the same run, and the published claims beside what was measured, each with a
plain-words verdict.

A probe's baseline differs from it only in the low-precision choice: bf16-amp for an fp8 dtype (the
precision fp8 is sold against), adamw for an optimizer (the state it shrinks), the 16-bit base for a
quantized one (quant axis: the bytes of the base it shrinks), with the same
attention, compile, recipe variant and seed. A bf16-amp/adamw probe is the baseline of an fp8 cell
with adamw, and of a bf16-amp cell with an 8-bit optimizer.

Pure analysis: no torch. Rows come from probe records (report/savings.py builds them); claims are data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cells import DEFAULT_OPTIMIZER, PRECISIONS

BASELINE_DTYPE = "bf16-amp"  # what an fp8 dtype is compared with
GUIDE = "the low-precision training guide quoted in nandoctor issue 11"
HELD, NOT_HELD, NOT_MEASURED = "held", "not held", "not measured"


@dataclass(frozen=True)
class SavingsRow:
    """One probe's figures. `variant` is what else tells probes apart (attention, compile, overrides,
    seed): a probe is compared with a baseline of the same variant only."""

    cell_id: str
    dtype: str
    optimizer: str
    optimizer_state_bytes: int | None
    peak_memory_bytes: int | None
    tokens_per_s: float | None  # steady state
    fidelity: float | None  # mean relative loss error against the fp32 reference
    verdict: str
    variant: str = ""
    device: str = "cuda"  # "cuda" or "cpu": what the speed and peak figures were measured on
    quant: str = "none"  # the base's quantization (the quant axis)
    base_bytes: int | None = None  # the frozen base as stored, quantization constants included


@dataclass(frozen=True)
class Claim:
    """A published claim and how nandoctor reads it as a range of one measured figure: held when
    low < figure <= high. The reading (the range) is nandoctor's, the words are the source's.
    gpu_only: the claim speaks of GPU speed or GPU memory, which a CPU probe does not measure."""

    id: str
    quote: str
    source: str
    axis: str  # "dtype" or "optimizer": the rows the claim speaks about
    values: tuple
    figure: str  # a Saving field
    low: float = -math.inf
    high: float = math.inf
    reading: str = ""
    gpu_only: bool = False


FP8 = tuple(name for name, p in PRECISIONS.items() if p.fp8)
ADAMW_8BIT = ("bnb-adamw8bit", "bnb-paged-adamw8bit", "ao-adamw8bit")
CLAIMS = (
    Claim(
        "fp8-speed",
        "up to 2x faster than FP16/BF16",
        GUIDE,
        "dtype",
        FP8,
        "speedup",
        low=1.0,
        reading="held when fp8 trains more tokens/s than bf16-amp at all; 'up to' sets no lower bound",
        gpu_only=True,
    ),
    Claim(
        "fp8-accuracy",
        "minimal accuracy loss (~0.1%)",
        GUIDE,
        "dtype",
        FP8,
        "extra_loss_error",
        high=0.001,
        reading="held when the fp8 loss curve is at most 0.1% (relative) further from the fp32 reference "
        "than bf16-amp's",
    ),
    Claim(
        "8bit-adamw-state",
        "reduces memory usage by approximately 75% for optimizer states",
        GUIDE,
        "optimizer",
        ADAMW_8BIT,
        "state_saving",
        low=0.70,
        high=0.80,
        reading="held when optimizer-state bytes fall by 70-80% ('approximately' read as 5 points either way)",
    ),
    Claim(
        "8bit-adamw-overall",
        "~50-75% overall",
        GUIDE,
        "optimizer",
        ADAMW_8BIT,
        "peak_saving",
        low=0.45,
        high=0.80,
        reading="held when peak memory falls by 45-80% ('~' read as 5 points either way)",
        gpu_only=True,
    ),
)


@dataclass(frozen=True)
class Saving:
    """One low-precision probe against its baseline; a figure is None when either side lacks it."""

    cell_id: str
    baseline_id: str | None
    state_saving: float | None  # 1 - state bytes / baseline state bytes
    peak_saving: float | None  # 1 - peak / baseline peak
    speedup: float | None  # tokens/s over baseline tokens/s
    extra_loss_error: float | None  # fidelity - baseline fidelity
    base_saving: float | None = None  # 1 - base bytes / baseline base bytes (a quantized base)


@dataclass(frozen=True)
class ClaimCheck:
    cell_id: str
    claim: Claim
    figure: float | None
    verdict: str  # HELD / NOT_HELD / NOT_MEASURED
    why: str


def is_low_precision(row: SavingsRow) -> bool:
    return PRECISIONS[row.dtype].fp8 is not None or row.optimizer != DEFAULT_OPTIMIZER or row.quant != "none"


def baseline_of(row: SavingsRow) -> tuple[str, str, str]:
    """(dtype, optimizer, quant) of the probe a low-precision row is compared with: a quantized base is
    compared with the same adapter, dtype and optimizer over the 16-bit base."""
    if row.quant != "none":
        return row.dtype, row.optimizer, "none"
    return (BASELINE_DTYPE if PRECISIONS[row.dtype].fp8 else row.dtype), DEFAULT_OPTIMIZER, row.quant


def _ratio(num, den):
    return num / den if num is not None and den else None


def _saving(used, baseline_used):
    ratio = _ratio(used, baseline_used)
    return None if ratio is None else 1 - ratio


def compare(row: SavingsRow, baseline: SavingsRow | None) -> Saving:
    if baseline is None:
        return Saving(row.cell_id, None, None, None, None, None)
    both_fidelities = row.fidelity is not None and baseline.fidelity is not None
    return Saving(
        row.cell_id,
        baseline.cell_id,
        state_saving=_saving(row.optimizer_state_bytes, baseline.optimizer_state_bytes),
        peak_saving=_saving(row.peak_memory_bytes, baseline.peak_memory_bytes),
        speedup=_ratio(row.tokens_per_s, baseline.tokens_per_s),
        extra_loss_error=row.fidelity - baseline.fidelity if both_fidelities else None,
        base_saving=_saving(row.base_bytes, baseline.base_bytes) if row.quant != "none" else None,
    )


def check(claim: Claim, row: SavingsRow, baseline: SavingsRow | None, saving: Saving) -> ClaimCheck:
    """The verdict of one claim on one probe. An unstable probe cannot hold an accuracy claim; its
    speed and memory figures are not taken as evidence either way, and neither are a CPU's for a
    claim about GPUs."""
    figure = getattr(saving, claim.figure)
    if baseline is None:
        return ClaimCheck(
            row.cell_id,
            claim,
            None,
            NOT_MEASURED,
            f"no {'/'.join(v for v in baseline_of(row) if v != 'none')} probe of the same variant in this run",
        )
    if baseline.verdict != "stable":
        return ClaimCheck(
            row.cell_id, claim, None, NOT_MEASURED, f"the baseline {baseline.cell_id} was {baseline.verdict}"
        )
    if row.verdict != "stable":
        verdict = NOT_HELD if claim.figure == "extra_loss_error" else NOT_MEASURED
        return ClaimCheck(row.cell_id, claim, None, verdict, f"the probe was {row.verdict}, not stable")
    if claim.gpu_only and row.device != "cuda":
        return ClaimCheck(
            row.cell_id,
            claim,
            figure,
            NOT_MEASURED,
            f"the claim is about GPU {'speed' if claim.figure == 'speedup' else 'memory'}; this probe ran on a CPU",
        )
    if figure is None:
        return ClaimCheck(row.cell_id, claim, None, NOT_MEASURED, f"{claim.figure} was not recorded")
    held = claim.low < figure <= claim.high
    return ClaimCheck(row.cell_id, claim, figure, HELD if held else NOT_HELD, claim.reading)


def savings(rows: list[SavingsRow]) -> tuple[list[Saving], list[ClaimCheck]]:
    """Every low-precision row compared with its baseline of the same variant, and every claim that
    speaks about the row's dtype or optimizer checked on it."""
    by_key = {(r.variant, r.dtype, r.optimizer, r.quant): r for r in rows}
    compared, checks = [], []
    for row in rows:
        if not is_low_precision(row):
            continue
        baseline = by_key.get((row.variant, *baseline_of(row)))
        saving = compare(row, baseline)
        compared.append(saving)
        checks += [check(c, row, baseline, saving) for c in CLAIMS if getattr(row, c.axis) in c.values]
    return compared, checks
