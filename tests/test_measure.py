"""The setup checks of nandoctor/measure/ on a real tiny Llama (hidden 64, 2 layers), each shown the
case that must fail it (STYLE rule 24): packing isolation against each segment run alone, with a
rounding floor from the segments alone in fp32, and gradient accumulation through the model's own loss
(num_items_in_batch passed as the Trainer passes it) against the full batch's gradient from one
backward. The mutants are modeling code a checkpoint can carry (tests/checkpoints.py): a Llama that
drops position_ids, and one that drops num_items_in_batch."""

import subprocess
import sys

import pytest
import torch
from checkpoints import save_drops_positions_llama, save_ignores_items_llama, save_llama
from userdata_fixtures import write_jsonl

from nandoctor.analysis.verdicts import setup_failures, setup_judged
from nandoctor.config import recipe_from_dict
from nandoctor.data import stream
from nandoctor.measure.accumulation import accumulation_figures, normalized
from nandoctor.measure.lint import lint_model, packed_inputs
from nandoctor.measure.numerics import cuda_matmul_precision, fp32_precision_knobs, in_fp32
from nandoctor.measure.packing import packing_isolation
from nandoctor.models import model_config
from nandoctor.thresholds import THRESHOLDS
from nandoctor.userdata.rows import encoded_rows


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": save_llama(d / "tiny", use_cache=False),
        "drops_positions": save_drops_positions_llama(d / "drops-positions"),
        "ignores_items": save_ignores_items_llama(d / "ignores-items"),
    }


def setup(tmp_path, ckpt, rows, batch_size, attn="sdpa", **options):
    r = recipe_from_dict(
        {
            "model": {"path": str(ckpt), "trust_remote_code": True},
            "data": {"path": str(write_jsonl(tmp_path / "ids.jsonl", rows)), **options.pop("data", {})},
            "batch_size": batch_size,
            **options,
        },
        "r",
    )
    config = model_config(r)
    model, _ = lint_model(r, attn)
    return r, encoded_rows(r, config), stream(r, config, 0), model


def ids_rows(lengths, seed=0):
    import random

    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(10, 1000) for _ in range(n)]} for n in lengths]


def accumulated(r, s, model, steps=4):
    group = s.batches[:steps]
    return accumulation_figures(model, [b.inputs for b in group], s.joined(group), normalized(r, model))


def test_lengths_32_4_4_4_accumulated_per_micro_batch_are_not_the_full_batch(tmp_path, ckpts):
    rows = ids_rows([32, 4, 4, 4])
    r, _, s, model = setup(tmp_path, ckpts["llama"], rows, 1, loss_normalization="micro_batch")
    got = accumulated(r, s, model)
    assert got["accumulation_targets"] == "31, 3, 3, 3" and got["loss_normalization"] == "micro_batch"
    assert got["accumulation_error"] > 0.5 and got["accumulation_cosine"] < 0.9  # measured 1.18, cosine 0.587
    assert got["accumulation_floor"] == 0.0 and setup_judged(got)["accumulation_misweighted"] is True
    r, _, s, model = setup(tmp_path, ckpts["llama"], rows, 1, loss_normalization="tokens")
    got = accumulated(r, s, model)
    assert got["accumulation_error"] < 1e-5 and setup_judged(got)["accumulation_misweighted"] is False


def test_a_model_that_ignores_num_items_in_batch_is_misweighted_even_on_equal_rows(tmp_path, ckpts):
    rows = ids_rows([12, 12, 12, 12], seed=1)
    r, _, s, model = setup(tmp_path, ckpts["ignores_items"], rows, 1)
    assert type(model).__name__ == "IgnoresItemsLlamaForCausalLM" and normalized(r, model) == "tokens"
    got = accumulated(r, s, model)
    # the Trainer does not divide by the steps for a model that takes loss kwargs: four means added up
    assert got["accumulation_error"] == pytest.approx(3.0, rel=1e-3) and got["accumulation_cosine"] > 0.9999
    assert setup_judged(got)["accumulation_misweighted"] is True
    r, _, s, model = setup(tmp_path, ckpts["llama"], rows, 1)
    assert setup_judged(accumulated(r, s, model))["accumulation_misweighted"] is False


