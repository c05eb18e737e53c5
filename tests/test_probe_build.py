"""The probe's model is built once, on its device, the same from the same seed; the forensics replay
restarts it from a snapshot instead of building it again, and still retraces the timed losses."""

import pytest
import torch

from nandoctor.cells import Cell
from nandoctor.env import collect_summary
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model
from nandoctor.record import ProbeRecord, ProbeSpec

pytestmark = pytest.mark.slow  # builds and trains real tiny models in this process


def spec_for(recipe, cell=Cell("fp32", "sdpa", "off"), steps=3, device=None) -> ProbeSpec:
    env = collect_summary()
    return ProbeSpec(cell.id, recipe, cell, plan_model(recipe, env), steps, recipe.seed, device or env.device, 1)


def test_two_builds_with_the_same_seed_are_bit_identical():
    from nandoctor.child.build import build_model

    spec = spec_for(resolve_model("tiny-llama"))
    a, b = (build_model(spec.plan, spec.recipe, spec.cell, spec.seed, spec.device) for _ in range(2))
    pairs = list(zip(a.state_dict().items(), b.state_dict().items()))
    assert pairs and all(na == nb and torch.equal(ta, tb) for (na, ta), (nb, tb) in pairs)


def test_a_lora_snapshot_keeps_only_the_adapter():
    from nandoctor.child.build import build_model
    from nandoctor.child.snapshot import Snapshot
    from nandoctor.config import set_field

    recipe = set_field(resolve_model("tiny-llama"), "adapter.type", "lora")
    spec = spec_for(recipe)
    model = build_model(spec.plan, recipe, spec.cell, spec.seed, spec.device)
    snap = Snapshot.take(model, "cpu")
    assert snap.saved and all("lora_" in name for name in snap.saved)
    assert snap.bytes == sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_the_replay_builds_no_second_model_and_retraces_the_timed_losses(monkeypatch):
    from nandoctor.child import build
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS
    from nandoctor.child.replay import forensics_of

    built = []
    real = build.build_model
    monkeypatch.setattr(build, "build_model", lambda *a: built.append(a) or real(*a))
    spec = spec_for(resolve_model("tiny-llama"), Cell("bf16-amp", "sdpa", "off"))
    record = ProbeRecord(spec.probe_id, spec.cell)
    s, snapshot, *_ = run_probe(spec, record, ONE_PROCESS, None)
    # the replay: what compiled and fp8 cells, and failing probes, get
    forensics = forensics_of(spec, record, s, snapshot, None, ONE_PROCESS)
    assert len(built) == 1
    assert forensics["reproduced"] is True, forensics.get("error")
    assert forensics["snapshot"]["where"] == spec.device and forensics["snapshot"]["bytes"] > 0  # it fits there
    assert record.build_s > 0 and record.load_s >= record.build_s
    assert record.compile_s is None and record.steady_step_s > 0
