"""The RL verdict and ranking (objective=grpo, docs/rl.md): a GRPO probe is stable only while its rollout's
log-probs are close enough to the training path's that a long completion's importance ratio stays inside
TRL's cap (Thresholds.off_policy), and the stable ones rank by that mismatch, then speed, never by a loss
fidelity to fp32 (a GRPO loss is near 0 by construction). Pure: records as a GRPO probe writes them, with
the figures measured on tiny-llama here (tests/test_rl_grid.py)."""

import math

import pytest

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.analysis.verdicts import OFF_POLICY, STABLE, check_results, classify
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step
from nandoctor.report.formatting import ranking_rows
from nandoctor.report.matrix import VERDICT_COLORS
from nandoctor.thresholds import THRESHOLDS

# mean |dlogp| as measured on tiny-llama, 2 steps of 2 prompts x 4 generations x 16 tokens (docs/rl.md)
FP32, FP16, BF16 = 1.5e-7, 9.5e-5, 7.5e-4
# GRPO losses of those probes: near 0, and far apart relatively (the 2112995% "fidelity" of bf16-amp)
LOSSES = {"fp32": [-3.0e-8, -2.9e-8], "fp16-amp": [-1.3e-4, 1.0e-5], "bf16-amp": [6.0e-4, 5.5e-4]}


def mismatch(mean: float, masked: float = 0.0, ratio_max: float = 1.004) -> dict:
    return {
        "engine": "generate",
        "steps": 2,
        "sequences": 16,
        "tokens": 256,
        "logp_diff_mean": mean,
        "logp_diff_max": 5 * mean,
        "k3_kl": mean**2,
        "ratio": {"min": 0.99, "p10": 0.995, "median": 1.0, "p90": 1.003, "max": ratio_max},
        "masked_share": masked,
        "mask_cap": 3.0,
    }


def grpo(dtype: str, mean: float | None, attn: str = "sdpa", tokens_per_s: float = 1000.0, **kw) -> ProbeRecord:
    losses = LOSSES.get(dtype, LOSSES["fp32"])
    steps = [Step(i, loss, 0.5, tokens_per_s=tokens_per_s, reward=0.5, entropy=8.3) for i, loss in enumerate(losses)]
    return ProbeRecord(
        f"{dtype}/{attn}/off",
        Cell(dtype, attn, "off"),
        steps=steps,
        recipe={"name": "tiny-llama", "objective": "grpo"},
        rollout_mismatch=mismatch(mean, **kw) if mean is not None else None,
    )


def test_bf16_amps_measured_mismatch_is_off_policy_at_a_4096_token_completion():
    v = classify(grpo("bf16-amp", BF16))
    assert (v.name, v.step) == (OFF_POLICY, 0) and v.failed
    assert "mean |dlogp| 7.50e-04" in v.reason and "4096-token completion" in v.reason
    assert f"exp({BF16 * 4096:.3g})" in v.reason and "beyond TRL's sequence cap 3" in v.reason


@pytest.mark.parametrize("dtype, mean", [("fp32", FP32), ("fp16-amp", FP16)])
def test_fp32_and_fp16_amps_measured_mismatch_is_on_policy(dtype, mean):
    assert classify(grpo(dtype, mean)).name == STABLE


def test_the_bound_is_the_cap_at_the_reference_length():
    edge = math.log(THRESHOLDS.rollout_ratio_cap) / THRESHOLDS.rollout_reference_tokens  # 2.7e-4
    assert classify(grpo("bf16-amp", 0.99 * edge)).name == STABLE
    assert classify(grpo("bf16-amp", 1.01 * edge)).name == OFF_POLICY


def test_completions_the_sequence_mask_already_drops_are_off_policy_however_small_the_mean():
    v = classify(grpo("fp16-amp", FP16, masked=0.125, ratio_max=3.4))
    assert v.name == OFF_POLICY and "12.5% of the probe's own 16 completions" in v.reason
    assert "largest 3.4" in v.reason and "4096-token" not in v.reason
    assert classify(grpo("fp16-amp", FP16, masked=0.0, ratio_max=2.9)).name == STABLE


def test_an_sft_probe_is_never_judged_on_a_rollout():
    sft = grpo("bf16-amp", BF16)
    sft.recipe = {"name": "tiny-llama", "objective": "sft"}
    sft.steps = [Step(i, loss, 1.0) for i, loss in enumerate([8.3, 8.1])]
    assert classify(sft).name == STABLE


def test_off_policy_has_a_colour_in_the_matrix():
    assert OFF_POLICY in VERDICT_COLORS


def test_grpo_ranks_by_mismatch_then_speed_and_shows_no_loss_fidelity():
    # fp16 is 5x faster than the fp32 cells here, but further from on-policy: it ranks after both
    records = [
        grpo("fp32", FP32, "eager", tokens_per_s=1000.0),
        grpo("fp32", 1.55e-7, "sdpa", tokens_per_s=3000.0),
        grpo("fp16-amp", FP16, tokens_per_s=15000.0),
        grpo("bf16-amp", BF16, tokens_per_s=30000.0),
    ]
    a = analyze_records({"kind": "grid", "planned": 4}, records)
    assert [o.probe_id for o in a.ranking] == ["fp32/sdpa/off", "fp32/eager/off", "fp16-amp/sdpa/off"]
    assert all(o.fidelity is None for o in a.outcomes)  # a GRPO loss against fp32's says nothing
    assert list(a.table["rollout_logp_diff"]) == [FP32, 1.55e-7, FP16, BF16]
    rows = ranking_rows(a)
    assert [r["rollout mean |dlogp|"] for r in rows] == ["1.55e-07", "1.50e-07", "9.50e-05"]
    assert all("fidelity vs fp32" not in r for r in rows)


