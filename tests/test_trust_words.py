"""Readable output: bisection steps are never confused with training steps, report.md says where a
failure class broke once, every subcommand's --help ends with examples, and when the dtype is the
culprit bisect recommends the nearest cheaper precision that trains stably, not only fp32."""

import shutil
from pathlib import Path

import pytest

from nandoctor.bisect.engine import Bisection, Run
from nandoctor.cli import COMMANDS, build_parser

FIXTURE_RUN = Path(__file__).parent / "fixtures" / "run-before-issue-9"  # fp32, fp16-pure x eager, sdpa; 3 steps
CUDA = {"device": "cuda"}
GPU_DTYPES = ["bf16-pure", "fp16-pure", "bf16-amp", "fp16-amp", "tf32", "fp32"]


class PrecisionOracle:
    """A fake device on which the precisions below `stable_from` in GPU_DTYPES are non-finite."""

    def __init__(self, stable_from: str):
        self.stable = GPU_DTYPES[GPU_DTYPES.index(stable_from) :]
        self.asked = []

    def __call__(self, trials):
        self.asked += [t.config["dtype"] for t in trials]
        runs = []
        for t in trials:
            failed = t.config["dtype"] not in self.stable
            speed = 1000.0 / (1 + GPU_DTYPES.index(t.config["dtype"]))  # lower precision, faster
            runs.append(
                Run(
                    f"p{len(self.asked)}-{t.config['dtype']}",
                    "nonfinite" if failed else "stable",
                    failed,
                    tokens_per_s=speed,
                )
            )
        return runs


def bisect_dtype(stable_from: str):
    from nandoctor.bisect.factors import precision_ladder

    good, bad = {"dtype": "fp32", "attn": "eager"}, {"dtype": "bf16-pure", "attn": "sdpa:flash"}
    oracle = PrecisionOracle(stable_from)
    return Bisection(good, bad, oracle, reruns=0, ladders=precision_ladder(good, bad, CUDA)).run(), oracle


def test_a_dtype_culprit_recommends_the_nearest_stable_cheaper_precision():
    result, oracle = bisect_dtype("bf16-amp")
    assert [c.factors for c in result.culprits] == [["dtype"]]
    assert result.recommended == {"dtype": "bf16-amp", "attn": "sdpa:flash"}
    assert "dtype=bf16-amp is the nearest to the target's bf16-pure that trains stably" in result.message
    assert "fp16-amp" not in oracle.asked  # the ladder stops at the first stable precision


def test_fp32_is_recommended_when_no_cheaper_precision_holds():
    result, _ = bisect_dtype("fp32")
    assert result.recommended == {"dtype": "fp32", "attn": "sdpa:flash"}
    assert [s.outcome for s in result.path if s.phase == "between"] == ["fail"] * 4


def test_no_ladder_where_the_baseline_precision_is_the_fastest():
    from nandoctor.bisect.factors import precision_ladder

    assert (
        precision_ladder({"dtype": "fp32"}, {"dtype": "fp16-pure"}, {"device": "cpu"}) == {}
    )  # fp32 is fastest on a CPU
    assert precision_ladder({"dtype": "fp32"}, {"dtype": "fp16-amp"}, CUDA) == {"dtype": ["tf32"]}


def test_bisection_steps_are_called_bisection_steps():
    from nandoctor.report.bisection import culprit_rows, describe_step, headline_lines, path_rows

    result, _ = bisect_dtype("bf16-amp")
    b = result.to_dict()
    b["recommendation"] = {"config": result.recommended}
    assert describe_step(b["path"][0]).startswith("  bisection step  0 confirm-target")
    assert f"(stable at bisection step {result.recommended_step})" in "\n".join(headline_lines(b))
    assert set(culprit_rows(b)[0]) >= {"fails alone (bisection step)", "passes without each factor (bisection steps)"}
    assert "bisection step" in path_rows(b)[0] and "step" not in path_rows(b)[0]
    assert path_rows(b)[-1]["target factors applied"] == "attn=sdpa:flash, dtype=bf16-amp (between)"


def test_report_md_says_where_a_failure_class_broke_once(tmp_path):
    from nandoctor.api import render_run

    for f in FIXTURE_RUN.iterdir():
        shutil.copy(f, tmp_path / f.name)
    render_run(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.count("where it broke") == 1  # fp16-pure/eager and fp16-pure/sdpa broke the same way
    assert (
        "### fp16-pure/eager/off, fp16-pure/sdpa/off (2 probes; figures of fp16-pure/eager/off): where it broke" in md
    )


@pytest.mark.parametrize("command", [c.__name__.rsplit(".", 1)[-1] for c in COMMANDS])
def test_every_subcommand_help_ends_with_examples(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    examples = help_text.split("examples:\n", 1)[1].splitlines()
    assert examples and all(
        line.startswith(f"  nandoctor {command} ") or line == f"  nandoctor {command}" for line in examples
    )


def test_the_checkpoint_warning_does_not_repeat_the_model_line(tmp_path):
    from checkpoints import save_llama

    from nandoctor.config import set_field
    from nandoctor.models import plan_model, plan_warnings
    from nandoctor.recipes import resolve_model

    cpu = {"device": "cpu", "gpus": [], "ram_bytes": 24 * 2**30, "ram_available_bytes": 23 * 2**30, "cpu_count": 2}
    recipe = set_field(resolve_model(str(save_llama(tmp_path / "ckpt"))), "model.scale", "probe")
    plan = plan_model(recipe, cpu)
    (warning,) = plan_warnings(recipe, plan, cpu)
    assert plan.why not in warning and str(tmp_path) not in warning
    assert warning == (
        "your checkpoint's weights are NOT what gets trained: every probe trains a random-init twin "
        "at probe scale (--scale full trains your weights)"
    )