def test_bf16_accumulation_passes_by_tokens_and_fails_per_micro_batch_above_its_floor(tmp_path, ckpts):
    rows = ids_rows([32, 4, 4, 4])
    for normalization, misweighted in (("tokens", False), ("micro_batch", True)):
        r, _, s, model = setup(tmp_path, ckpts["llama"], rows, 1, loss_normalization=normalization)
        model.to(torch.bfloat16)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        got = accumulated(r, s, model)
        assert 1e-4 < got["accumulation_floor"] < 0.05  # bf16 against fp32: measured 0.0065
        assert setup_judged(got)["accumulation_misweighted"] is misweighted, got
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # cast back bit for bit


def test_flattened_rows_without_a_mask_or_a_cache_stay_isolated(tmp_path, ckpts):
    r, _, s, model = setup(tmp_path, ckpts["llama"], ids_rows([10, 7, 12, 5]), 4, data={"packing": "position_ids"})
    got = packing_isolation(model, s.batches[0].inputs)
    assert got["packing_segments"] == 4 and got["packing_max_logit_diff"] < 1e-5 and got["packing_floor"] == 0.0
    assert setup_judged(got)["packing_leaks"] is False


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_stays_isolated_within_its_own_floor(tmp_path, ckpts, dtype):
    r, _, s, model = setup(tmp_path, ckpts["llama"], ids_rows([10, 7, 12, 5]), 4, data={"packing": "position_ids"})
    model.to(getattr(torch, dtype))
    got = packing_isolation(model, s.batches[0].inputs)
    assert got["packing_floor"] > 1e-4  # its own rounding against fp32: a leak must stand out from it
    assert setup_judged(got)["packing_leaks"] is False and next(model.parameters()).dtype == getattr(torch, dtype)


def test_a_model_that_drops_position_ids_leaks_in_any_precision(tmp_path, ckpts):
    r, _, s, model = setup(
        tmp_path, ckpts["drops_positions"], ids_rows([10, 7, 12, 5]), 4, data={"packing": "position_ids"}
    )
    got = packing_isolation(model, s.batches[0].inputs)
    assert got["packing_max_logit_diff"] > 0.1 and got["packing_floor"] == 0.0 and setup_judged(got)["packing_leaks"]
    model.to(torch.bfloat16)
    got = packing_isolation(model, s.batches[0].inputs)
    assert got["packing_floor"] < 0.05 and setup_judged(got)["packing_leaks"] is True


def test_packed_sequence_detection_turned_off_leaks(tmp_path, ckpts, monkeypatch):
    """transformers' own packed-sequence detection off: the forward the issue measured at 0.506 both
    as packed and with no mask and no cache, which the old floor then called isolated."""
    import transformers.masking_utils

    r, _, s, model = setup(tmp_path, ckpts["llama"], ids_rows([10, 7, 12, 5]), 4, data={"packing": "position_ids"})
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    got = packing_isolation(model, s.batches[0].inputs)
    assert got["packing_max_logit_diff"] > 0.1 and got["packing_floor"] == 0.0 and setup_judged(got)["packing_leaks"]


def test_a_block_mask_stays_isolated_under_eager_attention_too(tmp_path, ckpts):
    r, _, s, model = setup(
        tmp_path, ckpts["llama"], ids_rows([10, 7, 12, 5]), 4, attn="eager", data={"packing": "block_mask"}
    )
    assert setup_judged(packing_isolation(model, s.batches[0].inputs))["packing_leaks"] is False


def test_a_2d_all_ones_mask_beside_position_ids_leaks(tmp_path, ckpts):
    row = {
        "input_ids": ids_rows([17])[0]["input_ids"],
        "position_ids": list(range(10)) + list(range(7)),
        "attention_mask": [1] * 17,
    }
    r, encoded, s, model = setup(tmp_path, ckpts["llama"], [row], 1)
    got = packing_isolation(model, packed_inputs(encoded, s.batches))
    assert got["packing_segments"] == 2 and got["packing_max_logit_diff"] > 0.1  # the issue: 0.68
    assert "2-D attention mask" in got["packing_cause"] and setup_judged(got)["packing_leaks"] is True


def test_the_configs_use_cache_in_training_leaks_between_packed_segments(tmp_path, ckpts):
    """What a loop of the user's own trains when it keeps a saved config's use_cache=True (the Trainer
    and the probes turn it off): the live callbacks measure the live model as it is configured."""
    r, _, s, model = setup(tmp_path, ckpts["llama"], ids_rows([10, 7, 12, 5]), 4, data={"packing": "position_ids"})
    model.config.use_cache = True
    got = packing_isolation(model, s.batches[0].inputs)
    assert got["packing_max_logit_diff"] > 0.1 and "use_cache=True" in got["packing_cause"]
    assert setup_judged(got)["packing_leaks"] is True