def test_a_grpo_probes_loss_is_never_drift_against_fp32s():
    # other sampled completions give another GRPO loss: 0.05 nats off fp32's is past drift's 0.02 for an sft
    # probe, and says nothing of a GRPO one, whose mismatch here is inside the bounds
    other = grpo("bf16-amp", FP16)
    other.steps = [Step(i, loss, 0.5) for i, loss in enumerate([0.06, 0.05])]
    a = analyze_records({"kind": "grid", "planned": 2}, [grpo("fp32", FP32), other])
    assert [o.verdict.name for o in a.outcomes] == [STABLE, STABLE]
    other.recipe = {"name": "tiny-llama", "objective": "sft"}
    assert classify(other, grpo("fp32", FP32).steps).name == "drift"  # the same curves, judged as sft


def test_check_does_not_hold_a_grpo_loss_to_ln_vocab():
    checks = {name: (ok, detail) for name, ok, detail in check_results(grpo("fp32", FP32), 4096, True)}
    assert checks["initial loss near ln(vocab)"] == (True, "skipped: a GRPO loss is no cross-entropy")
    sft = grpo("fp32", FP32)
    sft.recipe = {"name": "tiny-llama", "objective": "sft"}
    checks = {name: ok for name, ok, _ in check_results(sft, 4096, True)}
    assert checks["initial loss near ln(vocab)"] is False  # a loss of 0 is far from ln(4096) = 8.3


def test_check_shows_the_off_policy_rule_as_a_check():
    checks = {name: ok for name, ok, _ in check_results(grpo("bf16-amp", BF16), 4096, True)}
    assert checks["rollout log-probs match training"] is False
    checks = {name: ok for name, ok, _ in check_results(grpo("fp16-amp", FP16), 4096, True)}
    assert checks["rollout log-probs match training"] is True


def test_a_grpo_loss_of_exactly_zero_is_no_zero_loss_fault():
    # completions that all run to max_new_tokens: each group's advantages sum to 0, and so does the dapo loss
    # (bf16-amp with the eager kernel on both paths measured mean |dlogp| 0.0 and such a loss on this CPU)
    exact = grpo("bf16-amp", 0.0)
    exact.steps = [Step(i, 0.0, 0.5) for i in range(2)]
    assert classify(exact).name == STABLE
    exact.recipe = {"name": "tiny-llama", "objective": "sft"}
    assert classify(exact).name == "zero-loss"


# GRPO losses as four steps of bf16-amp under vLLM measured them on an H200 (docs/gpu/2026-11-28-h200-rl.md):
# a surrogate of either sign around 0, whose step 3 is 7.7x the mean of the steps before it
H200_GRPO_LOSSES = [-0.01291, 0.00488, 0.00953, 0.00384]


def test_a_grpo_curve_is_not_judged_by_the_size_of_its_surrogate_loss():
    measured = grpo("fp32", 0.0)  # a mismatch inside the bound: only the curve could fail it
    measured.steps = [Step(i, loss, 0.5) for i, loss in enumerate(H200_GRPO_LOSSES)]
    assert classify(measured).name == STABLE
    rising = grpo("fp32", 0.0)  # a rise of a nat: a surrogate's value, no sign of a breaking run
    rising.steps = [Step(i, loss, 0.5) for i, loss in enumerate([-0.5, 0.1, 0.3, 0.6, 0.6, 0.6])]
    assert classify(rising).name == STABLE
    for sft in (measured, rising):
        sft.recipe = {"name": "tiny-llama", "objective": "sft"}
        assert classify(sft).name == "diverged"  # the same curve read as an sft loss


def test_a_grpo_curve_is_still_judged_by_its_grad_norm_and_finiteness():
    exploding = grpo("fp32", 0.0)
    exploding.steps = [Step(i, loss, g) for i, (loss, g) in enumerate(zip(H200_GRPO_LOSSES, [0.5, 0.5, 0.5, 400.0]))]
    assert classify(exploding).name == "diverged"
    broken = grpo("fp32", 0.0)
    broken.steps = [Step(0, 0.001, 0.5), Step(1, float("nan"), 0.5)]
    assert classify(broken).name == "nonfinite"


def test_a_grpo_loss_at_0_every_step_is_no_sign_that_nothing_learns():
    # every completion as long as the others at every step: the surrogate is 0.0 throughout
    flat = grpo("fp32", 0.0)
    flat.steps = [Step(i, 0.0, 0.5) for i in range(6)]
    assert classify(flat).name == STABLE
    dead = grpo("fp32", 0.0)  # no gradient at all is still no learning
    dead.steps = [Step(i, 0.0, 0.0) for i in range(6)]
    assert classify(dead).name == "no-learning"
