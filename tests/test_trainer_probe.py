"""`--trainer-args FILE`: each probe trains with the user's own transformers.Trainer or trl.SFTTrainer
(child/trainer.py, child/sft.py) for the probe's steps, the cell's precision, attention and compile set on
their TrainingArguments / SFTConfig; where no trainer is named the probes run nandoctor's own loop. One
verdict for one run, whichever body ran it."""

import math

import pytest
from conftest import needs, record_list, run_cli, verdicts

GRID = ("--axis", "dtype=fp32,bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "4")
QUIET = ("--set", "retime_rounds=0")


def training_args(path, **settings):
    """A real TrainingArguments as the user saves it (to_json_string()), the own loop's defaults otherwise:
    lr 1e-3, no schedule, 4 rows per batch, clipping at 1."""
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(path.parent / "user-output"),
        learning_rate=settings.pop("learning_rate", 1e-3),
        lr_scheduler_type="constant",
        per_device_train_batch_size=4,
        max_grad_norm=1.0,
        report_to="none",
        **settings,
    )
    path.write_text(args.to_json_string())
    return path


def sft_config(path, **settings):
    """A real TRL SFTConfig as the user saves it (to_json_string()), with its own defaults (bf16=True,
    gradient_checkpointing=True, max_length 1024) and the own loop's optimizer settings otherwise."""
    from trl import SFTConfig

    args = SFTConfig(
        output_dir=str(path.parent / "user-output"),
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        per_device_train_batch_size=4,
        max_grad_norm=1.0,
        report_to="none",
        use_cpu=True,  # bf16=True is refused on a host without a GPU otherwise; the file keeps bf16=True
        **settings,
    )
    path.write_text(args.to_json_string())
    return path


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """The same healthy tiny grid under the user's Trainer, under TRL's SFTTrainer and in nandoctor's own loop."""
    tmp = tmp_path_factory.mktemp("healthy")
    args = training_args(tmp / "args.json")
    sft = sft_config(tmp / "sft.json")
    runs = {}
    for body, flags in (("trainer", ("--trainer-args", args)), ("sft", ("--trainer-args", sft)), ("own", ())):
        out = tmp / body
        done = run_cli("grid", *GRID, *QUIET, *flags, "--out", out)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[body] = out
    return runs


@pytest.mark.slow
def test_grid_trainer_args_trains_every_cell_with_the_users_trainer(healthy):
    cells = verdicts(healthy["trainer"])
    assert {cell.split("/")[0] for cell in cells} >= {"fp32", "bf16-amp"}
    assert set(cells.values()) == {"stable"}
    for record in record_list(healthy["trainer"]):
        assert record["trainer"]["class"] == "transformers.Trainer"
        assert record["trainer"]["transformers"]
        assert len(record["steps"]) == 4
        assert "not_run" in record["forensics"]  # said, not faked: the replay re-runs nandoctor's own loop


@pytest.mark.slow
def test_own_loop_stays_where_no_trainer_is_named(healthy):
    for record in record_list(healthy["own"]):
        assert record["trainer"] is None
        assert "compute_dtype" in record["forensics"]  # the replay ran


@pytest.mark.slow
def test_trainer_and_own_loop_agree_on_every_verdict_of_a_healthy_setup(healthy):
    assert verdicts(healthy["trainer"]) == verdicts(healthy["own"])
    own = {r["probe_id"]: r for r in record_list(healthy["own"])}
    for record in record_list(healthy["trainer"]):  # the same batches, optimizer and clipping: the same step 0
        reference = own[record["probe_id"]]["steps"][0]
        assert math.isclose(record["steps"][0]["loss"], reference["loss"], rel_tol=1e-5)
        assert math.isclose(record["steps"][0]["grad_norm"], reference["grad_norm"], rel_tol=1e-4)
        assert record["steps"][0]["groups"].keys() == reference["groups"].keys()


@pytest.mark.slow
def test_trainer_and_own_loop_both_judge_an_exploding_lr_nonfinite(tmp_path):
    args = training_args(tmp_path / "args.json", learning_rate=1e30)
    grid = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "3", *QUIET)
    trainer = run_cli("grid", *grid, "--trainer-args", args, "--out", tmp_path / "trainer")
    own = run_cli("grid", *grid, "--set", "optimizer.lr=1e30", "--out", tmp_path / "own")
    assert trainer.returncode == own.returncode == 1, trainer.stdout + trainer.stderr
    judged = verdicts(tmp_path / "trainer")
    assert set(judged.values()) == {"nonfinite"}
    assert judged == verdicts(tmp_path / "own")


