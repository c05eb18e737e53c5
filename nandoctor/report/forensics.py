"""The forensics of each probe as rows and sentences, shared by report.md, report.html, summary.json
and `nandoctor explain`: where a probe broke, how much headroom the tightest modules have, how much of
the gradient underflows and how much of each update rounds away."""

from __future__ import annotations

import math

from ..analysis.forensics import FINFO_MAX, headroom, origin, ranks_alike, replayed, update_loss
from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..analysis.verdicts import UNSUPPORTED, fidelity_curve
from ..cells import SHORT_DTYPES
from .charts import as_float, line_chart
from .formatting import label
from .savings import explain_lines

TIGHTEST = 5  # modules listed per probe
KEPT_SHOWN = 4  # tensors named per probe whose dtype is not the weights'
# what a first offender's input that is an identity matrix is (child/instruments.is_identity)
IDENTITY_CALL = (
    "peft's DoRA calls lora_A on torch.eye to read lora_B @ lora_A for its weight norm, so this output is "
    "lora_A's weight itself, not an activation of the batch"
)
# bf16 keeps fp32's 8-bit exponent, so its range headroom is ~1e37x: only fp16 gets the per-module table
NARROW_RANGE = ("float16",)


def fmt_ratio(x: float | None) -> str:
    x = as_float(x)
    if x is None:
        return "-"
    if x == 0.0:
        return "overflowed"
    if not math.isfinite(x) or x >= 1e6:
        return f"{x:.1e}x" if math.isfinite(x) else "unbounded"
    return f"{x:.3g}x"


def fmt_value(x: float | None) -> str:
    x = as_float(x)
    return "-" if x is None else (repr(x) if not math.isfinite(x) else f"{x:.4g}")


def fmt_fraction(x: float | None) -> str:
    x = as_float(x)
    return "-" if x is None else f"{100 * x:.3g}%"


def forensics_of(o: ProbeOutcome) -> dict | None:
    f = o.record.forensics
    return f if replayed(f) else None


def _stats(d: dict) -> str:
    return f"min {fmt_value(d['min'])}, max {fmt_value(d['max'])}, abs-max {fmt_value(d['absmax'])}"


def on_rank(e: dict, f: dict | None) -> str:
    """' on rank 1 of 2 (rank 0 alike)' for an event of a parallel probe's replay; '' for one process."""
    if "rank" not in e:
        return ""
    size = (f or {}).get("world_size")
    alike = ranks_alike(f, e)
    also = f" ({'rank' if len(alike) == 1 else 'ranks'} {', '.join(map(str, alike))} alike)" if alike else ""
    return f" on rank {e['rank']}" + (f" of {size}" if size else "") + also


def event_line(e: dict, f: dict | None = None) -> str:
    """One sentence for a first-offender event; `f`, the forensics it comes from, names the ranks that
    saw the same in a parallel probe."""
    where = on_rank(e, f)
    if e["phase"] == "optimizer":
        text = (
            f"step {e['step']}{where}, optimizer step: the update turned {e['parameter']} non-finite "
            f"({e['nonfinite_elements']} elements; before it: {_stats(e['before'])})"
        )
        if e.get("eps") is not None and e.get("eps_in_dtype") == 0.0:
            text += f"; AdamW eps={e['eps']:g} is 0.0 in {e.get('state_dtype', 'the weight dtype')}"
        if e.get("exp_avg_sq_zero_fraction") is not None:
            text += (
                f", and exp_avg_sq is 0 for {fmt_fraction(e['exp_avg_sq_zero_fraction'])} of its elements: "
                "update = m / 0"
            )
        return text
    what = f"reduction of {e['parameter']}" if e["phase"] == "reduction" else e.get("parameter") or e["module"]
    text = f"step {e['step']}{where}, {what}: {e['tensor']} holds NaN/inf ({_stats(e['stats'])})"
    if e.get("before"):
        b = e["before"]
        where = "" if b["module"] == e["module"] else f" ({b['module']})"
        text += f"; {b['what']}{where}: {_stats(b)}"
        if b.get("identity"):
            text += f" (an identity matrix: {IDENTITY_CALL})"
    return text


