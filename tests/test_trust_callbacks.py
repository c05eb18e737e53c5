"""The training callbacks never harm the run they watch, and show that they watch: real Trainer.train()
and Trainer.fit() runs on the tiny Llama (CPU) with learning_rate=30, with a report directory that
cannot be created, with a module the watch cannot read, and with a checkpoint that cannot learn."""

import contextlib
import io

import pytest
import torch
from checkpoints import save_dead_llama
from conftest import strict_json
from training_runs import QUIET_LIGHTNING, hf_trainer, lightning_fit, tiny_llama

from nandoctor.integrations.watch import CheckFailed

pytestmark = pytest.mark.slow
REPORTS = {"report.md", "report.html", "junit.xml", "summary.json"}


def nandoctor_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("nandoctor:")]


def train(trainer) -> str:
    """trainer.train(), returning what nandoctor printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer.train()
    return err.getvalue()


@pytest.fixture(scope="module")
def hf_lr30(tmp_path_factory):
    from nandoctor.integrations.transformers import NandoctorCallback

    out = tmp_path_factory.mktemp("hf-lr30")
    callback = NandoctorCallback()
    trainer = hf_trainer(tiny_llama(), out, [callback], max_steps=12, learning_rate=30.0)
    return trainer, callback, train(trainer), out / "nandoctor"


def test_hf_trainer_at_lr_30_stops_cleanly_with_every_report_written(hf_lr30):
    trainer, callback, _, report = hf_lr30
    verdict = callback.watch.failure.verdict
    assert verdict.name in ("diverged", "nonfinite")
    assert trainer.state.global_step == verdict.step + 1 < 12  # stopped after the failing step, not at max_steps
    assert REPORTS <= {p.name for p in report.iterdir()}
    assert strict_json((report / "summary.json").read_text())["probes"][0]["verdict"] == verdict.name


def test_hf_callback_says_it_is_on_and_sums_the_run_up(hf_lr30):
    trainer, callback, stderr, report = hf_lr30
    lines = nandoctor_lines(stderr)
    assert (
        lines[0].startswith("nandoctor: watching fp32/sdpa/off (transformers run, ")
        and "judging every step" in lines[0]
    )
    assert lines[-1].startswith(
        f"nandoctor: watched {len(callback.watch.steps)} steps of fp32/sdpa/off: {callback.watch.failure.verdict.name}"
    )
    assert lines[-1].endswith(f"report {report / 'report.md'}")


def test_lightning_fit_at_lr_30_stops_cleanly_with_every_report_written(tmp_path):
    from nandoctor.integrations.lightning import NandoctorCallback

    callback = NandoctorCallback()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer, _ = lightning_fit(tiny_llama(), tmp_path, "32-true", [callback], max_steps=12, lr=30.0)
    verdict = callback.watch.failure.verdict
    assert trainer.should_stop and trainer.global_step == verdict.step + 1 < 12
    assert REPORTS <= {p.name for p in (tmp_path / "nandoctor").iterdir()}
    assert nandoctor_lines(err.getvalue())[-1].startswith(
        f"nandoctor: watched {len(callback.watch.steps)} steps of fp32/sdpa/off: {verdict.name}"
    )


def test_a_report_directory_that_cannot_be_made_costs_the_report_not_the_run(tmp_path):
    """output_dir lies under a regular file: mkdir fails inside nandoctor. The run still stops, because
    it diverged, and one line says what nandoctor could not do."""
    from nandoctor.integrations.transformers import NandoctorCallback

    (tmp_path / "a-file").write_text("not a directory")
    callback = NandoctorCallback(output_dir=str(tmp_path / "a-file" / "reports"))
    trainer = hf_trainer(tiny_llama(), tmp_path / "run", [callback], max_steps=12, learning_rate=30.0)
    lines = nandoctor_lines(train(trainer))
    verdict = callback.watch.failure.verdict
    assert trainer.state.global_step == verdict.step + 1 < 12
    failed = [line for line in lines if "Internal error while writing the report" in line]
    assert len(failed) == 1 and "NotADirectoryError" in failed[0] and "Training stopped" in failed[0]
    assert lines[-1].endswith(
        f"no report (NotADirectoryError: [Errno 20] Not a directory: '{tmp_path / 'a-file' / 'reports' / 'nandoctor'}')"
    )


def test_a_module_the_watch_cannot_read_trains_to_the_end_with_one_line(tmp_path):
    """A LightningModule with no transformers model inside: nandoctor cannot watch it, says so once,
    and the fit runs every step."""
    import lightning as L

    from nandoctor.integrations.lightning import NandoctorCallback

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.linear(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = L.Trainer(
        max_steps=5,
        accelerator="cpu",
        **QUIET_LIGHTNING,
        callbacks=[NandoctorCallback()],
        default_root_dir=str(tmp_path),
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 5
    assert nandoctor_lines(err.getvalue()) == [
        "nandoctor: internal error in lightning callback on_train_start: NandoctorError: NandoctorCallback watches a "
        "transformers model; Regression holds none; nandoctor stopped watching this run, training goes on"
    ]


@pytest.fixture(scope="module")
def dead_model_path(tmp_path_factory):
    return save_dead_llama(tmp_path_factory.mktemp("dead") / "ckpt")


def test_a_run_that_cannot_learn_is_warned_about_once_and_trains_on(dead_model_path, tmp_path):
    from nandoctor.integrations.transformers import NandoctorCallback

    callback = NandoctorCallback()
    trainer = hf_trainer(tiny_llama(path=dead_model_path), tmp_path, [callback], max_steps=6)
    with pytest.warns(UserWarning) as caught:
        stderr = train(trainer)
    said = [str(w.message) for w in caught if "no-learning" in str(w.message)]
    assert len(said) == 1 and "gradients reach the weights: no-learning: grad-norm is exactly 0 at step 0" in said[0]
    assert trainer.state.global_step == 6 and callback.watch.failure is None
    assert nandoctor_lines(stderr)[-1] == (
        "nandoctor: watched 6 steps of fp32/sdpa/off: no-learning (grad-norm is exactly 0 at every "
        "one of 6 steps: no parameter receives a gradient, nothing trains); no report (nothing stopped the run)"
    )


def test_strict_stops_a_run_that_cannot_learn_before_its_first_update(dead_model_path, tmp_path):
    from nandoctor.integrations.transformers import NandoctorCallback

    trainer = hf_trainer(tiny_llama(path=dead_model_path), tmp_path, [NandoctorCallback(strict=True)], max_steps=6)
    with pytest.raises(CheckFailed, match="step-0 check of fp32/sdpa/off .* gradients reach the weights: no-learning"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_healthy_run_ends_with_a_summary_line(tmp_path):
    from nandoctor.integrations.transformers import NandoctorCallback

    trainer = hf_trainer(tiny_llama(), tmp_path, [NandoctorCallback()], max_steps=4)
    lines = nandoctor_lines(train(trainer))
    assert len(lines) == 2 and lines[0].startswith("nandoctor: watching fp32/sdpa/off")
    assert lines[1].startswith("nandoctor: watched 4 steps of fp32/sdpa/off: stable (4 steps finite, loss ")
    assert lines[1].endswith("; no report (nothing stopped the run)")
