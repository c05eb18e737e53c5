"""NandoctorCallback inside a real Lightning Trainer.fit() on the tiny Llama (CPU)."""

import json
import math

import pytest
import torch
from checkpoints import LARGE_MLP, save_llama
from training_runs import lightning_fit, nandoctor_lightning, tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def large_mlp_run(tmp_path_factory):
    """The large-MLP checkpoint trained with precision="16-true": layer 1's down_proj output passes
    65504 in step 0's forward."""
    base = tmp_path_factory.mktemp("pl-large-mlp")
    model = tiny_llama(path=save_llama(base / "ckpt", mlp_scale=LARGE_MLP), attn="eager")
    callback = nandoctor_lightning().NandoctorCallback()
    with pytest.warns(UserWarning, match="loss finite at step 0: loss nan"):
        trainer, module = lightning_fit(model, base / "run", "16-true", [callback])
    return trainer, module, callback, base / "run" / "nandoctor"


def test_large_mlp_under_16_true_is_stopped_at_step_0(large_mlp_run):
    trainer, _, callback, _ = large_mlp_run
    assert trainer.global_step == 1 and trainer.should_stop
    assert len(callback.watch.steps) == 1 and math.isnan(callback.watch.steps[0].loss)


def test_large_mlp_report_names_layer_1_mlp_as_the_first_forward_offender(large_mlp_run):
    *_, report = large_mlp_run
    probe = json.loads((report / "summary.json").read_text())["probes"][0]
    assert (probe["cell"]["dtype"], probe["verdict"], probe["step"]) == ("fp16-pure", "nonfinite", 0)
    origin = probe["forensics"]["origin"]
    assert (origin["phase"], origin["step"]) == ("forward", 0)
    assert origin["module"] == "model.layers.1.mlp.down_proj"
    assert origin["before"]["absmax"] < 65504  # finite input, overflowed output
    assert "model.layers.1.mlp.down_proj: output holds NaN/inf" in (report / "report.md").read_text()


def test_the_replay_keeps_its_loss_out_of_the_users_logs(large_mlp_run):
    trainer, module, _, report = large_mlp_run
    assert json.loads((report / "summary.json").read_text())["probes"][0]["forensics"]["reproduced"] is True
    assert math.isnan(trainer.callback_metrics["train_loss"])
    assert len(module.losses) == 2  # the step, and its replay through the module's training_step


def test_clean_bf16_mixed_fit_is_bit_identical_with_and_without_the_callback(tmp_path):
    callback = nandoctor_lightning().NandoctorCallback()
    _, watched = lightning_fit(tiny_llama(), tmp_path / "watched", "bf16-mixed", [callback], max_steps=4)
    _, plain = lightning_fit(tiny_llama(), tmp_path / "plain", "bf16-mixed", [], max_steps=4)
    assert len(callback.watch.steps) == 4 and callback.watch.failure is None
    assert watched.losses == plain.losses and len(plain.losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(watched.parameters(), plain.parameters()))
