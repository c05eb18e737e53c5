"""Which engine samples a GRPO probe's rollouts (rollout.engine, child/vllm_engine.py): vLLM where the probe
runs on a CUDA GPU and vllm imports, generate() in its stead elsewhere, each record saying which ran and
why; rollout.engine=vllm on a host without a GPU is the user's error, said before any probe runs. On a
GPU host with vllm installed, a vLLM grid orders the mismatch fp32 < fp16-amp < bf16-amp as generate()'s
does (an H200 measured 7.8e-05, 1.7e-04 and 1.5e-03: docs/gpu/2026-11-28-h200-rl.md)."""

import importlib.util
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
from conftest import needs, records

from nandoctor.child.vllm_engine import choose, unavailable
from nandoctor.config import RolloutConfig
from nandoctor.recipes import recipe_by_name

RECIPE = replace(recipe_by_name("tiny-llama"), objective="grpo")
DENSE = SimpleNamespace()  # a model without a quantizer
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def recipe(**rollout):
    return replace(RECIPE, rollout=replace(RolloutConfig(), **rollout))


def test_auto_lets_generate_stand_in_on_a_cpu_and_says_so():
    engine, why = choose(recipe(), "cpu", DENSE, moe=False)
    assert engine == "generate"
    assert why == "generate() stands in for vLLM: vLLM runs on a CUDA GPU; this probe runs on cpu"


def test_generate_asked_for_is_generate_anywhere():
    assert choose(recipe(engine="generate"), "cuda", DENSE, moe=False) == (
        "generate",
        "rollout.engine=generate",
    )


def test_vllm_asked_for_where_it_cannot_run_is_an_error_naming_why():
    with pytest.raises(ValueError, match="rollout.engine=vllm cannot run here: vLLM runs on a CUDA GPU"):
        choose(recipe(engine="vllm"), "cpu", DENSE, moe=False)


@pytest.mark.parametrize(
    "settings, moe, phrase",
    [
        ({"lm_head_fp32": True}, False, "no switch for an fp32 output head"),
        ({"temperature": 0.7, "top_k": 20}, False, "only after top-k / top-p"),
        ({}, True, "does not report a mixture of experts' routing back"),
    ],
)
def test_on_a_gpu_auto_keeps_generate_where_vllm_would_not_compute_what_the_trainer_does(settings, moe, phrase):
    engine, why = choose(recipe(**settings), "cuda", DENSE, moe)
    assert engine == "generate" and why.startswith("generate() stands in for vLLM: ") and phrase in why


def test_an_adapter_or_a_quantized_base_keeps_generate():
    lora = replace(recipe(), adapter=replace(RECIPE.adapter, type="lora"))
    assert "lora adapter is not merged" in unavailable(lora, "cuda", DENSE, moe=False)
    quantized = SimpleNamespace(hf_quantizer=object())
    assert "quantized base" in unavailable(recipe(), "cuda", quantized, moe=False)


@needs("torchao")
def test_an_fp8_recipes_layers_keep_generate():
    import torch
    from torchao.float8 import convert_to_float8_training

    model = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    why = unavailable(recipe(), "cuda", model, moe=False)
    assert why == "the trainer's torchao Float8Linear layers are not the engine's"
    assert unavailable(recipe(), "cuda", torch.nn.Sequential(torch.nn.Linear(32, 32)), moe=False) in (
        None,
        "vllm is not installed",
    )


def test_a_tempered_distribution_without_filters_can_be_sampled_by_vllm():
    why = unavailable(recipe(temperature=0.7), "cuda", DENSE, moe=False)
    assert why is None if HAS_VLLM else why == "vllm is not installed"


def test_a_vllm_backend_name_is_checked_for_its_form():
    from nandoctor.errors import NandoctorError

    with pytest.raises(NandoctorError, match="rollout.vllm_attention='flash' is not valid"):
        recipe(vllm_attention="flash").validate()
    recipe(vllm_attention="FLASH_ATTN").validate()


def test_vllm_on_a_host_without_a_gpu_is_refused_before_any_probe():
    from nandoctor.device import DeviceFacts
    from nandoctor.errors import NandoctorError
    from nandoctor.plan import engine_without_gpu

    line = (
        "rollout.engine=vllm samples with vLLM, which needs a CUDA GPU; this host has none (device cpu): use "
        "rollout.engine=auto or generate"
    )
    with pytest.raises(NandoctorError, match=re.escape(line)):  # open_session asks it for grid, check and bisect
        engine_without_gpu(recipe(engine="vllm"), DeviceFacts(device="cpu"))
    engine_without_gpu(recipe(engine="vllm"), DeviceFacts(device="cuda"))
    engine_without_gpu(recipe(engine="auto"), DeviceFacts(device="cpu"))


@pytest.mark.slow  # the CLI gathers the device facts in a worker first (a few seconds), as a user's run does
def test_the_cli_refuses_vllm_on_a_host_without_a_gpu_in_one_line():
    import torch
    from conftest import run_cli

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the CLI would run vLLM")
    line = (
        "rollout.engine=vllm samples with vLLM, which needs a CUDA GPU; this host has none (device cpu): use "
        "rollout.engine=auto or generate"
    )
    proc = run_cli("check", "--dtype", "fp32", "--attn", "sdpa", "--objective", "grpo", "--set", "rollout.engine=vllm")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"nandoctor: error: {line}" and "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.slow
@needs("vllm")
def test_vllm_samples_the_rollouts_on_a_gpu_and_orders_the_precisions_as_generate_does(tmp_path):
    from conftest import run_cli

    out = tmp_path / "run"
    proc = run_cli(
        *("grid", "--objective", "grpo", "--steps", "4", "--out", out),
        *("--axis", "dtype=fp32,fp16-amp,bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off"),
        *("--set", "rollout.engine=vllm", "--set", "retime_rounds=0"),
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    found = records(out)
    cells = ("fp32/sdpa/off", "fp16-amp/sdpa/off", "bf16-amp/sdpa/off")
    for probe_id in cells:
        m = found[probe_id]["rollout_mismatch"]
        assert m["engine"] == "vllm" and m["engine_why"] == "rollout.engine=vllm" and m["engine_start_s"] > 0
    fp32, fp16, bf16 = (found[c]["rollout_mismatch"]["logp_diff_mean"] for c in cells)
    assert fp32 < fp16 < bf16 and bf16 >= 3 * fp16, (fp32, fp16, bf16)
    assert "Rollout engine: `vllm`" in (out / "report.md").read_text()
