"""Delta debugging over the factors that separate a good configuration from a bad one.

A factor is one setting (a grid axis or a dotted recipe field) whose value differs between the good
(baseline) and the bad (target) configuration. `ddmin` (Zeller and Hildebrandt, "Simplifying and
Isolating Failure-Inducing Input", IEEE TSE 28(2), 2002) finds a 1-minimal failure-inducing subset:
applying it to the good configuration fails, removing any one of its factors passes. Around it, a
`Bisection` answers what a user asks next: is the failure real (reruns with the same seed), does it
depend on the data (other seeds), and which stable configuration is nearest the target.

Pure logic: an oracle runs the probes. This module never spawns a process and imports no torch.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

PASS, FAIL, FLAKY, UNRESOLVED = "pass", "fail", "flaky", "unresolved"


@dataclass(frozen=True)
class Trial:
    """One probe the engine asks for: a full configuration, a seed offset and a rerun index."""

    config: dict
    seed: int = 0
    attempt: int = 0  # 0: first run; 1..reruns: identical reruns with the same seed

    @property
    def key(self) -> str:
        return json.dumps([self.config, self.seed, self.attempt], sort_keys=True, default=str)


@dataclass(frozen=True)
class Run:
    """What the oracle saw for one trial."""

    probe_id: str
    verdict: str
    failed: bool
    resolved: bool = True  # False when the probe could not say (the device cannot run the config)
    tokens_per_s: float | None = None


Oracle = Callable[[list[Trial]], list[Run]]


@dataclass
class Step:
    """One configuration on the bisection path and what its probes said."""

    index: int
    phase: str  # confirm-target, confirm-baseline, ddmin, rerun, minimality, revert, recommend, between
    factors: list[str]  # the target's factors applied to the baseline
    config: dict
    outcome: str  # pass, fail, flaky, unresolved
    verdicts: list[str]
    probe_ids: list[str]
    data_dependent: bool = False  # fails on some seeds and passes on others
    tokens_per_s: float | None = None
    between: dict = field(default_factory=dict)  # factor -> a value between the baseline's and the target's


@dataclass
class Culprit:
    factors: list[str]  # a 1-minimal failure-inducing subset; two or more is an interaction
    evidence: int  # index of the step where this subset alone failed
    minimality: list[int]  # indices of the steps where removing one of its factors passed
    data_dependent: bool = False


@dataclass
class BisectResult:
    status: str  # bisected, nothing-to-bisect, flaky-target, unresolved-target, unresolved-baseline, baseline-fails
    message: str
    factors: dict  # name -> [good value, bad value]
    good: dict
    bad: dict
    path: list[Step] = field(default_factory=list)
    culprits: list[Culprit] = field(default_factory=list)
    recommended: dict | None = None
    recommended_step: int | None = None
    probes: int = 0  # probe processes, reruns included
    configurations: int = 0  # distinct configurations probed
    full_grid: int = 0  # 2 ** factors: every mix of good and bad values

    @property
    def flaky(self) -> list[Step]:
        return [s for s in self.path if s.outcome == FLAKY]

    def to_dict(self) -> dict:
        return {**asdict(self), "flaky": [s.index for s in self.flaky]}


def differing_factors(good: dict, bad: dict) -> list[str]:
    """The factors whose values differ, in the target's order."""
    return [k for k in bad if good.get(k) != bad[k]]


