"""Optimizers as the user names them: every TrainingArguments optim= that runs here is an optimizer row (or
is refused with the reason), doctor --trainer-args lints the optimizer named, a schedule-free run's round
trip compares what save_model() writes with what evaluate() scores, and Muon trains with the usual split."""

import json

import pytest
import torch

from nandoctor.cells import OPTIMIZERS, UNSUPPORTED_OPTIMS, optimizer_of_training_args
from nandoctor.config import OptimizerConfig
from nandoctor.errors import NandoctorError
from tests.conftest import needs, run_cli


def test_every_trainer_optim_is_a_row_or_refused_with_its_reason():
    from transformers.training_args import OptimizerNames

    for optim in (o.value for o in OptimizerNames):
        if optim in UNSUPPORTED_OPTIMS:
            with pytest.raises(NandoctorError, match=f"optim={optim!r} is not probed: "):
                optimizer_of_training_args({"optim": optim})
        else:
            assert optim in OPTIMIZERS[optimizer_of_training_args({"optim": optim})].transformers_optim
    assert optimizer_of_training_args({}) == "adamw"


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.checkpoints import TINY

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))


@needs("schedulefree", "bitsandbytes")
@pytest.mark.slow
def test_every_row_this_cpu_runs_builds_and_lowers_the_loss():
    from nandoctor.child.optimizers import optimizer_for

    torch.manual_seed(1)
    batch = torch.randint(0, 1024, (2, 16))
    for name, row in OPTIMIZERS.items():
        if row.cuda_only or row.compiles_step:  # torchao's compiled step: tests/test_lowp_memory.py
            continue
        model = tiny_llama()
        optimizer = optimizer_for(name, model, OptimizerConfig(lr=1e-2, weight_decay=0.1))
        losses = []
        for _ in range(8):  # RAdam takes no step before its variance estimate holds (its first 5 steps)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        # the loss falls under every row (Lion's sign steps at lr 1e-2 may overshoot again by the 8th step)
        assert min(losses[1:]) < losses[0] - 0.1, (name, losses)


@needs("schedulefree")
def test_doctor_lints_a_schedule_free_trainer_as_schedule_free(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "optim": "schedule_free_adamw", "bf16": True}))
    proc = run_cli("doctor", "--trainer-args", args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cells bf16-amp/sdpa/off/sf-adamw" in proc.stdout
    assert "schedule-free-saved-in-train-mode" in proc.stdout
    assert "trainer.optimizer.eval() before trainer.save_model()" in proc.stdout


def test_doctor_refuses_an_optim_it_cannot_probe_in_one_line(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "optim": "lomo"}))
    proc = run_cli("doctor", "--trainer-args", args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optim='lomo' is not probed: LOMO fuses the update into backward" in proc.stderr


def schedule_free_roundtrip(out, eval_before_save: bool):
    return run_cli(
        "check",
        "--dtype",
        "fp32",
        "--attn",
        "sdpa",
        "--compile",
        "off",
        "--optimizer",
        "sf-adamw",
        "--steps",
        "8",
        "--set",
        "optimizer.lr=0.01",
        "--set",
        f"optimizer.eval_before_save={str(eval_before_save).lower()}",
        "--set",
        "retime_rounds=0",
        "--roundtrip",
        "--out",
        out,
    )


@needs("schedulefree")
@pytest.mark.slow
def test_a_schedule_free_run_saved_in_train_mode_fails_the_round_trip_with_the_fix(tmp_path):
    proc = schedule_free_roundtrip(tmp_path / "train", eval_before_save=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "the saved model is the model that was trained" in ln)
    assert line.lstrip().startswith("FAIL") and "the saved model is not the one evaluate() scores" in line
    assert "call optimizer.eval() before trainer.save_model()" in line

    proc = schedule_free_roundtrip(tmp_path / "eval", eval_before_save=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "the saved model is the model that was trained" in ln)
    assert line.lstrip().startswith("ok")


@pytest.mark.slow
def test_muon_trains_the_hidden_matrices_and_names_the_embeddings_and_head_it_leaves_to_adamw(tmp_path):
    proc = run_cli(
        "check",
        "--dtype",
        "bf16-amp",
        "--optimizer",
        "muon",
        "--steps",
        "4",
        "--set",
        "retime_rounds=0",
        "--out",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    split = record["optimizer_split"]
    assert split["embeddings"] == ["model.embed_tokens.weight"] and split["head"] == ["lm_head.weight"]
    assert split["muon_tensors"] > 0 and split["adamw_tensors"] > 0
