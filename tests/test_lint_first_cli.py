"""grid, check and bisect lint the user's rows and setup before any probe: each error and warning is
one line, the lint is stored in run.json's "data" (the reports' Data section), and the run goes on, so
that the probes show the consequences. Through the CLI, on a tiny local checkpoint with its own
tokenizer and chat template and a chat JSONL, packed with a 2-D mask beside the position_ids."""

import json

import pytest
from checkpoints import save_llama
from conftest import run_cli
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

pytestmark = pytest.mark.slow  # a grid and a check through the CLI

LEAK_LINE = "nandoctor: WARNING: the data lint found an error (packing-leaks-across-segments): One packed forward of"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lint-first")
    ckpt = save_llama(d / "ckpt", use_cache=False)
    save_chat_tokenizer(ckpt)
    return {"ckpt": ckpt, "chat": write_jsonl(d / "chat.jsonl", chat_rows(12, seed=1)), "dir": d}


def common(files) -> list:
    return ["--model", files["ckpt"], "--data", files["chat"], "--set", "data.packing=position_ids_with_mask"]


def test_a_grid_lints_first_stores_the_lint_and_its_probes_show_the_leak(files):
    out = files["dir"] / "grid"
    proc = run_cli(
        "grid", *common(files), "--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off", "--steps", "2",
        "--out", out,
        "--set", "retime_rounds=0", "--set", "forensics_steps=0", process=True
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # no stable configuration
    lines = [line for line in proc.stderr.splitlines() if line.startswith(LEAK_LINE)]
    assert len(lines) == 1 and "max logit difference" in lines[0]
    assert [
        line for line in proc.stderr.splitlines() if not line.startswith("nandoctor:")
    ] == []  # no third-party lines
    meta = json.loads((out / "run.json").read_text())
    assert [f["id"] for f in meta["data"]["findings"]] == ["packing-leaks-across-segments"]
    assert meta["data"]["source"]["rows"] == 12
    md = (out / "report.md").read_text().split("## Data")[1]
    assert "- [error] packing-leaks-across-segments: One packed forward" in md
    trained = md.split("Rows each probe trained on:")[1].split("\n\n")[1].splitlines()  # the rows of the data set
    assert trained[2].startswith("| fp32/eager/off, fp32/sdpa/off | first ") and "| 0, 1, 2, 3 " in trained[2]
    summary = json.loads((out / "summary.json").read_text())
    assert {p["verdict"] for p in summary["probes"]} == {"misconfigured"}


def test_a_check_lints_first_and_fails_the_setup_check(files):
    out = files["dir"] / "check"
    proc = run_cli("check", *common(files), "--dtype", "fp32", "--attn", "sdpa", "--out", out, process=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert any(line.startswith(LEAK_LINE) for line in proc.stderr.splitlines())
    assert [
        line for line in proc.stderr.splitlines() if not line.startswith("nandoctor:")
    ] == []  # no third-party lines
    assert "FAIL the setup passes its step-0 checks: packing: one packed forward" in proc.stdout
    assert json.loads((out / "run.json").read_text())["data"]["findings"][0]["severity"] == "error"
