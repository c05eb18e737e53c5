"""The pure side of forensics: which event is the origin, headroom ratios, replay checks, fidelity curve."""

import math

from nandoctor.analysis.forensics import FINFO_MAX, headroom, origin, update_loss
from nandoctor.analysis.verdicts import fidelity_curve
from nandoctor.cells import AXES, Cell
from nandoctor.child.replay import replay_cost, reproduced
from nandoctor.record import Step

NAN = math.nan


def step(i, loss=2.0, skipped=False, scale=None, grad_norm=1.0, update=None, time_s=0.1):
    return Step(i, loss, grad_norm, skipped, scale, time_s, update_loss=update)


def steps(*made):
    """Steps as the forensics record holds them (JSON)."""
    return [s.to_dict() for s in made]


def event(i, phase, module="m"):
    return {"step": i, "phase": phase, "module": module, "tensor": "output", "stats": {}}


def test_backward_overflow_on_a_gradscaler_calibration_skip_is_not_the_origin():
    f = {
        "steps": steps(step(0, skipped=True, scale=65536.0), step(1, scale=32768.0)),
        "events": [event(0, "backward", "lm_head")],
    }
    assert origin(f) is None


def test_backward_overflow_that_drives_the_scale_below_one_is_the_origin():
    f = {"steps": steps(step(0, skipped=True, scale=1.0)), "events": [event(0, "backward", "lm_head")]}
    assert origin(f)["module"] == "lm_head"


def test_optimizer_step_before_the_next_forward_is_the_origin():
    f = {
        "steps": steps(step(0), step(1, loss=NAN)),
        "events": [
            event(1, "forward", "model.embed_tokens"),
            event(0, "optimizer", "model.embed_tokens"),
            event(1, "backward", "lm_head"),
        ],
    }
    o = origin(f)
    assert (o["phase"], o["step"]) == ("optimizer", 0)


def test_forward_comes_before_backward_within_a_step():
    f = {"steps": steps(step(0, loss=NAN)), "events": [event(0, "backward", "a"), event(0, "forward", "b")]}
    assert origin(f)["module"] == "b"


def test_headroom_is_the_dtype_max_over_the_largest_value_tightest_first():
    f = {
        "compute_dtype": "float16",
        "activation_absmax": {"a": 65504.0 / 1.7, "b": 10.0, "c": math.inf},
        "gradient_absmax": {"a": 2.0},
    }
    rows = headroom(f)
    assert [r["module"] for r in rows] == ["c", "a", "b"]
    assert rows[0]["activation_headroom"] == 0.0  # overflowed
    assert math.isclose(rows[1]["activation_headroom"], 1.7)
    assert rows[1]["gradient_headroom"] == 65504.0 / 2.0 and rows[2]["gradient_headroom"] is None


def test_compute_dtype_of_each_precision_cell():
    assert [Cell(d).precision.compute for d in AXES["dtype"]] == [
        "float32",
        "float32",
        "bfloat16",
        "float16",
        "bfloat16",
        "float16",
    ] + ["bfloat16"] * 4  # fp8: in bf16 autocast


def test_update_loss_averages_the_steps_that_ran_an_optimizer_step():
    f = {"weight_dtype": "bfloat16", "steps": steps(step(0, update=0.6), step(1, skipped=True), step(2, update=0.8))}
    u = update_loss(f)
    assert math.isclose(u["mean"], 0.7) and u["max"] == 0.8 and u["steps"] == 2


def test_a_replay_reproduces_only_with_the_same_losses_nan_included():
    timed = [step(0, loss=2.5), step(1, loss=NAN)]
    assert reproduced(timed, [step(0, loss=2.5), step(1, loss=NAN)])
    assert not reproduced(timed, [step(0, loss=2.5000001), step(1, loss=NAN)])
    assert not reproduced(timed, [])


def test_replay_cost_is_the_median_hooked_over_timed_step_ratio_without_step_0():
    timed = [step(i, time_s=t) for i, t in enumerate([5.0, 1.0, 1.0, 1.0])]
    hooked = [step(i, time_s=t) for i, t in enumerate([9.0, 1.2, 1.5, 1.3])]
    assert math.isclose(replay_cost(timed, hooked, 3.0)["hooked_step_overhead"], 1.3)


def test_fidelity_curve_is_relative_error_per_step_and_none_where_nonfinite():
    ref = [step(0, loss=2.0, grad_norm=4.0), step(1, loss=1.0, grad_norm=2.0)]
    mine = [step(0, loss=2.2, grad_norm=4.0), step(1, loss=NAN, grad_norm=3.0)]
    curve = fidelity_curve(mine, ref)
    assert math.isclose(curve[0]["loss"], 0.1) and curve[0]["grad_norm"] == 0.0
    assert curve[1]["loss"] is None and math.isclose(curve[1]["grad_norm"], 0.5)


def test_finfo_table_matches_torch():
    import torch

    assert FINFO_MAX == {name: torch.finfo(getattr(torch, name)).max for name in FINFO_MAX}
