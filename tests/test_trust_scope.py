"""Honest scope, clear refusals: an attention implementation the architecture refuses is `unsupported`
(predicted from the class flags, and so classified when it happens at run time), --scale auto weighs a
probe's time as well as its memory, a grid too short to judge is refused or warned about, the doctor
fails only the user's own setup, and rule evidence is public."""

import json

import pytest
from conftest import summary

from nandoctor.analysis.verdicts import UNSUPPORTED, classify
from nandoctor.cells import Cell
from nandoctor.config import recipe_from_dict
from nandoctor.doctor import exit_code, run_doctor
from nandoctor.errors import NandoctorError
from nandoctor.knowledge import rules
from nandoctor.models import plan_model
from nandoctor.recipes import recipe_by_name, resolve_model
from nandoctor.record import ProbeRecord
from nandoctor.report.doctor import render_doctor_text

# a quiet 2-core CPU: ~50 GFLOP/s fp32 (tiny-llama's 2.8 GFLOP step takes ~0.06 s); given, not measured, so
# the plan does not depend on the load of the machine running the tests
CPU_24G = {
    "device": "cpu",
    "gpus": [],
    "ram_bytes": 24 * 2**30,
    "ram_available_bytes": 23 * 2**30,
    "cpu_count": 2,
    "train_flops": 50e9,
}
H100 = {
    **CPU_24G,
    "device": "cuda",
    "train_flops": None,
    "gpus": [{"index": 0, "name": "H100", "capability": "9.0", "memory_bytes": 80 * 2**30}],
}
# GPT-Neo's class refuses SDPA in every transformers this suite runs on (5.17 to 5.24); Gemma2's took it
# up to 5.17 and refuses it in 5.24
TINY_GPT_NEO = {
    "model": {
        "arch": {
            "model_type": "gpt_neo",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_layers": 2,
            "num_heads": 4,
            "vocab_size": 256,
            "max_position_embeddings": 64,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 16,
            "bos_token_id": 0,
            "eos_token_id": 1,
        }
    },
    "batch_size": 2,
    "seq_len": 32,
    "steps": 4,
}


def test_the_plan_predicts_that_a_class_refuses_sdpa_as_the_installed_transformers_says():
    from transformers import Gemma2ForCausalLM

    plan = plan_model(recipe_from_dict(TINY_GPT_NEO, "tiny-gpt-neo"), CPU_24G)
    assert set(plan.refuses) == {"sdpa"}  # the class takes eager and flash_attention_2
    assert "GPTNeoForCausalLM._supports_sdpa = False" in plan.refuses["sdpa"]
    gemma2 = plan_model(recipe_by_name("gemma-2-2b"), CPU_24G).refuses
    assert ("sdpa" in gemma2) == (Gemma2ForCausalLM._supports_sdpa is False)
    assert plan_model(resolve_model(None), CPU_24G).refuses == {}  # llama takes every implementation


def test_a_refusal_raised_at_run_time_is_unsupported_not_a_crash():
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(TINY_GPT_NEO["model"]["arch"])
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    with pytest.raises(ValueError) as raised:  # what the probe's build meets, raised by transformers itself
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    record = ProbeRecord(
        "fp32/sdpa/off",
        Cell("fp32", "sdpa", "off"),
        "error",
        error={"type": "ValueError", "message": str(raised.value)},
    )
    verdict = classify(record)
    assert verdict.name == UNSUPPORTED
    assert verdict.reason.startswith("ValueError: GPTNeoForCausalLM does not support an attention implementation")


