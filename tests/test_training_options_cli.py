"""The user's real setup end to end: a grid through the CLI on a local tiny checkpoint with its own
tokenizer and chat template, trained on a chat JSONL with gradient accumulation, each probe's record
naming the rows it trained on; and a 2-rank DDP probe of the same rows, packed and accumulated, whose
ranks train exactly the one-process step (token normalisation over every rank, as the Trainer's
average_tokens_across_devices)."""

import pytest
from checkpoints import save_llama
from conftest import cuda_hidden, record_list, run_cli, run_warm
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

from nandoctor.cells import Cell
from nandoctor.config import set_field
from nandoctor.models import plan_model
from nandoctor.recipes import resolve_model
from nandoctor.record import ProbeRecord, ProbeSpec

pytestmark = pytest.mark.slow  # a grid through the CLI, and a probe of two ranks


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    ckpt = save_llama(d / "ckpt", use_cache=False)
    save_chat_tokenizer(ckpt)  # the checkpoint's own tokenizer, with its chat template
    return {"ckpt": ckpt, "chat": write_jsonl(d / "chat.jsonl", chat_rows(24, seed=4)), "dir": d}


def test_a_grid_on_the_users_chats_names_the_rows_each_probe_trained_on(files):
    out = files["dir"] / "run"
    proc = run_cli(
        "grid",
        "--model",
        files["ckpt"],
        "--data",
        files["chat"],
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=sdpa,eager",
        "--axis",
        "compile=off",
        "--steps",
        "4",
        "--set",
        "gradient_accumulation_steps=2",
        "--set",
        "data.labels=completion_only",
        "--set",
        "retime_rounds=0",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [ProbeRecord.from_dict(r) for r in record_list(out)]
    assert {r.cell.attn for r in records} == {"sdpa", "eager"}
    for r in records:
        assert r.status == "ok" and r.data["source"] == "file" and r.data["kind"] == "messages"
        assert r.data["tokenizer"] == str(files["ckpt"]) and r.data["micro_batches_per_step"] == 2
        first = [b["rows"] for b in r.data["batches"] if b["kind"] == "first"]
        assert first == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
        assert r.setup_checks["accumulation_error"] < 1e-5  # by tokens, the Trainer's default: the full batch's
        assert all(s.groups["embeddings"] > 0 and s.groups["rest"] > 0 for s in r.steps)
    assert "| fp32/sdpa/off" in (out / "report.md").read_text().split("## Data")[1]


def test_a_ddp_probe_packs_and_accumulates_each_ranks_rows_as_one_process_would(files, tmp_path):
    recipe = resolve_model(str(files["ckpt"]))
    fields = {
        "data.path": str(files["chat"]),
        "data.packing": "position_ids",
        "gradient_accumulation_steps": 2,
        "forensics_steps": 0,
    }
    for key, value in fields.items():
        recipe = set_field(recipe, key, value)
    cell = Cell("fp32", "sdpa", "off", parallel="ddp")
    spec = ProbeSpec(cell.id, recipe, cell, plan_model(recipe, {"device": "cpu"}), 3, recipe.seed, "cpu", 2)
    record = run_warm(spec, tmp_path, env=cuda_hidden())
    assert record.status == "ok", (record.error, record.log_tail)
    agreement = record.parallel["grad_agreement"]
    assert agreement["max_rel_error"] < 1e-4 and agreement["norm_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert record.data["packing"] == "position_ids" and record.setup_checks["packing_max_logit_diff"] < 1e-4
    assert len(record.steps) == 3 and all(s.groups["rest"] > 0 for s in record.steps)
    tokens = [b["tokens"] for b in record.data["batches"]]
    assert record.steps[0].tokens == tokens[0] + tokens[1]  # both ranks' segments of both micro-batches
