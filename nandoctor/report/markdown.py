"""report.md: the ranked table, the failures with their reasons, the model and the environment."""
from __future__ import annotations

from tabulate import tabulate

from ..analysis.run import RunAnalysis
from ..config import THRESHOLDS
from . import bisection, common
from .doctor import doctor_markdown
from .forensics import forensics_markdown
from .savings import savings_markdown


def _table(rows: list[dict]) -> str:
    return tabulate(rows, headers="keys", tablefmt="github") if rows else "_none_"


def render_markdown(a: RunAnalysis) -> str:
    m = a.meta
    probed, why = common.model_line(a)
    parts = [f"# nandoctor {m['kind']}: {m['recipe']['name']}", "",
             f"Run `{m['run_id']}` started {m['created']}; {m['steps']} steps per probe, seed {m['seed']}.", ""]
    parts += [f"- {line}" for line in common.headline(a)]
    parts += ["", "## Model", "", f"Probed: {probed}.", "", f"Why: {why}.", ""]
    if m["kind"] == "bisect" and a.bisection:
        parts += bisection_section(a.bisection)
    parts += ["## Stable configurations, ranked", "",
              "Ordered by fidelity to the fp32/eager reference (mean relative loss error, in "
              f"{100 * THRESHOLDS.fidelity_bucket:g}% buckets), then tokens/s, then peak memory.", "",
              _table(common.ranking_rows(a)), ""]
    parts += ["## Failures", "", _table(common.failure_rows(a)), ""]
    parts += forensics_markdown(a, _table)
    parts += savings_markdown(a, _table)
    parts += ["## Not run on this device", "", _table(common.unsupported_rows(a)), ""]
    parts += doctor_markdown(m.get("env", {}), a.findings)
    parts += ["## Environment", "", _table(common.environment_rows(a)), ""]
    parts += [f"Command: `{m.get('command', '')}`", ""]
    return "\n".join(parts)


def bisection_section(b: dict) -> list[str]:
    parts = ["## Bisection", "", b["message"][0].upper() + b["message"][1:] + ".", "", _table(bisection.factor_rows(b)), "",
             "### Culprits", "", _table(bisection.culprit_rows(b)), ""]
    lines = bisection.recommendation_lines(b)
    if lines:
        parts += ["### Recommended configuration", "", "```", *lines, "```", ""]
    parts += ["### Bisection path, probe by probe", "", _table(bisection.path_rows(b)), ""]
    return parts
