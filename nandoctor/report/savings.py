"""The "Low-precision savings" section, shared by report.md, report.html, summary.json and `nandoctor
explain`: each low-precision probe against its baseline (analysis/savings.py) on optimizer-state
bytes, peak memory, steady-state tokens/s and fidelity; the guide's claims beside the measured
figures, with which held here; and, per fp8 probe, the linears kept in high precision and how the
fp8 casts fared in the forensics replay."""

from __future__ import annotations

import json

from ..analysis.forensics import replayed
from ..analysis.outcomes import ProbeOutcome, RunAnalysis, grid_speed
from ..analysis.savings import HELD, NOT_HELD, NOT_MEASURED, SavingsRow, is_low_precision, savings
from ..analysis.verdicts import UNSUPPORTED
from .formatting import fmt_bytes, fmt_fidelity, fmt_rate, label

CAST_ROLES = ("input", "weight", "grad_output")
SHOWN_CASTS = 8  # fp8 linears listed per probe, worst saturation / flush first


def grid_rate(o: ProbeOutcome) -> float | None:
    """The grid probe's own tokens/s per device: every figure the section compares is of one kind (a
    re-timed figure comes from shorter probes, analysis/speed.py)."""
    return grid_speed(o)[0] or None


def savings_row(o: ProbeOutcome) -> SavingsRow:
    r = o.record
    cell = r.cell
    variant = json.dumps([cell.attn, cell.compile, r.overrides, r.seed], sort_keys=True, default=str)
    return SavingsRow(
        o.probe_id,
        cell.dtype,
        cell.optimizer,
        r.optimizer_state_bytes,
        r.peak_memory_bytes,
        grid_rate(o),
        o.fidelity,
        o.verdict.name,
        variant,
        r.device or "cpu",
        cell.quant,
        (r.quant or {}).get("base_bytes"),
    )


def _ran(a: RunAnalysis) -> list[ProbeOutcome]:
    return [o for o in a.outcomes if o.verdict.name != UNSUPPORTED]


def section(a: RunAnalysis) -> dict | None:
    """Everything the section shows, or None when the run probed no low-precision cell."""
    outcomes = _ran(a)
    rows = [savings_row(o) for o in outcomes]
    if not any(is_low_precision(r) for r in rows):
        return None
    by_id = {o.probe_id: o for o in outcomes}
    compared, checks = savings(rows)
    quantized = any(by_id[s.cell_id].record.cell.quant != "none" for s in compared)
    table = [_saving_row(s, by_id, quantized) for s in compared]
    claims = [
        {
            "config": c.cell_id,
            "claim": f"\u201c{c.claim.quote}\u201d",
            "measured": _figure(c.claim.figure, c.figure),
            "verdict": c.verdict,
            "why": c.why,
        }
        for c in checks
    ]
    return {
        "intro": intro(a),
        "table": table,
        "claims": claims,
        "plain": plain_words(checks),
        "notes": notes(outcomes),
        "fp8": [fp8_section(o) for o in outcomes if o.record.fp8_excluded is not None or _fp8_forensics(o)],
    }


def intro(a: RunAnalysis) -> list[str]:
    on_cpu = any((o.record.device or "cpu") != "cuda" for o in _ran(a))
    lines = [
        "Each low-precision probe against the probe that differs from it only in that choice: bf16-amp for an "
        "fp8 dtype, adamw for an optimizer (same attention, compile, recipe and seed). Optimizer state is "
        "real storage after the first step (quantized state opened to the tensors it is made of), not "
        "numel x element size; tokens/s is the median over the steps after the first."
    ]
    if any(o.record.cell.quant != "none" for o in _ran(a)):
        lines.append(
            "A quantized base (quant) is compared with the same adapter, dtype and optimizer over the 16-bit "
            "base: its base weights are the frozen weights as stored (4-bit or 8-bit) plus their quantization "
            "constants (block scales, code book), the layers left unquantized in their own dtype."
        )
    if on_cpu:
        lines.append(
            "Measured on a CPU: tokens/s compares CPU kernels (no fp8 or tensor-core matmuls; bf16 runs "
            "several times slower than fp32 here) and says nothing about a GPU; peak memory is the process's "
            "peak RSS, interpreter and libraries included. Byte counts of optimizer state carry over to a GPU."
        )
    return lines


def _saving_row(s, by_id: dict, quantized: bool = False) -> dict:
    o, base = by_id[s.cell_id], by_id.get(s.baseline_id)
    base_bytes = {}
    if quantized:  # a run with a quantized base: its bytes as stored, against the 16-bit base's
        base_bytes = {
            "base weights": fmt_bytes((o.record.quant or {}).get("base_bytes")),
            "base vs baseline": _pct(s.base_saving, "smaller"),
        }
    return {
        "config": label(o),
        "baseline": s.baseline_id or "none in this run",
        **base_bytes,
        "optimizer state": fmt_bytes(o.record.optimizer_state_bytes),
        "vs baseline": _pct(s.state_saving, "smaller"),
        "peak memory": fmt_bytes(o.peak_memory_bytes),
        "peak vs baseline": _pct(s.peak_saving, "smaller"),
        "tokens/s": fmt_rate(grid_rate(o)),
        "speed vs baseline": f"{s.speedup:.2f}x" if s.speedup else "-",
        "fidelity vs fp32": fmt_fidelity(o.fidelity),
        "baseline fidelity": fmt_fidelity(base.fidelity) if base else "-",
        "verdict": o.verdict.name,
    }


