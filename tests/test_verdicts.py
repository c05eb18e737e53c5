"""Verdict thresholds on hand-made curves: pure logic, no torch."""

import math

import pandas as pd

from nandoctor.analysis.ranking import rank, tokens_per_s
from nandoctor.analysis.verdicts import check_results, classify, fidelity, numeric_verdict
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step
from nandoctor.thresholds import THRESHOLDS

NAN, INF = math.nan, math.inf


def curve(losses, grads=None, scales=None, skipped=None):
    n = len(losses)
    grads = grads or [1.0] * n
    scales = scales or [None] * n
    skipped = skipped or [False] * n
    return [
        Step(i, loss, g, k, s, tokens_per_s=100.0 + i)
        for i, (loss, g, s, k) in enumerate(zip(losses, grads, scales, skipped))
    ]


def record(status, **fields):
    return ProbeRecord("p", Cell(), status, **fields)


def falling(n=16, start=8.0, drop=2.0):
    return [start - drop * i / (n - 1) for i in range(n)]


def test_a_falling_finite_curve_is_stable():
    assert numeric_verdict(curve(falling()), None).name == "stable"


def test_nan_loss_is_nonfinite_at_its_step():
    v = numeric_verdict(curve([8.0, 7.9, NAN]), None)
    assert (v.name, v.step) == ("nonfinite", 2) and "loss is nan" in v.reason


def test_inf_grad_without_scaler_is_nonfinite():
    assert numeric_verdict(curve([8.0, 7.9], grads=[1.0, INF]), None).name == "nonfinite"


def test_gradscaler_calibration_skips_are_not_failures():
    steps = curve(
        falling(6),
        grads=[INF, INF, 1, 1, 1, 1],
        scales=[65536.0, 32768.0] + [16384.0] * 4,
        skipped=[True, True, False, False, False, False],
    )
    assert numeric_verdict(steps, None).name == "stable"


def test_gradscaler_scale_collapse_is_nonfinite():
    steps = curve([8.0] * 3, grads=[INF] * 3, scales=[4.0, 2.0, 1.0], skipped=[True] * 3)
    v = numeric_verdict(steps, None)
    assert v.name == "nonfinite" and "scale fell below 1" in v.reason and v.step == 2


def test_exact_zero_loss_is_zero_loss():
    assert numeric_verdict(curve([8.0, 0.0, 7.0]), None).name == "zero-loss"


def test_loss_spike_over_twice_the_window_mean_is_diverged():
    v = numeric_verdict(curve([8.0, 7.5, 7.0, 6.5, 15.0, 6.0]), None)
    assert v.name == "diverged" and v.step == 4 and "spiked" in v.reason


def spike_by_definition(steps, t=THRESHOLDS):
    """loss_spike's rule read straight from its definition: each step against every earlier step of its
    kind and a like size, the last spike_window of them (what loss_spike computes reading backwards)."""

    def like(a, b):
        if not a.supervised or not b.supervised:
            return True
        return max(a.supervised, b.supervised) <= t.spike_size_ratio * min(a.supervised, b.supervised)

    for k, now in enumerate(steps):
        window = [s.loss for s in steps[:k] if s.batch == now.batch and like(s, now)][-t.spike_window :]
        if len(window) >= t.spike_min_history:
            mean = sum(window) / len(window)
            if mean > 0 and now.loss > t.spike_factor * mean:
                return now.step, round(now.loss / mean, 1)
    return None


def test_the_spike_check_reading_each_window_backwards_finds_what_its_definition_finds():
    """loss_spike reads only each step's window (a long fit a callback watches costs steps x window, not
    steps squared: bench/spike_check.py times it); on random curves of mixed batch kinds and sizes it names
    the same step at the same ratio as the rule read from its definition, or no spike where that finds none."""
    import random

    from nandoctor.analysis.verdicts.curve import loss_spike

    rng, found = random.Random(0), 0
    for _ in range(400):
        n = rng.randint(2, 60)
        steps = [
            Step(
                i,
                rng.choice([rng.uniform(0.5, 3.0), rng.uniform(5.0, 12.0), -rng.uniform(0, 1)]),
                1.0,
                supervised=rng.choice([None, 64, 200, 900]),
                batch=rng.choice([None, "first", "longest"]),
            )
            for i in range(n)
        ]
        v = loss_spike(steps)
        want = spike_by_definition(steps)
        assert (v.step, float(v.reason.split(", ")[1].split("x")[0])) == want if v else want is None, steps
        found += v is not None
    assert 50 < found < 350  # both kinds of answer were asked for


def test_grad_norm_explosion_is_diverged():
    v = numeric_verdict(curve(falling(6), grads=[2.0, 2.0, 2.0, 50.0, 2.0, 2.0]), None)
    assert v.name == "diverged" and "exploded" in v.reason


def test_a_whole_curve_names_the_earlier_of_an_explosion_and_a_spike_as_a_live_run_meets_them():
    """An unclipped lr 0.7 on the tiny Llama's random rows: the grad-norm explodes at step 1, the loss
    spikes at step 3; a callback judging step by step stops at step 1, and so must the grid's verdict."""
    losses, grads = [6.94, 27.0, 23.0, 60.0], [1.5, 1000.0, 800.0, 900.0]
    whole = numeric_verdict(curve(losses, grads), None)
    live = next(
        v
        for k in range(4)
        if (v := numeric_verdict(curve(losses[: k + 1], grads[: k + 1]), None, since=k)).name != "stable"
    )
    assert (whole.step, live.step) == (1, 1) and "exploded" in whole.reason and whole.reason == live.reason


