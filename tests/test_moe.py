"""Mixtures of experts: the 2025-2026 recipes train, their routers are measured in every probe, and
what is known about their load-balancing loss and router collapse is said with its fix (docs/moe.md)."""

import dataclasses

import pytest
from checkpoints import save_collapsed_qwen3_moe, save_tied_router_qwen3_moe
from conftest import record_list

from nandoctor.analysis.verdicts import EXPERT_COLLAPSE, classify, route_flips
from nandoctor.cells import Cell
from nandoctor.config import set_field
from nandoctor.env import collect_summary
from nandoctor.models import plan_model
from nandoctor.recipes import recipe_by_name, resolve_model
from nandoctor.record import ProbeRecord, ProbeSpec

NEW_RECIPES = (
    "qwen3-8b",
    "qwen3-30b-a3b",
    "gemma-3-4b",
    "llama-3.2-3b",
    "gpt-oss-20b",
    "mixtral-8x7b",
    "qwen3-next-80b-a3b",
)
MOE_RECIPES = {"qwen3-30b-a3b": 32, "gpt-oss-20b": 16, "mixtral-8x7b": 8, "qwen3-next-80b-a3b": 40}
# A recipe at probe scale keeps its family's vocabulary and head_dim; these keep the suite fast (the
# architecture, layer kinds, experts and top-k stay the family's)
QUICK = {"model.arch.vocab_size": 512, "model.arch.head_dim": 16, "batch_size": 2, "seq_len": 16}


def quick(recipe):
    for key, value in QUICK.items():
        recipe = set_field(recipe, key, value)
    return recipe


def probe_in_process(recipe, cell=Cell("fp32", "eager", "off"), steps=4):
    """One probe of `steps` steps run in this process (child/probe.run_probe), its record."""
    from nandoctor.child.probe import run_probe
    from nandoctor.child.ranks import ONE_PROCESS

    cpu = {**collect_summary().to_dict(), "device": "cpu", "gpus": []}  # planned for the CPU it trains on
    recipe = dataclasses.replace(recipe, forensics_steps=0)
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, cpu), steps, recipe.seed, "cpu", 1)
    record = ProbeRecord(spec.probe_id, spec.cell)
    run_probe(spec, record, ONE_PROCESS, None)
    return spec, record


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW_RECIPES)
def test_each_new_recipe_trains_four_steps_on_the_cpu_and_refuses_with_reasons(name):
    spec, record = probe_in_process(quick(recipe_by_name(name)))
    assert spec.plan.scale == "probe" and spec.plan.source == "architecture-twin"
    assert len(record.steps) == 4 and all(s.loss == s.loss and s.loss < 1e3 for s in record.steps)
    assert all(isinstance(why, str) and len(why) > 40 for why in spec.plan.refuses.values())
    if name in MOE_RECIPES:
        assert record.moe["experts"] == MOE_RECIPES[name]
        assert len(record.moe["layers"]) == 2  # a router per layer of the probe-scale twin
        assert sum(record.moe["layers"][0]["step_0"]["tokens"]) == 2 * 16 * record.moe["top_k"]
    else:
        assert record.moe is None


def test_gpt_oss_refuses_sdpa_and_flash_attention_for_training_with_the_sinks_reason():
    plan = plan_model(recipe_by_name("gpt-oss-20b"), collect_summary())
    assert set(plan.refuses) == {"sdpa", "flash_attention_2"}
    assert all("sinks" in why and "flash-attention#1895" in why for why in plan.refuses.values())
    assert recipe_by_name("gpt-oss-20b").axes == {"attn": ["eager"]}


def test_probe_scale_keeps_the_top_k_and_four_times_as_many_experts():
    from nandoctor.models import expert_count, expert_top_k, model_config, probe_scale

    for name, experts in MOE_RECIPES.items():
        full = model_config(recipe_by_name(name))
        small = probe_scale(full)
        assert expert_top_k(small) == expert_top_k(full) and expert_count(small) == experts


