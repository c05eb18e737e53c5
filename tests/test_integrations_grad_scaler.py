"""The callbacks' GradScaler path, on a CPU: a real torch.amp.GradScaler("cpu") inside a real Lightning
Trainer.fit() and a real transformers Trainer.train(), fp16 autocast on the tiny Llama, real overflows.

Neither framework makes a scaler on a CPU by itself (Lightning turns "16-mixed" into "bf16-mixed",
accelerate trains fp16=True in fp32), so each test hands one over: Lightning through its MixedPrecision
plugin, transformers through the Trainer's accelerator. A high init_scale makes the scaled gradients
overflow fp16 in backward, so the scaler skips steps and halves its scale, as it calibrates on a GPU;
a loss weighted by 1e8 overflows fp16 even unscaled, so the scale falls below 1."""

import json
import math
import warnings

import pytest
import torch
from training_runs import hf_trainer, lightning_fit, nandoctor_lightning, nandoctor_transformers, tiny_llama

from nandoctor.integrations.watch import CheckFailed


def fp16_mixed(init_scale: float):
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return scaler, MixedPrecision("16-mixed", "cpu", scaler=scaler)


def nandoctor_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("nandoctor")]


def assert_each_step_ran_at_the_scale_the_last_one_left(steps, init_scale: float, scaler) -> None:
    """Halved after a skipped step, kept after one that stepped; the real scaler ends where the last step left it."""
    scales = [init_scale]
    for s in steps:
        scales.append(scales[-1] / 2 if s.skipped else scales[-1])
    assert [s.scale for s in steps] == scales[:-1] and scaler.get_scale() == scales[-1]
    assert all(s.skipped == (not math.isfinite(s.grad_norm)) for s in steps)