def test_loss_rising_half_a_nat_is_diverged():
    assert numeric_verdict(curve([8.0, 8.2, 8.4, 8.6, 8.8, 9.0, 9.2, 9.4]), None).name == "diverged"


def test_curve_that_stalls_while_reference_falls_is_drift():
    ref = curve(falling(16, drop=1.0))
    stalled = curve([8.0 - 0.2 * i / 15 for i in range(16)])
    v = numeric_verdict(stalled, ref)
    assert v.name == "drift" and "fp32 reference" in v.reason


def test_curve_within_tolerance_of_reference_is_stable():
    ref = curve(falling(16, drop=1.0))
    close = curve([loss + 0.005 for loss in falling(16, drop=1.0)])
    assert numeric_verdict(close, ref).name == "stable"


def test_a_curve_a_few_hundredths_of_a_nat_off_a_flat_reference_drifts():
    """The absolute floor of the drift tolerance is 0.02 nats: a reference that barely moves (0.018 nats
    from its first step to its last quarter, a quarter of which adds 0.0045) leaves a tolerance of 0.024,
    so a curve 0.05 nats above it has left it, and one 0.015 nats above it has not."""
    flat = [8.0 - 0.02 * i / 15 for i in range(16)]
    off = numeric_verdict(curve([loss + 0.05 for loss in flat]), curve(flat))
    assert off.name == "drift" and "tolerance 0.024" in off.reason
    assert numeric_verdict(curve([loss + 0.015 for loss in flat]), curve(flat)).name == "stable"


def test_harness_statuses_map_to_verdicts():
    assert classify(record("timeout", timeout_s=5)).name == "timeout"
    assert classify(record("signal", signal="SIGSEGV")).name == "crash"
    assert classify(record("signal", signal="SIGKILL")).name == "killed"
    err = {"type": "OutOfMemoryError", "message": "CUDA out of memory", "oom": True}
    assert classify(record("error", error=err)).name == "oom"
    assert classify(record("unsupported", reason="no")).name == "unsupported"


def test_fidelity_is_mean_relative_loss_error():
    ref = curve([10.0, 8.0])
    assert fidelity(curve([11.0, 8.0]), ref) == 0.05
    assert fidelity(curve([NAN, 8.0]), ref) is None


def test_rank_prefers_fidelity_buckets_then_speed_then_memory():
    rows = pd.DataFrame(
        [
            {"id": "slow-exact", "fidelity": 0.0, "tokens_per_s": 10, "peak_memory_bytes": 1},
            {"id": "fast-close", "fidelity": 0.001, "tokens_per_s": 50, "peak_memory_bytes": 1},
            {"id": "fast-far", "fidelity": 0.2, "tokens_per_s": 99, "peak_memory_bytes": 1},
            {"id": "fast-close-lean", "fidelity": 0.002, "tokens_per_s": 50, "peak_memory_bytes": 0},
        ]
    )
    assert list(rank(rows)["id"]) == ["fast-close-lean", "fast-close", "slow-exact", "fast-far"]


def test_tokens_per_s_leaves_out_the_warmup_step():
    steps = [Step(i, 1.0, 1.0, tokens_per_s=rate) for i, rate in enumerate([1.0, 10.0, 12.0])]
    assert tokens_per_s(steps) == 11.0


def test_check_flags_initial_loss_far_from_ln_vocab():
    checks = dict(
        (name, ok) for name, ok, _ in check_results(record("ok", steps=curve([2.0])), vocab=4096, random_init=True)
    )
    assert checks["initial loss near ln(vocab)"] is False and checks["loss finite at step 0"] is True


def test_inside_a_fidelity_bucket_a_cell_flagged_by_a_rule_ranks_below_a_clean_one():
    rows = pd.DataFrame(
        [
            {
                "id": "bf16-pure",
                "fidelity": 0.0018,
                "tokens_per_s": 90,
                "peak_memory_bytes": 1,
                "flags": "bf16-weights-without-fp32-master",
            },
            {"id": "bf16-amp", "fidelity": 0.0003, "tokens_per_s": 50, "peak_memory_bytes": 1, "flags": ""},
            {"id": "far", "fidelity": 0.2, "tokens_per_s": 99, "peak_memory_bytes": 1, "flags": ""},
        ]
    )
    assert list(rank(rows)["id"]) == ["bf16-amp", "bf16-pure", "far"]


def test_every_threshold_says_where_it_comes_from():
    """Each Thresholds field is named in its docstring, beside its reason."""
    from dataclasses import fields

    from nandoctor.thresholds import Thresholds

    doc = Thresholds.__doc__
    assert [f.name for f in fields(Thresholds) if f.name not in doc] == []


def test_check_fails_a_gradscaler_that_skipped_every_step():
    """`check --steps 8` on an fp16-amp loss scaled so far that every step overflowed: the scale never fell
    below 1, but the optimizer never stepped."""
    n = 8
    steps = curve([8.0] * n, grads=[INF] * n, scales=[65536.0 / 2**i for i in range(n)], skipped=[True] * n)
    checks = {name: ok for name, ok, _ in check_results(record("ok", steps=steps), 256, False)}
    assert checks["no skipped step beyond GradScaler calibration"] is False
