"""NandoctorCallback inside a real transformers Trainer.train() on the tiny Llama (CPU)."""

import json
import math

import pytest
import torch
from training_runs import hf_trainer, nandoctor_transformers, tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp16_eps_run(tmp_path_factory):
    """fp16 weights, torch AdamW with eps 1e-8 (0.0 in fp16): step 0's update writes inf into the
    weights, step 1's loss is NaN, and Trainer logs it as 0.0 (logging_nan_inf_filter, its default)."""
    out = tmp_path_factory.mktemp("hf-fp16-eps")
    callback = nandoctor_transformers().NandoctorCallback()
    trainer = hf_trainer(
        tiny_llama(torch.float16),
        out,
        [callback],
        max_steps=6,
        learning_rate=2e-5,
        optim="adamw_torch",
        adam_epsilon=1e-8,
    )
    with pytest.warns(UserWarning, match="fp16-adamw-eps-below-smallest-normal"):
        trainer.train()
    return trainer, callback, out / "nandoctor"


def test_fp16_adamw_eps_run_is_stopped_at_step_1(fp16_eps_run):
    trainer, callback, _ = fp16_eps_run
    assert trainer.state.global_step == 2  # step 1 ran (Trainer cannot skip its optimizer step), then it stopped
    assert [s.step for s in callback.watch.steps] == [0, 1]
    assert math.isnan(callback.watch.steps[1].loss)


def test_nan_hidden_by_logging_nan_inf_filter_is_still_caught(fp16_eps_run):
    trainer, callback, _ = fp16_eps_run
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.args.logging_nan_inf_filter and logged[1] == 0.0  # what the user's logs show for step 1
    assert math.isnan(callback.watch.steps[1].loss)


def test_fp16_adamw_eps_report_names_the_optimizer_step(fp16_eps_run):
    _, _, report = fp16_eps_run
    probe = json.loads((report / "summary.json").read_text())["probes"][0]
    assert (probe["verdict"], probe["step"]) == ("nonfinite", 1)
    origin = probe["forensics"]["origin"]
    assert (origin["phase"], origin["step"]) == ("optimizer", 0)
    assert origin["eps"] == 1e-8 and origin["eps_in_dtype"] == 0.0
    md = (report / "report.md").read_text()
    assert f"step 0, optimizer step: the update turned {origin['parameter']} non-finite" in md
    assert "eps=1e-08 is 0.0 in float16" in md and (report / "report.html").exists()


def test_the_replay_retraces_the_failing_step_and_leaves_the_model_as_the_run_left_it(fp16_eps_run):
    trainer, callback, report = fp16_eps_run
    forensics = json.loads((report / "summary.json").read_text())["probes"][0]["forensics"]
    assert forensics["reproduced"] is True
    assert not all(
        torch.isfinite(p).all() for p in trainer.model.parameters()
    )  # the run's own state, not a restored one


def test_failure_prints_a_bisect_command_with_the_run_as_a_recipe(fp16_eps_run, capsys):
    _, callback, report = fp16_eps_run
    assert callback.watch.bisect_command.startswith(f"nandoctor bisect --recipe {report / 'recipe.yaml'} --bad ")
    assert "dtype=fp16-pure,attn=sdpa,compile=off" in callback.watch.bisect_command
    from nandoctor.recipes import load_recipe

    recipe = load_recipe(report / "recipe.yaml")
    assert recipe.optimizer.eps == 1e-8 and recipe.optimizer.lr == 2e-5 and recipe.model.arch["hidden_size"] == 64


def train_bf16(out, callbacks):
    trainer = hf_trainer(tiny_llama(), out, callbacks, max_steps=4, bf16=True)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


def test_clean_bf16_run_trains_to_the_end_bit_identical_with_and_without_the_callback(tmp_path):
    callback = nandoctor_transformers().NandoctorCallback()
    watched_losses, watched_weights = train_bf16(tmp_path / "watched", [callback])
    plain_losses, plain_weights = train_bf16(tmp_path / "plain", [])
    assert len(callback.watch.steps) == 4 and callback.watch.failure is None
    assert watched_losses == plain_losses and len(plain_losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(watched_weights, plain_weights))
    assert not (tmp_path / "watched" / "nandoctor").exists()
