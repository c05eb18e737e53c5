"""The low-precision savings compare each low-precision probe with the probe that differs from it only
in that choice (bf16-amp for an fp8 dtype, adamw for an optimizer) and put the guide's claims beside
the measured figures: held, not held, or not measured (a GPU claim on a CPU probe included)."""

import pytest

from nandoctor.analysis.savings import CLAIMS, HELD, NOT_HELD, NOT_MEASURED, SavingsRow, savings

MiB = 1 << 20


def row(
    dtype="bf16-amp",
    optimizer="adamw",
    state=122 * MiB,
    peak=400 * MiB,
    tps=1000.0,
    fidelity=0.002,
    verdict="stable",
    variant="sdpa/off",
    device="cuda",
):
    return SavingsRow(
        f"{dtype}/{variant}/{optimizer}", dtype, optimizer, state, peak, tps, fidelity, verdict, variant, device
    )


def by_claim(rows):
    _, checks = savings(rows)
    return {c.claim.id: c for c in checks}


def test_issue_11_bnb_figures_hold_the_state_claim_but_not_the_overall_one():
    # H100 figures from issue 11: AdamW8bit state 31 MiB against AdamW's 122 MiB
    compared, checks = savings([row(), row(optimizer="bnb-adamw8bit", state=31 * MiB, peak=300 * MiB)])
    assert compared[0].state_saving == pytest.approx(1 - 31 / 122) and compared[0].peak_saving == pytest.approx(0.25)
    assert {c.claim.id: c.verdict for c in checks} == {"8bit-adamw-state": HELD, "8bit-adamw-overall": NOT_HELD}


def test_an_optimizer_is_compared_with_adamw_in_its_own_dtype():
    compared, _ = savings(
        [
            row(dtype="fp32", state=8 * MiB, device="cpu"),
            row(),
            row(dtype="fp32", optimizer="ao-adamw8bit", state=2 * MiB, device="cpu"),
        ]
    )
    assert compared[0].baseline_id == "fp32/sdpa/off/adamw" and compared[0].state_saving == pytest.approx(0.75)


def test_on_a_cpu_the_state_claim_is_judged_and_the_gpu_memory_claim_is_not_measured():
    got = by_claim(
        [
            row(dtype="fp32", device="cpu"),
            row(dtype="fp32", optimizer="ao-adamw8bit", state=30 * MiB, peak=390 * MiB, device="cpu"),
        ]
    )
    assert got["8bit-adamw-state"].verdict == HELD
    assert got["8bit-adamw-overall"].verdict == NOT_MEASURED
    assert got["8bit-adamw-overall"].why == "the claim is about GPU memory; this probe ran on a CPU"


def test_fp8_faster_and_close_to_bf16_holds_both_fp8_claims():
    got = by_claim([row(), row(dtype="fp8-tensorwise", tps=1300.0, fidelity=0.0025)])
    assert {k: c.verdict for k, c in got.items()} == {"fp8-speed": HELD, "fp8-accuracy": HELD}
    assert got["fp8-speed"].figure == pytest.approx(1.3)


def test_fp8_slower_than_bf16_or_further_from_fp32_does_not_hold():
    got = by_claim([row(), row(dtype="fp8-rowwise", tps=800.0, fidelity=0.01)])
    assert {c.verdict for c in got.values()} == {NOT_HELD}


def test_an_unstable_fp8_probe_fails_the_accuracy_claim_and_measures_no_speed():
    got = by_claim([row(), row(dtype="fp8-te-hybrid", tps=2000.0, fidelity=None, verdict="nonfinite")])
    assert got["fp8-accuracy"].verdict == NOT_HELD and got["fp8-speed"].verdict == NOT_MEASURED
    assert got["fp8-speed"].why == "the probe was nonfinite, not stable"


def test_without_a_baseline_of_the_same_variant_nothing_is_measured():
    compared, checks = savings(
        [row(variant="sdpa/off"), row(optimizer="ao-adamw8bit", state=30 * MiB, variant="sdpa/inductor")]
    )
    assert compared[0].baseline_id is None and compared[0].state_saving is None
    assert {c.verdict for c in checks} == {NOT_MEASURED}
    assert checks[0].why == "no bf16-amp/adamw probe of the same variant in this run"


def test_an_optimizer_the_guide_says_nothing_about_is_compared_but_not_judged():
    compared, checks = savings([row(), row(optimizer="ao-adamw4bit", state=17 * MiB)])
    assert compared[0].state_saving == pytest.approx(1 - 17 / 122) and checks == []


def test_full_precision_cells_with_adamw_are_baselines_not_compared():
    compared, checks = savings([row(), row(dtype="fp32"), row(dtype="bf16-pure")])
    assert compared == [] and checks == []


def test_every_claim_quotes_its_source_and_says_how_it_is_read():
    assert all(c.quote and c.source and c.reading and c.low < c.high for c in CLAIMS)