def test_yaml_trainer_args_are_read(tmp_path):
    from nandoctor.config import Recipe
    from nandoctor.knowledge.facts import trainer_of, with_trainer_args

    path = tmp_path / "args.yaml"
    path.write_text("learning_rate: 2.0e-5\ngradient_accumulation_steps: 2\nmax_grad_norm: 0.5\n")
    trainer = trainer_of(path)
    assert trainer == {
        "kind": "hf",
        "args": {"learning_rate": 2e-5, "gradient_accumulation_steps": 2, "max_grad_norm": 0.5},
    }
    recipe = with_trainer_args(Recipe(), trainer["args"])
    assert (recipe.optimizer.lr, recipe.gradient_accumulation_steps, recipe.grad_clip) == (2e-5, 2, 0.5)


@pytest.mark.slow
@needs("trl", "datasets")
def test_grid_sft_config_trains_every_cell_with_trl_sft_trainer(healthy):
    import trl

    cells = verdicts(healthy["sft"])
    assert {cell.split("/")[0] for cell in cells} >= {"fp32", "bf16-amp"}
    assert set(cells.values()) == {"stable"}
    for record in record_list(healthy["sft"]):
        assert record["trainer"]["class"] == "trl.SFTTrainer"
        assert record["trainer"]["trl"] == trl.__version__
        assert len(record["steps"]) == 4
        trains = record["trainer"]["sft_trains"]  # nothing truncated, dropped or packed: the own loop's rows
        for figure in ("rows", "tokens", "supervised"):
            assert trains[figure]["trainer"] == trains[figure]["own"], figure
        assert (trains["packing"], trains["padding_free"]) == (False, False)


@pytest.mark.slow
@needs("trl", "datasets")
def test_sft_trainer_and_trainer_agree_on_every_verdict_of_a_healthy_setup(healthy):
    assert verdicts(healthy["sft"]) == verdicts(healthy["trainer"]) == verdicts(healthy["own"])
    own = {r["probe_id"]: r for r in record_list(healthy["own"])}
    for record in record_list(healthy["sft"]):
        reference, step = own[record["probe_id"]]["steps"][0], record["steps"][0]
        assert (step["tokens"], step["supervised"]) == (reference["tokens"], reference["supervised"])
        assert math.isclose(step["loss"], reference["loss"], rel_tol=1e-5)
        # fp32: the same gradient; bf16-amp: SFTTrainer's fused LM head differentiates the log-probs its own
        # way (2e-4 of the grad-norm on tiny-llama)
        bound = 1e-5 if record["probe_id"].startswith("fp32") else 1e-3
        assert math.isclose(step["grad_norm"], reference["grad_norm"], rel_tol=bound)


@pytest.mark.slow
@needs("trl", "datasets")
def test_sft_max_length_shorter_than_the_rows_is_trained_and_said(tmp_path):
    sft = sft_config(tmp_path / "sft.json", max_length=32)  # the probe's rows are 64 tokens
    grid = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "2", *QUIET)
    done = run_cli("grid", *grid, "--trainer-args", sft, "--out", tmp_path / "run")
    assert done.returncode == 0, done.stdout + done.stderr
    for record in record_list(tmp_path / "run"):
        trains = record["trainer"]["sft_trains"]
        assert trains["max_length"] == 32
        assert trains["tokens"] == {"own": 2 * 4 * 64, "trainer": 2 * 4 * 32}
        assert trains["rows"] == {"own": 8, "trainer": 8}
        assert [s["tokens"] for s in record["steps"]] == [4 * 32, 4 * 32]


def test_an_sft_config_with_data_packing_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "sft.json"
    path.write_text('{"learning_rate": 1e-5, "dataset_text_field": "text", "packing": true}')
    done = run_cli("grid", "--trainer-args", path, "--set", "data.packing=position_ids", "--out", tmp_path / "run")
    assert done.returncode == 2
    assert "trl.SFTTrainer packs as the SFTConfig says" in done.stderr
    assert "Traceback" not in done.stderr
