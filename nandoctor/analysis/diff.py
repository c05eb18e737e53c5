"""Compare a run with a baseline run: what changed in the environment and the settings, which cells
changed verdict, and, for cells stable in both, how fidelity, tokens/s, peak memory and the loss curve
moved. Pure (no torch): two RunAnalysis in, one RunDiff out; `nandoctor diff` and `--baseline` render it.

A cell regressed when it was stable and now fails, when it crashes now and did not before, when its
fidelity got worse by more than Thresholds.fidelity_regression, or (a `check` run) when its step-0 loss
or grad-norm moved beyond the golden tolerance of its matmul dtype. A probe the scheduler lost (its
record's status `lost`: a node failure, a preemption, a job never started) is no verdict about the
configuration in either run: it is NOT_COMPARED, never a regression."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field

from ..cells import PRECISIONS
from ..config import recipe_from_dict, recipe_to_dict, with_load_dtype_resolved
from ..device import DeviceFacts
from ..errors import NandoctorError
from ..record import ProbeRecord, Step
from ..runmeta import RunMeta
from ..thresholds import THRESHOLDS, Thresholds
from .forensics import FINFO_EPS
from .outcomes import ProbeOutcome, RunAnalysis
from .ranking import order_bucket
from .verdicts import CRASH, STABLE, UNSUPPORTED

# How a cell's verdict moved, in the order a report lists them: regressions first.
REGRESSED, FIXED, CHANGED, NOT_COMPARED, NOW_UNSUPPORTED, NOW_SUPPORTED, ADDED, REMOVED, SAME = (
    "regressed",
    "fixed",
    "changed",
    "not compared",  # the scheduler lost the probe in one of the runs: nothing is known about the cell there
    "now unsupported",
    "now supported",
    "added",
    "removed",
    "same",
)
CHANGE_ORDER = (REGRESSED, FIXED, CHANGED, NOT_COMPARED, NOW_UNSUPPORTED, NOW_SUPPORTED, ADDED, REMOVED, SAME)
# How two loss curves of one cell compare
BIT_IDENTICAL, WITHIN_TOLERANCE, PARTED = "bit-identical", "within tolerance", "parted"
RUN_FACTS = ("kind", "steps", "seed")  # run.json facts beside the recipe that change what a probe does


# ---- the environment -------------------------------------------------------------------------------------

# (the name a report shows, the run.json `env` key it is read from). A key a run lacks is a fact that
# run did not record (older versions recorded fewer), not a difference.
ENV_FACTS = (
    ("torch", "torch"),
    ("CUDA", "cuda"),
    ("cuDNN", "cudnn"),
    ("NCCL", "nccl"),
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("driver", "nvml"),
    ("GPU", "gpus"),
    ("python", "python"),
    ("CPU", "cpu_model"),
    ("CPU kernels", "cpu_capability"),
    ("flash-attn", "flash_attn"),
)


def _fact(env: DeviceFacts, key: str) -> str:
    value = getattr(env, key)
    if key == "nvml":
        value = value.driver if value is not None else None
    elif key == "gpus":
        value = ", ".join(f"{g.name} (cc {g.capability})" for g in value) or "none"
    return "-" if value is None else str(value)


def environment_facts(env: DeviceFacts) -> dict[str, str]:
    """The facts of a run's environment that change numerics or support, as strings ('-': absent), plus
    each optional package's version; facts the run did not record are left out."""
    out = {name: _fact(env, key) for name, key in ENV_FACTS if env.has(key)}
    for module, package in env.packages.items():
        out[module] = (package.version or "installed") if package.importable else "-"
    return out


@dataclass(frozen=True)
class Difference:
    """One fact or setting that differs: its name, the baseline's value and this run's."""

    name: str
    before: str
    after: str


def _differences(before: dict, after: dict) -> list[Difference]:
    return [Difference(k, before[k], after[k]) for k in before if k in after and before[k] != after[k]]


def _unrecorded(before: dict, after: dict) -> list[str]:
    return [k for k in {**before, **after} if (k in before) != (k in after)]


# ---- the settings --------------------------------------------------------------------------------------------


def _flat(data, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): json.dumps(data, default=str) if not isinstance(data, str) else data}


def _recipe_today(recipe: dict) -> dict:
    """The recipe read back with today's defaults, so that a section added since (fp8) is no difference,
    and model.dtype_on_load "auto" as the dtype it loads (a run from before "auto" was the default said fp32)."""
    try:
        return with_load_dtype_resolved(
            recipe_to_dict(recipe_from_dict({k: v for k, v in recipe.items() if k != "name"}, recipe.get("name", "")))
        )
    except NandoctorError:
        return recipe  # a recipe this version cannot read is compared as written


