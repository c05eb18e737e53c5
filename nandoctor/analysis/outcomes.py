"""From the results store to what the reports say: a verdict per probe against its fp32 reference,
the probe table, the ranking of the stable ones, the recommended and the fastest configuration, and
the exit code."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ..knowledge import current_id, evaluate, finding, rule_by_id
from ..knowledge.facts import observed_facts
from ..record import ProbeRecord, Step, Throughput
from ..run.store import BISECT_FILE, RETIME_FILE, ROUNDTRIP_FILE, ResultsStore
from ..runmeta import RunMeta
from ..thresholds import THRESHOLDS, Thresholds
from .load import load_summary, unpaired_margin
from .ranking import SpeedComparison, compare_speed, order_bucket, paired_ratios, rank, retime_candidates, tie_key
from .speed import devices, grid_throughput, retimed_throughput, round_medians
from .verdicts import (
    HARNESS_FAILURES,
    STABLE,
    VERDICTS,
    Reference,
    References,
    Verdict,
    fidelity,
    judged_facts,
    objective,
)

FLAGGING = ("error", "warning")  # finding severities that rank a stable probe below unflagged ones


@dataclass
class ProbeOutcome:
    record: ProbeRecord
    verdict: Verdict
    fidelity: float | None
    # tokens/s per device (analysis/speed.py): the re-timed figure when the leading cells were re-timed,
    # else the probe's own
    throughput: Throughput | None
    reference_steps: list[Step] | None = None
    flags: list[str] = field(default_factory=list)  # ids of the error / warning findings that name this probe
    exact_fidelity: float | None = None  # a parallel probe against the one-process probe of its cell
    retimed: bool = False  # throughput comes from the interleaved re-timing rounds (retime.json)
    speed_class: int | None = None  # ranked probes: equal numbers in one fidelity bucket are equally fast within noise
    devices: int = 1  # the devices (ranks) the probe trained on: its tokens/s is its figure over these
    reference: str | None = None  # the probe whose curve this one's drift and fidelity were judged against
    # a mixture of experts: the share of step 0's token -> expert choices that differ from its fp32
    # reference's (verdicts.route_flips); None for a dense model, a reference, or none to compare with
    route_flips: float | None = None

    @property
    def mismatch(self) -> float | None:
        """An RL probe's mean |dlogp| between its rollout and its training path (record.rollout_mismatch):
        what it is ranked by, in place of a loss fidelity; None for an sft probe or none measured."""
        if objective(self.record) == "sft":
            return None
        return (self.record.rollout_mismatch or {}).get("logp_diff_mean")

    @property
    def tokens_per_s(self) -> float | None:
        """Median tokens/s per device."""
        return self.throughput.median if self.throughput else None

    @property
    def tokens_per_s_all_devices(self) -> float | None:
        """Median tokens/s of the whole probe, every rank's tokens counted."""
        return self.throughput.median * self.devices if self.throughput else None

    @property
    def probe_id(self) -> str:
        return self.record.probe_id

    @property
    def peak_memory_bytes(self) -> int | None:
        return self.record.peak_memory_bytes


