"""From the results store to what the reports say: a verdict per probe against its fp32 reference,
the probe table, the ranking of the stable ones, the recommended and the fastest configuration, and
the exit code."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ..knowledge import evaluate, finding, rule_by_id
from ..knowledge.facts import observed_facts
from ..record import ProbeRecord, Step
from ..run.store import BISECT_FILE, ResultsStore
from .ranking import rank, tokens_per_s
from .verdicts import HARNESS_FAILURES, STABLE, References, Verdict

FLAGGING = ("error", "warning")  # finding severities that rank a stable probe below unflagged ones


@dataclass
class ProbeOutcome:
    record: ProbeRecord
    verdict: Verdict
    fidelity: float | None
    tokens_per_s: float | None
    reference_steps: list[Step] | None = None
    flags: list[str] = field(default_factory=list)  # ids of the error / warning findings that name this probe

    @property
    def probe_id(self) -> str:
        return self.record.probe_id

    @property
    def peak_memory_bytes(self) -> int | None:
        return self.record.peak_memory_bytes


@dataclass
class RunAnalysis:
    meta: dict
    outcomes: list[ProbeOutcome]
    table: pd.DataFrame  # one row per outcome, same order: see probe_table
    ranking: list[ProbeOutcome] = field(default_factory=list)
    expected: int = 0  # probes planned; more than len(outcomes) when the run was interrupted
    findings: list[dict] = field(default_factory=list)  # known issues: planned (run.json) and observed in probes
    bisection: dict | None = None  # bisect.json of a `bisect` run: path, culprits, recommendation
    comparison: object | None = None  # a diff.RunDiff: this run against the --baseline run (diff imports this module)

    @property
    def recommended(self) -> ProbeOutcome | None:
        return self.ranking[0] if self.ranking else None

    @property
    def fastest(self) -> ProbeOutcome | None:
        return max(self.ranking, key=lambda o: o.tokens_per_s or 0.0) if self.ranking else None

    @property
    def complete(self) -> bool:
        return len(self.outcomes) >= self.expected

    @property
    def exit_code(self) -> int:
        """0 when a stable configuration exists and no probe crashed, hung or was killed; else 1.
        Numerical failures are findings, not errors: finding them is the point of a grid.
        A bisection exits 0 when it found a configuration that held up on its reruns, 2 when it could
        not test the target or the baseline (timeout, out of memory: the user's setup to change), else 1.
        Compared with a --baseline run, a cell that regressed against it exits 1 as well."""
        if self.meta.get("kind") == "bisect":
            if self.bisection and self.bisection.get("status", "").startswith("unresolved"):
                return 2
            return 0 if self.bisection and self.bisection.get("recommended") is not None else 1
        if not self.ranking or any(o.verdict.name in HARNESS_FAILURES for o in self.outcomes):
            return 1
        return self.comparison.exit_code if self.comparison else 0


def probe_table(outcomes: list[ProbeOutcome]) -> pd.DataFrame:
    """One row per probe: its cell and overrides, verdict, failing step, fidelity, tokens/s, peak memory,
    optimizer-state bytes."""
    rows = [{"probe_id": o.probe_id, "dtype": o.record.cell.dtype, "attn": o.record.cell.attn,
             "compile": o.record.cell.compile, "optimizer": o.record.cell.optimizer, "overrides": o.record.overrides,
             "seed": o.record.seed, "verdict": o.verdict.name, "step": o.verdict.step, "reason": o.verdict.reason,
             "fidelity": o.fidelity, "tokens_per_s": o.tokens_per_s, "peak_memory_bytes": o.peak_memory_bytes,
             "optimizer_state_bytes": o.record.optimizer_state_bytes,
             "steps_run": len(o.record.steps), "wall_s": o.record.wall_s, "flags": ",".join(o.flags)} for o in outcomes]
    columns = ["probe_id", "dtype", "attn", "compile", "optimizer", "overrides", "seed", "verdict", "step", "reason",
               "fidelity", "tokens_per_s", "peak_memory_bytes", "optimizer_state_bytes", "steps_run", "wall_s", "flags"]
    return pd.DataFrame(rows, columns=columns).astype({"step": "Int64", "peak_memory_bytes": "Int64",
                                                       "optimizer_state_bytes": "Int64"})


def analyze_records(meta: dict, records: list[ProbeRecord]) -> RunAnalysis:
    """Verdicts need the fp32 reference of the same recipe and seed: learn the references first."""
    references = References()
    for r in records:
        references.learn(r)
    findings = findings_of(meta, records)
    outcomes = []
    for r in records:
        v = references.judge(r)
        outcomes.append(ProbeOutcome(r, v, references.fidelity(r, v), tokens_per_s(r.steps), references.of(r),
                                     flags_of(r, findings)))
    table = probe_table(outcomes)
    ranked = rank(table[table["verdict"] == STABLE])
    return RunAnalysis(meta=meta, outcomes=outcomes, table=table, ranking=[outcomes[i] for i in ranked.index],
                       expected=meta.get("planned", len(records)), findings=findings)


def flags_of(record: ProbeRecord, findings: list[dict]) -> list[str]:
    """The error and warning findings that name this probe (by probe id or cell id): nandoctor's own
    rules say it trains, but at a cost the ranking should not hide."""
    names = {record.probe_id, record.cell.id}
    return [f["id"] for f in findings if f["severity"] in FLAGGING and names & set(f.get("cells") or [])]


def findings_of(meta: dict, records: list[ProbeRecord]) -> list[dict]:
    """The doctor's findings for the planned setup, plus the rules that fire on what probes showed."""
    findings = [dict(f) for f in (meta.get("doctor") or {}).get("findings", [])]
    observed: dict[str, list[str]] = {}
    for r in records:
        for rule in evaluate(observed_facts(r)):
            observed.setdefault(rule.id, []).append(r.probe_id)
    for rule_id, probes in observed.items():
        known = next((f for f in findings if f["id"] == rule_id), None)
        if known is None:
            findings.append(finding(rule_by_id(rule_id), probes))
        else:
            known["cells"] = sorted(set(known["cells"]) | set(probes))
    return findings


def analyze(run_dir) -> RunAnalysis:
    store = ResultsStore(run_dir)
    meta = store.meta()
    meta["run_dir"] = str(run_dir)  # where it is now, which may differ from where it was written
    analysis = analyze_records(meta, store.records())
    analysis.bisection = store.read_json(BISECT_FILE)
    return analysis


def ranked_table(analysis: RunAnalysis) -> pd.DataFrame:
    """The probe table with a `rank` column: 1 for the recommended configuration, NA for probes that
    are not stable."""
    table = analysis.table.copy()
    ranks = {id(o): i + 1 for i, o in enumerate(analysis.ranking)}
    table["rank"] = pd.array([ranks.get(id(o)) for o in analysis.outcomes], dtype="Int64")
    return table


def load_run(run_dir) -> pd.DataFrame:
    """A run directory's probes as a DataFrame, one row per probe: cell (dtype, attn, compile, optimizer) and
    overrides, verdict, failing step, fidelity, tokens/s, peak memory and rank."""
    return ranked_table(analyze(run_dir))
