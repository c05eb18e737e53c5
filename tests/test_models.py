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


def test_a_text_file_is_tokenized_and_each_batch_padded_to_its_longest_row(tmp_path):
    from userdata_fixtures import save_chat_tokenizer, text_rows, write_rows

    from nandoctor.config import recipe_from_dict
    from nandoctor.data import stream

    text = write_rows(tmp_path / "corpus.txt", text_rows(12, words=(3, 20)))
    data = {"path": str(text), "tokenizer": str(save_chat_tokenizer(tmp_path / "tok")), "labels": "attention_mask"}
    recipe = recipe_from_dict({"data": data, "seq_len": 32, "batch_size": 3}, "r")
    first = stream(recipe, model_config(resolve_model(None)), seed=0).batches[0]
    ids, mask, labels = (first.inputs[k] for k in ("input_ids", "attention_mask", "labels"))
    assert recipe.data.source == "file" and first.rows == (0, 1, 2) and ids.shape[0] == 3
    assert ids.shape[1] == int(mask.sum(dim=1).max()) <= 32  # padded to the longest row, truncated at seq_len
    assert (labels[mask == 0] == -100).all() and (labels[mask == 1] == ids[mask == 1]).all()


def test_same_seed_same_batches_other_seed_other_batches():
    from nandoctor.data import batches

    recipe, config = resolve_model(None), model_config(resolve_model(None))
    a, b, c = (next(batches(recipe, config, seed=s))["input_ids"] for s in (0, 0, 1))
    assert (a == b).all() and not (a == c).all()


def test_hub_id_in_the_local_cache_is_used_as_real_weights(tmp_path, monkeypatch):
    """A cache laid out as huggingface_hub writes it: refs/main -> snapshots/<rev>/ with the files."""
    from checkpoints import save_llama

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    rev = "0123456789abcdef0123456789abcdef01234567"
    save_llama(repo / "snapshots" / rev)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    recipe = resolve_model("acme/tiny-llama")
    plan = plan_model(recipe, CPU_24G)
    assert plan.source == "local-weights" and plan.path.endswith(rev)
    assert "real weights from" in plan.why