def first_offenders(f: dict) -> dict[str, dict]:
    """The origin of the failure and the first forward and backward offenders from its step on; empty
    when nothing unrecoverable happened (GradScaler calibration overflows are not offenders)."""
    root = origin(f)
    if not root:
        return {}
    out = {f"origin ({root['phase']})": root}
    later = sorted(
        (e for e in f.get("events", []) if e["step"] >= root["step"]), key=lambda e: (e["step"], e.get("rank", 0))
    )
    for phase in ("forward", "backward", "reduction"):
        e = next((e for e in later if e["phase"] == phase), None)
        if e:
            out[f"first {phase} offender"] = e
    return out


def headroom_rows(o: ProbeOutcome, n: int = TIGHTEST) -> list[dict]:
    f = forensics_of(o)
    if not f:
        return []
    dtype = SHORT_DTYPES.get(f["compute_dtype"], f["compute_dtype"])
    return [
        {
            "module": r["module"],
            "max |activation|": fmt_value(r["activation_absmax"]),
            f"{dtype} activation headroom": fmt_ratio(r["activation_headroom"]),
            "max |gradient|": fmt_value(r["gradient_absmax"]),
            f"{dtype} gradient headroom": fmt_ratio(r["gradient_headroom"]),
        }
        for r in tightest(headroom(f), n)
    ]


def tightest(rows: list[dict], n: int) -> list[dict]:
    """The n tightest by activation and the n tightest by gradient, tightest (either kind) first."""
    big = math.inf
    by_grad = sorted(rows, key=lambda r: big if r["gradient_headroom"] is None else r["gradient_headroom"])
    chosen = {r["module"]: r for r in rows[:n] + by_grad[:n]}.values()
    return sorted(
        chosen, key=lambda r: min(big if r[k] is None else r[k] for k in ("activation_headroom", "gradient_headroom"))
    )


def tightest_line(o: ProbeOutcome) -> str | None:
    """'fp16 headroom 1.7x at model.layers.1.mlp.down_proj (activation)'."""
    f = forensics_of(o)
    rows = headroom(f)
    if not rows:
        return None
    dtype = SHORT_DTYPES.get(f["compute_dtype"], f["compute_dtype"])
    act = rows[0]
    grads = [r for r in rows if r["gradient_headroom"] is not None]
    text = f"{dtype} headroom {fmt_ratio(act['activation_headroom'])} at {act['module']} (activation)"
    if grads:
        g = min(grads, key=lambda r: r["gradient_headroom"])
        scales = [st["scale"] for st in f.get("steps", []) if st.get("scale")]
        scaled = f", loss-scaled by up to {max(scales):g}" if scales else ""
        text += f", {fmt_ratio(g['gradient_headroom'])} at {g['module']} (gradient{scaled})"
    return text


def summary_row(o: ProbeOutcome) -> dict:
    f = forensics_of(o)
    uf = (f or {}).get("underflow")
    ul = update_loss(o.record.forensics)  # a probe under the user's trainer measures it without a replay
    root = origin(f)
    return {
        "config": label(o),
        "compute": f["compute_dtype"] if f else "-",
        "headroom": headroom_text(o),
        "grad underflow": f"{fmt_fraction(uf['fraction'])} (scale {uf['loss_scale']:g})" if uf else "-",
        "update loss": f"{fmt_fraction(ul['mean'])} ({ul['weight_dtype']})" if ul else "-",
        "origin": f"{root['phase']} step {root['step']}{on_rank(root, f)}: {root.get('parameter') or root['module']}"
        if root
        else "-",
        "replay": _replay_note(o),
    }


def headroom_text(o: ProbeOutcome) -> str:
    """The margin worth reading for one probe. fp16: the tightest activation and gradient. bf16 and
    fp32 share fp32's exponent, so a ratio to their own largest value (~1e37x) says nothing: say
    whether the activations would fit fp16 instead. A probe that broke has no margin left."""
    f = forensics_of(o)
    rows = headroom(f)
    if not rows or origin(f):
        return "-"
    if headroom_applies(f):
        return tightest_line(o)
    seen = [r for r in rows if r["activation_absmax"] is not None and math.isfinite(r["activation_absmax"])]
    if not seen:
        return "-"
    top = max(seen, key=lambda r: r["activation_absmax"])
    peak = fmt_value(top["activation_absmax"])
    if top["activation_absmax"] < FINFO_MAX["float16"]:
        return f"no activation reached fp16's range (largest |activation| {peak}, at {top['module']})"
    return f"|activation| {peak} at {top['module']}: beyond fp16's range (65504)"