@pytest.mark.slow
def test_a_collapsed_router_is_diagnosed_with_its_layer_and_idle_experts(tmp_path):
    """A real router that sends every token to experts 0 and 1 (a local checkpoint) trains 4 finite
    steps with a falling loss, and is judged expert-collapse naming the layer and the 6 idle experts."""
    recipe = resolve_model(str(save_collapsed_qwen3_moe(tmp_path / "collapsed")))
    _, record = probe_in_process(recipe)
    record.recipe = {"adapter": {"type": "none"}}
    verdict = classify(record)
    assert verdict.name == EXPERT_COLLAPSE, verdict
    assert "layer 0 (model.layers.0.mlp.gate): 6 of 8 experts got no token at step 3" in verdict.reason
    assert "layer 1" in verdict.reason and "expert 0 took 100%" in verdict.reason
    # the same model with its routers left as initialised spreads the tokens: nothing to diagnose
    spread = resolve_model(str(_reinitialised_routers(tmp_path)))
    _, healthy = probe_in_process(spread)
    assert classify(healthy).name != EXPERT_COLLAPSE
    assert max(layer["step_0"]["no_token"] for layer in healthy.moe["layers"]) < 4


def _reinitialised_routers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_collapsed_qwen3_moe(tmp_path / "base"))
    torch.manual_seed(1)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.02)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.02)
    model.save_pretrained(tmp_path / "spread")
    return tmp_path / "spread"


def test_route_flips_counts_the_choices_that_differ_per_token_and_slot():
    assert route_flips([[[0, 1], [2, 3]]], [[[0, 1], [2, 4]]]) == 0.25
    assert route_flips([[[0, 1]]], None) is None


QUICK_FLAGS = [f"--set={k}={v}" for k, v in QUICK.items()] + ["--set=retime_rounds=0"]


def _findings(run_dir):
    from conftest import summary

    return {f["id"]: f for f in summary(run_dir)["doctor"]["findings"]}


GRID = ["grid", "--model", "qwen3-30b-a3b", "--steps", "8", "--axis", "attn=sdpa", "--axis", "compile=off"]


