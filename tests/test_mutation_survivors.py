"""Fast tests for the five mutants of the verdict code that survived the fast tier (bench/RESULTS.md, the
mutation run of issue 44): each rule shown a case on either side of its edge, pure logic on hand-made
records."""

from __future__ import annotations

import math

from nandoctor.analysis.verdicts import References, check_results, reference_key, roundtrip_differs
from nandoctor.cells import Cell
from nandoctor.integrations.judge import headroom_checks
from nandoctor.record import ProbeRecord, Step
from nandoctor.thresholds import THRESHOLDS

VOCAB = 4096  # ln 4096 = 8.318: 10% of it (0.83) is below the 1-nat floor of the band


def probe(cell: str, first_loss: float = 8.3, status: str = "ok", seed: int = 0, steps: int = 8) -> ProbeRecord:
    curve = [Step(i, first_loss - 0.05 * i, 1.0, False, None, tokens_per_s=100.0) for i in range(steps)]
    return ProbeRecord(cell, Cell.parse(cell), status, steps=curve if status == "ok" else [], seed=seed, recipe={})


def band_check(loss: float) -> bool:
    checks = check_results(probe("fp32/eager/off", loss), VOCAB, random_init=True)
    return next(passed for name, passed, _ in checks if name.startswith("initial loss near ln(vocab)"))


def test_the_initial_loss_band_is_the_larger_of_one_nat_and_a_tenth_of_ln_vocab():
    expected = math.log(VOCAB)
    assert THRESHOLDS.init_loss_band_rel * expected < THRESHOLDS.init_loss_band_nats
    assert band_check(expected + 0.95)  # inside 1 nat, outside 10% (0.83): the larger band holds
    assert not band_check(expected + 1.05)
    assert band_check(expected - 0.95)


def test_a_stand_in_reference_is_the_fp32_probe_with_compile_off_then_sdpa():
    refs = References()
    for cell in ("fp32/eager/off", "fp32/sdpa/inductor", "fp32/sdpa:math/off", "fp32/sdpa/off"):
        refs.learn(probe(cell, status="oom") if cell == "fp32/eager/off" else probe(cell))
    assert refs.reference(probe("bf16-amp/sdpa/off")).probe_id == "fp32/sdpa/off"
    refs = References()
    for cell in ("fp32/eager/off", "fp32/sdpa/inductor", "fp32/sdpa:math/off"):
        refs.learn(probe(cell, status="oom") if cell == "fp32/eager/off" else probe(cell))
    assert refs.reference(probe("bf16-amp/sdpa/off")).probe_id == "fp32/sdpa:math/off"  # compile off first


def test_a_probe_is_judged_against_the_reference_of_its_own_seed():
    assert reference_key(probe("bf16-amp/sdpa/off", seed=0)) != reference_key(probe("bf16-amp/sdpa/off", seed=1))
    refs = References()
    refs.learn(probe("fp32/eager/off", first_loss=8.3, seed=0))
    refs.learn(probe("fp32/eager/off", first_loss=6.0, seed=1))
    assert refs.of(probe("bf16-amp/sdpa/off", seed=1))[0].loss == 6.0


def test_a_merged_loss_two_percent_off_the_live_one_fails_the_round_trip():
    def rt(merged: float) -> dict:
        return {
            "adapter": True,
            "loss": {"live": 5.0, "merged": merged, "reloaded": merged},
            "logits_rel_change": {"merged": 0.0, "reloaded": 0.0},
            "tied": {"live": False, "merged": False, "reloaded": False},
            "unmerged": [],
            "tensors": {"merge": [], "reload": []},
        }

    assert THRESHOLDS.roundtrip_loss_rel == 0.01
    assert any(d.startswith("merged loss 5.1") for d in roundtrip_differs(rt(5.1)))  # 2% off
    assert roundtrip_differs(rt(5.04)) == []  # 0.8% off


def test_the_callbacks_headroom_check_fails_below_one_and_passes_above():
    def passed(absmax: float) -> bool:
        forensics = {"compute_dtype": "float16", "activation_absmax": {"mlp": absmax}, "gradient_absmax": {}}
        return next(ok for name, ok, _ in headroom_checks(forensics, []) if name.startswith("activation"))

    assert passed(1000.0)  # 65504 / 1000: 65x to spare
    assert not passed(70000.0)  # beyond fp16's largest value
    assert not passed(65504.0)  # exactly at the edge: no headroom left
