"""Model planning: which model is probed, at which scale, and why (meta device: no memory, fast)."""

import pytest

from nandoctor.models import model_config, plan_model, probe_scale, shape_of
from nandoctor.recipes import recipe_by_name, resolve_model

CPU_24G = {"device": "cpu", "gpus": [], "ram_bytes": 24 * 2**30, "ram_available_bytes": 23 * 2**30, "cpu_count": 2}


def test_llama_8b_twin_keeps_head_dim_gqa_vocab_and_rope():
    full = model_config(recipe_by_name("llama-3.1-8b"))
    small = probe_scale(full)
    a, b = shape_of(full), shape_of(small)
    assert b["head_dim"] == a["head_dim"] == 128
    assert a["heads"] // a["kv_heads"] == b["heads"] // b["kv_heads"] == 4
    assert b["vocab"] == 128256 and b["layers"] == 2
    assert small.rope_parameters == full.rope_parameters and small.rope_parameters["rope_type"] == "llama3"
    assert b["intermediate"] / b["hidden"] == pytest.approx(a["intermediate"] / a["hidden"], rel=0.01)


def test_gemma2_twin_keeps_its_alternating_layer_types_and_softcapping():
    full = model_config(recipe_by_name("gemma-2-2b"))
    small = probe_scale(full)
    assert small.layer_types == full.layer_types[:2]
    assert small.attn_logit_softcapping == 50.0 and shape_of(small)["head_dim"] == 256


def test_8b_does_not_fit_24gib_so_auto_plans_a_probe_scale_twin_and_says_why():
    plan = plan_model(recipe_by_name("llama-3.1-8b"), CPU_24G)
    assert plan.scale == "probe" and plan.source == "architecture-twin"
    assert plan.full_params > 8e9 and plan.params < 0.2e9
    assert "no local weights for meta-llama/Llama-3.1-8B" in plan.why and "probe scale" in plan.why


def test_tiny_llama_fits_and_is_probed_at_full_scale():
    plan = plan_model(resolve_model(None), CPU_24G)
    assert plan.scale == "full" and plan.params == plan.full_params
    assert 1e6 < plan.params < 5e6


def test_dora_adapter_makes_only_adapter_params_trainable():
    plan = plan_model(recipe_by_name("llama-3.1-8b"), CPU_24G)
    assert 0 < plan.trainable_params < plan.params / 10
