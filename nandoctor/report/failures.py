"""Why the other configurations failed, one line per failure class: probes that failed the same way
(verdict, step and the origin the forensics found, or the crash signature) are one class, described
by what they share ('fp16-pure with every attention'), where it broke and the known fix. Cells the
device cannot run are grouped by their reason the same way."""

from __future__ import annotations

from ..analysis.forensics import origin
from ..analysis.outcomes import ProbeOutcome, RunAnalysis
from ..analysis.verdicts import UNSUPPORTED
from .forensics import event_line, fmt_fraction, forensics_of, on_rank
from .formatting import cells_text, label

SEVERITY_ORDER = ("error", "warning", "advice")
KNOWN_CRASH = " -- known issue "  # verdicts.known_crash appends the signature's diagnosis and fix after this


def _origin(o: ProbeOutcome) -> dict | None:
    return origin(forensics_of(o))


def where_it_broke(e: dict, f: dict | None = None) -> str:
    """A short sentence for the origin of a failure (event_line has the full statistics); `f`, the
    forensics it comes from, names the ranks of a parallel probe."""
    where = on_rank(e, f)
    if e["phase"] == "optimizer":
        text = f"the AdamW step at step {e['step']}{where} turned {e['parameter']} non-finite"
        if e.get("eps") is not None and e.get("eps_in_dtype") == 0.0:
            text += f": eps={e['eps']:g} is 0.0 in {e.get('state_dtype', 'the weight dtype')}"
            if e.get("exp_avg_sq_zero_fraction"):
                text += f" and exp_avg_sq is 0 for {fmt_fraction(e['exp_avg_sq_zero_fraction'])} of it (update = m / 0)"
        return text
    if e["phase"] == "reduction":
        return (
            f"first NaN/inf at step {e['step']}{where} in the gradient reduction, "
            f"{e['parameter']} (finite before it on that rank)"
        )
    return (
        f"first NaN/inf at step {e['step']}{where} in the {e['phase']} pass, "
        f"{e['tensor']} of {e.get('parameter') or e['module']}"
    )


def _cause_key(o: ProbeOutcome) -> tuple:
    """What makes two failures the same: the crash signature, or where the forensics saw it start."""
    if KNOWN_CRASH in o.verdict.reason:
        return ("signature", o.verdict.reason.split(KNOWN_CRASH, 1)[1].split(":", 1)[0])
    e = _origin(o)
    if e is None:
        return ()
    eps_zero = e.get("eps_in_dtype") == 0.0
    return (e["phase"], e.get("parameter") or e.get("module"), eps_zero)


def _fix(probes: list[ProbeOutcome], findings: list[dict]) -> tuple[str, str] | None:
    """(fix, source) from the crash signature in the verdict, else the most severe known-issue finding
    that names these probes; None when no knowledge applies."""
    reason = probes[0].verdict.reason
    if KNOWN_CRASH in reason and "Fix: " in reason:
        known = reason.split(KNOWN_CRASH, 1)[1]
        return known.split("Fix: ", 1)[1], f"known issue {known.split(':', 1)[0]}"
    names = {o.probe_id for o in probes} | {label(o) for o in probes}
    matching = [f for f in findings if names & set(f.get("cells") or []) and f.get("fix")]
    if not matching:
        return None
    best = min(matching, key=lambda f: SEVERITY_ORDER.index(f["severity"]) if f["severity"] in SEVERITY_ORDER else 9)
    return best["fix"], f"rule {best['id']}"


def _what(probes: list[ProbeOutcome]) -> str:
    """The failure itself: the shared verdict reason, or the verdict and step when the reasons differ
    (drift and spikes carry each probe's own numbers)."""
    reasons = {o.verdict.reason.split(KNOWN_CRASH, 1)[0] for o in probes}
    v = probes[0].verdict
    if len(reasons) == 1:
        return f"{v.name}: {reasons.pop()}"
    return (
        f"{v.name}"
        + (f" at step {v.step}" if v.step is not None else "")
        + f" (e.g. {v.reason.split(KNOWN_CRASH, 1)[0]})"
    )


def failure_classes(a: RunAnalysis) -> list[dict]:
    """One dict per way of failing, in the order the first probe of each appears: 'subject' (the
    probes in words), 'probes' (ids), 'verdict', 'what', 'where' (the origin, short) and 'where_detail'
    (full), 'fix' and 'fix_source' (None when no knowledge applies)."""
    ran = [o.record.cell for o in a.outcomes if o.verdict.name != UNSUPPORTED]
    groups: dict[tuple, list[ProbeOutcome]] = {}
    for o in a.outcomes:
        if o.verdict.failed:
            groups.setdefault((o.verdict.name, o.verdict.step, _cause_key(o)), []).append(o)
    classes = []
    for probes in groups.values():
        e, f = _origin(probes[0]), forensics_of(probes[0])
        fix = _fix(probes, a.findings)
        overrides = any(o.record.overrides for o in probes)
        subject = ", ".join(label(o) for o in probes) if overrides else cells_text([o.record.cell for o in probes], ran)
        classes.append(
            {
                "subject": subject,
                "probes": [o.probe_id for o in probes],
                "verdict": probes[0].verdict.name,
                "what": _what(probes),
                "where": where_it_broke(e, f) if e else None,
                "where_detail": event_line(e, f) if e else None,
                "fix": fix[0] if fix else None,
                "fix_source": fix[1] if fix else None,
            }
        )
    return classes


def failure_line(c: dict) -> str:
    """'fp16-pure with every attention (4 probes): nonfinite: loss is nan at step 1. Where: ... Fix: ...'"""
    n = len(c["probes"])
    text = f"{c['subject']}" + (f" ({n} probes)" if n > 1 else "") + f": {c['what']}."
    if c["where"]:
        text += f" Where: {c['where']}."
    if c["fix"]:
        text += f" Fix ({c['fix_source']}): {c['fix'].rstrip('.')}."
    return text


def unsupported_classes(a: RunAnalysis) -> list[dict]:
    """The cells this device cannot run, grouped by reason: [{'subject', 'reason', 'probes'}]."""
    every = [o.record.cell for o in a.outcomes]
    groups: dict[str, list[ProbeOutcome]] = {}
    for o in a.outcomes:
        if o.verdict.name == UNSUPPORTED:
            groups.setdefault(o.verdict.reason, []).append(o)
    return [
        {
            "subject": cells_text([o.record.cell for o in probes], every),
            "reason": reason,
            "probes": [o.probe_id for o in probes],
        }
        for reason, probes in groups.items()
    ]
