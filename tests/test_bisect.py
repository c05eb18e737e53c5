"""The bisection engine against small fake oracles: pure logic, no torch, no processes."""

import math

from nandoctor.bisect.engine import FLAKY, Bisection, Run, Trial, ddmin, judge, split

FACTORS = [f"f{i}" for i in range(16)]
GOOD = {f: "good" for f in FACTORS}
BAD = {f: "bad" for f in FACTORS}


class FakeOracle:
    """Fails a configuration when `breaks(applied factors)` is true; counts every probe it runs."""

    def __init__(self, breaks, verdict="nonfinite", flip=None):
        self.breaks, self.verdict, self.flip = breaks, verdict, flip or (lambda applied, trial: False)
        self.trials = []

    def __call__(self, trials):
        runs = []
        for t in trials:
            self.trials.append(t)
            applied = {k for k, v in t.config.items() if v == "bad"}
            failed = self.breaks(applied) != self.flip(applied, t)
            runs.append(
                Run(
                    f"p{len(self.trials)}",
                    self.verdict if failed else "stable",
                    failed,
                    tokens_per_s=100.0 * len(applied),
                )
            )
        return runs


def bisect(breaks, factors=FACTORS, reruns=0, data_seeds=0, parallel=1, flip=None):
    oracle = FakeOracle(breaks, flip=flip)
    good, bad = {f: "good" for f in factors}, {f: "bad" for f in factors}
    return Bisection(good, bad, oracle, reruns, data_seeds, parallel).run(), oracle


def test_split_covers_every_factor_in_order():
    assert split(list("abcde"), 2) == [list("abc"), list("de")]
    assert split(list("ab"), 4) == [["a"], ["b"]]


def test_ddmin_returns_the_single_culprit():
    assert ddmin(FACTORS, lambda cands: next((i for i, c in enumerate(cands) if "f11" in c), None)) == ["f11"]


def test_single_culprit_is_named_and_the_rest_is_kept():
    result, _ = bisect(lambda applied: "f5" in applied)
    assert result.status == "bisected"
    assert [c.factors for c in result.culprits] == [["f5"]]
    assert result.recommended == {**BAD, "f5": "good"}  # nearest the target: only the culprit reverted


def test_two_factor_interaction_comes_out_as_the_pair():
    result, _ = bisect(lambda applied: {"f2", "f9"} <= applied)
    assert [sorted(c.factors) for c in result.culprits] == [["f2", "f9"]]
    steps = {s.index: s for s in result.path}
    culprit = result.culprits[0]
    assert steps[culprit.evidence].outcome == "fail"
    assert [steps[i].outcome for i in culprit.minimality] == ["pass", "pass"]
    # reverting either one breaks the interaction; the fake is faster with more target factors kept
    reverted = {k for k, v in result.recommended.items() if v == "good"}
    assert len(reverted) == 1 and reverted < {"f2", "f9"}


def test_two_independent_culprits_are_both_found():
    result, _ = bisect(lambda applied: "f1" in applied or "f14" in applied)
    assert sorted(c.factors for c in result.culprits) == [["f1"], ["f14"]]
    assert result.recommended == {**BAD, "f1": "good", "f14": "good"}


def test_stable_target_means_nothing_to_bisect():
    result, oracle = bisect(lambda applied: False)
    assert result.status == "nothing-to-bisect" and "nothing to bisect" in result.message
    assert result.recommended == BAD and not result.culprits
    assert len(oracle.trials) == 2  # the target and the baseline, nothing more


def test_failing_baseline_is_reported_and_nothing_is_recommended():
    result, _ = bisect(lambda applied: True)
    assert result.status == "baseline-fails" and result.recommended is None


def test_target_whose_rerun_disagrees_is_flaky_and_not_bisected():
    result, _ = bisect(
        lambda applied: bool(applied), reruns=1, flip=lambda applied, trial: bool(applied) and trial.attempt == 1
    )
    assert result.status == "flaky-target" and not result.culprits
    assert result.path[0].outcome == FLAKY and result.path[0].verdicts == ["nonfinite", "stable"]
    assert result.recommended == GOOD  # the baseline held up on its rerun


def test_flaky_factor_is_not_used_as_a_culprit():
    # f0 alone fails on first runs only; f12 fails every time
    def flip(applied, trial):
        return applied == {"f0"} and trial.attempt == 1

    result, _ = bisect(
        lambda applied: "f12" in applied or applied == {"f0"}, factors=["f0", "f12"], reruns=1, flip=flip
    )
    assert [c.factors for c in result.culprits] == [["f12"]]
    assert any(s.outcome == FLAKY and s.factors == ["f0"] for s in result.path)


