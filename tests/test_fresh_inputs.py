"""What a run reads is what the file holds now: a checkpoint's tokenizer and template files are part of
a probe's fingerprint, an edit of the data file that keeps its modification time is read (not served
from the datasets cache), and `--resume` reruns the records whose inputs changed since."""

import json
import os

import pytest
from checkpoints import save_llama
from conftest import record_list, run_main
from userdata_fixtures import chat_rows, save_chat_tokenizer, write_jsonl

from nandoctor.run.fingerprint import probe_fingerprint

ONE_CELL = ("--axis", "dtype=fp32", "--axis", "attn=sdpa", "--axis", "compile=off")


def rewrite_keeping_time(path, text: str) -> None:
    """What `rsync -t` or `cp -p` leaves: new bytes, the old modification time."""
    st = path.stat()
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.model", "generation_config.json"])
def test_a_checkpoint_file_edited_in_place_changes_the_fingerprint(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / name).write_text("{{ messages }}")
    spec = {
        "recipe": {"name": "r"},
        "cell": {"dtype": "fp32", "attn": "sdpa", "compile": "off"},
        "model_plan": {"path": str(ckpt)},
    }
    before = probe_fingerprint(spec, {}, {})
    rewrite_keeping_time(ckpt / name, "{{ message }}!")  # same size would pass a stat, not a digest
    assert probe_fingerprint(spec, {}, {}) != before


def test_an_edit_of_the_data_file_that_keeps_its_time_is_read(tmp_path):
    rows = tmp_path / "rows.jsonl"

    def row(r):
        return json.dumps({"input_ids": [10 + (i + r) % 80 for i in range(24)]}) + "\n"

    rows.write_text("".join(row(r) for r in range(8)))

    def rows_read():
        proc = run_main("doctor", "--data", rows, "--json", *ONE_CELL[:4])
        assert proc.returncode in (0, 1), proc.stderr
        return json.loads(proc.stdout)["data"]["source"]["rows"]

    assert rows_read() == 8
    rewrite_keeping_time(rows, "".join(row(r) for r in range(9)))
    assert rows_read() == 9


def fingerprints(run_dir) -> dict:
    records = record_list(run_dir)
    assert len(records) == len({r["probe_id"] for r in records})  # one record per probe
    return {r["probe_id"]: r["fingerprint"] for r in records}


@pytest.mark.slow
def test_resume_reruns_a_probe_whose_checkpoint_template_changed(tmp_path, cli):
    ckpt = save_chat_tokenizer(save_llama(tmp_path / "ckpt", use_cache=False))  # the tokenizer beside the weights
    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    out = tmp_path / "run"
    args = ("--model", ckpt, "--data", rows, *ONE_CELL, "--steps", "2", "--set", "retime_rounds=0", "--jobs", "1")
    first = cli("grid", *args, "--out", out)
    assert first.returncode == 0, first.stdout + first.stderr
    recorded = fingerprints(out)

    # nothing changed: nothing to rerun; in this process, and --cold starts no worker for no probe
    same = run_main("grid", "--resume", out, "--cold")
    assert same.returncode == 0 and "rerunning" not in same.stdout, same.stdout + same.stderr

    template = ckpt / "chat_template.jinja"
    rewrite_keeping_time(template, template.read_text().replace("</s>", "</s>\n"))
    again = cli("grid", "--resume", out)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resume: rerunning {len(recorded)} recorded probe(s) whose inputs changed since" in again.stdout
    now = fingerprints(out)
    assert now.keys() == recorded.keys() and all(now[p] != recorded[p] for p in now)


def test_weights_swapped_for_others_of_the_same_size_and_time_change_the_fingerprint(tmp_path):
    """Two real checkpoints of one shape (other seeds): their safetensors files have the same size; the
    second's bytes copied over the first's, its modification time put back, as `cp -p` or `rsync -t` of
    another training run's weights leave it."""
    ckpt, other = save_llama(tmp_path / "ckpt"), save_llama(tmp_path / "other", seed=1)
    weights = ckpt / "model.safetensors"
    assert weights.stat().st_size == (other / "model.safetensors").stat().st_size
    spec = {
        "recipe": {"name": "r"},
        "cell": {"dtype": "fp32", "attn": "sdpa", "compile": "off"},
        "model_plan": {"path": str(ckpt)},
    }
    before = probe_fingerprint(spec, {}, {})
    st = weights.stat()
    weights.write_bytes((other / "model.safetensors").read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert probe_fingerprint(spec, {}, {}) != before
