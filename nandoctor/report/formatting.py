"""How every renderer writes a run's numbers, labels and rows (the ranking, the failures, the environment),
so the terminal, Markdown, HTML and JSON agree."""

from __future__ import annotations

import math

from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..analysis.speed import grid_throughput
from ..analysis.twin import twin_caveat
from ..analysis.verdicts import HARNESS_FAILURES, NO_TARGET, NONFINITE, STABLE, roundtrip_result
from ..cells import AXES, Cell
from ..device import DeviceFacts
from ..record import ModelPlan
from . import timing
from .bisection import config_text
from .charts import as_float

AXIS_NOUNS = {
    "dtype": "precision",
    "attn": "attention",
    "compile": "compile mode",
    "optimizer": "optimizer",
    "parallel": "parallel setup",
    "quant": "base quantization",
    "hardware": "kind of hardware",
}
CELL_AXES = (*AXES, "hardware")  # what tells cells apart: the grid axes and the hardware they ran on


def fmt_bytes(n: int | None) -> str:
    n = as_float(n)
    if not n:
        return "-"
    if not math.isfinite(n):
        return repr(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return "-"


def fmt_rate(x: float | None) -> str:
    x = as_float(x)
    return f"{x:,.0f}" if x and math.isfinite(x) else repr(x) if x else "-"


def shown_rate(o: ProbeOutcome) -> float | None:
    """The grid probe's tokens/s, where worth printing: a probe that stopped at a non-finite step or did not
    finish timed too few steps (and the wrong arithmetic) for its rate to mean anything."""
    return None if o.verdict.name in (NONFINITE, *HARNESS_FAILURES) else timing.grid_rate(o)


def fmt_fidelity(x: float | None) -> str:
    x = as_float(x)
    return f"{100 * x:.3f}%" if x is not None else "-"


def fidelity_text(o: ProbeOutcome) -> str:
    """A probe's fidelity to fp32 in words: 'not judged' where no fp32 probe trained to compare it with."""
    if o.fidelity is None and o.reference is None and o.verdict.name == STABLE:
        return "not judged: no fp32 reference"
    return fmt_fidelity(o.fidelity)


def fmt_mismatch(x: float | None) -> str:
    """An RL probe's mean |dlogp| as written in its section (7.47e-04)."""
    x = as_float(x)
    return f"{x:.2e}" if x is not None else "-"


def closeness(o: ProbeOutcome) -> str:
    """What a ranked probe is ordered by, in words: its rollout mismatch for an RL probe ('rollout mean
    |dlogp| 7.47e-04'), else its fidelity to fp32 ('fidelity 0.012%')."""
    if o.mismatch is not None:
        return f"rollout mean |dlogp| {fmt_mismatch(o.mismatch)}"
    return f"fidelity {fidelity_text(o)}"


def closeness_column(a: RunAnalysis) -> str:
    """The ranking table's column of what orders it: the rollout mismatch in an RL run, else fidelity."""
    return "rollout mean |dlogp|" if any(o.mismatch is not None for o in a.ranking) else "fidelity vs fp32"


def reference_lines(a: RunAnalysis) -> list[str]:
    """What the reports say first about the fp32 reference: which probe stood in for a failed fp32/eager,
    or that drift was not judged and why (analysis RunAnalysis.references)."""
    return [r.sentence() for r in a.references]


def fmt_loss(x: float | None) -> str:
    x = as_float(x)
    if x is None:
        return "-"
    return repr(x) if not math.isfinite(x) else f"{x:.4f}"


def label(o: ProbeOutcome) -> str:
    overrides = o.record.overrides
    extra = "".join(f" {k}={v}" for k, v in overrides.items())
    return o.probe_id if not extra or extra.strip() in o.probe_id else o.probe_id + extra


def _values(cells: list[Cell], axis: str) -> list[str]:
    present = list(dict.fromkeys(getattr(c, axis) for c in cells))  # hardware names: in the run's order
    return [v for v in AXES[axis] if v in present] if axis in AXES else present


def cells_text(cells: list[Cell], universe: list[Cell]) -> str:
    """A set of cells in words, against the cells of the run they come from:
    'fp16-pure with every attention', 'sdpa:efficient with every precision but tf32',
    'fp32/eager/off'. An axis with one value in the whole run goes unsaid."""
    cells = list(dict.fromkeys(cells))
    if len(cells) == 1:
        return cells[0].id
    varying = [axis for axis in CELL_AXES if len(_values(cells, axis)) > 1]
    product = math.prod(len(_values(cells, axis)) for axis in varying)
    if product != len(cells):  # not a full cross product: describe it one value of the first varying axis at a time
        first = varying[0]
        return "; ".join(
            cells_text([c for c in cells if getattr(c, first) == v], universe) for v in _values(cells, first)
        )
    fixed = [axis for axis in CELL_AXES if axis not in varying]
    peers = [u for u in universe if all(getattr(u, axis) == getattr(cells[0], axis) for axis in fixed)]
    named = [getattr(cells[0], axis) for axis in fixed if len(_values(universe, axis)) > 1]
    spans = []
    for axis in varying:
        mine, every = _values(cells, axis), _values(peers, axis)
        missing = [v for v in every if v not in mine]
        noun = AXIS_NOUNS[axis]
        spans.append(
            f"every {noun}"
            if not missing
            else f"every {noun} but {', '.join(missing)}"
            if len(missing) < len(mine)
            else f"{noun} {', '.join(mine)}"
        )
    return f"{'/'.join(named)} with {' and '.join(spans)}" if named else " and ".join(spans)


def last_loss(o: ProbeOutcome) -> float | None:
    steps = o.record.steps
    return steps[-1].loss if steps else None


def recommended_ids(a: RunAnalysis) -> set[str]:
    """The probes of the recommended configuration: the bisection's recommendation in a bisect run
    (its ranking is only the probes it happened to need), else the top of the ranking."""
    if a.meta.kind == "bisect":
        b = a.bisection or {}
        step = b.get("recommended_step")
        return set(b["path"][step]["probe_ids"]) if step is not None else set()
    if a.hardware:  # one recommendation per kind of hardware
        return {o.probe_id for o in map(a.recommended_on, a.hardware) if o}
    return {a.recommended.probe_id} if a.recommended else set()


def ranking_note(a: RunAnalysis) -> str | None:
    """Beside the ranked table of a bisect run: its recommendation is the bisection's (the stable
    configuration nearest the target), not the table's first row, and where it ranks there."""
    if a.meta.kind != "bisect" or not a.ranking:
        return None
    ids = recommended_ids(a)
    rank = next((i + 1 for i, o in enumerate(a.ranking) if o.probe_id in ids), None)
    if rank == 1:
        return None
    config = ((a.bisection or {}).get("recommendation") or {}).get("config")
    named = config_text(config) if config else "none"
    where = f"it is rank {rank} here, marked ★" if rank else "it is not in this table"
    return (
        f"The bisection recommends {named}: the stable configuration nearest the target (the most target "
        "factors kept), not the fastest. This table ranks every stable configuration the bisection tried by "
        f"fidelity and speed; {where}."
    )


def ranking_rows(a: RunAnalysis) -> list[dict]:
    """One row per ranked configuration. Every row shows its grid probe's tokens/s (one kind of figure in
    one column); a run that re-timed its leaders adds their re-timed figures in a column of their own."""
    starred = recommended_ids(a) if a.meta.kind == "bisect" else set()
    retimed = any(o.retimed for o in a.ranking)
    return [
        {
            "rank": i + 1,
            "config": ("★ " if o.probe_id in starred else "") + label(o),
            closeness_column(a): fmt_mismatch(o.mismatch)
            if o.mismatch is not None
            else "not judged"
            if o.fidelity is None and o.reference is None
            else fmt_fidelity(o.fidelity),
            "grid tokens/s": timing.grid_text(o) + per_device(o),
            "grid IQR": timing.spread_text(grid_throughput(o.record)),
            **({"re-timed tokens/s": timing.retimed_text(o, a)} if retimed else {}),
            "peak memory": fmt_bytes(o.peak_memory_bytes),
            "final loss": fmt_loss(last_loss(o)),
            "flagged by": ", ".join(o.flags) or "-",
        }
        for i, o in enumerate(a.ranking)
    ]


def failure_rows(a: RunAnalysis) -> list[dict]:
    return [
        {
            "config": label(o),
            "verdict": o.verdict.name,
            "step": "-" if o.verdict.step is None else o.verdict.step,
            "reason": o.verdict.reason,
        }
        for o in a.outcomes
        if o.verdict.failed
    ]


def model_line(a: RunAnalysis) -> tuple[str, str]:
    plan = ModelPlan.from_dict(a.meta.model_plan)
    return plan.describe(), plan.why


def stand_in_line(a: RunAnalysis) -> str | None:
    """'the probes train 32 of the named model's 128 routed experts ...', or None when the probed
    model has the named one's experts and layers (ModelPlan.stand_in)."""
    return ModelPlan.from_dict(a.meta.model_plan).stand_in()


def twin_caveat_line(a: RunAnalysis) -> str | None:
    """What the run's half-precision verdicts on a random-init twin cannot show (analysis.twin), or None."""
    return twin_caveat(ModelPlan.from_dict(a.meta.model_plan), [o.record.cell for o in a.outcomes])


def device_text(env: DeviceFacts) -> str:
    return (
        ", ".join(f"{g.name} (cc {g.capability}, {fmt_bytes(g.memory_bytes)})" for g in env.gpus)
        or f"CPU, {env.cpu_count} cores, {fmt_bytes(env.ram_bytes)} RAM"
    )


def gathered_text(env: DeviceFacts) -> str:
    """Where an executor's device facts were gathered: the job, host and process that read them."""
    g = env.gathered or {}
    job = (
        f"job {g['job']}" + (f" (partition {g['partition']})" if g.get("partition") else "")
        if g.get("job")
        else "a task"
    )
    return f"{device_text(env)}; read by {job} on {g.get('host')}, pid {g.get('pid')}"


def environment_rows(a: RunAnalysis) -> list[dict]:
    """The run's environment; a run placed by an executor adds, per kind of hardware, the facts its
    cells were planned with and which job on which node read them."""
    env = a.meta.env or DeviceFacts.from_dict({})
    rows = [
        ("device", device_text(env)),
        ("python", env.python),
        ("torch", env.torch),
        ("transformers", env.transformers),
        ("peft", env.peft),
        ("CUDA", env.cuda or "-"),
        ("cuDNN", env.cudnn or "-"),
        ("platform", env.platform),
    ]
    rows += [
        (f"planned on {kind}" if kind else "planned on the cluster", gathered_text(facts))
        for kind, facts in (a.meta.env_by_hardware or {}).items()
    ]
    return [{"fact": k, "value": v} for k, v in rows]


def per_device(o: ProbeOutcome) -> str:
    """' per device (3,225 over 2)' for a parallel probe's grid tokens/s, '' for one process."""
    if o.devices == 1:
        return ""
    rate = timing.grid_rate(o)
    return f" per device ({fmt_rate(rate * o.devices if rate else None)} over {o.devices})"


def hardware_line(a: RunAnalysis, hardware: str) -> str:
    """The recommendation on one kind of hardware (a grid with a hardware axis ranks each kind apart)."""
    rec = a.recommended_on(hardware)
    if rec is None:
        return f"Recommended on {hardware}: none (no stable configuration there)"
    flagged = f"; flagged by {', '.join(rec.flags)}" if rec.flags else ""
    return (
        f"Recommended on {hardware}: {label(rec)} "
        f"({closeness(rec)}, {timing.grid_text(rec)} tokens/s{per_device(rec)}, "
        f"peak {fmt_bytes(rec.peak_memory_bytes)}{flagged})"
    )


def headline(a: RunAnalysis) -> list[str]:
    """The sentences a user reads first."""
    lines = []
    rec, fast = a.recommended, a.fastest
    if a.meta.kind == "bisect":
        from .bisection import headline_lines

        lines += headline_lines(a.bisection)
    elif a.hardware:
        for h in a.hardware:
            lines.append(hardware_line(a, h))
            fast_here = a.fastest_on(h)
            if fast_here is not a.recommended_on(h):
                lines.append(
                    f"Fastest stable on {h}: {label(fast_here)} ({timing.grid_text(fast_here)} tokens/s"
                    f"{per_device(fast_here)}, "
                    f"{closeness(fast_here)})"
                )
        lines += timing.speed_lines(a)
    elif rec:
        flagged = f"; flagged by {', '.join(rec.flags)}" if rec.flags else ""
        lines.append(
            f"Recommended: {label(rec)} ({closeness(rec)}, {timing.grid_text(rec)} tokens/s"
            f"{per_device(rec)}, peak {fmt_bytes(rec.peak_memory_bytes)}{flagged})"
        )
        if fast is not rec:
            lines.append(
                f"Fastest stable: {label(fast)} "
                f"({timing.grid_text(fast)} tokens/s{per_device(fast)}, {closeness(fast)})"
            )
        lines += timing.speed_lines(a)
    else:
        lines.append("No stable configuration was found.")
    if a.roundtrip is not None:  # grid --roundtrip: the recommended cell merged, saved and reloaded
        rt = a.roundtrip
        trained = rt.get("status") == "ok" and not rt.get("first_nonfinite")
        _, passed, detail = roundtrip_result(rt.get("roundtrip"), trained)
        lines.append(f"Round trip of {rt['probe_id']}: {'ok' if passed else 'FAIL'}, {detail}")
    untargeted = [o for o in a.outcomes if o.verdict.name == NO_TARGET]
    if untargeted and a.meta.kind != "bisect":
        lines.append(
            f"{len(untargeted)} of {len(a.outcomes)} probes met a batch of the data with no supervised token "
            f"(first: {untargeted[0].probe_id} at step {untargeted[0].verdict.step}): a fault of the data, which "
            "every configuration meets; fix the rows (`nandoctor doctor --data` names them) and run again."
        )
    first = len(a.hardware) if a.hardware and a.meta.kind != "bisect" else 1  # the recommendation line(s)
    why = timing.why_line(a)
    lines[first:first] = reference_lines(a) + ([why] if why else [])
    counts = {}
    for o in a.outcomes:
        counts[o.verdict.name] = counts.get(o.verdict.name, 0) + 1
    lines.append("Verdicts: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])))
    if not a.complete:
        lines.append(f"Interrupted run: {len(a.outcomes)} of {a.expected} planned probes have results.")
    return lines