def test_in_fp32_restores_weights_buffers_and_matmul_precision(ckpts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpts["llama"], dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with in_fp32(model):
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert cuda_matmul_precision() == "highest"
    assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in model.state_dict().items())


@pytest.fixture
def precision_settings():
    """This process's fp32 precision settings, put back after the test."""
    saved = [(k, k.fp32_precision) for k in fp32_precision_knobs()]
    yield
    for knob, value in saved:
        knob.fp32_precision = value


def test_tf32_set_through_the_new_api_is_read_and_restored_without_the_legacy_reader(precision_settings):
    """A process that set TF32 through torch's per-backend API (as a user, Lightning or an earlier probe
    may): torch's legacy get_float32_matmul_precision() raises there on a mix of the two APIs; nandoctor
    reads and sets the per-backend settings only."""
    if not fp32_precision_knobs():
        pytest.skip(f"torch {torch.__version__} has only the legacy precision API")
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert cuda_matmul_precision() == "high"
    with in_fp32(torch.nn.Linear(2, 2).bfloat16()):
        assert {k.fp32_precision for k in fp32_precision_knobs()} == {"ieee"}
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def test_a_probes_tf32_switch_keeps_torchs_legacy_reader_working():
    """The probe's TF32 switch (set_tf32), then what inductor's cache key reads
    (torch.get_float32_matmul_precision) and what nandoctor reads: in a fresh process, as a probe's."""
    code = (
        "import torch; from nandoctor.measure.numerics import cuda_matmul_precision, set_tf32\n"
        "for on in (True, False):\n"
        "    set_tf32(on); print(torch.get_float32_matmul_precision(), cuda_matmul_precision())"
    )
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert said[-4:] == ["high", "high", "highest", "highest"]


def test_a_leak_as_small_as_a_half_precision_floor_is_judged_in_fp32(tmp_path, ckpts):
    """Issue 44: a leak of the size fp32 shows passed as isolated in bf16-pure, whose bound is 10x its own
    rounding. The model that drops position_ids, its attention outputs scaled down so that what leaks across
    segments is a few hundredths of a logit: bf16's floor hides it in the cell's own comparison, and the same
    comparison in fp32 finds it."""
    r, _, s, model = setup(
        tmp_path, ckpts["drops_positions"], ids_rows([10, 7, 12, 5]), 4, data={"packing": "position_ids"}
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
    model.to(torch.bfloat16)
    got = packing_isolation(model, s.batches[0].inputs)
    assert 1e-3 < got["packing_fp32_diff"] < got["packing_max_logit_diff"] + 0.05
    assert got["packing_max_logit_diff"] <= THRESHOLDS.packing_bound(got["packing_floor"])  # the cell alone: hidden
    assert setup_judged(got)["packing_leaks"] is True
    assert "in fp32 the packed forward differs by" in setup_failures(got)[0]


def test_a_cosine_is_never_printed_above_one():
    """torch's fp32 cosine_similarity of four million equal gradients is 1.0035: the accumulation check's line
    once read "cosine 1.008". Accumulated in fp64 and clamped, a cosine stays in [-1, 1]."""
    from nandoctor.measure.numerics import cosine

    grads = torch.full((4_000_000,), 0.1)
    assert cosine(grads, grads) == 1.0
    assert cosine(grads, -grads) == -1.0
    assert cosine(grads, torch.zeros_like(grads)) is None


@pytest.mark.slow  # a check through the CLI
def test_check_prints_and_records_an_accumulation_cosine_no_larger_than_one(tmp_path):
    """tiny-llama's 1.8M-element step-0 gradient, accumulated over 2 micro-batches against the full batch's:
    torch's fp32 cosine_similarity put them at 1.00033 in summary.json."""
    import json
    import re

    from conftest import run_cli

    out = tmp_path / "check"
    flags = ("--dtype", "fp32", "--attn", "sdpa", "--compile", "off", "--steps", "2")
    sets = ("--set", "gradient_accumulation_steps=2", "--set", "retime_rounds=0", "--set", "forensics_steps=0")
    done = run_cli("check", *flags, *sets, "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = [float(x) for x in re.findall(r"cosine (\S+?)[),;]", done.stdout)]
    assert printed and all(-1 <= c <= 1 for c in printed)
    recorded = json.loads((out / "results.jsonl").read_text().splitlines()[0])["setup_checks"]["accumulation_cosine"]
    assert 0.9999 < recorded <= 1.0
