"""A stable eager probe is not replayed (issue 20): read-only hooks on its timed step 0 measure its
headroom, gradient underflow and update loss, the same figures a one-step replay gives, bit for bit,
and its losses and grad-norms are those of an unhooked run. A probe that goes non-finite, a compiled
or fp8 cell, a one-step probe and `check` keep the replay. Real tiny-llama probes, in this process."""

import dataclasses

import pytest

from nandoctor.analysis.forensics import headroom
from nandoctor.cells import Cell
from nandoctor.config import set_field
from nandoctor.recipes import resolve_model
from nandoctor.record import ProbeRecord, ProbeSpec


def spec_for(cell: Cell, steps: int = 2, **fields) -> ProbeSpec:
    from nandoctor.models import plan_model

    recipe = resolve_model("tiny-llama")
    for key, value in fields.items():
        recipe = set_field(recipe, key, value)
    return ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), steps, recipe.seed, "cpu", 1)


def probe(spec: ProbeSpec, monkeypatch=None):
    """Train the spec's probe and take its forensics as the child does; a replay raises when
    monkeypatch is given (the stable path must not reach it)."""
    from nandoctor.child import replay
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS

    if monkeypatch:
        monkeypatch.setattr(replay, "replay", lambda *a: pytest.fail("a stable eager probe was replayed"))
    record = ProbeRecord(spec.probe_id, spec.cell)
    s, snapshot, watch, _ = run_probe(spec, record, ONE_PROCESS, None)
    return record, s, snapshot, watch, replay.forensics_of(spec, record, s, snapshot, watch, ONE_PROCESS)


@pytest.fixture(scope="module")
def fp16_amp():
    """fp16-amp/sdpa/off, 2 steps: stable, and fp16 is the dtype whose headroom the report tabulates."""
    with pytest.MonkeyPatch.context() as mp:
        return probe(spec_for(Cell("fp16-amp", "sdpa", "off")), mp)


def test_a_stable_eager_probe_is_measured_on_timed_step_0_without_a_replay(fp16_amp):
    record, _, _, watch, f = fp16_amp
    assert record.first_nonfinite is None and watch is not None
    assert "error" not in f, f.get("traceback")
    assert (f["measured_on"], f["replayed_steps"], f["compile"]) == ("timed step 0", 0, "off")
    assert [s["step"] for s in f["steps"]] == [0] and f["steps"][0]["loss"] == record.steps[0].loss


def test_its_headroom_is_reported_from_step_0(fp16_amp):
    f = fp16_amp[-1]
    rows = headroom(f)
    assert f["compute_dtype"] == "float16" and len(rows) > 10
    tightest = rows[0]
    assert 1 < tightest["activation_headroom"] < 65504 and tightest["activation_absmax"] > 0
    assert any(r["gradient_absmax"] for r in rows)  # output gradients were watched too
    assert f["underflow"]["loss_scale"] == 65536.0 and f["steps"][0]["update_loss"] is not None


def test_step_0_figures_equal_a_one_step_replay_bit_for_bit(fp16_amp):
    from nandoctor.child.replay import replay

    record, s, snapshot, _, f = fp16_amp
    one = dataclasses.replace(
        spec_for(record.cell), recipe=set_field(resolve_model("tiny-llama"), "forensics_steps", "1")
    )
    r = replay(one, record, s, snapshot)
    assert r["reproduced"] is True and r["replayed_steps"] == 1
    assert f["activation_absmax"] == r["activation_absmax"] and f["gradient_absmax"] == r["gradient_absmax"]
    assert f["steps"][0]["update_loss"] == r["steps"][0]["update_loss"]
    drop = ("seconds",)
    assert {k: v for k, v in f["underflow"].items() if k not in drop} == {
        k: v for k, v in r["underflow"].items() if k not in drop
    }


def test_the_hooks_leave_losses_and_grad_norms_bit_identical(fp16_amp):
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS

    record = fp16_amp[0]
    bare = ProbeRecord(record.probe_id, record.cell)
    _, snapshot, watch, _ = run_probe(spec_for(record.cell, forensics_steps="0"), bare, ONE_PROCESS, None)
    assert snapshot is None and watch is None
    assert [(s.loss, s.grad_norm, s.scale) for s in bare.steps] == [
        (s.loss, s.grad_norm, s.scale) for s in record.steps
    ]


def test_a_probe_that_goes_nonfinite_is_replayed_up_to_its_failure():
    record, _, _, watch, f = probe(spec_for(Cell("fp16-pure", "eager", "off")))
    assert record.first_nonfinite and watch is not None  # watched step 0 too, then replayed
    assert "measured_on" not in f and f["replayed_steps"] == record.first_nonfinite["step"] + 1
    assert f["reproduced"] is True
    assert any(e["phase"] == "optimizer" and e.get("eps_in_dtype") == 0.0 for e in f["events"])


@pytest.mark.parametrize(
    "cell, steps, fields",
    [
        (Cell("fp32", "sdpa", "inductor"), 4, {}),  # hooks need eager execution
        (Cell("fp8-tensorwise", "sdpa", "off"), 4, {}),  # the replay watches the fp8 casts
        (Cell("fp32", "sdpa", "off"), 1, {}),  # step 0 would be the only, steady, step
        (Cell("fp32", "sdpa", "off"), 4, {"forensics_steps": "0"}),  # no forensics asked
    ],
)
def test_cells_that_keep_the_replay_or_have_none(cell, steps, fields):
    from nandoctor.child.replay import eager_forensics

    assert not eager_forensics(spec_for(cell, steps, **fields))
    # a check of more than one step measures its step 0 as a grid probe does (it judges a stall alike)
    assert eager_forensics(dataclasses.replace(spec_for(Cell("fp32", "sdpa", "off"), 4), replay_failed_only=True))
    assert eager_forensics(spec_for(Cell("fp32", "sdpa", "off"), 4))
