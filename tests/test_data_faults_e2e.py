"""Faults of the data and of the GradScaler's calibration, met as a user meets them in a grid, named for
what they are: a batch with no target is a data finding (which rows, why), not a numeric failure of the
fp32 reference; a loss spike is judged against earlier steps of the same kind of batch, not against the
user's other batches; a probe whose GradScaler skipped every step never trained, so it is not stable."""

from __future__ import annotations

import json

import pytest
from checkpoints import save_llama
from conftest import record_list, run_main
from userdata_fixtures import prompt_completion_rows, save_chat_tokenizer, sentence, write_jsonl

pytestmark = pytest.mark.slow
FP32_EAGER = ("--axis", "dtype=fp32", "--axis", "attn=eager", "--set", "retime_rounds=0")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data-faults")
    return {"tok": save_chat_tokenizer(d / "tok"), "ckpt": save_llama(d / "ckpt", use_cache=False), "dir": d}


def grid(out, *args):
    proc = run_main("grid", *map(str, args), "--out", out)
    summary = json.loads((out / "summary.json").read_text())
    return proc, {p["probe_id"]: p for p in summary["probes"]}, summary


def test_a_batch_whose_answers_fall_past_max_length_is_a_data_finding_not_a_nonfinite_reference(files, tmp_path):
    # the first 4 rows (step 0's batch) have prompts longer than max_length: completion-only labels leave none
    rows = prompt_completion_rows(4, seed=1, prompt_words=(30, 40)) + prompt_completion_rows(12)
    data = write_jsonl(files["dir"] / "cut.jsonl", rows)
    proc, probes, summary = grid(
        tmp_path / "run",
        *("--model", files["ckpt"], "--data", data, "--tokenizer", files["tok"], "--steps", "2", *FP32_EAGER),
        *("--set", "data.labels=completion_only", "--set", "data.max_length=24"),
    )
    reference = probes["fp32/eager/off"]
    assert (reference["verdict"], reference["step"]) == ("no-target", 0), reference["reason"]
    assert "step 0's first batch has no supervised token" in reference["reason"]
    assert "rows 0, 1, 2, 3 of" in reference["reason"]
    assert summary["drift_judged"] is False
    assert "met a batch of the data with no supervised token" in proc.stdout


def test_a_batch_of_short_rows_is_not_a_spike_next_to_the_memorised_first_batches(files, tmp_path):
    # 36 rows of one answer the model memorises, 4 short random ones (the most_padded and
    # fewest_supervised batches): every 7th step trains those, and its loss stays high. Measured: the
    # rule over the last 10 steps of any kind called step 27 a spike, 2.2x, and the fp32 reference diverged
    same = {"prompt": "what is two plus two?", "completion": " the cat sat on a mat and the dog ran to the park"}
    import random

    rng = random.Random(5)
    rows = [same] * 36 + [{"prompt": "tell me", "completion": " " + sentence(rng, 2)} for _ in range(4)]
    data = write_jsonl(files["dir"] / "mix.jsonl", rows)
    _, probes, _ = grid(
        tmp_path / "run",
        *("--model", files["ckpt"], "--data", data, "--tokenizer", files["tok"], "--steps", "30", *FP32_EAGER),
        *("--set", "data.labels=completion_only", "--set", "optimizer.lr=0.01"),
    )
    assert probes["fp32/eager/off"]["verdict"] == "stable", probes["fp32/eager/off"]["reason"]
    steps = record_list(tmp_path / "run")[0]["steps"]
    assert [s["batch"] for s in steps[:7]] == ["first"] * 4 + ["longest", "most_padded", "fewest_supervised"]
    assert steps[27]["loss"] > 2 * sum(s["loss"] for s in steps[17:27]) / 10  # what the old rule saw


def test_a_gradscaler_that_skipped_every_step_is_nonfinite_not_stable(tmp_path):
    # both MLPs' down_proj x1e5 (inputs x3e-3, so the forward fits fp16): backward overflows fp16 at every
    # scale from 65536 down to 2048; measured in-process, the first scale that fits is 64 (after 10 skips)
    ckpt = save_llama(tmp_path / "ckpt", mlp_scale={0: (3e-3, 1e5), 1: (3e-3, 1e5)})
    _, probes, _ = grid(
        tmp_path / "run",
        *("--model", ckpt, "--axis", "dtype=fp16-amp", "--axis", "attn=sdpa", "--steps", "6"),
        *("--set", "retime_rounds=0"),
    )
    fp16 = probes["fp16-amp/sdpa/off"]
    assert fp16["verdict"] == "nonfinite", fp16["reason"]
    assert fp16["reason"].startswith("GradScaler skipped every one of the 6 steps (scale 65536 -> 1024)")
    assert probes["fp32/eager/off"]["verdict"] == "stable"


def test_bisect_names_max_length_when_a_longer_one_gives_the_answers_back(files, tmp_path):
    """Issue 44: bisect refused to name data.max_length for rows whose answers fall past it ("whatever the
    configuration"), though the max_length=256 baseline trained. When the two configurations differ in how
    the data is read, a batch with no target is the configuration's doing, and bisect names the field."""
    rows = prompt_completion_rows(4, seed=1, prompt_words=(30, 40)) + prompt_completion_rows(12)
    data = write_jsonl(files["dir"] / "cut-bisect.jsonl", rows)
    out = tmp_path / "run"
    proc = run_main(
        "bisect",
        *("--model", str(files["ckpt"]), "--data", str(data), "--tokenizer", str(files["tok"])),
        *("--set", "data.labels=completion_only", "--bad", "data.max_length=24", "--good", "data.max_length=256"),
        *("--steps", "2", "--reruns", "0", "--out", str(out)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Culprit (single factor): data.max_length=24 -> no-target" in proc.stdout
    assert "Recommended: fp32/eager/off data.max_length=256" in proc.stdout