def _replay_note(o: ProbeOutcome) -> str:
    f = o.record.forensics
    if not f:
        return "not run"
    if "error" in f:
        return f"failed: {f['error']}"
    if "not_run" in f and f.get("measured_on"):  # a stable probe under the user's trainer
        return f"no replay ({f['not_run']}); its update loss measured on {f['measured_on']} by read-only hooks"
    if "not_run" in f:
        return f"not run: {f['not_run']}"
    if f.get("measured_on"):  # a stable eager probe: read-only hooks on its timed step 0, no replay
        return f"none; measured on {f['measured_on']} by read-only hooks"
    cost = f.get("cost") or {}
    over = cost.get("hooked_step_overhead")
    # The median hooked / timed step time; below 1 it is timing noise (hooks never make a step faster),
    # so only a real slowdown is worth a number.
    slower = f", hooked steps {over:.2f}x slower" if over and over >= 1 else ""
    text = f"{f['replayed_steps']} steps, {cost.get('seconds', 0):.1f} s{slower}"
    budget = f.get("budget")
    if budget:
        text += (
            f", stopped after step {budget['stopped_at']}: its budget ({budget['share']:g}x the timed steps' time, "
            f"at least {budget.get('min_s', 0):g} s: {budget['seconds']:.3g} s; --set forensics_share=... or "
            "forensics_min_s=...) ran out"
        )
    return text + ("" if f.get("reproduced") else ", DID NOT reproduce the timed losses")


def probes_with_forensics(a: RunAnalysis) -> list[ProbeOutcome]:
    return [o for o in a.outcomes if o.verdict.name != UNSUPPORTED and o.record.forensics]


def headroom_sections(a: RunAnalysis) -> list[dict]:
    """The tightest modules of every fp16 probe that did not break."""
    return [
        {"label": label(o), "line": tightest_line(o), "rows": headroom_rows(o)}
        for o in probes_with_forensics(a)
        if headroom_applies(forensics_of(o)) and headroom_rows(o)
    ]


def headroom_applies(f: dict | None) -> bool:
    """Headroom is a margin: it means something for fp16 probes that did not break
    (after a NaN, every later module reads 'overflowed')."""
    return bool(f) and f["compute_dtype"] in NARROW_RANGE and origin(f) is None


def forensics_markdown(a: RunAnalysis, table) -> list[str]:
    """The '## Numerics forensics' section of report.md; `table` renders a list of row dicts."""
    probes = probes_with_forensics(a)
    if not probes:
        return []
    parts = [
        "## Numerics forensics",
        "",
        "A probe that went non-finite (or ran compiled, or in fp8) replayed its first steps with hooks after "
        "the timed run (same seed); a stable eager probe was measured by hooks that only read, on its timed "
        "step 0 (a warm-up step: the throughput above leaves it out). "
        "Headroom = the compute dtype's largest finite value / the largest |value| seen; "
        "grad underflow = non-zero fp32 gradient elements that round to 0 in the compute dtype "
        "at the loss scale; update loss = elements whose AdamW update rounds away in the weights' dtype.",
        "",
        table([summary_row(o) for o in probes]),
        "",
    ]
    blocks: dict[tuple, tuple[list[str], list[str]]] = {}  # where and how it broke -> (its lines, the probes)
    for o in probes:
        f = forensics_of(o)
        offenders = first_offenders(f) if f else {}
        if offenders:
            key = tuple(
                (kind, e.get("step"), e.get("phase"), e.get("parameter") or e.get("module"), e.get("tensor"))
                for kind, e in offenders.items()
            )
            lines = [f"- {kind}: {event_line(e, f)}" for kind, e in offenders.items()]
            blocks.setdefault(key, (lines, []))[1].append(label(o))
    for lines, labels in blocks.values():  # one block per place of breaking, not one per probe that broke there
        who = labels[0] if len(labels) == 1 else f"{', '.join(labels)} ({len(labels)} probes; figures of {labels[0]})"
        parts += [f"### {who}: where it broke", "", *lines, ""]
    for h in headroom_sections(a):
        parts += [f"### {h['label']}: tightest modules", "", f"{h['line']}.", "", table(h["rows"]), ""]
    return parts