def split(items: list, n: int) -> list[list]:
    """n nearly equal consecutive chunks."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return [c for c in out if c]


def ddmin(factors: list[str], test: Callable[[list[list[str]]], int | None]) -> list[str]:
    """Zeller's ddmin. test(candidates) returns the index of the first candidate that fails, or None;
    it may probe several candidates at once. Returns a 1-minimal failing subset of `factors`
    (assuming `factors` itself fails and the empty set passes)."""
    c, n = list(factors), 2
    while len(c) >= 2:
        subsets = split(c, n)
        hit = test(subsets)
        if hit is not None:
            c, n = subsets[hit], 2
            continue
        complements = [[f for f in c if f not in s] for s in subsets] if n > 2 else []
        hit = test(complements) if complements else None
        if hit is not None:
            c, n = complements[hit], max(n - 1, 2)
            continue
        if n >= len(c):
            break
        n = min(len(c), 2 * n)
    return c


class Bisection:
    """Confirm the target fails and the baseline passes, isolate the culprits, recommend the stable
    configuration nearest the target. `parallel` probes are asked of the oracle at once."""

    def __init__(
        self,
        good: dict,
        bad: dict,
        oracle: Oracle,
        reruns: int = 1,
        data_seeds: int = 0,
        parallel: int = 1,
        on_step: Callable[[Step], None] | None = None,
        ladders: dict | None = None,
        workload: tuple[str, ...] = (),
    ):
        self.good, self.bad, self.oracle = dict(good), dict(bad), oracle
        # the factors that say what is trained rather than how (factors.WORKLOAD): of two repairs equally
        # near the target, the one that keeps more of them as the target has them is recommended
        self.workload = tuple(workload)
        # factor -> the values between the target's and the baseline's, nearest the target first: when a
        # culprit is reverted to the baseline, the nearest of them that is stable is recommended instead
        # (a cheaper precision than fp32 when the culprit is the dtype)
        self.ladders = {k: list(v) for k, v in (ladders or {}).items() if k in differing_factors(good, bad)}
        self.reruns, self.data_seeds, self.parallel = reruns, data_seeds, max(1, parallel)
        self.on_step = on_step
        self.factors = differing_factors(good, bad)
        self.cache: dict[str, Run] = {}
        self.path: list[Step] = []
        self.seed = 0  # the seed the search probes with: the first seed on which the target fails

    def config(self, factors: list[str], between: dict | None = None) -> dict:
        return {**{k: (self.bad[k] if k in factors else self.good[k]) for k in self.good | self.bad}, **(between or {})}

    def _run(self, trials: list[Trial]) -> list[Run]:
        todo = list({t.key: t for t in trials if t.key not in self.cache}.values())
        for start in range(0, len(todo), self.parallel):
            chunk = todo[start : start + self.parallel]
            for t, r in zip(chunk, self.oracle(chunk)):
                self.cache[t.key] = r
        return [self.cache[t.key] for t in trials]

    def _trials(self, factors: list[str], confirm: bool, between: dict | None = None) -> list[Trial]:
        cfg = self.config(factors, between)
        trials = [Trial(cfg, self.seed, 0)]
        if confirm:
            trials += [Trial(cfg, self.seed, a) for a in range(1, self.reruns + 1)]
            trials += [
                Trial(cfg, s, a) for s in range(self.data_seeds + 1) if s != self.seed for a in range(self.reruns + 1)
            ]
        return trials

    def _failing_seeds(self, factors: list[str]) -> list[int]:
        trials = self._trials(factors, confirm=True)
        return sorted({t.seed for t, r in zip(trials, self._run(trials)) if r.failed})

    def _step(
        self, phase: str, factors: list[str], trials: list[Trial], runs: list[Run], between: dict | None = None
    ) -> Step:
        """Record a configuration's probes on the path; asking again for the same probes adds nothing."""
        ids = [r.probe_id for r in runs]
        seen = next((s for s in self.path if s.probe_ids == ids), None)
        if seen is not None:
            return seen
        outcome, data_dependent = judge(trials, runs)
        rates = [r.tokens_per_s for r in runs if r.tokens_per_s]
        step = Step(
            len(self.path),
            phase,
            list(factors),
            trials[0].config,
            outcome,
            [r.verdict for r in runs],
            ids,
            data_dependent,
            min(rates) if rates and outcome == PASS else None,
            dict(between or {}),
        )
        self.path.append(step)
        if self.on_step:
            self.on_step(step)
        return step

    def probe(self, phase: str, factors: list[str], confirm: bool = True, between: dict | None = None) -> Step:
        trials = self._trials(factors, confirm, between)
        return self._step(phase, factors, trials, self._run(trials), between)

    def probe_many(self, phase: str | list[str], candidates: list[list[str]], confirm: bool) -> list[Step]:
        """Probe several configurations at once (the oracle may run them in parallel); `phase` names
        all of them, or each one."""
        phases = phase if isinstance(phase, list) else [phase] * len(candidates)
        groups = [self._trials(c, confirm) for c in candidates]
        runs = self._run([t for g in groups for t in g])
        steps, i = [], 0
        for p, c, g in zip(phases, candidates, groups):
            steps.append(self._step(p, c, g, runs[i : i + len(g)]))
            i += len(g)
        return steps

    def _first_failing(self, candidates: list[list[str]]) -> int | None:
        """The ddmin test: probe candidates `parallel` at a time, confirm a failure before trusting it."""
        for start in range(0, len(candidates), self.parallel):
            chunk = candidates[start : start + self.parallel]
            for offset, step in enumerate(self.probe_many("ddmin", chunk, confirm=False)):
                if step.outcome == FAIL and self.probe("rerun", step.factors).outcome == FAIL:
                    return start + offset
        return None

    def isolate(self, factors: list[str]) -> Culprit:
        """ddmin, then check each one-factor removal with reruns; a removal that still fails means the
        subset was not minimal after all (a pass that did not hold up), so search on from there."""
        while True:
            subset = ddmin(factors, self._first_failing)
            removals = [[f for f in subset if f != g] for g in subset] if len(subset) > 1 else [[]]
            checks = self.probe_many("minimality", removals, confirm=True)
            failing = [s for s in checks if s.outcome == FAIL]
            if not failing or not failing[0].factors:
                evidence = self.probe("ddmin", subset)
                return Culprit(subset, evidence.index, [s.index for s in checks], evidence.data_dependent)
            factors = failing[0].factors

    def run(self) -> BisectResult:
        result = BisectResult(
            "bisected",
            "",
            {k: [self.good.get(k), self.bad[k]] for k in self.factors},
            self.good,
            self.bad,
            full_grid=2 ** len(self.factors),
        )
        target, baseline = self.probe_many(["confirm-target", "confirm-baseline"], [self.factors, []], confirm=True)
        if target.outcome == PASS:
            self._finish(result, "nothing-to-bisect", "the target is already stable: nothing to bisect", target)
        elif target.outcome == FLAKY:
            self._finish(
                result,
                "flaky-target",
                f"the target is flaky (its verdict changed between identical reruns: "
                f"{', '.join(target.verdicts)}); not bisected",
                baseline if baseline.outcome == PASS else None,
            )
        elif target.outcome == UNRESOLVED:
            self._finish(
                result,
                "unresolved-target",
                f"could not test the target: its probes ended "
                f"{', '.join(target.verdicts)}, which says nothing about its numerics; not bisected",
                baseline if baseline.outcome == PASS else None,
            )
        elif baseline.outcome == UNRESOLVED:
            self._finish(
                result,
                "unresolved-baseline",
                f"could not test the baseline: its probes ended {', '.join(baseline.verdicts)}; not bisected",
                None,
            )
        elif baseline.outcome != PASS:
            self._finish(
                result,
                "baseline-fails",
                f"the baseline does not pass ({baseline.outcome}: "
                f"{', '.join(baseline.verdicts)}); nothing to bisect against",
                None,
            )
        else:
            self.seed = self._failing_seeds(self.factors)[0]
            self._bisect(result)
        result.path = self.path
        result.probes = len(self.cache)
        result.configurations = len({json.dumps(json.loads(k)[0], sort_keys=True) for k in self.cache})
        return result

    def _bisect(self, result: BisectResult) -> None:
        remaining, revert = list(self.factors), None
        while True:  # the target with every culprit so far reverted may still fail for another reason
            result.culprits.append(self.isolate(remaining))
            reverted = {f for c in result.culprits for f in c.factors}
            remaining = [f for f in self.factors if f not in reverted]
            if not remaining:
                break
            revert = self.probe("revert", remaining)
            if revert.outcome != FAIL:  # pass; or flaky / unresolved, where no further culprit can be trusted
                break
        candidates = [
            [f for f in self.factors if f not in choice]
            for choice in itertools.product(*[c.factors for c in result.culprits])
        ]
        steps = [s for s in self.probe_many("recommend", candidates, confirm=True) if s.outcome == PASS]
        if not steps:
            fallback = [revert] if revert is not None and revert.outcome == PASS else []
            steps = fallback or [self.probe("recommend", [])]  # the baseline, confirmed at the start
        best = nearest_then_clearly_faster(steps, self.workload)
        names = " + ".join("{" + ", ".join(c.factors) + "}" for c in result.culprits)
        kept = [f for f in self.factors if f in best.factors]
        message = (
            f"culprits: {names}; nearest stable configuration keeps {len(kept)} of {len(self.factors)} target factors"
        )
        nearer = self._between(best, {f for c in result.culprits for f in c.factors})
        if nearer is not None:
            best = nearer
            message += "; " + ", ".join(
                f"{k}={v} is the nearest to the target's {self.bad[k]} that trains stably "
                f"(the baseline has {self.good[k]})"
                for k, v in nearer.between.items()
            )
        self._finish(result, "bisected", message, best)

    def _between(self, best: Step, culprits: set[str]) -> Step | None:
        """For a culprit factor that `best` reverted to the baseline and that has a ladder, the first value
        on the ladder that passes with everything else as in `best`; None when none does."""
        for name, values in self.ladders.items():
            if name not in culprits or name in best.factors:
                continue
            for value in values:
                step = self.probe("between", best.factors, between={name: value})
                if step.outcome == PASS:
                    return step
        return None

    def _finish(self, result: BisectResult, status: str, message: str, recommended: Step | None) -> None:
        result.status, result.message = status, message
        if recommended is not None and recommended.outcome == PASS:
            result.recommended, result.recommended_step = recommended.config, recommended.index


