"""The RL objective's pieces that need no probe: the mismatch figures' arithmetic on known log-prob
differences, GRPO's group advantages, the completion mask, the recipe fields and their one-line errors,
and which probes' fingerprints the rollout settings enter."""

import math

import pytest
from conftest import run_main

from nandoctor.cells import Cell
from nandoctor.config import Recipe, set_field
from nandoctor.errors import NandoctorError
from nandoctor.record import ModelPlan, ProbeRecord, ProbeSpec
from nandoctor.run.fingerprint import probe_fingerprint


def test_the_mismatch_figures_are_the_token_and_sequence_statistics_of_known_differences():
    import torch

    from nandoctor.child.rollout import mismatch_figures

    # three sequences of three positions; the last position of the third is past its eos (masked out)
    diff = torch.tensor([[0.1, -0.2, 0.0], [0.0, 0.0, 0.0], [1.5, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    f = mismatch_figures(diff, mask)
    tokens = [0.1, -0.2, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0]
    assert f["tokens"] == 8 and f["sequences"] == 3
    assert f["logp_diff_mean"] == pytest.approx(sum(map(abs, tokens)) / 8)
    assert f["logp_diff_max"] == pytest.approx(1.5)  # the masked 9.0 counts nowhere
    assert f["k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in tokens) / 8)
    ratios = sorted([math.exp(-0.1), 1.0, math.exp(1.5)])  # exp of each sequence's summed difference
    assert f["ratio"]["min"] == pytest.approx(ratios[0]) and f["ratio"]["max"] == pytest.approx(ratios[2])
    assert f["ratio"]["median"] == pytest.approx(ratios[1])
    assert f["ratio"]["p10"] == pytest.approx(ratios[0] + 0.2 * (ratios[1] - ratios[0]))  # linear, as torch
    assert f["masked_share"] == pytest.approx(1 / 3)  # exp(1.5) = 4.48 > TRL's cap 3.0
    assert f["per_position"] == pytest.approx([1.6 / 3, 0.2 / 3, 0.0])


def test_identical_log_probs_have_no_mismatch_and_no_sequence_is_masked():
    import torch

    from nandoctor.child.rollout import mismatch_figures

    f = mismatch_figures(torch.zeros(4, 5), torch.ones(4, 5))
    assert f["logp_diff_mean"] == f["logp_diff_max"] == f["k3_kl"] == f["masked_share"] == 0.0
    assert set(f["ratio"].values()) == {1.0}


def test_grpo_advantages_are_rewards_against_their_own_group():
    import torch

    from nandoctor.child.rollout import advantages

    a = advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group=2)
    assert a[0] > 0 > a[1] and a[0] == pytest.approx(-a[1])
    assert a[2:].tolist() == [0.0, 0.0]  # a group that all scored alike teaches nothing


def test_a_completion_ends_at_its_first_eos_and_keeps_it():
    import torch

    from nandoctor.child.rollout import until_eos

    mask = until_eos(torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]]), eos=2)
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]


def test_the_objective_and_rollout_fields_are_recipe_fields_with_small_defaults():
    r = set_field(set_field(Recipe(), "objective", "grpo"), "rollout.top_k", "5").validate()
    assert (r.objective, r.rollout.top_k, Recipe().objective) == ("grpo", 5, "sft")
    assert r.rollout.prompts * r.rollout.num_generations * r.rollout.max_new_tokens <= 256


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("objective", "ppo", "objective='ppo' is not valid; valid: sft, grpo"),
        ("rollout.temperature", "0", "rollout.temperature must be > 0"),
        ("rollout.top_p", "1.5", "rollout.top_p must be in (0, 1]"),
        ("rollout.num_generations", "1", "rollout.num_generations must be >= 2"),
        ("rollout.prompt_len", "100", "rollout.prompt_len (100) is longer than"),
    ],
)
def test_a_bad_rollout_setting_is_one_line(key, value, says):
    with pytest.raises(NandoctorError) as e:
        set_field(set_field(Recipe(), "objective", "grpo"), key, value).validate()
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_bad_objective_flag_exits_2_without_a_traceback(tmp_path):
    proc = run_main("grid", "--set", "rollout.num_generations=1", "--objective", "grpo", "--out", tmp_path / "r")
    assert proc.returncode == 2 and "rollout.num_generations must be >= 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def spec(recipe: Recipe) -> dict:
    plan = ModelPlan("architecture-twin", "full", "llama", 1, 1, 1, None, "why", {})
    return ProbeSpec("fp32/sdpa/off", recipe, Cell("fp32"), plan, 3, 0, "cpu", 1).to_dict()


