"""Forensics end to end: real tiny models replayed with hooks in the probe's child process."""

import contextlib
import io
import re

import pytest
from conftest import record_list, run_cli, run_main, summary

# slow: the end-to-end tests (real probe processes); the bad-input ones end in this process (run_main)


def probe_summary(run_dir, probe_id) -> dict:
    return next(p for p in summary(run_dir)["probes"] if p["probe_id"] == probe_id)


def forensics_record(run_dir, probe_id) -> dict:
    records = record_list(run_dir)
    return next(r for r in records if r["probe_id"] == probe_id)["forensics"]


def debug_underflow_overflow_first_module(ckpt) -> str:
    """The module transformers' DebugUnderflowOverflow stops at, for the probe's first batch under fp16 autocast."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.debug_utils import DebugUnderflowOverflow

    from nandoctor.data import batches
    from nandoctor.recipes import resolve_model

    recipe = resolve_model(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    batch = next(batches(recipe, model.config, recipe.seed))
    DebugUnderflowOverflow(model)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(ValueError, match="inf/nan detected"):
        with torch.autocast("cpu", dtype=torch.float16):
            model(**batch)
    frames = printed.getvalue().split("Detected inf/nan", 1)[1]
    return re.findall(r"^ {18}(\S+) \w+$", frames, re.M)[-1]  # each frame opens with "<name> <Class>"


@pytest.mark.slow
def test_large_mlp_first_offender_is_inside_layer_1_mlp_in_the_forward_of_step_0(large_mlp_grid):
    origin = probe_summary(large_mlp_grid, "fp16-amp/sdpa/off")["forensics"]["origin"]
    assert (origin["phase"], origin["step"]) == ("forward", 0)
    assert origin["module"].startswith("model.layers.1.mlp")
    # summary.json writes a non-finite float as the string float() reads back ("Infinity")
    assert (
        float(origin["before"]["absmax"]) < 65504 < float(origin["stats"]["absmax"])
    )  # finite input, overflowed output


@pytest.mark.slow
def test_large_mlp_first_offender_agrees_with_debug_underflow_overflow(large_mlp_grid, large_mlp_checkpoint):
    ours = probe_summary(large_mlp_grid, "fp16-amp/sdpa/off")["forensics"]["origin"]["module"]
    assert ours == debug_underflow_overflow_first_module(large_mlp_checkpoint)


@pytest.mark.slow
def test_the_replay_retraces_the_timed_run_and_states_its_cost(large_mlp_grid):
    f = forensics_record(large_mlp_grid, "fp16-amp/sdpa/off")
    assert f["reproduced"] is True and f["replayed_steps"] == 1
    assert f["cost"]["seconds"] > 0 and f["cost"]["hooked_step_overhead"] > 0


@pytest.fixture(scope="module")
def precision(tmp_path_factory):
    """tiny-llama at lr 2e-5 in every reduced-precision cell the CPU runs, two steps each."""
    out = tmp_path_factory.mktemp("forensics") / "precision"
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp16-pure,bf16-pure,bf16-amp,fp16-amp",
        "--axis",
        "attn=eager",
        "--axis",
        "compile=off",
        "--set",
        "optimizer.lr=2e-5",
        "--set",
        "retime_rounds=0",
        "--steps",
        "2",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.slow
def test_fp16_pure_adamw_eps_origin_is_the_optimizer_step(precision):
    p = probe_summary(precision, "fp16-pure/eager/off")
    assert p["verdict"] == "nonfinite" and p["step"] == 1
    origin = p["forensics"]["origin"]
    assert p["forensics"]["measured_on"] == "replay"  # a failing probe keeps its replay
    assert (origin["phase"], origin["step"]) == ("optimizer", 0)
    assert origin["eps"] == 1e-8 and origin["eps_in_dtype"] == 0.0  # eps rounds to 0 in fp16


@pytest.mark.slow
def test_bf16_pure_update_loss_is_large_and_bf16_amp_small(precision):
    pure = probe_summary(precision, "bf16-pure/eager/off")["forensics"]["update_loss"]
    amp = probe_summary(precision, "bf16-amp/eager/off")["forensics"]["update_loss"]
    assert pure["weight_dtype"] == "bfloat16" and amp["weight_dtype"] == "float32"
    assert pure["mean"] > 0.5  # lr 2e-5 is below half a bf16 ulp of most weights
    assert amp["mean"] < 0.001


@pytest.mark.slow
def test_stable_fp16_probe_headroom_is_in_report_md_and_html(precision):
    assert probe_summary(precision, "fp16-amp/eager/off")["verdict"] == "stable"
    f = forensics_record(precision, "fp16-amp/eager/off")
    assert (f["measured_on"], f["replayed_steps"]) == ("timed step 0", 0)  # no replay: hooks on its timed step 0
    md = (precision / "report.md").read_text()
    html = (precision / "report.html").read_text()
    section = md.split("### fp16-amp/eager/off: tightest modules", 1)[1]
    ratio = re.search(r"fp16 headroom ([0-9.e+]+)x at (\S+) \(activation\)", section)
    assert ratio and float(ratio.group(1)) > 1
    assert "fp16 activation headroom" in section
    assert f"fp16 headroom {ratio.group(1)}x at {ratio.group(2)}" in html and "fp16 activation headroom" in html
    assert "none; measured on timed step 0 by read-only hooks" in md


@pytest.mark.slow
def test_html_has_a_fidelity_curve_per_probe(precision):
    html = (precision / "report.html").read_text()
    # bf16-pure, bf16-amp and fp16-amp; fp16-pure has one finite step, and a one-point chart says nothing
    assert html.count("<title>fidelity vs fp32 reference (relative error)</title>") == 3


@pytest.mark.slow
def test_explain_prints_the_origin_of_one_probe(precision):
    proc = run_cli("explain", precision, "--probe", "fp16-pure/eager/off")
    assert proc.returncode == 0, proc.stderr
    assert "origin (optimizer): step 0, optimizer step" in proc.stdout
    assert "eps=1e-08 is 0.0 in float16" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["dora", "lora"])
def test_explain_says_when_a_first_offenders_input_is_doras_identity_call(tmp_path, adapter):
    """AdamW with eps=0 turns lora_A NaN at step 0 (B starts at 0, so A's first gradient and exp_avg_sq are 0:
    update = 0 / 0). With DoRA the first module to output NaN at step 1 is lora_A called on torch.eye (peft
    reads lora_B @ lora_A for the weight norm): explain says that its input range [0, 1] is that identity
    matrix. With LoRA, lora_A's first call is on the batch, and nothing is said."""
    out = tmp_path / adapter
    grid = ("grid", "--steps", "3", "--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off")
    run = run_cli(*grid, "--set", f"adapter.type={adapter}", "--set", "optimizer.eps=0", "--out", out)
    assert run.returncode == 1, run.stderr[-2000:]
    proc = run_cli("explain", out, "--probe", "fp32/sdpa/off")
    assert proc.returncode == 0, proc.stderr
    offender = next(line for line in proc.stdout.splitlines() if "first forward offender" in line)
    assert "layers.0.self_attn.q_proj.lora_A.default: output holds NaN/inf" in offender
    identity = "its input: min 0, max 1, abs-max 1 (an identity matrix: peft's DoRA calls lora_A on torch.eye"
    assert (identity in offender) is (adapter == "dora"), offender
    assert ("identity matrix" in offender) is (adapter == "dora"), offender


@pytest.mark.slow
def test_explain_unknown_probe_is_one_line_exit_2(precision):
    proc = run_cli("explain", precision, "--probe", "fp8/eager/off")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "fp16-pure/eager/off" in proc.stderr


def test_explain_bad_run_dir_is_one_line_exit_2(tmp_path):
    proc = run_main("explain", tmp_path / "missing")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
