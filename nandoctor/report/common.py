"""Rows and numbers shared by every renderer, so the terminal, Markdown, HTML and JSON agree."""
from __future__ import annotations

import math

from ..analysis.run import ProbeOutcome, RunAnalysis
from ..analysis.verdicts import UNSUPPORTED
from ..record import ModelPlan


def fmt_bytes(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return "-"


def fmt_rate(x: float | None) -> str:
    return f"{x:,.0f}" if x else "-"


def fmt_fidelity(x: float | None) -> str:
    return f"{100 * x:.3f}%" if x is not None else "-"


def fmt_loss(x: float | None) -> str:
    if x is None:
        return "-"
    return repr(x) if not math.isfinite(x) else f"{x:.4f}"


def label(o: ProbeOutcome) -> str:
    overrides = o.record.overrides
    extra = "".join(f" {k}={v}" for k, v in overrides.items())
    return o.probe_id if not extra or extra.strip() in o.probe_id else o.probe_id + extra


def last_loss(o: ProbeOutcome) -> float | None:
    steps = o.record.steps
    return steps[-1].loss if steps else None


def ranking_rows(a: RunAnalysis) -> list[dict]:
    return [{"rank": i + 1, "config": label(o), "fidelity vs fp32": fmt_fidelity(o.fidelity),
             "tokens/s": fmt_rate(o.tokens_per_s), "peak memory": fmt_bytes(o.peak_memory_bytes),
             "final loss": fmt_loss(last_loss(o))} for i, o in enumerate(a.ranking)]


def failure_rows(a: RunAnalysis) -> list[dict]:
    return [{"config": label(o), "verdict": o.verdict.name, "step": "-" if o.verdict.step is None else o.verdict.step,
             "reason": o.verdict.reason} for o in a.outcomes if o.verdict.failed]


def unsupported_rows(a: RunAnalysis) -> list[dict]:
    return [{"config": label(o), "reason": o.verdict.reason} for o in a.outcomes if o.verdict.name == UNSUPPORTED]


def model_line(a: RunAnalysis) -> tuple[str, str]:
    plan = ModelPlan.from_dict(a.meta["model_plan"])
    return plan.describe(), plan.why


def environment_rows(a: RunAnalysis) -> list[dict]:
    env = a.meta.get("env", {})
    gpus = env.get("gpus") or []
    device = ", ".join(f"{g['name']} (cc {g['capability']}, {fmt_bytes(g['memory_bytes'])})" for g in gpus) or \
        f"CPU, {env.get('cpu_count')} cores, {fmt_bytes(env.get('ram_bytes'))} RAM"
    rows = [("device", device), ("python", env.get("python")), ("torch", env.get("torch")),
            ("transformers", env.get("transformers")), ("peft", env.get("peft")), ("CUDA", env.get("cuda") or "-"),
            ("cuDNN", env.get("cudnn") or "-"), ("platform", env.get("platform"))]
    return [{"fact": k, "value": v} for k, v in rows]


def headline(a: RunAnalysis) -> list[str]:
    """The sentences a user reads first."""
    lines = []
    rec, fast = a.recommended, a.fastest
    if a.meta["kind"] == "bisect":
        from .bisection import headline_lines
        lines += headline_lines(a.bisection)
    elif rec:
        flagged = f"; flagged by {', '.join(rec.flags)}" if rec.flags else ""
        lines.append(f"Recommended: {label(rec)} (fidelity {fmt_fidelity(rec.fidelity)}, {fmt_rate(rec.tokens_per_s)} tokens/s, "
                     f"peak {fmt_bytes(rec.peak_memory_bytes)}{flagged})")
        if fast is not rec:
            lines.append(f"Fastest stable: {label(fast)} ({fmt_rate(fast.tokens_per_s)} tokens/s, fidelity {fmt_fidelity(fast.fidelity)})")
    else:
        lines.append("No stable configuration was found.")
    counts = {}
    for o in a.outcomes:
        counts[o.verdict.name] = counts.get(o.verdict.name, 0) + 1
    lines.append("Verdicts: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])))
    if not a.complete:
        lines.append(f"Interrupted run: {len(a.outcomes)} of {a.expected} planned probes have results.")
    return lines