@dataclass
class RunAnalysis:
    meta: RunMeta
    outcomes: list[ProbeOutcome]
    table: pd.DataFrame  # one row per outcome, same order: see probe_table
    ranking: list[ProbeOutcome] = field(default_factory=list)
    expected: int = 0  # probes planned; more than len(outcomes) when the run was interrupted
    findings: list[dict] = field(default_factory=list)  # known issues: planned (run.json) and observed in probes
    bisection: dict | None = None  # bisect.json of a `bisect` run: path, culprits, recommendation
    roundtrip: dict | None = None  # roundtrip.json of a `grid --roundtrip`: the recommended cell's round trip
    comparison: object | None = None  # a diff.RunDiff: this run against the --baseline run (diff imports this module)
    timing: dict | None = None  # retime.json: the leading cells re-timed back to back, interleaved
    load: dict | None = None  # analysis.load.load_summary: how busy the host was while probes were timed
    unwritten: list[tuple[str, bool]] = field(
        default_factory=list
    )  # (line, the OS refused it) per report file not written
    rounds: dict[str, dict[int, float]] = field(default_factory=dict)  # speed.round_medians of the re-timing
    # the recipe variants whose probes were not judged against a stable fp32/eager probe: another fp32
    # probe stood in for it, or none could (drift not judged); the reports say so first
    references: list[Reference] = field(default_factory=list)

    def __post_init__(self):
        self.meta = RunMeta.of(self.meta)  # run.json's meta, given as the dict it holds

    @property
    def loaded(self) -> bool:
        """Other processes loaded the host while probes were timed (load_summary): the grid's own figures
        are compared with the wider speed_margin."""
        return bool(self.load and self.load.get("significant"))

    @property
    def speed_margin(self) -> float:
        """The relative gain one grid probe must show over another to count as faster: the quiet
        Thresholds.speed_margin, or on a loaded host what the measured load could swing (load.unpaired_margin)."""
        return unpaired_margin(self.load)

    @property
    def recommended(self) -> ProbeOutcome | None:
        return self.ranking[0] if self.ranking else None

    @property
    def unjudged(self) -> list[Reference]:
        """The recipe variants whose drift was not judged (no fp32 probe trained stably)."""
        return [r for r in self.references if r.probe_id is None]

    @property
    def hardware(self) -> list[str]:
        """The kinds of hardware the run probed (its hardware axis: Cell.hardware), in plan order; []
        when it had none. The ranking is per kind, kind after kind (rank_per_hardware)."""
        return list(dict.fromkeys(o.record.cell.hardware for o in self.outcomes if o.record.cell.hardware))

    def recommended_on(self, hardware: str) -> ProbeOutcome | None:
        """The best stable configuration on one kind of hardware: the first of its ranking."""
        return next((o for o in self.ranking if o.record.cell.hardware == hardware), None)

    @property
    def speed_ties(self) -> list[ProbeOutcome]:
        """speed_ties_on the recommendation's kind of hardware (the whole run without a hardware axis)."""
        return self.speed_ties_on(self.recommended.record.cell.hardware) if self.recommended else []

    def speed_ties_on(self, hardware: str) -> list[ProbeOutcome]:
        """The ranked probes on this kind of hardware ("" without a hardware axis) that are as fast as its
        recommendation within their measured noise, in its fidelity bucket and flag status (the
        recommendation among them is the fixed tie order's). Speeds of two kinds are never compared."""
        rec = self.recommended_on(hardware)
        if rec is None:
            return []
        return [
            o
            for o in self.ranking
            if o is not rec
            and o.record.cell.hardware == hardware
            and o.speed_class == rec.speed_class
            and o.speed_class is not None
            and bool(o.flags) == bool(rec.flags)
            and same_bucket(o, rec)
        ]

    @property
    def fastest(self) -> ProbeOutcome | None:
        """fastest_on the recommendation's kind of hardware (the whole run without a hardware axis)."""
        return self.fastest_on(self.recommended.record.cell.hardware) if self.recommended else None

    def fastest_on(self, hardware: str) -> ProbeOutcome | None:
        """The stable probe on this kind of hardware with the highest median tokens/s per device in the
        grid; its recommended one unless that is clearly faster (ranking.compare_speed). Two probes the
        re-timing measured are compared on its rounds; any other pair on the grid's own probes, never a
        re-timed figure (short probes, another time) against a grid one."""
        rec = self.recommended_on(hardware)
        if rec is None:
            return None
        best = max((o for o in self.ranking if o.record.cell.hardware == hardware), key=lambda o: grid_speed(o)[0])
        return best if self.compare(best, rec).faster else rec

    def compare(self, a: ProbeOutcome, b: ProbeOutcome) -> SpeedComparison:
        """Speed a against speed b as the ranking compares them: on the re-timing rounds when both were
        re-timed, else on the grid's own probes (the loaded margin when the host was loaded)."""
        both = a.retimed and b.retimed
        measured = speed if both else grid_speed
        ratios = paired_ratios(self.rounds, a.probe_id, b.probe_id) if both else None
        return compare_speed(measured(a), measured(b), THRESHOLDS, ratios, self.speed_margin)

    def tie_reasons_on(self, hardware: str) -> list[tuple[ProbeOutcome, ProbeOutcome, SpeedComparison]]:
        """Why the recommendation on this kind of hardware ties with its speed_ties_on: (the fastest of
        them, another of them, how the fastest compared with it: not clearly faster), for each other one;
        the same rule ranking.rank applied between each probe and its class's fastest."""
        rec = self.recommended_on(hardware)
        ties = self.speed_ties_on(hardware)
        if rec is None or not ties:
            return []
        lead = max([rec, *ties], key=lambda o: speed(o)[0])
        return [(lead, o, self.compare(lead, o)) for o in [rec, *ties] if o is not lead]

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
        if self.meta.kind == "bisect":
            if self.bisection and self.bisection.get("status", "").startswith("unresolved"):
                return 2
            return 0 if self.bisection and self.bisection.get("recommended") is not None else 1
        if not self.ranking or any(o.verdict.name in HARNESS_FAILURES for o in self.outcomes):
            return 1
        return self.comparison.exit_code if self.comparison else 0


