"""`--trainer-args FILE`: each probe trains with the user's own transformers.Trainer or trl.SFTTrainer
(child/trainer.py, child/sft.py) for the probe's steps, the cell's precision, attention and compile set on
their TrainingArguments / SFTConfig; where no trainer is named the probes run nandoctor's own loop. One
verdict for one run, whichever body ran it."""

import json
import math

import pytest
from conftest import needs, record_list, records, run_cli, summary, verdicts
from training_runs import saved_arguments

GRID = ("--axis", "dtype=fp32,bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "4")
QUIET = ("--set", "retime_rounds=0")


def training_args(path, **settings):
    """A real TrainingArguments as the user saves it (to_json_string()), the own loop's defaults otherwise:
    lr 1e-3, no schedule, 4 rows per batch, clipping at 1."""
    from transformers import TrainingArguments

    return saved_arguments(TrainingArguments, path, **{"per_device_train_batch_size": 4, **settings})


def sft_config(path, **settings):
    """A real TRL SFTConfig as the user saves it (to_json_string()), with its own defaults (bf16=True,
    gradient_checkpointing=True, max_length 1024) and the own loop's optimizer settings otherwise."""
    from trl import SFTConfig

    # use_cpu: bf16=True is refused on a host without a GPU otherwise; the file keeps bf16=True
    return saved_arguments(SFTConfig, path, **{"per_device_train_batch_size": 4, "use_cpu": True, **settings})


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
        assert "not_run" in record["forensics"]  # said, not faked: only a failing step is replayed


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


STALLING = ("--axis", "dtype=fp32,bf16-pure", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "4", *QUIET)


@pytest.fixture(scope="module")
def stalling(tmp_path_factory):
    """An lr of 1e-6 under the user's Trainer (the file names only it and the batch) and in the own loop:
    bf16-pure's step-0 AdamW update rounds away in the bf16 weights, over 4 steps too few for the loss to show it."""
    tmp = tmp_path_factory.mktemp("stalling")
    args = tmp / "args.json"
    args.write_text(json.dumps({"learning_rate": 1e-6, "per_device_train_batch_size": 4}))
    trainer = run_cli("grid", *STALLING, "--trainer-args", args, "--out", tmp / "trainer")
    own = run_cli("grid", *STALLING, "--set", "optimizer.lr=1e-6", "--set", "batch_size=4", "--out", tmp / "own")
    for done in (trainer, own):
        assert done.returncode == 0, done.stdout + done.stderr
    return {"trainer": tmp / "trainer", "own": tmp / "own"}


@pytest.mark.slow
def test_trainer_and_own_loop_both_judge_bf16_pure_at_lr_1e_6_stalled(stalling):
    judged = {}
    for body, out in stalling.items():
        probes = {p["probe_id"]: p for p in summary(out)["probes"]}
        assert probes["fp32/sdpa/off"]["verdict"] == "stable", body
        pure = probes["bf16-pure/sdpa/off"]
        assert pure["verdict"] == "drift" and pure["reason"].startswith("stalled: step 0's optimizer step lost"), body
        judged[body] = {p: (v["verdict"], v["reason"].split(":")[0]) for p, v in probes.items()}
    assert judged["trainer"] == judged["own"]
    trainer, own = records(stalling["trainer"]), records(stalling["own"])
    for probe in ("fp32/sdpa/off", "bf16-pure/sdpa/off"):  # the same AdamW step 0 on the same weights: one figure
        measured = [r[probe]["forensics"]["steps"][0]["update_loss"] for r in (trainer, own)]
        assert math.isclose(*measured, abs_tol=0.01), (probe, measured)


@pytest.mark.slow
def test_explain_shows_the_update_loss_a_stable_trainer_probe_measured(stalling):
    done = run_cli("explain", stalling["trainer"], "--probe", "bf16-pure/sdpa/off")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "update loss (bfloat16 weights): 98% at step 0" in done.stdout, done.stdout
    assert "only a failing step is replayed" in done.stdout


EXPLODING = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "3", *QUIET)


@pytest.fixture(scope="module")
def exploding(tmp_path_factory):
    """An lr of 1e30 in fp32 under the user's Trainer and in the own loop: the weights reach 1e30 after
    step 0, and step 1's forward overflows."""
    tmp = tmp_path_factory.mktemp("exploding")
    args = training_args(tmp / "args.json", learning_rate=1e30)
    trainer = run_cli("grid", *EXPLODING, "--trainer-args", args, "--out", tmp / "trainer")
    own = run_cli("grid", *EXPLODING, "--set", "optimizer.lr=1e30", "--out", tmp / "own")
    assert trainer.returncode == own.returncode == 1, trainer.stdout + trainer.stderr
    return {"trainer": tmp / "trainer", "own": tmp / "own"}


