"""A model that does not learn is not "stable": all-zero gradients, or a loss that never moves, is the
no-learning verdict, judged on the probe itself (its fp32 reference is as dead). The verdict rules are
tested fast on step lists; the dead checkpoint (zero lm_head and final norm: every gradient exactly 0)
goes through a real grid and a real `nandoctor check`."""

import math

import pytest
from checkpoints import TINY, save_dead_llama

from nandoctor.analysis.outcomes import analyze_records
from nandoctor.analysis.verdicts import NO_LEARNING, STABLE, check_results, numeric_verdict
from nandoctor.cells import Cell
from nandoctor.record import ProbeRecord, Step
from nandoctor.thresholds import THRESHOLDS

LN_VOCAB = math.log(TINY["vocab_size"])


def curve(losses, grad_norms):
    return [Step(i, loss, g) for i, (loss, g) in enumerate(zip(losses, grad_norms))]


def test_zero_grad_norm_at_every_step_is_no_learning_from_step_0():
    v = numeric_verdict(curve([LN_VOCAB] * 6, [0.0] * 6), None)
    assert (v.name, v.step) == (NO_LEARNING, 0) and v.failed
    assert "grad-norm is exactly 0 at every one of 6 steps" in v.reason
    one = numeric_verdict(curve([LN_VOCAB], [0.0]), None)
    assert (one.name, one.reason) == (
        NO_LEARNING,
        "grad-norm is exactly 0 at step 0: no parameter receives a gradient, nothing trains",
    )


def test_a_loss_that_never_moves_is_no_learning_even_with_gradients():
    v = numeric_verdict(curve([5.0, 5.0 * (1 + 1e-7), 5.0, 5.0], [0.3] * 4), None)
    assert v.name == NO_LEARNING and "loss stayed at 5 for all 4 steps" in v.reason


def test_a_flat_loss_is_judged_only_on_enough_steps_and_a_moving_one_is_stable():
    short = THRESHOLDS.no_learning_min_steps - 1
    assert numeric_verdict(curve([5.0] * short, [0.3] * short), None).name == STABLE
    assert numeric_verdict(curve([6.9, 6.5, 6.1, 5.8], [1.0, 0.9, 0.8, 0.7]), None).name == STABLE
    assert (
        numeric_verdict(curve([6.9, 6.5, 6.1, 5.8], [0.0, 0.9, 0.8, 0.7]), None).name == STABLE
    )  # one zero step is not dead


def test_check_fails_on_zero_gradients_at_step_0():
    record = ProbeRecord("fp32/sdpa/off", Cell("fp32"), steps=curve([LN_VOCAB], [0.0]))
    checks = {name: (ok, detail) for name, ok, detail in check_results(record, TINY["vocab_size"], random_init=True)}
    assert checks["grad-norm finite at step 0"][0]  # 0 is finite: the old check passed it
    assert checks["gradients reach the weights"] == (
        False,
        "no-learning: grad-norm is exactly 0 at step 0: no parameter receives a gradient, nothing trains",
    )


def test_a_dead_run_is_never_recommended_and_its_failure_names_the_known_fix():
    meta = {"kind": "grid", "seed": 0, "doctor": {"findings": []}}
    dead = [
        ProbeRecord(c.id, c, steps=curve([LN_VOCAB] * 4, [0.0] * 4), recipe={"name": "t"})
        for c in (Cell("fp32", "eager"), Cell("fp32", "sdpa"))
    ]
    a = analyze_records(meta, dead)
    assert [o.verdict.name for o in a.outcomes] == [NO_LEARNING] * 2
    assert a.recommended is None and a.exit_code == 1
    assert {f["id"] for f in a.findings} == {"gradients-all-zero"}


@pytest.fixture(scope="module")
def dead_checkpoint(tmp_path_factory):
    return save_dead_llama(tmp_path_factory.mktemp("dead") / "ckpt")


@pytest.fixture(scope="module")
def dead_grid(dead_checkpoint, tmp_path_factory):
    from conftest import run_cli

    out = tmp_path_factory.mktemp("dead-grid") / "run"
    done = run_cli(
        "grid",
        "--model",
        dead_checkpoint,
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "4",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
    )
    return done, out


@pytest.mark.slow
def test_dead_checkpoint_is_no_learning_in_every_cell_and_nothing_is_recommended(dead_grid):
    from conftest import summary

    done, out = dead_grid
    s = summary(out)
    assert done.returncode == 1, done.stderr[-2000:]
    assert {p["probe_id"]: p["verdict"] for p in s["probes"]} == {
        "fp32/sdpa/off": NO_LEARNING,
        "fp32/eager/off": NO_LEARNING,
    }
    assert s["recommended"] is None and s["ranking"] == []
    assert "No stable configuration was found." in done.stdout


@pytest.mark.slow
def test_dead_checkpoint_report_shows_the_class_and_its_fix(dead_grid):
    _, out = dead_grid
    md = (out / "report.md").read_text()
    assert "every attention (2 probes): no-learning: grad-norm is exactly 0 at every one of 4 steps" in md
    assert "Fix (rule gradients-all-zero): Check that the checkpoint's lm_head" in md
    assert (
        "no-learning" in (out / "report.html").read_text() and 'type="no-learning"' in (out / "junit.xml").read_text()
    )


@pytest.mark.slow
def test_check_fails_a_dead_checkpoint_with_exit_1(dead_checkpoint, cli, tmp_path):
    done = cli("check", "--model", dead_checkpoint, "--dtype", "fp32", "--out", tmp_path / "run")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "FAIL gradients reach the weights: no-learning: grad-norm is exactly 0 at step 0" in done.stdout
    assert "check fp32/sdpa/off on ckpt: FAIL" in done.stdout
