"""Quantized bases end to end through the CLI (issue 36): a grid over quant=nf4 records each base's
settings and bytes, fp16 compute overflows a large-activation model's 4-bit base where bf16 does not and
bisect names the compute dtype, and `check --roundtrip` fails the merge into a 4-bit base and passes a
LoRA over a 16-bit base with tied embeddings trained through modules_to_save."""

from __future__ import annotations

import json

import pytest
from checkpoints import save_llama
from conftest import records, run_cli, run_main, verdicts

pytestmark = pytest.mark.slow
LORA = ("--set", "adapter.type=lora")
# the issue's case: LoRA r=8 on q/v/up/down at lr 1e-2, 8 AdamW steps on one batch
ISSUE = (*LORA, "--set", "adapter.target_modules=q_proj,v_proj,up_proj,down_proj", "--set", "optimizer.lr=1e-2")
ISSUE += ("--set", "data.batches=1", "--steps", "8")


@pytest.fixture(scope="module")
def quant_grid(large_mlp_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant-grid") / "run"
    proc = run_cli(
        "grid",
        "--model",
        large_mlp_checkpoint,
        *LORA,
        "--set",
        "retime_rounds=0",
        "--axis",
        "quant=nf4",
        "--axis",
        "dtype=bf16-amp,fp16-amp",
        "--axis",
        "attn=sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "2",
        "--roundtrip",
        "--out",
        out,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return out


def test_every_nf4_record_carries_its_settings_and_its_bases_bytes(quant_grid):
    """The bytes against a 16-bit base's: tests/test_quant.py builds both; here the grid's records and
    reports (summary.json, whose renderers read the quant cells) are what is checked."""
    nf4 = {k: r["quant"] for k, r in records(quant_grid).items()}
    assert set(nf4) == {"fp32/eager/off/nf4", "bf16-amp/sdpa/off/nf4", "fp16-amp/sdpa/off/nf4"}
    for cell, q in nf4.items():
        assert (q["type"], q["bits"], q["quant_type"], q["storage"]) == ("nf4", 4, "nf4", "uint8")
        assert q["compute"] == {"fp32": "float32", "bf16-amp": "bfloat16", "fp16-amp": "float16"}[cell.split("/")[0]]
        assert 0 < q["constants_bytes"] < q["base_bytes"]
    assert (quant_grid / "summary.json").exists() and (quant_grid / "report.html").exists()


def test_fp16_compute_overflows_the_4_bit_base_where_bf16_compute_trains(quant_grid):
    v = verdicts(quant_grid)
    assert v["fp16-amp/sdpa/off/nf4"] == "nonfinite"
    assert v["bf16-amp/sdpa/off/nf4"] == "stable"


def test_grid_roundtrip_merges_saves_and_reloads_the_recommended_cell(quant_grid):
    """The recommended nf4 cell trained again, its adapter merged into the 4-bit base: 4 steps at lr 1e-3
    move the weights less than a 4-bit step, so the merge loses the update and the report says so."""
    rt = json.loads((quant_grid / "roundtrip.json").read_text())
    recommended = json.loads((quant_grid / "summary.json").read_text())
    assert rt["probe_id"].endswith("/nf4") and rt["probe_id"] in json.dumps(recommended)
    assert set(rt["roundtrip"]["loss"]) == {"live", "merged", "reloaded"}
    report = (quant_grid / "report.md").read_text()
    assert f"Round trip of {rt['probe_id']}: FAIL" in report and "merge rounding" in report


class RecordedSession:
    """The grid's probe records served to bisect's real oracle in place of new probe processes: the
    bisection asks for probes by id, and every one it asks for must be one the grid ran."""

    def __init__(self, run_dir):
        from nandoctor.env import collect_summary
        from nandoctor.run.store import ResultsStore

        self.device = collect_summary()
        self.records = {r.probe_id: r for r in ResultsStore(run_dir).records()}
        self.asked = []

    def run(self, recipe, probes):
        self.asked += [p.probe_id for p in probes]
        return [self.records[p.probe_id] for p in probes]


def test_bisect_names_the_compute_dtype_of_a_4_bit_base(quant_grid, large_mlp_checkpoint):
    """`nandoctor bisect --good dtype=bf16-amp,attn=sdpa,quant=nf4 --bad dtype=fp16-amp,attn=sdpa,quant=nf4`
    as run_bisect runs it (its parsing of the flags, its oracle with the fp32 reference it asks for
    before trusting a stable verdict, the engine) over the grid's records of those very probes: a
    bisect through the CLI would train the same three probes again, minutes on a loaded 2-core CPU."""
    from nandoctor.bisect.engine import Bisection
    from nandoctor.bisect.factors import WORKLOAD, parse_configurations, precision_ladder
    from nandoctor.bisect.oracle import ProbeOracle
    from nandoctor.config import Recipe, set_field

    recipe = set_field(set_field(Recipe(), "adapter.type", "lora"), "model.path", str(large_mlp_checkpoint))
    session = RecordedSession(quant_grid)
    good, bad = parse_configurations(
        recipe, session.device, "dtype=bf16-amp,attn=sdpa,quant=nf4", "dtype=fp16-amp,attn=sdpa,quant=nf4", []
    )
    ladders = precision_ladder(good, bad, session.device)
    result = Bisection(good, bad, ProbeOracle(session, recipe), 0, 0, 1, None, ladders, WORKLOAD).run()
    assert result.status == "bisected", result.message
    assert [c.factors for c in result.culprits] == [["dtype"]]
    assert result.factors == {"dtype": ["bf16-amp", "fp16-amp"]}
    assert set(session.asked) == {"fp16-amp/sdpa/off/nf4", "bf16-amp/sdpa/off/nf4", "fp32/eager/off/nf4"}


def test_roundtrip_finds_the_merge_into_a_4_bit_base(tmp_path):
    ckpt = save_llama(tmp_path / "ckpt", hidden_size=128, intermediate_size=256, num_key_value_heads=4)
    proc = run_cli("check", "--model", ckpt, *ISSUE, "--quant", "nf4", "--roundtrip", "--out", tmp_path / "run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "the saved model is the model that was trained" in x)
    assert "FAIL" in line and "loss live" in line and "merged" in line and "reloaded" in line
    assert "merge rounding" in line and "of its update lost" in line


def test_roundtrip_passes_lora_over_a_16_bit_base_with_tied_embeddings_trained(tmp_path):
    """LoRA over a 16-bit base with tied embeddings, both lm_head and embed_tokens in modules_to_save
    (each alone, and no modules_to_save on an untied model, measured the same by hand: live, merged
    and reloaded losses equal, docs/quantization.md). Through `nandoctor.cli.main` in this process (the
    probe still trains in its own): the nf4 case above is the round trip's fresh-interpreter CLI run."""
    ckpt = save_llama(tmp_path / "ckpt", tie_word_embeddings=True)
    extra = ("--set", "adapter.modules_to_save=lm_head,embed_tokens")
    proc = run_main(
        "check", "--model", ckpt, *ISSUE, *extra, "--dtype", "fp32", "--roundtrip", "--out", tmp_path / "run"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "the saved model is the model that was trained" in x)
    assert line.strip().startswith("ok") and "equal within" in line