def settings(meta: RunMeta) -> dict[str, str]:
    """What a run was asked to do, flat: run facts, recipe fields (recipe.optimizer.lr, ...) and axes."""
    recipe = {k: v for k, v in _recipe_today(meta.recipe or {}).items() if k != "description"}
    out = {k: str(getattr(meta, k)) for k in RUN_FACTS if meta.has(k)}
    out.update(_flat(recipe, "recipe."))
    out.update(_flat({axis: ",".join(values) for axis, values in (meta.axes or {}).items()}, "axis."))
    plan = meta.model_plan or {}
    out.update({f"model.{k}": str(plan[k]) for k in ("source", "scale", "params") if k in plan})
    return out


# ---- one cell ------------------------------------------------------------------------------------------------


def golden_tolerance(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> tuple[float, float]:
    """(loss, grad-norm) relative tolerance for a step of this cell: Thresholds.golden_*_eps machine
    epsilons of the dtype its matmuls run in, at least Thresholds.golden_floor."""
    precision = PRECISIONS.get(record.cell.dtype)
    dtype = "tf32" if precision and precision.tf32 else (precision.compute if precision else "float32")
    eps = FINFO_EPS.get(dtype, FINFO_EPS["float32"])
    return max(t.golden_floor, t.golden_loss_eps * eps), max(t.golden_floor, t.golden_grad_eps * eps)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def relative_change(before: float, after: float) -> float:
    """|after - before| / |before|; 0 for equal values (NaN and NaN included), inf where either is not finite."""
    if _same(before, after):
        return 0.0
    if not (math.isfinite(before) and math.isfinite(after)):
        return math.inf
    return abs(after - before) / abs(before) if before else math.inf


@dataclass(frozen=True)
class CurveMatch:
    """How this run's loss curve compares with the baseline's over their common steps."""

    status: str  # BIT_IDENTICAL, WITHIN_TOLERANCE or PARTED
    steps: int  # common steps compared
    tolerance: float  # relative, per step (golden_tolerance's loss tolerance)
    first_difference: int | None = None  # the first step whose loss differs at all
    parted_at: int | None = None  # the first step whose loss differs beyond the tolerance
    largest: float = 0.0  # the largest relative difference over the common steps


def compare_curves(before: list[Step], after: list[Step], tolerance: float) -> CurveMatch:
    """Step by step over the steps both curves have: bit-identical, within the tolerance, or the step
    where they part."""
    pairs = list(zip(before, after))
    changes = [(a.step, relative_change(a.loss, b.loss)) for a, b in pairs]
    differ = [step for step, c in changes if c > 0]
    beyond = [step for step, c in changes if c > tolerance]
    largest = max((c for _, c in changes), default=0.0)
    status = PARTED if beyond else WITHIN_TOLERANCE if differ else BIT_IDENTICAL
    return CurveMatch(
        status, len(pairs), tolerance, differ[0] if differ else None, beyond[0] if beyond else None, largest
    )


def thread_change(before: ProbeRecord, after: ProbeRecord) -> tuple[int, int] | None:
    """(before, after) torch CPU threads of two probes that trained with different counts; None when the
    counts agree or either record does not say (records before cpu_threads, parallel ranks)."""
    counts = [(r.cpu_threads or {}).get("torch") for r in (before, after)]
    if None in counts or counts[0] == counts[1]:
        return None
    return counts[0], counts[1]


@dataclass(frozen=True)
class Golden:
    """A `check` run's step-0 value against the baseline's: the golden-value test."""

    name: str  # "step-0 loss" or "step-0 grad-norm"
    before: float
    after: float
    tolerance: float  # relative

    @property
    def change(self) -> float:
        return relative_change(self.before, self.after)

    @property
    def passed(self) -> bool:
        return self.change <= self.tolerance


def golden_values(before: ProbeRecord, after: ProbeRecord, t: Thresholds = THRESHOLDS) -> list[Golden]:
    """Step-0 loss and grad-norm of this run against the baseline's; empty when either has no step 0."""
    if not before.steps or not after.steps:
        return []
    loss_tol, grad_tol = golden_tolerance(after, t)
    a, b = before.steps[0], after.steps[0]
    return [
        Golden("step-0 loss", a.loss, b.loss, loss_tol),
        Golden("step-0 grad-norm", a.grad_norm, b.grad_norm, grad_tol),
    ]


def throughput_noise(record: ProbeRecord, t: Thresholds = THRESHOLDS) -> float | None:
    """A probe's own tokens/s noise, relative: the interquartile range of its per-step rates over their
    median. The record's own measured spread (`record.throughput`, over its steady steps) when it has one;
    a record written before throughput was recorded gets it from its steps (step 0 left out); None with
    fewer than t.throughput_noise_min_steps timed steps."""
    if record.throughput is not None and math.isfinite(record.throughput.spread):
        return record.throughput.spread
    rates = sorted(s.tokens_per_s for s in record.steps[1:] if s.tokens_per_s)
    if len(rates) < t.throughput_noise_min_steps:
        return None
    q1, _, q3 = statistics.quantiles(rates, n=4)
    return (q3 - q1) / statistics.median(rates)


@dataclass(frozen=True)
class Measured:
    """A number of a cell stable in both runs, and the band within which a change is noise."""

    before: float | None
    after: float | None
    band: float  # relative to `before`; in the number's own units when absolute
    absolute: bool = False  # fidelity is itself a relative error: its change is a difference

    @property
    def change(self) -> float | None:
        """after - before (absolute) or after / before - 1; None when either is missing."""
        if self.before is None or self.after is None:
            return None
        if self.absolute:
            return self.after - self.before
        return self.after / self.before - 1 if self.before else None

    @property
    def moved(self) -> bool:
        return self.change is not None and abs(self.change) > self.band


@dataclass
class CellChange:
    """One probe id as the baseline and this run saw it."""

    probe_id: str
    before: ProbeOutcome | None
    after: ProbeOutcome | None
    change: str  # CHANGE_ORDER
    why: str  # a sentence: what moved, or that nothing did
    curve: CurveMatch | None = None
    fidelity: Measured | None = None
    tokens_per_s: Measured | None = None
    peak_memory: Measured | None = None
    golden: list[Golden] = field(default_factory=list)
    # (before, after) torch CPU threads when the two probes trained with different counts (a probe sizes
    # its threads to the cores other processes leave free): a loss's last digits follow the thread count
    threads: tuple[int, int] | None = None

    @property
    def regressed(self) -> bool:
        return self.change == REGRESSED

    @property
    def measured(self) -> tuple[Measured | None, Measured | None, Measured | None]:
        """(fidelity, tokens/s, peak memory) of a cell stable in both runs; Nones otherwise."""
        return self.fidelity, self.tokens_per_s, self.peak_memory

    @property
    def verdicts(self) -> str:
        return f"{self.before.verdict.name if self.before else '-'} -> {self.after.verdict.name if self.after else '-'}"


def _verdict_change(before: ProbeOutcome | None, after: ProbeOutcome | None) -> tuple[str, str]:
    if before is None:
        return (
            (REGRESSED, f"new cell, {after.verdict.name}: {after.verdict.reason}")
            if after.verdict.name == CRASH
            else (ADDED, f"not in the baseline; {after.verdict.name} now")
        )
    if after is None:
        return REMOVED, f"not in this run; {before.verdict.name} in the baseline"
    lost = [(run, o) for run, o in (("this run", after), ("the baseline", before)) if o.record.status == "lost"]
    if lost:
        run, o = lost[0]
        return NOT_COMPARED, f"lost in {run}: {o.verdict.reason}"
    was, now = before.verdict.name, after.verdict.name
    if was == now:
        return SAME, f"{now} in both"
    moved = after.verdict.reason
    if was == STABLE and after.verdict.failed or now == CRASH:
        return REGRESSED, moved
    if now == UNSUPPORTED:
        return NOW_UNSUPPORTED, moved
    if was == UNSUPPORTED:
        return NOW_SUPPORTED, moved
    if now == STABLE:
        return FIXED, moved
    return CHANGED, moved


def compare_cell(
    probe_id: str, before: ProbeOutcome | None, after: ProbeOutcome | None, golden: bool, t: Thresholds = THRESHOLDS
) -> CellChange:
    """The change of one cell; golden=True (a `check` run) also holds step 0 to the baseline's values."""
    change, why = _verdict_change(before, after)
    out = CellChange(probe_id, before, after, change, why)
    if before is None or after is None:
        return out
    if before.record.steps and after.record.steps:
        out.curve = compare_curves(before.record.steps, after.record.steps, golden_tolerance(after.record, t)[0])
    out.threads = thread_change(before.record, after.record)
    if golden:
        out.golden = golden_values(before.record, after.record, t)
        moved = [g for g in out.golden if not g.passed]
        if moved and out.change in (SAME, FIXED, CHANGED):
            out.change = REGRESSED
            out.why = "; ".join(
                f"{g.name} moved {g.change:.3g} (relative), beyond the ±{g.tolerance:.3g} of {after.record.cell.dtype}"
                for g in moved
            )
    if before.verdict.name == STABLE and after.verdict.name == STABLE:
        noise = [n for n in (throughput_noise(before.record, t), throughput_noise(after.record, t)) if n is not None]
        out.fidelity = Measured(before.fidelity, after.fidelity, t.fidelity_regression, absolute=True)
        out.tokens_per_s = Measured(
            before.tokens_per_s, after.tokens_per_s, max(noise) if noise else t.throughput_noise
        )
        out.peak_memory = Measured(before.peak_memory_bytes, after.peak_memory_bytes, t.memory_noise)
        worse = out.fidelity.change is not None and out.fidelity.change > t.fidelity_regression
        if worse and out.change == SAME:
            out.change = REGRESSED
            out.why = (
                f"fidelity to fp32 {100 * before.fidelity:.3f}% -> {100 * after.fidelity:.3f}%, "
                f"worse by more than {100 * t.fidelity_regression:g} points"
            )
    return out


# ---- the run -------------------------------------------------------------------------------------------------


@dataclass
class RunDiff:
    """A run against its baseline. `cells` in CHANGE_ORDER, regressions first."""

    baseline: RunAnalysis
    current: RunAnalysis
    environment: list[Difference]
    settings: list[Difference]
    unrecorded: list[str]  # environment facts only one of the two runs recorded
    cells: list[CellChange]

    @property
    def regressions(self) -> list[CellChange]:
        return [c for c in self.cells if c.regressed]

    @property
    def exit_code(self) -> int:
        """1 when a cell regressed, else 0."""
        return 1 if self.regressions else 0

    @property
    def recommendation(self) -> tuple[str | None, str | None]:
        """(the baseline's recommended probe, this run's); a check recommends nothing, so (None, None)."""
        if "check" in (self.baseline.meta.kind, self.current.meta.kind):
            return None, None
        return tuple(a.recommended.probe_id if a.recommended else None for a in (self.baseline, self.current))

    def recommendation_tie(self, t: Thresholds = THRESHOLDS) -> bool:
        """Whether a changed recommendation is a tie broken by timing: the old recommended cell is still
        stable, in the new one's fidelity bucket, and within tokens/s noise of it in this run."""
        before, after = self.recommendation
        now = {o.probe_id: o for o in self.current.ranking}
        if before == after or before not in now or after not in now:
            return False
        old, new = now[before], now[after]
        if order_bucket(old.fidelity, old.mismatch, t) != order_bucket(new.fidelity, new.mismatch, t):
            return False
        noise = [n for n in (throughput_noise(old.record), throughput_noise(new.record)) if n is not None]
        band = max(noise) if noise else t.throughput_noise
        return bool(old.tokens_per_s and new.tokens_per_s) and abs(new.tokens_per_s / old.tokens_per_s - 1) <= band

    @property
    def moved(self) -> list[CellChange]:
        """Cells stable in both runs whose fidelity, tokens/s or peak memory moved beyond its noise band."""
        return [c for c in self.cells if any(m is not None and m.moved for m in c.measured)]

    @property
    def unchanged(self) -> bool:
        """Same environment and settings, same verdicts, and every common loss curve bit-identical: the
        numerics did not change. Speed and memory may still have moved beyond their noise (`moved`): a
        busy host moves tokens/s between two identical runs."""
        return (
            not self.environment
            and not self.settings
            and all(c.change == SAME for c in self.cells)
            and all(c.curve is None or c.curve.status == BIT_IDENTICAL for c in self.cells)
        )


def compare_runs(baseline: RunAnalysis, current: RunAnalysis, t: Thresholds = THRESHOLDS) -> RunDiff:
    """Everything that differs between a baseline run and this one. Probes meet by probe id (the cell,
    and the overrides of a bisect probe), which runs written before the optimizer axis share."""
    before = {o.probe_id: o for o in baseline.outcomes}
    after = {o.probe_id: o for o in current.outcomes}
    golden = current.meta.kind == "check"  # a check probes one cell of what may be a whole grid
    ids = list(after) + ([] if golden else [p for p in before if p not in after])
    cells = [compare_cell(p, before.get(p), after.get(p), golden, t) for p in ids]
    cells.sort(key=lambda c: CHANGE_ORDER.index(c.change))
    env_a = environment_facts(baseline.meta.env or DeviceFacts.from_dict({}))
    env_b = environment_facts(current.meta.env or DeviceFacts.from_dict({}))
    return RunDiff(
        baseline,
        current,
        _differences(env_a, env_b),
        _differences(settings(baseline.meta), settings(current.meta)),
        _unrecorded(env_a, env_b),
        cells,
    )
