"""`--trainer-args` with a TRL GRPOConfig: each probe runs trl.GRPOTrainer itself (child/grpo.py) on the
probe's prompts with the toy verifiable reward, its rollout settings the GRPOConfig's, and records the
rollout-training log-prob mismatch measured on the trainer's own model, which the RL verdict judges as
it judges the own GRPO loop's (docs/rl.md)."""

import json

import pytest
from conftest import needs, record_list, run_cli, verdicts
from training_runs import saved_arguments

GRID = ("--axis", "dtype=fp32,bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "3")
QUIET = ("--set", "retime_rounds=0")


def grpo_config(path, **settings):
    """A real TRL GRPOConfig as the user saves it (to_json_string()): 2 prompts x 4 generations of up to 16
    tokens per step, TRL's defaults otherwise (bf16=True, loss_type dapo, beta 0)."""
    from trl import GRPOConfig

    per_step = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 16}
    # use_cpu: bf16=True is refused on a host without a GPU otherwise; the file keeps bf16=True
    return saved_arguments(GRPOConfig, path, **{**per_step, "use_cpu": True, **settings})


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-trainer")
    config = grpo_config(tmp / "grpo.json")
    out = tmp / "run"
    done = run_cli("grid", *GRID, *QUIET, "--trainer-args", config, "--out", out, on_cpu=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return config, out, {r["probe_id"]: r for r in record_list(out)}, done


@pytest.mark.slow
@needs("trl", "datasets")
def test_a_grpo_config_trains_every_probe_with_trl_grpo_trainer(grid):
    _, _, records, done = grid
    assert "every probe runs trl.GRPOTrainer (objective grpo)" in done.stderr  # --objective was not given
    assert {"fp32/sdpa/off", "bf16-amp/sdpa/off"} <= set(records)
    for probe_id, r in records.items():
        assert r["status"] == "ok", probe_id
        assert r["trainer"]["class"] == "trl.GRPOTrainer" and r["trainer"]["trl"]
        trains = r["trainer"]["grpo_trains"]
        assert (trains["engine"], trains["loss_type"], trains["num_generations"]) == ("generate", "dapo", 4)
        assert len(r["steps"]) == 3
        for step in r["steps"]:
            assert 0.0 <= step["reward"] <= 1.0 and step["entropy"] > 0 and step["batch"] == "rollout"
            assert step["grad_norm"] > 0 and step["time_s"] > 0
            assert 8 <= step["supervised"] <= 8 * 16 and step["tokens"] == 8 * 8 + step["supervised"]


@pytest.mark.slow
@needs("trl", "datasets")
def test_the_grpo_configs_sampler_is_the_probes_rollout(grid):
    _, _, records, _ = grid
    for r in records.values():
        assert r["recipe"]["objective"] == "grpo"
        rollout = r["recipe"]["rollout"]
        assert (rollout["num_generations"], rollout["prompts"], rollout["max_new_tokens"]) == (4, 2, 16)
        assert (rollout["temperature"], rollout["top_p"], rollout["top_k"]) == (1.0, 1.0, 0)


@pytest.mark.slow
@needs("trl", "datasets")
def test_grpo_trainer_probes_record_the_mismatch_of_their_own_rollouts(grid):
    _, _, records, _ = grid
    for probe_id, r in records.items():
        m = r["rollout_mismatch"]
        # GRPOTrainer samples with the model's own attention: the cell's
        assert (m["engine"], m["engine_attn"], m["steps"]) == ("generate", probe_id.split("/")[1], 3), probe_id
        assert m["sequences"] == 3 * 8 and len(m["per_step_logp_diff_mean"]) == 3
        assert m["mask_cap"] == 3.0  # the GRPOConfig's default vllm_importance_sampling_clip_max
        assert 0 < m["tokens"] == sum(s["supervised"] for s in r["steps"])
    fp32, bf16 = (records[c]["rollout_mismatch"]["logp_diff_mean"] for c in ("fp32/sdpa/off", "bf16-amp/sdpa/off"))
    assert fp32 < 1e-6 < 1e-4 < bf16, (fp32, bf16)


@pytest.mark.slow
@needs("trl", "datasets")
def test_grpo_trainer_probes_are_judged_by_the_rl_verdict(grid):
    _, out, _, _ = grid
    cells = verdicts(out)
    # as measured on tiny-llama: fp32 differs by ~3e-7 nats, bf16-amp by ~7e-4, past the 2.7e-4 bound
    assert cells["fp32/sdpa/off"] == "stable" and cells["bf16-amp/sdpa/off"] == "off-policy", cells


@pytest.mark.slow
@needs("trl", "datasets")
def test_check_with_a_grpo_config_reaches_the_grids_verdict(grid, tmp_path):
    config, out, _, _ = grid
    cell = ("--dtype", "bf16-amp", "--attn", "sdpa", "--compile", "off", "--steps", "3")
    done = run_cli("check", *cell, *QUIET, "--trainer-args", config, "--trainer", "grpo", "--out", tmp_path / "c")
    assert "FAIL rollout log-probs match training" in done.stdout, done.stdout + done.stderr
    assert verdicts(tmp_path / "c") == {"bf16-amp/sdpa/off": verdicts(out)["bf16-amp/sdpa/off"]}


def test_a_grpo_config_is_told_from_its_keys_or_named_with_trainer_grpo(tmp_path):
    from nandoctor.knowledge.facts import trainer_of

    grpo = tmp_path / "grpo.json"
    grpo.write_text(json.dumps({"learning_rate": 1e-6, "max_completion_length": 64, "loss_type": "dapo"}))
    plain = tmp_path / "args.json"
    plain.write_text(json.dumps({"learning_rate": 1e-6}))
    assert trainer_of(grpo)["kind"] == "grpo"
    assert trainer_of(plain)["kind"] == "hf"
    assert trainer_of(plain, "grpo")["kind"] == "grpo"


def test_a_grpo_config_sets_the_rollout_from_trls_defaults_where_it_is_silent():
    from nandoctor.config import Recipe
    from nandoctor.knowledge.facts import with_trainer

    recipe = with_trainer(Recipe(), {"kind": "grpo", "args": {"num_generations": 4, "temperature": 0.7}})
    r = recipe.rollout
    assert recipe.objective == "grpo"
    # GRPOConfig's per_device_train_batch_size 8 / num_generations 4; max_completion_length 512
    assert (r.num_generations, r.prompts, r.temperature, r.max_new_tokens) == (4, 2, 0.7, 512)


@pytest.mark.parametrize(
    "file, objective, said",
    [
        ('{"learning_rate": 1e-6, "num_generations": 8, "beta": 0.0}', "sft", "--objective sft with a GRPOConfig"),
        ('{"learning_rate": 1e-5}', "grpo", "objective grpo with a TrainingArguments"),
    ],
)
def test_an_objective_the_trainer_file_cannot_train_is_one_line_and_exit_2(tmp_path, file, objective, said):
    path = tmp_path / "trainer.json"
    path.write_text(file)
    done = run_cli("grid", "--trainer-args", path, "--objective", objective, "--out", tmp_path / "run")
    assert done.returncode == 2
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@needs("trl", "datasets")
def test_the_grpo_configs_own_sequence_cap_is_the_one_the_probe_judges_by(tmp_path):
    # TRL masks a completion whose ratio is above vllm_importance_sampling_clip_max: at 1.0 it drops every
    # completion whose sampled tokens the trainer finds likelier at all, even fp32's (mean |dlogp| ~3e-7),
    # which the default cap 3.0 passes (the module's grid)
    config = grpo_config(tmp_path / "grpo.json", vllm_importance_sampling_clip_max=1.0)
    cell = ("--dtype", "fp32", "--attn", "sdpa", "--compile", "off", "--steps", "3")
    done = run_cli("check", *cell, *QUIET, "--trainer-args", config, "--trainer", "grpo", "--out", tmp_path / "c")
    assert done.returncode == 1, done.stdout + done.stderr
    [r] = record_list(tmp_path / "c")
    m = r["rollout_mismatch"]
    assert m["mask_cap"] == 1.0 and m["masked_share"] > 0 and m["logp_diff_mean"] < 1e-6
    assert m["engine_why"] == "trl.GRPOTrainer samples with its own generate() (the probe sets use_vllm=False)"
    assert "off-policy" in done.stdout and "beyond TRL's sequence cap 1 " in done.stdout