# The probe table (RunAnalysis.table; load_run and `report --csv` add `rank`): column -> what it holds.
# docs/python-api.md lists the same columns; tests/test_report_words.py holds the two together.
PROBE_COLUMNS = {
    "probe_id": "the probe's id: its cell (dtype/attn/compile[/optimizer][/parallel][@hardware]); a bisection "
    "probe's recipe overrides, seed and rerun follow it",
    "dtype": "the precision axis value (fp32, bf16-amp, ...)",
    "attn": "the attention axis value (eager, sdpa, sdpa:flash, ...)",
    "compile": "the compile axis value (off, inductor, aot_eager)",
    "optimizer": "the optimizer axis value (adamw, ...)",
    "parallel": "the parallel axis value (none, ddp, fsdp2, ...)",
    "hardware": "the kind of hardware (a SLURM partition or Ray node type); empty without a hardware axis",
    "node": "the host an executor placed the probe on; None on this machine",
    "gpu": "the GPUs the scheduler gave the probe there; None without",
    "overrides": "the recipe fields set for this probe (a bisection's factors), as a dict",
    "seed": "the probe's seed",
    "verdict": ", ".join(v.name for v in VERDICTS[:-1]) + f" or {VERDICTS[-1].name}",
    "step": "the failing step (the first step the verdict is about); NA when none",
    "reason": "the verdict's one-line reason",
    "fidelity": "mean relative loss error against the fp32 reference of the same recipe and seed (0.01 = 1%); "
    "NA when no fp32 probe trained stably (drift not judged), and for objective=grpo (its loss is no fidelity)",
    "rollout_logp_diff": "objective=grpo: the mean |dlogp| between the rollout's and the training path's "
    "log-probs of the sampled tokens (rollout_mismatch), what the ranking orders by; NA for sft",
    "world_size": "the devices (ranks) the probe trained on: 1 for one process",
    "tokens_per_s": "median tokens/s per device over the steady steps (the probe's over its world_size): "
    "what the ranking compares; the re-timed figure when `retimed`",
    "tokens_per_s_q1": "lower quartile of the per-step tokens/s per device",
    "tokens_per_s_q3": "upper quartile of the per-step tokens/s per device",
    "tokens_per_s_all_devices": "median tokens/s of the whole probe, every rank's tokens counted",
    "retimed": "True when the tokens/s come from the interleaved re-timing rounds (retime.json), which "
    "run shorter probes than the grid's",
    "grid_tokens_per_s": "median tokens/s per device of the probe's own grid probe, re-timed or not: the one "
    "figure every probe has, so the one to compare them all on",
    "peak_memory_bytes": "peak memory (the CUDA allocator's peak on a GPU, the process's peak RSS on a CPU)",
    "optimizer_state_bytes": "bytes of optimizer state after the first optimizer step",
    "steps_run": "training steps the probe ran",
    "wall_s": "the probe process's wall time, in seconds",
    "flags": "ids of the nandoctor rules (errors, warnings) that name this probe, comma-separated",
}


def probe_table(outcomes: list[ProbeOutcome]) -> pd.DataFrame:
    """One row per probe, the columns of PROBE_COLUMNS in that order."""
    rows = [
        {
            "probe_id": o.probe_id,
            "dtype": o.record.cell.dtype,
            "attn": o.record.cell.attn,
            "compile": o.record.cell.compile,
            "optimizer": o.record.cell.optimizer,
            "parallel": o.record.cell.parallel,
            "hardware": o.record.cell.hardware,
            "node": o.record.node,
            "gpu": o.record.gpu,
            "overrides": o.record.overrides,
            "seed": o.record.seed,
            "verdict": o.verdict.name,
            "step": o.verdict.step,
            "reason": o.verdict.reason,
            "fidelity": o.fidelity,
            "rollout_logp_diff": o.mismatch,
            "world_size": o.devices,
            "tokens_per_s": o.tokens_per_s,
            "tokens_per_s_q1": o.throughput.q1 if o.throughput else None,
            "tokens_per_s_q3": o.throughput.q3 if o.throughput else None,
            "tokens_per_s_all_devices": o.tokens_per_s_all_devices,
            "retimed": o.retimed,
            "grid_tokens_per_s": grid_speed(o)[0] if grid_throughput(o.record) else None,
            "peak_memory_bytes": o.peak_memory_bytes,
            "optimizer_state_bytes": o.record.optimizer_state_bytes,
            "steps_run": len(o.record.steps),
            "wall_s": o.record.wall_s,
            "flags": ",".join(o.flags),
        }
        for o in outcomes
    ]
    return pd.DataFrame(rows, columns=list(PROBE_COLUMNS)).astype(
        {"step": "Int64", "peak_memory_bytes": "Int64", "optimizer_state_bytes": "Int64"}
    )