# A passing candidate displaces an equally near one only when it is this much faster: its rate is the
# slowest of a few short probes, which a busy host moves by tens of percent (issue 16 saw 16x).
CLEARLY_FASTER = 1.5


def nearest_then_clearly_faster(steps: list[Step], workload: tuple[str, ...] = ()) -> Step:
    """The recommendation among passing steps: the one that keeps the most target factors (the nearest
    to what the user asked for), then the most `workload` factors (a repair that changes how the step is
    computed before one that changes what is trained: token normalisation with the accumulation kept,
    not the accumulation removed), then candidate order; a later, equally near step wins only when it is
    CLEARLY_FASTER, so the answer does not flip with the host's load."""

    def nearness(s: Step) -> tuple[int, int]:
        return len(s.factors), sum(f in workload for f in s.factors)

    nearest = max(nearness(s) for s in steps)
    best = None
    for s in (s for s in steps if nearness(s) == nearest):
        if best is None or (s.tokens_per_s or 0.0) > CLEARLY_FASTER * (best.tokens_per_s or 0.0):
            best = s
    return best


def judge(trials: list[Trial], runs: list[Run]) -> tuple[str, bool]:
    """(outcome, data_dependent) of one configuration's probes. Reruns with the same seed that disagree
    on the verdict make it flaky; seeds that agree within themselves but differ between each other
    make it a data-dependent failure."""
    if not all(r.resolved for r in runs):
        return UNRESOLVED, False
    by_seed: dict[int, set] = {}
    failed_by_seed: dict[int, bool] = {}
    for t, r in zip(trials, runs):
        by_seed.setdefault(t.seed, set()).add(r.verdict)
        failed_by_seed[t.seed] = r.failed
    if any(len(v) > 1 for v in by_seed.values()):
        return FLAKY, False
    fails = set(failed_by_seed.values())
    if fails == {False}:
        return PASS, False
    return FAIL, fails == {True, False}