def origins(run_dir) -> dict[str, str]:
    """{probe: the origin line `nandoctor explain` prints for it}."""
    out = {}
    for probe in verdicts(run_dir):
        done = run_cli("explain", run_dir, "--probe", probe)
        assert done.returncode == 0, done.stdout + done.stderr
        out[probe] = next(
            (line.strip() for line in done.stdout.splitlines() if line.strip().startswith("origin (")), None
        )
    return out


@pytest.mark.slow
def test_trainer_and_own_loop_both_judge_an_exploding_lr_nonfinite(exploding):
    judged = verdicts(exploding["trainer"])
    assert set(judged.values()) == {"nonfinite"}
    assert judged == verdicts(exploding["own"])


@pytest.mark.slow
def test_a_trainer_probe_that_goes_nonfinite_replays_its_failing_step(exploding):
    for record in record_list(exploding["trainer"]):
        f = record["forensics"]
        assert record["trainer"]["class"] == "transformers.Trainer"
        assert "not_run" not in f and "error" not in f, f
        assert record["first_nonfinite"]["step"] == 1 and f["replayed_steps"] == 1
        assert f["reproduced"] is True  # the hooked step retraced the trainer's step 1: loss NaN
        assert any(e["phase"] == "forward" and e["step"] == 1 for e in f["events"])


@pytest.mark.slow
def test_explain_names_the_module_the_own_loop_names_for_a_failing_trainer_probe(exploding):
    trainer = origins(exploding["trainer"])
    assert trainer == origins(exploding["own"])
    assert all("step 1, model.layers.0.self_attn.q_proj: output holds NaN/inf" in line for line in trainer.values())


@pytest.mark.slow
@needs("trl", "datasets")
def test_an_sft_trainer_probe_that_goes_nonfinite_names_the_module_the_own_loop_names(exploding, tmp_path):
    sft = sft_config(tmp_path / "sft.json", learning_rate=1e30)
    done = run_cli("grid", *EXPLODING, "--trainer-args", sft, "--out", tmp_path / "sft")
    assert done.returncode == 1, done.stdout + done.stderr
    assert {r["trainer"]["class"] for r in record_list(tmp_path / "sft")} == {"trl.SFTTrainer"}
    assert origins(tmp_path / "sft") == origins(exploding["own"])


@pytest.mark.slow
def test_bisect_trainer_args_names_the_lr_factor_it_set_on_the_users_trainer(tmp_path):
    args = training_args(tmp_path / "args.json")  # lr 1e-3: stable; the target's factor sets 1e30
    good, bad = "dtype=fp32,attn=sdpa,compile=off", "dtype=bf16-amp,attn=sdpa,compile=off,optimizer.lr=1e30"
    out = tmp_path / "bisect"
    flags = ("--steps", "2", "--reruns", "0", "--set", "forensics_steps=0", *QUIET, "--out", out)
    done = run_cli("bisect", "--trainer-args", args, "--good", good, "--bad", bad, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Culprit (single factor): optimizer.lr=1e+30 -> nonfinite" in done.stdout
    b = json.loads((out / "bisect.json").read_text())
    assert b["status"] == "bisected" and [c["factors"] for c in b["culprits"]] == [["optimizer.lr"]]
    assert b["recommended"]["dtype"] == "bf16-amp"  # the factor reverted, the target's precision kept
    records = record_list(out)
    assert {r["trainer"]["class"] for r in records} == {"transformers.Trainer"}
    failed = {r["probe_id"] for r in records if r["first_nonfinite"]}
    assert failed and all("optimizer.lr=1e+30" in probe for probe in failed)


def test_the_recipe_gives_the_trainer_back_the_fields_it_read_from_the_file():
    from nandoctor.config import Recipe, set_field, trainer_arguments
    from nandoctor.knowledge.facts import with_trainer_args

    recipe = set_field(set_field(Recipe(), "optimizer.lr", "1e30"), "grad_clip", "0.5")
    given = trainer_arguments(recipe)
    assert (given["learning_rate"], given["max_grad_norm"]) == (1e30, 0.5)
    assert with_trainer_args(Recipe(), given) == recipe.validate()


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