def speed(o: ProbeOutcome) -> tuple[float, float, float]:
    """(median, q1, q3) tokens/s per device, re-timed when the probe was."""
    t = o.throughput
    return (t.median, t.q1, t.q3) if t else (0.0, 0.0, 0.0)


def grid_speed(o: ProbeOutcome) -> tuple[float, float, float]:
    """speed() as the grid's own probe measured it, before any re-timing replaced it."""
    t = grid_throughput(o.record)
    return (t.median, t.q1, t.q3) if t else (0.0, 0.0, 0.0)


def same_bucket(a: ProbeOutcome, b: ProbeOutcome) -> bool:
    return order_bucket(a.fidelity, a.mismatch) == order_bucket(b.fidelity, b.mismatch)


def configuration(record: ProbeRecord) -> tuple:
    """What a probe configures: its cell, recipe overrides and seed. A bisection's identical reruns share one."""
    return record.cell, tuple(sorted(record.overrides.items())), record.seed


def rankable(outcomes: list[ProbeOutcome]) -> list[int]:
    """Indices of the outcomes the ranking lists: one per configuration, its first probe, and only when
    every probe of it (reruns included) was stable (a verdict that changes on a rerun is a failure)."""
    by_config: dict[tuple, list[int]] = {}
    for i, o in enumerate(outcomes):
        by_config.setdefault(configuration(o.record), []).append(i)
    return [ids[0] for ids in by_config.values() if all(outcomes[i].verdict.name == STABLE for i in ids)]


def rank_per_hardware(
    table: pd.DataFrame,
    hardware: list[str],
    rounds: dict[str, dict[int, float]] | None = None,
    t: Thresholds = THRESHOLDS,
    margin: float | None = None,
) -> pd.DataFrame:
    """ranking.rank within each kind of hardware (a probe's speed and fidelity compare only with those
    measured on the same kind), the kinds in the order they first appear; hardware: one per table row
    of the whole probe table, by position."""
    kinds = list(dict.fromkeys(hardware[i] for i in table.index))
    return (
        pd.concat([rank(table.loc[[i for i in table.index if hardware[i] == h]], t, rounds, margin) for h in kinds])
        if len(kinds) > 1
        else rank(table, t, rounds, margin)
    )


def analyze_records(meta: RunMeta | dict, records: list[ProbeRecord], timing: dict | None = None) -> RunAnalysis:
    """Verdicts need the fp32 reference of the same recipe and seed: learn the references first.
    `meta` is run.json's (a dict as it holds it is read with RunMeta.from_dict); `timing` (retime.json)
    replaces the throughput of the probes it re-timed."""
    meta = RunMeta.of(meta)
    references = References()
    for r in records:
        references.learn(r)
    findings = findings_of(meta, records)
    world = {r.probe_id: devices(r) for r in records}
    retimed = retimed_throughput(timing, world)
    outcomes = []
    for r in records:
        v = references.judge(r)
        throughput = retimed.get(r.probe_id) or grid_throughput(r)
        outcomes.append(
            ProbeOutcome(
                r,
                v,
                references.fidelity(r, v) if objective(r) == "sft" else None,
                throughput,
                references.of(r),
                flags_of(r, findings),
                fidelity(r.steps, references.exact(r)),
                retimed=r.probe_id in retimed,
                devices=world[r.probe_id],
                reference=None if references.is_own(r) else references.reference(r).probe_id,
                route_flips=references.flips(r),
            )
        )
    table = probe_table(outcomes)
    load = load_summary(records, timing)
    rounds = round_medians(timing, world)
    analysis = RunAnalysis(
        meta=meta,
        outcomes=outcomes,
        table=table,
        expected=meta.planned if meta.planned is not None else len(records),
        findings=findings,
        timing=timing,
        load=load,
        rounds=rounds,
        references=references.notes() if meta.kind != "check" else [],  # a check judges no drift
    )
    ranked = rank_per_hardware(
        table.iloc[rankable(outcomes)],
        [o.record.cell.hardware for o in outcomes],
        rounds,
        THRESHOLDS,
        analysis.speed_margin,
    )
    for i, speed_class in zip(ranked.index, ranked["speed_class"]):
        outcomes[i].speed_class = int(speed_class)
    analysis.ranking = [outcomes[i] for i in ranked.index]
    return analysis


