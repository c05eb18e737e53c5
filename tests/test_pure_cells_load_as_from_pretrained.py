"""A pure cell's model holds what from_pretrained(dtype=...) loads, which is what the recommendation prints:
the weights in the cell's dtype, and the buffers transformers computes at init (RoPE's inv_freq) in fp32."""

import pytest
import torch

from nandoctor.cells import Cell
from nandoctor.config import set_field
from nandoctor.env import collect_summary
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model
from tests.checkpoints import save_llama

pytestmark = pytest.mark.slow  # builds real tiny models in this process


def test_a_bf16_pure_cell_keeps_the_buffers_from_pretrained_keeps(tmp_path):
    from transformers import AutoModelForCausalLM

    from nandoctor.child.build import build_model

    path = save_llama(tmp_path / "ckpt")
    recipe = set_field(resolve_model("tiny-llama"), "model.path", str(path))
    cell = Cell("bf16-pure", "sdpa", "off")
    probed = build_model(plan_model(recipe, collect_summary()), recipe, cell, 0, "cpu")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert {n: b.dtype for n, b in probed.named_buffers()} == {n: b.dtype for n, b in loaded.named_buffers()}
    assert probed.model.rotary_emb.inv_freq.dtype == torch.float32
    assert {p.dtype for p in probed.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(probed.state_dict().values(), loaded.state_dict().values()))


def test_grid_bf16_pure_records_and_explains_the_rope_buffers_kept_in_fp32(tmp_path):
    import json

    from conftest import run_cli

    out = tmp_path / "grid"
    axes = ("--axis", "dtype=bf16-pure", "--axis", "attn=sdpa", "--axis", "compile=off")
    done = run_cli(
        "grid", *axes, "--steps", "2", "--set", "retime_rounds=0", "--set", "forensics_steps=0", "--out", out
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = {r["probe_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    kept = records["bf16-pure/sdpa/off"]["kept_dtypes"]
    assert kept == {"model.rotary_emb.inv_freq": "float32", "model.rotary_emb.original_inv_freq": "float32"}
    assert records["fp32/eager/off"]["kept_dtypes"] == {}
    said = run_cli("explain", out, "--probe", "bf16-pure/sdpa/off").stdout
    assert "not in the weight dtype: model.rotary_emb.inv_freq float32" in said
