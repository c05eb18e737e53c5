"""The step-0 setup checks end to end, as a user meets them: the README's packing example gets one
answer from `doctor` and `grid` (the segments are isolated: the Trainer and the probes train with
use_cache=False), and the two mutants a setup check must catch (STYLE rule 24), modeling code a
checkpoint carries, fail `check` and `doctor` alike: a Llama that drops position_ids (packed rows
attend to each other) and one that drops num_items_in_batch (the accumulated gradient is the micro-
batches' means added up). One rule per finding (verdicts.setup_judged) decides for every command."""

import json

import pytest
from checkpoints import save_drops_positions_llama, save_ignores_items_llama, save_llama
from conftest import run_main
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

pytestmark = pytest.mark.slow  # probes and the doctor through the CLI

ONE_CELL = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off")
PACKED = ("--set", "data.packing=position_ids")
ACCUMULATED = ("--set", "batch_size=1", "--set", "gradient_accumulation_steps=4")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("checks")
    out = {
        "ckpt": save_llama(d / "ckpt"),  # config.use_cache=True, as a saved default config has it
        "drops_positions": save_drops_positions_llama(d / "drops-positions"),
        "ignores_items": save_ignores_items_llama(d / "ignores-items"),
        "chat": write_jsonl(d / "chat.jsonl", chat_rows(16, seed=3)),
        "dir": d,
    }
    # a tokenizer of its own: transformers' AutoTokenizer asks before it reads a custom-code config
    out["data"] = ("--data", out["chat"], "--tokenizer", save_chat_tokenizer(d / "tok"))
    save_chat_tokenizer(out["ckpt"])  # the README's checkpoint carries its own
    return out


def doctor(*args):
    proc = run_main("doctor", *args, *ONE_CELL, "--json")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    return proc.returncode, {f["id"]: f for f in report["findings"]}, report["data"]["measured"]


def check(out, *args):
    proc = run_main("check", "--dtype", "fp32", "--attn", "sdpa", *args, "--out", out)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, proc.stdout + proc.stderr[-3000:]


def test_the_readme_packing_example_is_isolated_in_doctor_and_grid(files):
    """README: `nandoctor grid --model ./my-checkpoint --data chat.jsonl --set data.packing=position_ids`
    (docs/data.md: the same with `doctor`). The checkpoint's config says use_cache=True; the Trainer sets
    it from TrainingArguments.use_cache (False), and so does every probe: both commands say isolated."""
    code, found, measured = doctor("--model", files["ckpt"], "--data", files["chat"], *PACKED)
    assert code == 0 and "packing-leaks-across-segments" not in found, found
    assert measured["packing_max_logit_diff"] < 1e-5 and measured["packing_floor"] == 0.0
    out = files["dir"] / "readme-grid"
    proc = run_main(
        "grid", "--model", files["ckpt"], "--data", files["chat"], *PACKED, *ONE_CELL, "--steps", "2",
        "--set", "retime_rounds=0", "--out", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the data lint found an error" not in proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "fp32/sdpa/off" in x and "stable" in x)
    assert "setup: packed segments isolated (max logit difference" in line and "bound 0.0001" in line


def test_a_model_that_drops_position_ids_fails_check_and_doctor(files):
    args = ("--model", files["drops_positions"], "--set", "model.trust_remote_code=true", *files["data"], *PACKED)
    code, out = check(files["dir"] / "check-drops-positions", *args)
    assert code == 1 and "FAIL the setup passes its step-0 checks: packing: one packed forward of" in out, out
    code, found, measured = doctor(*args)
    assert code == 1 and measured["packing_max_logit_diff"] > 0.1, measured
    assert (
        "beyond 0.0001 (the segments alone move by 0 against fp32)" in found["packing-leaks-across-segments"]["figure"]
    )


def test_a_model_that_ignores_num_items_in_batch_fails_check_and_doctor(files):
    args = ("--model", files["ignores_items"], "--set", "model.trust_remote_code=true", *files["data"], *ACCUMULATED)
    code, out = check(files["dir"] / "check-ignores-items", *args)
    assert code == 1 and "FAIL the setup passes its step-0 checks: accumulation: step 0's gradient over 4" in out, out
    code, found, measured = doctor(*args)
    assert code == 1 and measured["accumulation_error"] > 1.0, measured  # four means added up: about 3
    assert "loss_normalization=tokens" in found["accumulation-normalised-per-micro-batch"]["figure"]