def fidelity_chart(o: ProbeOutcome) -> str:
    """Per-step relative error of loss and grad-norm against the fp32 reference, as an SVG."""
    curve = fidelity_curve(o.record.steps, o.reference_steps)
    if sum(c["loss"] is not None for c in curve) < 2:  # one point is not a curve
        return ""
    series = [
        {"label": "loss rel. error", "points": [(c["step"], c["loss"]) for c in curve]},
        {"label": "grad-norm rel. error", "points": [(c["step"], c["grad_norm"]) for c in curve], "dashed": True},
    ]
    return line_chart(series, "fidelity vs fp32 reference (relative error)")


def explain_text(o: ProbeOutcome) -> str:
    """What `nandoctor explain` prints for one probe."""
    lines = [f"{label(o)}: {o.verdict.name} — {o.verdict.reason}"]
    kept = o.record.kept_dtypes
    if kept:
        named = ", ".join(f"{n} {d}" for n, d in list(kept.items())[:KEPT_SHOWN])
        more = f" and {len(kept) - KEPT_SHOWN} more" if len(kept) > KEPT_SHOWN else ""
        lines.append(f"  not in the weight dtype: {named}{more}")
    f = o.record.forensics
    if not replayed(f):
        lines.append("  forensics: " + _replay_note(o))
        measured = [s for s in (f or {}).get("steps", []) if s.get("update_loss") is not None]
        if measured:  # a stable probe under the user's trainer: step 0's update loss alone
            lines.append(
                f"  update loss ({f['weight_dtype']} weights): {fmt_fraction(measured[0]['update_loss'])} "
                f"at step {measured[0]['step']}"
            )
        return "\n".join(lines)
    limit = FINFO_MAX[f["compute_dtype"]]
    lines.append(
        f"  compute dtype {f['compute_dtype']} (largest finite {limit:.6g}), weights {f['weight_dtype']}; "
        f"replay: {_replay_note(o)}"
    )
    for note in ("note", "underflow_note"):
        if f.get(note):
            lines.append(f"  note: {f[note]}")
    for kind, e in first_offenders(f).items():
        lines.append(f"  {kind}: {event_line(e, f)}")
    if headroom_applies(f):
        lines.append(f"  {tightest_line(o)}")
        for r in tightest(headroom(f), TIGHTEST):
            lines.append(
                f"    {r['module']:<48} "
                f"activation {fmt_value(r['activation_absmax']):>10} ({fmt_ratio(r['activation_headroom'])})"
                f"  gradient {fmt_value(r['gradient_absmax']):>10} ({fmt_ratio(r['gradient_headroom'])})"
            )
    uf, ul = f.get("underflow"), update_loss(f)
    if uf:
        worst = ", ".join(f"{w['parameter']} {fmt_fraction(w['fraction'])}" for w in uf["worst"] if w["fraction"])
        lines.append(
            f"  gradient underflow in {uf['dtype']} at loss scale {uf['loss_scale']:g}: {fmt_fraction(uf['fraction'])} "
            f"of {uf['nonzero_elements']} non-zero elements" + (f" (worst: {worst})" if worst else "")
        )
    if ul:
        lines.append(
            f"  update loss ({ul['weight_dtype']} weights): mean {fmt_fraction(ul['mean'])}, "
            f"max {fmt_fraction(ul['max'])} over {ul['steps']} steps"
        )
    lines += explain_lines(o)
    curve = fidelity_curve(o.record.steps, o.reference_steps)
    if curve:
        lines.append("  fidelity per step (loss rel. error): " + " ".join(fmt_fraction(c["loss"]) for c in curve))
    return "\n".join(lines)


def forensics_summary(o: ProbeOutcome) -> dict | None:
    """The forensics as data for summary.json; a probe with no replay has its update loss alone, where it
    measured it (a stable probe under the user's trainer)."""
    f = forensics_of(o)
    if not f:
        ul = update_loss(o.record.forensics)
        if ul is None:
            return None
        return {
            "compute_dtype": None,
            "origin": None,
            "first_offenders": {},
            "tightest": [],
            "underflow": None,
            "update_loss": ul,
            "reproduced": None,
            "measured_on": o.record.forensics.get("measured_on"),
            "cost": None,
        }
    rows = headroom(f)
    return {
        "compute_dtype": f["compute_dtype"],
        "origin": origin(f),
        "first_offenders": first_offenders(f),
        "tightest": rows[:TIGHTEST],
        "underflow": f.get("underflow"),
        "update_loss": update_loss(f),
        "reproduced": f.get("reproduced"),
        "measured_on": f.get("measured_on", "replay"),
        "cost": f.get("cost"),
    }