def tie_order_key(o: ProbeOutcome) -> tuple:
    """A probe's place in the fixed tie order (ranking.tie_key of its cell and id)."""
    return tie_key({**o.record.cell.to_dict(), "probe_id": o.probe_id})


def tie_first(outcomes: list[ProbeOutcome]) -> ProbeOutcome:
    """The one of these the fixed tie order puts first, whatever their speeds."""
    return min(outcomes, key=tie_order_key)


def speed_buckets(a: RunAnalysis) -> list[list[ProbeOutcome]]:
    """The ranked probes sharing each recommendation's fidelity bucket and flag status, in rank order,
    where there are two or more: the probes speed decides between (one list per kind of hardware)."""
    buckets = []
    for rec in [a.recommended_on(h) for h in a.hardware] if a.hardware else [a.recommended]:
        if rec is None:
            continue
        top = [
            o
            for o in a.ranking
            if o.record.cell.hardware == rec.record.cell.hardware
            and same_bucket(o, rec)
            and bool(o.flags) == bool(rec.flags)
        ]
        if len(top) > 1:
            buckets.append(top)
    return buckets


def speed_candidates(a: RunAnalysis, most: int) -> list[tuple[list[ProbeOutcome], ProbeOutcome | None]]:
    """Per speed bucket (speed_buckets), the probes worth re-timing, fastest first: ranking.retime_candidates
    on their grid probes' tokens/s (never the tie order's first few: on a loaded host the wide margin makes
    one speed class of the bucket, and the tie order alone would choose), with the margin the run's load
    calls for and at least Thresholds.loaded_speed_margin (grid probes ran minutes apart), and the tie
    order's first where the grid cannot tell it from them. Each with the probe the tie order put in only
    for being first in it (None when it was among the fastest anyway).
    Buckets where the grid's probes already tell the fastest from every other are left out."""
    margin = max(THRESHOLDS.loaded_speed_margin, a.speed_margin)
    out = []
    for top in speed_buckets(a):
        of = {o.probe_id: o for o in top}
        speeds, first = {o.probe_id: grid_speed(o) for o in top}, tie_first(top).probe_id
        ids = retime_candidates(speeds, first, most, margin)
        if ids:
            added = first if first not in retime_candidates(speeds, None, most, margin) else None
            out.append(([of[i] for i in ids], of[added] if added in ids else None))
    return out


def flags_of(record: ProbeRecord, findings: list[dict]) -> list[str]:
    """The error and warning findings that name this probe (by probe id or cell id): nandoctor's own
    rules say it trains, but at a cost the ranking should not hide."""
    names = {record.probe_id, record.cell.id}
    return [f["id"] for f in findings if f["severity"] in FLAGGING and names & set(f.get("cells") or [])]


def findings_of(meta: RunMeta | dict, records: list[ProbeRecord]) -> list[dict]:
    """The doctor's findings for the planned setup (a merged rule's old id read as its kept one), plus
    the rules that fire on what probes showed."""
    findings = [{**f, "id": current_id(f["id"])} for f in (RunMeta.of(meta).doctor or {}).get("findings", [])]
    observed: dict[str, list[str]] = {}
    for r in records:
        for rule in evaluate({**observed_facts(r), **judged_facts(r)}, "probe"):
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
    # where it is now, which may differ from where it was written
    meta = RunMeta.from_dict({**store.meta(), "run_dir": str(run_dir)})
    analysis = analyze_records(meta, store.records(), store.read_json(RETIME_FILE))
    analysis.bisection = store.read_json(BISECT_FILE)
    analysis.roundtrip = store.read_json(ROUNDTRIP_FILE)
    return analysis


def ranked_table(analysis: RunAnalysis) -> pd.DataFrame:
    """The probe table with a `rank` column: 1 for the recommended configuration, NA for probes that
    are not stable."""
    table = analysis.table.copy()
    ranks = {id(o): i + 1 for i, o in enumerate(analysis.ranking)}
    table["rank"] = pd.array([ranks.get(id(o)) for o in analysis.outcomes], dtype="Int64")
    return table


def load_run(run_dir) -> pd.DataFrame:
    """A run directory's probes as a DataFrame, one row per probe: the columns of PROBE_COLUMNS, then
    `rank` (docs/python-api.md lists them with their meaning)."""
    return ranked_table(analyze(run_dir))
