"""The API behind `nandoctor explain`: one run directory's analysis and the probes asked about."""

from __future__ import annotations

from .analysis.outcomes import ProbeOutcome, RunAnalysis, analyze
from .errors import NandoctorError


def explain(run_dir, probe_id: str | None = None) -> tuple[RunAnalysis, list[ProbeOutcome]]:
    """The run's analysis and the outcome of `probe_id` (a probe id such as 'fp16-amp/sdpa/off'), or
    of every probe that ran when it is None. An unknown id is the user's error."""
    analysis = analyze(run_dir)
    ran = [o for o in analysis.outcomes if o.verdict.name != "unsupported"]
    if probe_id is None:
        return analysis, ran
    chosen = [o for o in analysis.outcomes if o.probe_id == probe_id]
    if not chosen:
        known = ", ".join(o.probe_id for o in analysis.outcomes) or "none"
        raise NandoctorError(f"no probe {probe_id!r} in {run_dir}; its probes: {known}")
    return analysis, chosen