ENV = {"device": "cpu"}


def test_the_rollout_settings_are_in_a_grpo_probes_fingerprint_only():
    grpo = set_field(Recipe(), "objective", "grpo")
    hotter = set_field(grpo, "rollout.temperature", "0.7")
    assert probe_fingerprint(spec(grpo), {}, ENV) != probe_fingerprint(spec(Recipe()), {}, ENV)
    assert probe_fingerprint(spec(grpo), {}, ENV) != probe_fingerprint(spec(hotter), {}, ENV)
    # an sft probe reads no rollout field: its fingerprint is the one it had before they existed
    sft = spec(Recipe())
    older = {**sft, "recipe": {k: v for k, v in sft["recipe"].items() if k not in ("objective", "rollout")}}
    assert probe_fingerprint(sft, {}, ENV) == probe_fingerprint(older, {}, ENV)
    assert probe_fingerprint(sft, {}, ENV) == probe_fingerprint(
        spec(set_field(Recipe(), "rollout.top_k", "3")), {}, ENV
    )


def test_rollout_mismatch_and_the_steps_reward_and_entropy_survive_the_json_round_trip():
    record = ProbeRecord("p", Cell("fp32"), rollout_mismatch={"engine": "generate", "logp_diff_mean": 1e-7})
    data = record.to_dict()
    data["steps"] = [{"step": 0, "loss": 0.1, "grad_norm": 1.0, "reward": 0.5, "entropy": 8.3}]
    back = ProbeRecord.from_dict(data)
    assert back.rollout_mismatch == {"engine": "generate", "logp_diff_mean": 1e-7}
    assert (back.steps[0].reward, back.steps[0].entropy) == (0.5, 8.3)


@pytest.mark.parametrize("tied", [False, True])
def test_an_fp32_head_computes_fp32_logits_under_bf16_autocast_over_bf16_weights(tied):
    """rollout.lm_head_fp32 (child/rollout.pin_head_fp32): the head's weight is fp32 and its logits are
    the fp32 matmul of the fp32-cast hidden states, where autocast alone would give bf16 logits; a head
    tied to the embedding leaves the embedding's output in the layers' bf16."""
    import torch
    from checkpoints import TINY
    from transformers import AutoConfig, AutoModelForCausalLM

    from nandoctor.child.rollout import pin_head_fp32

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**TINY, "tie_word_embeddings": tied})
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(input_ids=ids).logits.dtype == torch.bfloat16
    pin_head_fp32(model, "cpu")
    hidden = []
    model.model.norm.register_forward_hook(lambda m, a, out: hidden.append(out))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
        assert model.get_input_embeddings()(ids).dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32 and logits.dtype == torch.float32
    assert torch.equal(logits, hidden[0].float() @ model.lm_head.weight.T)


def test_a_routers_choices_are_compared_at_each_completion_tokens_input_position():
    """RouteCapture.compare on hand-made choices: 2 sequences, a prompt of 3, 3 generated tokens, top-2.
    The rollout's prefill chose at the prompt's last position, each decode call at its one new token; the
    training forward at every position. One token differs in layer 0, on the second sequence's second
    completion token; the third completion token of the first sequence is past its eos (masked)."""
    import torch

    from nandoctor.child.rollout import RouteCapture

    capture = RouteCapture.__new__(RouteCapture)
    capture.modules, capture.counts, capture.mode = [("layer0", None)], [[0, 0]], None
    rows, prompt, length = 2, 3, 6
    train = torch.tensor([[[0, 1]] * length, [[2, 3]] * length])  # (rows, positions, k)
    prefill = train[:, :prompt].reshape(rows * prompt, 2)
    decodes = [train[:, p].clone() for p in (3, 4)]  # inputs: completion tokens 0 and 1
    decodes[0][1] = torch.tensor([2, 4])  # rollout chose otherwise at the 2nd completion token's input
    capture.rollout = [[prefill, *decodes]]
    capture.train = [train.reshape(rows * length, 2)]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    capture.compare(rows, prompt, length, mask)
    assert capture.counts == [[1, 5]]
    assert capture.figures() == {"per_layer": [0.2], "mean": 0.2}
