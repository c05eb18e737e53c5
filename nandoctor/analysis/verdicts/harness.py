"""The verdict of a probe that did not finish on its own: unsupported, killed, timed out, crashed, out of
memory (a crash matched to a known signature is named with its fix)."""

from __future__ import annotations

import re

from ...knowledge import diagnose_crash
from ...record import ProbeRecord
from .table import CRASH, KILLED, OOM, TIMEOUT, UNSUPPORTED, Verdict

CRASH_SIGNALS = {
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "abort",
    "SIGBUS": "bus error",
    "SIGILL": "illegal instruction",
    "SIGFPE": "floating-point exception",
}


def known_crash(text: str) -> str:
    """' -- known issue ID: diagnosis Fix: fix' when the text matches a crash signature, else ''."""
    sig = diagnose_crash(text)
    return f" -- known issue {sig.id}: {sig.diagnosis} Fix: {sig.fix}" if sig else ""


def harness_verdict(record: ProbeRecord) -> Verdict | None:
    """The verdict of a probe that did not finish on its own, or None if it did."""
    status = record.status
    last = len(record.steps) - 1
    done = f"after {last + 1} completed step(s)"
    if record.failed_rank is not None:  # a parallel probe: the rank whose end stopped the others
        done = f"on rank {record.failed_rank} of {len(record.ranks or []) or '?'} {done}"
    if status == "unsupported":
        return Verdict(UNSUPPORTED, record.reason)
    if status == "lost":
        return Verdict(KILLED, f"{record.reason}; this says nothing about the configuration")
    if status == "timeout":
        if record.timed_out_in == "build":
            budget = (record.recipe or {}).get("build_timeout_s")
            budget = f"{budget:g}" if isinstance(budget, (int, float)) else "?"
            return Verdict(TIMEOUT, f"model not built within build_timeout_s={budget} s (imports, load, wrapping)", 0)
        since = " of its build" if record.timed_out_in == "steps" else ""
        budget = f"{record.timeout_s:g}" if isinstance(record.timeout_s, (int, float)) else "?"
        return Verdict(TIMEOUT, f"no result within {budget} s{since}, {done}", max(last, 0))
    if status == "signal":
        sig = record.signal
        if sig in CRASH_SIGNALS:
            return Verdict(
                CRASH,
                f"process died of {sig} ({CRASH_SIGNALS[sig]}) {done}" + known_crash(record.log_tail or ""),
                max(last, 0),
            )
        hint = " (the kernel's OOM killer sends SIGKILL)" if sig == "SIGKILL" else ""
        return Verdict(KILLED, f"process killed by {sig}{hint} {done}", max(last, 0))
    if status == "error":
        err = record.error
        first = (err.get("message") or "").strip().splitlines()[:1]
        text = f"{err['type']}: {first[0] if first else ''}".strip().rstrip(":")
        sig = diagnose_crash(err.get("message") or "")
        if sig and sig.verdict == UNSUPPORTED:  # the device refused the cell: not the probe's failure
            said = [w for w in err.get("warnings") or [] if re.search(sig.explained_by or "$^", w)]
            because = "; ".join(w.split(": ", 1)[-1].strip() for w in said)
            return Verdict(
                UNSUPPORTED,
                f"{text[:200]} ({sig.diagnosis.rstrip('.')})" + (f": PyTorch said {because[:600]}" if because else ""),
            )
        oom = err.get("oom") or (sig is not None and sig.verdict == OOM)
        return Verdict(OOM if oom else CRASH, text[:300] + known_crash(err.get("message") or ""), max(last + 1, 0))
    if not record.steps:
        return Verdict(CRASH, "the probe finished without completing a training step")
    return None