@pytest.fixture(scope="module")
def calibrating_fit(tmp_path_factory):
    """Scale 2**24 at the start: the scaled gradients overflow fp16 in backward (measured here: steps 0-4
    are skipped, step 5 fits at 2**19)."""
    scaler, plugin = fp16_mixed(2.0**24)
    callback = nandoctor_lightning().NandoctorCallback(strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, module = lightning_fit(
            tiny_llama(), tmp_path_factory.mktemp("pl-calibrating"), None, [callback], plugins=[plugin]
        )
    return trainer, module, callback, scaler, nandoctor_warnings(caught)


def test_lightning_calibration_skips_are_recorded_with_the_scale_each_step_ran_at(calibrating_fit):
    trainer, _, callback, scaler, _ = calibrating_fit
    steps = callback.watch.steps
    assert callback.watch.run.cell.id == "fp16-amp/sdpa/off"
    assert [s.skipped for s in steps][:3] == [True] * 3 and not steps[-1].skipped  # measured: 5 skips, then 2**19 fits
    assert_each_step_ran_at_the_scale_the_last_one_left(steps, 2.0**24, scaler)
    assert all(0 < s.grad_norm < 100 for s in steps if not s.skipped)


def test_lightning_loss_is_read_unscaled(calibrating_fit):
    _, module, callback, *_ = calibrating_fit
    # on_before_backward sees the loss times 2**k; divided back, it is the module's own loss bit for bit
    assert [s.loss for s in callback.watch.steps] == module.losses


def test_strict_watch_lets_a_calibrating_16_mixed_fit_train_to_the_end(calibrating_fit):
    trainer, _, callback, _, said = calibrating_fit
    assert trainer.global_step == 6 and not trainer.should_stop
    assert callback.watch.failure is None and callback.watch.off is None
    assert said == []  # step 0's gradient overflow at scale 2**24 is calibration, not a failed headroom check
    assert callback.watch.finish().startswith("watched 6 steps of fp16-amp/sdpa/off: stable")


@pytest.fixture(scope="module")
def overflowing_fit(tmp_path_factory):
    """A loss weighted by 1e8 (7e8): its gradient overflows fp16 at any scale >= 1. From scale 4 the
    scaler skips steps 0, 1 and 2 (at 4, 2, 1); after step 2 it would fall below 1."""
    out = tmp_path_factory.mktemp("pl-overflow")
    scaler, plugin = fp16_mixed(4.0)
    callback = nandoctor_lightning().NandoctorCallback()
    with pytest.warns(UserWarning, match="initial loss near ln") as caught:
        trainer, _ = lightning_fit(tiny_llama(), out, None, [callback], plugins=[plugin], loss_weight=1e8)
    return trainer, callback, scaler, nandoctor_warnings(caught), out / "nandoctor"


def test_scale_falling_below_1_stops_the_fit_at_that_step(overflowing_fit):
    trainer, callback, scaler, *_ = overflowing_fit
    assert [(s.step, s.skipped, s.scale) for s in callback.watch.steps] == [
        (0, True, 4.0),
        (1, True, 2.0),
        (2, True, 1.0),
    ]
    assert trainer.global_step == 3 and trainer.should_stop and scaler.get_scale() == 0.5
    verdict = callback.watch.failure.verdict
    assert (verdict.name, verdict.step) == ("nonfinite", 2)
    assert verdict.reason == "GradScaler scale fell below 1 at step 2: gradients overflow fp16 even unscaled"


def test_step_0_gradient_overflow_under_a_scaler_passes_the_headroom_check(overflowing_fit):
    *_, said, _ = overflowing_fit
    [step0] = said
    assert "FAIL initial loss near ln(vocab): loss 6.9" in step0  # the weighted loss: the one real finding
    assert (
        "ok   gradient headroom in float16: overflowed first at lm_head (gradient of output abs-max inf) "
        "at loss scale 4: the GradScaler skips the step and halves its scale"
    ) in step0
    assert "ok   no skipped step beyond GradScaler calibration: 1 calibration skip(s)" in step0


def test_scale_report_replays_the_skipped_step_at_its_scale(overflowing_fit):
    *_, report = overflowing_fit
    probe = json.loads((report / "summary.json").read_text())["probes"][0]
    assert (probe["cell"]["dtype"], probe["verdict"], probe["step"]) == ("fp16-amp", "nonfinite", 2)
    forensics = probe["forensics"]
    assert forensics["reproduced"] is True
    # the replay at scale 1 overflows where the run did: in backward, at the lm_head's output gradient
    assert (forensics["origin"]["step"], forensics["origin"]["phase"], forensics["origin"]["module"]) == (
        2,
        "backward",
        "lm_head",
    )
    assert "grad-scale-falls-below-1" in (report / "report.md").read_text()


def test_strict_watch_stops_a_fit_whose_first_step_already_overflows_at_scale_1(tmp_path):
    _, plugin = fp16_mixed(1.0)
    callback = nandoctor_lightning().NandoctorCallback(strict=True)
    model = tiny_llama()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        CheckFailed, match="no skipped step beyond GradScaler calibration: scale fell below 1 at step 0"
    ):
        lightning_fit(model, tmp_path, None, [callback], plugins=[plugin], loss_weight=1e8)
    assert [s.step for s in callback.watch.steps] == [0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # raised before the optimizer step


def test_fused_adamw_grad_norm_is_read_unscaled(tmp_path):
    """A fused AdamW unscales inside its own step, so Lightning leaves the gradients scaled when the hook runs."""
    norms = {}
    for fused in (False, True):
        _, plugin = fp16_mixed(2.0**10)
        callback = nandoctor_lightning().NandoctorCallback()
        lightning_fit(tiny_llama(), tmp_path / str(fused), None, [callback], plugins=[plugin], fused=fused, max_steps=1)
        [step] = callback.watch.steps
        assert not step.skipped and step.scale == 2.0**10
        norms[fused] = step.grad_norm
    assert norms[True] == pytest.approx(norms[False], rel=1e-5) and 0 < norms[False] < 100


@pytest.fixture(scope="module")
def hf_calibrating_run(tmp_path_factory):
    """A transformers Trainer with fp16=True whose accelerator steps through a CPU GradScaler from 2**20."""
    callback = nandoctor_transformers().NandoctorCallback(strict=True)
    trainer = hf_trainer(tiny_llama(), tmp_path_factory.mktemp("hf-calibrating"), [callback], max_steps=6, fp16=True)
    # what accelerate sets up for fp16 on a GPU: prepare() then runs the forward in fp16 autocast and
    # wraps the optimizer with the scaler, whose skips the Trainer reports as optimizer_step_was_skipped
    scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    trainer.accelerator.native_amp = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, callback, scaler, nandoctor_warnings(caught)


def test_hf_calibration_skips_are_recorded_with_the_scale_each_step_ran_at(hf_calibrating_run):
    trainer, callback, scaler, said = hf_calibrating_run
    steps = callback.watch.steps
    assert callback.watch.run.cell.id == "fp16-amp/sdpa/off"  # fp16 autocast runs: not the fp32 a CPU gives fp16=True
    assert steps[0].skipped and 2 <= sum(s.skipped for s in steps) < 6  # measured: steps 0 and 2 skipped
    assert_each_step_ran_at_the_scale_the_last_one_left(steps, 2.0**20, scaler)
    assert trainer.state.global_step == 6 and callback.watch.failure is None and said == []


def test_hf_grad_norm_is_the_unscaled_one_the_trainer_logs(hf_calibrating_run):
    trainer, callback, *_ = hf_calibrating_run
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    for step, norm in zip(callback.watch.steps, logged):
        if step.skipped:
            assert not math.isfinite(step.grad_norm) and not math.isfinite(norm)
        else:  # hooks saw the scaled gradients during backward; the Trainer clipped the unscaled ones
            assert step.grad_norm == pytest.approx(norm, rel=1e-4) and 0 < norm < 100