@pytest.mark.slow
def test_grid_plans_the_sdpa_cell_of_a_class_that_refuses_it_unsupported_and_never_spawns_it(tmp_path, cli):
    recipe = tmp_path / "tiny-gpt-neo.yaml"
    recipe.write_text(json.dumps(TINY_GPT_NEO))  # JSON is YAML
    out = tmp_path / "run"
    proc = cli(
        "grid", "--recipe", recipe, "--axis", "dtype=fp32", "--axis", "attn=eager,sdpa", "--axis", "compile=off",
        "--out", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    probes = {p["probe_id"]: p for p in summary(out)["probes"]}
    assert probes["fp32/eager/off"]["verdict"] == "stable"
    assert probes["fp32/sdpa/off"]["verdict"] == "unsupported"
    assert "_supports_sdpa = False" in probes["fp32/sdpa/off"]["reason"]
    assert sorted(p.name for p in (out / "probes").iterdir()) == ["fp32__eager__off"]


def test_scale_auto_probes_a_twin_when_the_full_model_fits_but_would_take_too_long():
    plan = plan_model(recipe_by_name("gemma-2-2b"), CPU_24G)  # 2.6B params: ~10 GiB to train, fits 24 GiB
    assert plan.scale == "probe" and plan.full_params > 2.5e9
    assert "fits" not in plan.why and "a full-scale probe would take at least 45 min for 50 steps" in plan.why
    assert "2.7 TFLOP per step at 50 GFLOP/s given" in plan.why and "over the 120 s budget" in plan.why


def test_scale_auto_keeps_the_full_model_where_it_is_quick():
    plan = plan_model(recipe_by_name("gemma-2-2b"), H100)
    assert plan.scale == "full"
    assert "a full-scale probe takes at least 0.4" in plan.why and "Hopper tabled peak" in plan.why
    assert plan_model(resolve_model(None), CPU_24G).scale == "full"  # tiny-llama: quick anywhere


def test_the_cpu_speed_is_measured_when_nobody_gives_it():
    from nandoctor.models import device_flops

    speed, source = device_flops({"device": "cpu", "gpus": []})
    assert speed > 1e8 and source == "measured on this CPU"


def test_a_one_step_grid_is_refused_before_any_probe_runs(tmp_path, cli):
    proc = cli(
        "grid", "--axis", "dtype=fp32,fp16-pure", "--axis", "attn=eager", "--steps", "1", "--out", tmp_path / "run"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--steps 1 is too few for grid" in proc.stderr and "nandoctor check" in proc.stderr
    assert not (tmp_path / "run" / "probes").exists()


def test_a_grid_too_short_for_the_spike_and_rise_rules_is_warned_about():
    from nandoctor.thresholds import refuse_short_probes

    with pytest.raises(NandoctorError, match="too few for bisect"):
        refuse_short_probes("bisect", 1)
    warning = refuse_short_probes("grid", 3)
    assert "a loss spike (needs 4 steps) or a rising loss (needs 4 steps)" in warning
    assert refuse_short_probes("grid", 4) is None


def test_doctor_on_the_default_grid_lists_what_the_grid_will_find_and_exits_0():
    report = run_doctor(resolve_model("tiny-llama"), env=CPU_24G)
    eps = next(f for f in report["findings"] if f["id"] == "fp16-adamw-eps-below-smallest-normal")
    assert eps["severity"] == "error" and eps["scope"] == "grid" and eps["cells"][0].startswith("fp16-pure/")
    assert exit_code(report) == 0
    text = render_doctor_text(report)
    assert text.index("What the grid will find:") < text.index("fp16-adamw-eps-below-smallest-normal")


def test_doctor_exits_1_when_the_setup_itself_walks_into_an_error():
    report = run_doctor(resolve_model("tiny-llama"), axes={"dtype": ["fp16-pure"], "attn": ["sdpa"]}, env=CPU_24G)
    assert [f["scope"] for f in report["findings"] if f["severity"] == "error"] == ["setup"]
    assert exit_code(report) == 1


def test_rule_evidence_is_public_and_the_projects_own_checks_are_verified_by():
    for rule in rules():
        assert any(e.startswith("https://") for e in rule.evidence), rule.id
        assert not [e for e in rule.evidence if e.startswith(("tests/", "nandoctor/", "bench/"))], rule.id
    by_id = {r.id: r for r in rules()}
    assert by_id["fp16-adamw-eps-below-smallest-normal"].verified_by[0].startswith("tests/test_grid_numerics.py::")