@pytest.fixture(scope="module")
def qwen3_moe_grid(tmp_path_factory):
    """The issue's grid, on a smaller vocabulary and head_dim, run once for this module's tests as a user's
    `nandoctor` process: (the finished process, its run directory)."""
    from conftest import run_cli

    out = tmp_path_factory.mktemp("qwen3-moe") / "off"
    proc = run_cli(*GRID, "--axis", "dtype=fp32,bf16-amp", *QUICK_FLAGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, out


@pytest.mark.slow
def test_qwen3_moe_grid_reports_expert_load_and_the_load_balancing_loss_off(qwen3_moe_grid, tmp_path):
    """The report shows the expert load per router layer, and says that the load-balancing loss is off,
    with its fix; switched on, the finding is gone and the aux loss is recorded at every step. The second
    grid goes through the same `cli.main` in this process (run_main: its probes still run in a real
    worker), which spares a second interpreter's `import transformers`."""
    from conftest import run_main

    _, off = qwen3_moe_grid
    finding = _findings(off)["moe-load-balancing-off"]
    assert "output_router_logits=True" in finding["fix"] and finding["evidence"]
    report = (off / "report.md").read_text()
    assert "## Mixture of experts" in report and "### Expert load: bf16-amp/sdpa/off" in report
    assert "| top-8 of 32 | off " in report  # top-8 of 32 experts, no load-balancing loss
    assert "<svg" in (off / "report.html").read_text().split("Mixture of experts", 1)[1]
    assert "router_aux_loss_coef=0.001) adds it" in report  # the recommendation's code says how
    for record in record_list(off):
        assert len(record["moe"]["layers"]) == 2 and not record["moe"]["aux_loss_in_loss"]
        assert all(s["aux_loss"] is None for s in record["steps"])

    on = run_main(*GRID, "--axis", "dtype=fp32", "--set=moe.aux_loss=on", *QUICK_FLAGS, "--out", tmp_path / "on")
    assert on.returncode == 0, on.stderr[-2000:]
    assert "moe-load-balancing-off" not in _findings(tmp_path / "on")
    for record in record_list(tmp_path / "on"):
        assert record["moe"]["aux_loss_in_loss"] and record["moe"]["aux_loss_coef"] == 0.001
        assert all(s["aux_loss"] > 0 for s in record["steps"]) and len(record["steps"]) == 8
    assert "output_router_logits=True, router_aux_loss_coef=0.001" in (tmp_path / "on" / "report.md").read_text()


@pytest.mark.slow
def test_the_terminal_shows_each_probes_router_figures(qwen3_moe_grid):
    """The figures of report.md's Mixture of experts table, a row per probe, in the terminal report: top-k of
    the experts, the load-balancing loss, the router's dtype, step 0's choices against fp32, and the worst
    layer's load at the last step, as the record measured it."""
    import re

    proc, off = qwen3_moe_grid
    table = proc.stdout.split("Mixture of experts, the router per probe", 1)[1]
    by_probe = {r["probe_id"]: r["moe"] for r in record_list(off)}
    for probe, moe in by_probe.items():
        row = next(line for line in table.splitlines() if line.startswith(probe))
        last = [layer["step_last"] for layer in moe["layers"]]
        idle = max(at["no_token"] for at in last)
        share = max(at["largest_share"] for at in last)
        assert re.search(rf"top-8 of 32 +off +{moe['router_dtype']} ", row), row
        assert f"step 7: {idle} of 32 idle, largest share {share:.1%}" in row, row
    assert re.search(r"bf16-amp/sdpa/off .* bfloat16 +\d+\.\d%", table)  # step-0 choices vs the fp32 reference


@pytest.mark.slow
def test_grid_says_plainly_that_it_probes_a_stand_in_with_fewer_experts_and_layers(qwen3_moe_grid):
    """qwen3-30b-a3b has 128 routed experts in 48 layers; its probe-scale twin keeps top-8 of 32 in 2 layers.
    The terminal's header (at the start and in the final report) and report.md say so with both numbers."""
    from html import unescape

    proc, off = qwen3_moe_grid
    said = "the probes train 32 of the named model's 128 routed experts (top-8 kept) and 2 of its 48 layers"
    header = proc.stdout.split("[  1/", 1)[0]
    assert f"stand-in: {said}" in header, header
    assert proc.stdout.count(f"stand-in: {said}") == 2
    report = (off / "report.md").read_text()
    assert f"Stand-in: {said}." in report.split("## ", 1)[0]  # above the first section
    assert f"<b>Stand-in:</b> {said}." in unescape((off / "report.html").read_text())


@pytest.mark.slow
def test_doctor_says_what_the_grid_will_probe_for_a_moe_recipe():
    from conftest import run_main

    proc = run_main("doctor", "--model", "qwen3-30b-a3b", "--axis", "dtype=fp32", "--axis", "attn=sdpa")
    assert proc.returncode == 0, proc.stderr
    assert "Router (qwen3_moe): 128 experts, each token routed to 8" in proc.stdout
    assert "  grid probes: qwen3_moe architecture-twin at probe scale" in proc.stdout
    said = "  stand-in: the probes train 32 of the named model's 128 routed experts (top-8 kept) and 2 of its 48 layers"
    assert said in proc.stdout.splitlines()


@pytest.mark.slow
def test_the_router_heat_map_has_a_scale(qwen3_moe_grid):
    """Each heat map says what its shades mean (a share of the row's busiest expert, 0 to 100%) and what the
    red edge marks (an expert with no token)."""
    _, off = qwen3_moe_grid
    import re

    maps = re.findall(r'<svg[^>]*aria-label="expert load of .*?</svg>', (off / "report.html").read_text())
    assert len(maps) == 3  # a map per probe
    for svg in maps:
        assert ">tokens, share of the row's busiest</text>" in svg
        assert all(f">{p}</text>" in svg for p in ("0%", "25%", "50%", "75%", "100%"))
        assert 'stroke="#c62828"/><text' in svg and ">no token</text>" in svg


@pytest.mark.slow
def test_a_bf16_router_flips_near_tied_choices_and_moe_router_dtype_fp32_keeps_them(tmp_path):
    """Near-tied router logits (ViperEkura/AstrAI#57): under bf16 autocast most of step 0's token ->
    expert choices differ from the fp32 reference's; with moe.router_dtype=fp32 the router's logits are
    fp32 again and the choices are the reference's, up to the rounding of the layers before it."""
    from nandoctor.thresholds import THRESHOLDS

    recipe = resolve_model(str(save_tied_router_qwen3_moe(tmp_path / "tied")))
    _, reference = probe_in_process(recipe, steps=2)
    _, bf16 = probe_in_process(recipe, Cell("bf16-amp", "eager", "off"), steps=2)
    _, pinned = probe_in_process(set_field(recipe, "moe.router_dtype", "fp32"), Cell("bf16-amp", "eager", "off"), 2)
    choices = reference.moe["step0_choices"]
    assert bf16.moe["router_dtype"] == "bfloat16" and pinned.moe["router_dtype"] == "float32"
    assert route_flips(bf16.moe["step0_choices"], choices) > 0.5
    assert route_flips(pinned.moe["step0_choices"], choices) < THRESHOLDS.route_flip_share


def test_a_drift_with_flipped_routing_names_the_routing_as_its_cause():
    from nandoctor.analysis.verdicts import DRIFT, STABLE, Verdict, routing_cause

    drift = Verdict(DRIFT, "loss 6.9 vs fp32 reference 6.5 over the last 2 steps", 6)
    assert "caused by the routing: 66.4% of step 0's token -> expert choices" in routing_cause(drift, 0.664).reason
    assert routing_cause(drift, 0.01) == drift  # within the threshold: the routing is not the cause
    assert routing_cause(Verdict(STABLE, "fine"), 0.9).name == STABLE


def test_bisect_takes_moe_aux_loss_and_router_dtype_as_factors_and_names_the_one_that_fails():
    """--good / --bad parse both fields, typed and validated like the recipe's; the engine, against an
    oracle that fails where the router's logits are bf16 (what the test above measures), names
    moe.router_dtype and keeps the rest of the target."""
    from nandoctor.bisect.engine import Bisection, Run
    from nandoctor.bisect.factors import parse_configurations
    from nandoctor.errors import NandoctorError

    cpu = {"device": "cpu", "gpus": []}
    good, bad = parse_configurations(
        recipe_by_name("qwen3-30b-a3b"),
        cpu,
        "dtype=bf16-amp,moe.router_dtype=fp32,moe.aux_loss=on",
        "moe.router_dtype=compute,moe.aux_loss=family,attn=sdpa",
        [],
    )
    assert (good["moe.router_dtype"], bad["moe.router_dtype"]) == ("fp32", "compute")
    assert (good["moe.aux_loss"], bad["moe.aux_loss"]) == ("on", "family")
    with pytest.raises(NandoctorError, match="moe.router_dtype='bf16' is not valid"):
        parse_configurations(recipe_by_name("qwen3-30b-a3b"), cpu, None, "moe.router_dtype=bf16", [])

    probes = []

    def oracle(trials):
        collapsed = [t.config["moe.router_dtype"] == "compute" for t in trials]
        probes.extend(collapsed)
        return [Run(f"p{len(probes)}-{i}", "expert-collapse" if c else "stable", c) for i, c in enumerate(collapsed)]

    result = Bisection(good, bad, oracle).run()
    assert result.status == "bisected", result.message
    assert [c.factors for c in result.culprits] == [["moe.router_dtype"]]
    assert result.recommended == {**bad, "moe.router_dtype": "fp32"}


@pytest.mark.slow
def test_packing_check_names_the_layer_where_a_hybrid_or_sink_model_leaks():
    """Packed by position_ids, Qwen3-Next's linear-attention torch fallback and gpt-oss's eager attention
    with sinks mix the segments even with no mask and no cache; the check names the first layer that
    mixes them and its kind. gpt-oss with a 4-D block mask, and a
    Qwen3-MoE by position_ids, keep the segments apart: nothing to say."""
    from nandoctor.analysis.verdicts import setup_failures

    def packed(name, packing="position_ids"):
        recipe = set_field(set_field(quick(recipe_by_name(name)), "data.packing", packing), "seq_len", 32)
        _, record = probe_in_process(recipe, steps=1)
        return record.setup_checks

    hybrid = setup_failures(packed("qwen3-next-80b-a3b"))
    assert len(hybrid) == 1 and "first mix at layer 0 (linear_attention)" in hybrid[0]
    sinks = setup_failures(packed("gpt-oss-20b"))
    assert len(sinks) == 1 and "first mix at layer 0 (sliding_attention)" in sinks[0]
    assert setup_failures(packed("gpt-oss-20b", "block_mask")) == []
    assert setup_failures(packed("qwen3-30b-a3b")) == []


@pytest.mark.slow
@pytest.mark.parametrize("output_router_logits", [False, True])
def test_a_trainer_run_of_a_moe_without_its_load_balancing_loss_is_told_so(tmp_path, output_router_logits):
    """The Trainer callback judges the user's own model config: a Qwen3-MoE as transformers builds it
    (output_router_logits=False) gets moe-load-balancing-off at train start; with it on, it does not."""
    import torch
    from training_runs import hf_trainer
    from transformers import AutoModelForCausalLM

    from nandoctor.integrations.transformers import NandoctorCallback

    path = save_collapsed_qwen3_moe(tmp_path / "moe", output_router_logits=output_router_logits)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.config.use_cache = False
    callback = NandoctorCallback()
    hf_trainer(model, tmp_path / "out", [callback], max_steps=1).train()
    fired = {f["id"] for f in callback.watch.findings}
    assert ("moe-load-balancing-off" in fired) is not output_router_logits


@pytest.mark.slow
def test_bisect_names_moe_router_dtype_for_a_router_that_collapses_in_bf16(cli, tmp_path):
    """ViperEkura/AstrAI#57 end to end: near-tied router logits, bf16 autocast. With the router in the
    compute dtype every token goes to the same two experts (expert-collapse); with moe.router_dtype=fp32
    the bf16 cell is stable. Between that baseline and a target that also changes the attention, bisect
    names moe.router_dtype alone."""
    import json

    path = save_tied_router_qwen3_moe(tmp_path / "tied")
    out = tmp_path / "bisect"
    proc = cli(
        "bisect",
        "--model",
        path,
        "--good",
        "dtype=bf16-amp,moe.router_dtype=fp32",
        "--bad",
        "moe.router_dtype=compute,attn=sdpa",
        "--steps",
        "4",
        "--reruns",
        "0",
        "--set=optimizer.lr=1e-4",
        "--set=forensics_steps=0",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bisect.json").read_text())
    assert result["status"] == "bisected" and [c["factors"] for c in result["culprits"]] == [["moe.router_dtype"]]
    verdicts = {step["outcome"]: step["verdicts"] for step in result["path"]}
    assert verdicts["fail"] == ["expert-collapse"] and verdicts["pass"] == ["stable"]
    assert result["recommended"]["moe.router_dtype"] == "fp32" and result["recommended"]["attn"] == "sdpa"