def test_failure_on_some_seeds_only_is_data_dependent():
    result, _ = bisect(
        lambda applied: "f3" in applied,
        reruns=0,
        data_seeds=2,
        flip=lambda applied, trial: "f3" in applied and trial.seed == 1,
    )
    assert [c.factors for c in result.culprits] == [["f3"]]
    assert result.culprits[0].data_dependent


def test_probe_count_for_one_culprit_grows_like_log_k():
    counts = {}
    for k in (4, 16, 64):
        factors = FACTORS[:k] if k <= 16 else [f"g{i}" for i in range(k)]
        culprit = factors[k // 3]
        result, oracle = bisect(lambda applied, culprit=culprit: culprit in applied, factors=factors)
        assert [c.factors for c in result.culprits] == [[culprit]]
        counts[k] = result.configurations
        assert result.full_grid == 2**k
    assert counts[16] < 16 and counts[64] < 2 * counts[16]
    assert counts[64] <= 2 * math.log2(64) + 4, counts


def test_parallel_probing_finds_the_same_culprit():
    result, _ = bisect(lambda applied: "f7" in applied, parallel=4)
    assert [c.factors for c in result.culprits] == [["f7"]]


def test_judge_needs_every_probe_resolved():
    trials = [Trial({"a": 1}), Trial({"a": 1}, attempt=1)]
    assert judge(trials, [Run("x", "unsupported", False, resolved=False), Run("y", "stable", False)])[0] == "unresolved"


class TimingOutOracle(FakeOracle):
    """The target configuration (every factor applied) hangs: a timeout, unresolved."""

    def __call__(self, trials):
        runs = super().__call__(trials)
        return [
            Run(r.probe_id, "timeout", True, resolved=False)
            if len(t.config) == sum(v == "bad" for v in t.config.values())
            else r
            for t, r in zip(trials, runs)
        ]


def test_a_target_that_only_times_out_is_unresolved_with_no_culprit():
    oracle = TimingOutOracle(lambda applied: False)
    result = Bisection(GOOD, BAD, oracle, reruns=0).run()
    assert result.status == "unresolved-target" and not result.culprits
    assert result.message.startswith("could not test the target: its probes ended timeout")
    assert result.recommended == GOOD  # the baseline passed: it is still the safe configuration


def test_an_unresolved_subset_is_neither_pass_nor_fail_for_ddmin():
    # f12 fails; a subset with f9 but not f12 hangs: ddmin must still isolate f12 and never blame f9
    class Hangs(FakeOracle):
        def __call__(self, trials):
            runs = super().__call__(trials)
            return [
                Run(r.probe_id, "timeout", True, resolved=False)
                if t.config["f9"] == "bad" and t.config["f12"] == "good"
                else r
                for t, r in zip(trials, runs)
            ]

    result = Bisection(GOOD, BAD, Hangs(lambda applied: "f12" in applied), reruns=0).run()
    assert [c.factors for c in result.culprits] == [["f12"]]
    assert any(s.outcome == "unresolved" and "f9" in s.factors for s in result.path)


def _passing(index, factors, rate):
    from nandoctor.bisect.engine import PASS, Step

    return Step(index, "recommend", factors, {}, PASS, ["stable"], [f"p{index}"], False, rate)


def test_recommendation_keeps_the_most_target_factors_whatever_the_speed():
    from nandoctor.bisect.engine import nearest_then_clearly_faster

    near, far = _passing(0, ["f1", "f2"], 10.0), _passing(1, ["f1"], 1000.0)
    assert nearest_then_clearly_faster([far, near]) is near


def test_equally_near_candidates_are_not_reordered_by_speed_noise():
    from nandoctor.bisect.engine import nearest_then_clearly_faster

    first, noisy = _passing(0, ["f1"], 100.0), _passing(1, ["f2"], 140.0)  # 40% faster: within a busy host's noise
    assert nearest_then_clearly_faster([first, noisy]) is first
    clearly = _passing(2, ["f3"], 200.0)
    assert nearest_then_clearly_faster([first, noisy, clearly]) is clearly


def test_a_repair_keeps_the_users_accumulation_where_fixing_the_normalisation_also_holds():
    from nandoctor.bisect.factors import WORKLOAD

    good = {"gradient_accumulation_steps": 1, "loss_normalization": "tokens"}
    bad = {"gradient_accumulation_steps": 4, "loss_normalization": "micro_batch"}

    probed = []

    def oracle(trials):  # micro-batch normalisation misweights only an accumulated step
        probed.extend(trials)
        fails = [t.config == bad for t in trials]
        return [Run(f"p{len(probed)}-{i}", "misconfigured" if f else "stable", f) for i, f in enumerate(fails)]

    result = Bisection(good, bad, oracle, reruns=0, workload=WORKLOAD).run()
    assert [sorted(c.factors) for c in result.culprits] == [["gradient_accumulation_steps", "loss_normalization"]]
    assert result.recommended == {"gradient_accumulation_steps": 4, "loss_normalization": "tokens"}
