"""From the results store to what the reports say: a verdict per probe, the fp32 reference of each,
the ranking of the stable ones, the recommended and the fastest configuration, and the exit code."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .config import REFERENCE_CELL
from .knowledge import evaluate, finding, rule_by_id
from .knowledge.facts import observed_facts
from .ranking import rank, tokens_per_s
from .store import BISECT_FILE, ResultsStore
from .verdicts import HARNESS_FAILURES, STABLE, Verdict, classify, fidelity


@dataclass
class ProbeOutcome:
    record: dict
    verdict: Verdict
    fidelity: float | None
    tokens_per_s: float | None
    reference_steps: list[dict] | None = None

    @property
    def probe_id(self) -> str:
        return self.record["probe_id"]

    @property
    def peak_memory_bytes(self) -> int | None:
        return self.record.get("peak_memory_bytes")


@dataclass
class RunAnalysis:
    meta: dict
    outcomes: list[ProbeOutcome]
    ranking: list[ProbeOutcome] = field(default_factory=list)
    expected: int = 0  # probes planned; more than len(outcomes) when the run was interrupted
    findings: list[dict] = field(default_factory=list)  # known issues: planned (run.json) and observed in probes
    bisection: dict | None = None  # bisect.json of a `bisect` run: path, culprits, recommendation

    @property
    def recommended(self) -> ProbeOutcome | None:
        return self.ranking[0] if self.ranking else None

    @property
    def fastest(self) -> ProbeOutcome | None:
        return max(self.ranking, key=lambda o: o.tokens_per_s or 0.0) if self.ranking else None

    def count(self, name: str) -> int:
        return sum(o.verdict.name == name for o in self.outcomes)

    @property
    def complete(self) -> bool:
        return len(self.outcomes) >= self.expected

    @property
    def exit_code(self) -> int:
        """0 when a stable configuration exists and no probe crashed, hung or was killed; else 1.
        Numerical failures are findings, not errors: finding them is the point of a grid.
        A bisection exits 0 when it found a configuration that held up on its reruns, else 1."""
        if self.meta.get("kind") == "bisect":
            return 0 if self.bisection and self.bisection.get("recommended") is not None else 1
        if not self.ranking or any(o.verdict.name in HARNESS_FAILURES for o in self.outcomes):
            return 1
        return 0


def reference_key(record: dict) -> str:
    return json.dumps([record.get("recipe"), record.get("seed")], sort_keys=True, default=str)


def is_reference(record: dict) -> bool:
    return record.get("cell") == {"dtype": REFERENCE_CELL.dtype, "attn": REFERENCE_CELL.attn, "compile": REFERENCE_CELL.compile}


def reference_steps(record: dict) -> list[dict] | None:
    """The loss curve drift and fidelity are measured against: a reference probe's steps, when it
    finished and is itself stable; None otherwise."""
    if is_reference(record) and record["status"] == "ok" and classify(record).name == STABLE:
        return record["steps"]
    return None


def analyze_records(meta: dict, records: list[dict]) -> RunAnalysis:
    """Verdicts need the fp32 reference of the same recipe and seed: classify references first."""
    references: dict[str, list[dict]] = {}
    for r in records:
        steps = reference_steps(r)
        if steps is not None:
            references[reference_key(r)] = steps
    outcomes = []
    for r in records:
        ref = None if is_reference(r) else references.get(reference_key(r))
        v = classify(r, ref)
        fid = 0.0 if is_reference(r) and v.name == STABLE else fidelity(r.get("steps") or [], ref)
        outcomes.append(ProbeOutcome(r, v, fid, tokens_per_s(r.get("steps") or []), ref))
    stable = [o for o in outcomes if o.verdict.name == STABLE]
    order = rank([{"o": o, "fidelity": o.fidelity, "tokens_per_s": o.tokens_per_s, "peak_memory_bytes": o.peak_memory_bytes} for o in stable])
    return RunAnalysis(meta=meta, outcomes=outcomes, ranking=[row["o"] for row in order],
                       expected=meta.get("planned", len(records)), findings=findings_of(meta, records))


def findings_of(meta: dict, records: list[dict]) -> list[dict]:
    """The doctor's findings for the planned setup, plus the rules that fire on what probes showed."""
    findings = [dict(f) for f in (meta.get("doctor") or {}).get("findings", [])]
    observed: dict[str, list[str]] = {}
    for r in records:
        for rule in evaluate(observed_facts(r)):
            observed.setdefault(rule.id, []).append(r["probe_id"])
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