def _pct(saving: float | None, word: str) -> str:
    if saving is None:
        return "-"
    return f"{100 * saving:.1f}% {word}" if saving >= 0 else f"{-100 * saving:.1f}% larger"


def _figure(figure: str, value: float | None) -> str:
    if value is None:
        return "-"
    if figure == "speedup":
        return f"{value:.2f}x the baseline's tokens/s"
    if figure == "extra_loss_error":
        return f"{100 * value:+.3f}% loss error vs the baseline's"
    what = "optimizer state" if figure == "state_saving" else "peak memory"
    return f"{100 * value:.1f}% less {what}" if value >= 0 else f"{-100 * value:.1f}% more {what}"


def plain_words(checks) -> list[str]:
    """One sentence per claim: on which probes it held, did not hold, or could not be measured here."""
    lines = []
    for claim in dict.fromkeys(c.claim for c in checks):
        mine = [c for c in checks if c.claim == claim]
        parts = []
        for verdict, words in ((HELD, "held"), (NOT_HELD, "did not hold"), (NOT_MEASURED, "was not measured")):
            cells = [c for c in mine if c.verdict == verdict]
            if cells:
                detail = "; ".join(
                    f"{c.cell_id}: {c.why if verdict == NOT_MEASURED else _figure(c.claim.figure, c.figure)}"
                    for c in cells
                )
                parts.append(f"{words} for {detail}")
        lines.append(f"\u201c{claim.quote}\u201d ({claim.source}): " + "; it ".join(parts) + ".")
    return lines


def notes(outcomes: list[ProbeOutcome]) -> list[str]:
    return [f"{label(o)}: {o.record.optimizer_eager}." for o in outcomes if o.record.optimizer_eager]


def _fp8_forensics(o: ProbeOutcome) -> dict | None:
    f = o.record.forensics
    return f.get("fp8") if replayed(f) else None


def cast_rows(o: ProbeOutcome, n: int = SHOWN_CASTS) -> list[dict]:
    """Per fp8 linear and tensor role: amax, scale range, saturated and flushed shares, worst first."""
    f = _fp8_forensics(o)
    rows = []
    for module, roles in (f or {}).get("casts", {}).items():
        for role in CAST_ROLES:
            s = roles.get(role)
            if s:
                rows.append(
                    {
                        "linear": module,
                        "tensor": role,
                        "amax": f"{s['amax']:.4g}",
                        "scale": f"{s['scale_min']:.4g}"
                        if s["scale_min"] == s["scale_max"]
                        else f"{s['scale_min']:.3g}-{s['scale_max']:.3g}",
                        "saturated": f"{100 * s['saturated']:.3g}%",
                        "flushed to zero": f"{100 * s['flushed']:.3g}%",
                        "_worst": max(s["saturated"], s["flushed"]),
                    }
                )
    rows.sort(key=lambda r: -r["_worst"])
    return [{k: v for k, v in r.items() if k != "_worst"} for r in rows[:n]]


def fp8_section(o: ProbeOutcome) -> dict:
    excluded = o.record.fp8_excluded or {}
    return {"label": label(o), "excluded": [f"{m}: {why}" for m, why in excluded.items()], "casts": cast_rows(o)}


def explain_lines(o: ProbeOutcome) -> list[str]:
    """What `nandoctor explain` adds: the memory split, how the optimizer stepped, and for an fp8 probe
    its linears kept in high precision and its worst casts."""
    r = o.record
    lines = []
    if r.optimizer_state_bytes is not None:
        lines.append(
            f"  memory after the first step ({r.cell.optimizer}): weights {fmt_bytes(r.weights_bytes)}, "
            f"gradients {fmt_bytes(r.grads_bytes)}, optimizer state {fmt_bytes(r.optimizer_state_bytes)}"
        )
    if r.optimizer_eager:
        lines.append(f"  note: {r.optimizer_eager}")
    if r.fp8_excluded is None and not _fp8_forensics(o):
        return lines
    s = fp8_section(o)
    lines += [f"  kept in high precision: {m}" for m in s["excluded"]] or ["  every linear ran in fp8"]
    for r in s["casts"]:
        lines.append(
            f"    fp8 {r['linear']} {r['tensor']}: amax {r['amax']}, scale {r['scale']}, "
            f"saturated {r['saturated']}, flushed {r['flushed to zero']}"
        )
    return lines


def savings_markdown(a: RunAnalysis, table) -> list[str]:
    """The '## Low-precision savings' section of report.md; `table` renders a list of row dicts."""
    s = section(a)
    if s is None:
        return []
    parts = ["## Low-precision savings", "", *[line + "\n" for line in s["intro"]], table(s["table"]), ""]
    if s["claims"]:
        parts += ["### The guide's claims, measured here", "", table(s["claims"]), ""]
        parts += [f"- {line}" for line in s["plain"]] + [""]
    parts += [f"- {line}" for line in s["notes"]] + ([""] if s["notes"] else [])
    for f in s["fp8"]:
        parts += [f"### {f['label']}: fp8 linears", ""]
        parts += [f"- kept in high precision: {line}" for line in f["excluded"]] + [""]
        if f["casts"]:
            parts += [table(f["casts"]), ""]
    return parts


def savings_summary(a: RunAnalysis) -> dict | None:
    """The section as data for summary.json."""
    s = section(a)
    return None if s is None else {k: s[k] for k in ("table", "claims", "plain", "notes", "fp8")}
