"""Issue 47's causes told apart: the rollout engine samples with its own attention kernel (rollout.attn,
generate()'s sdpa by default) whatever kernel the cell trains with, so the trainer's attention and
compile are causes of the rollout-training mismatch that bisect --objective grpo can name, each shown
a configuration it fails and one it passes. On this CPU, bf16-amp with the eager kernel on both paths
scores the rollout's tokens bit for bit (mean |dlogp| 0.0); the trainer's sdpa against an eager engine
is off-policy (8.4e-4). The sampler's filters (top_k, top_p) never flip a verdict."""

import contextlib
import json

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow  # real models sample and score; the bisections spawn probe processes

GRPO = ("--objective", "grpo", "--steps", "2", "--set", "forensics_steps=0")


def test_the_rollout_samples_with_the_engines_attention_and_the_trainer_scores_with_the_cells():
    """An eager cell's model under rollout.attn=sdpa: generate() runs sdpa, the training forward eager;
    under rollout.attn=eager both run eager (the case a rollout that ran the cell's kernel would give
    whatever rollout.attn says)."""
    import torch
    from checkpoints import TINY
    from transformers import AutoConfig, AutoModelForCausalLM

    from nandoctor.child.rollout import Rollouts
    from nandoctor.config import Recipe, set_field
    from nandoctor.data import stream

    for engine in ("sdpa", "eager"):
        seen: dict[str, set] = {"rollout": set(), "train": set()}
        where = ["rollout"]
        recipe = set_field(set_field(Recipe(), "objective", "grpo"), "rollout.attn", engine).validate()
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **TINY)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        attention = model.model.layers[0].self_attn
        attention.register_forward_pre_hook(
            lambda m, a, seen=seen, where=where: seen[where[0]].add(m.config._attn_implementation)
        )
        rollouts = Rollouts(recipe, model, stream(recipe, model.config, 0), contextlib.nullcontext, "cpu", 0)
        batch = rollouts.sample(0)
        where[0] = "train"
        rollouts.loss(model, batch)
        assert seen == {"rollout": {engine}, "train": {"eager"}}, engine
        assert model.config._attn_implementation == "eager" and rollouts.figures()["engine_attn"] == engine


def bisect(tmp_path, good: str, bad: str, *settings: str):
    out = tmp_path / "bisect"
    proc = run_cli("bisect", *GRPO, "--good", good, "--bad", bad, "--reruns", "0", *settings, "--out", out, on_cpu=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bisect.json").read_text())
    records = {r["probe_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    return proc, result, records


def test_bisect_names_attn_when_the_trainers_kernel_is_not_the_engines(tmp_path):
    """bf16-amp against an eager engine: the eager trainer is on-policy, the sdpa trainer off-policy, and
    bisect names the attention as the one factor between them."""
    proc, result, records = bisect(
        tmp_path,
        "dtype=bf16-amp,attn=eager,compile=off",
        "dtype=bf16-amp,attn=sdpa,compile=off",
        *("--set", "rollout.attn=eager"),
    )
    verdicts = {step["outcome"]: step["verdicts"] for step in result["path"]}
    assert result["status"] == "bisected" and [c["factors"] for c in result["culprits"]] == [["attn"]]
    assert verdicts == {"fail": ["off-policy"], "pass": ["stable"]}
    assert "Culprit (single factor): attn=sdpa -> off-policy" in proc.stdout
    same = records["bf16-amp/eager/off"]["rollout_mismatch"]
    apart = records["bf16-amp/sdpa/off"]["rollout_mismatch"]
    assert same["engine_attn"] == apart["engine_attn"] == "eager"
    assert same["logp_diff_mean"] < apart["logp_diff_mean"]
