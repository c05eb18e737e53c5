"""--resume finishes an interrupted run; --cache reuses identical probes. Real runs, really interrupted."""

import json
import subprocess
import sys
import time

import pytest
from conftest import record_list, result_lines, run_main, summary

# slow: the end-to-end tests (real probe processes); the refusal ends in this process (run_main)

# --jobs 2: one thread per probe (two threads per probe crawl on a shared 2-core box). Four cells that
# run on a CPU and on a GPU alike (fp32 sdpa:flash is unsupported on CUDA; the GPU grid adds compile values).
GRID = (
    "--axis",
    "dtype=fp32,bf16-amp",
    "--axis",
    "attn=eager,sdpa",
    "--axis",
    "compile=off",
    "--steps",
    "3",
    "--jobs",
    "2",
    "--set",
    "retime_rounds=0",
)


@pytest.mark.slow
def test_resume_after_kill_runs_only_the_missing_cells(tmp_path, cli):
    out = tmp_path / "run"
    grid = subprocess.Popen(
        [sys.executable, "-m", "nandoctor", "grid", *GRID, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while len(result_lines(out, complete=True)) < 2 and grid.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    grid.kill()  # SIGKILL: no cleanup, as when a job is preempted
    grid.wait()
    before = result_lines(out, complete=True)
    assert 2 <= len(before) < 4, "the run must be interrupted part-way for this test to mean anything"
    done = {json.loads(line)["probe_id"] for line in before}

    proc = cli("grid", "--resume", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = result_lines(out, complete=True)
    assert after[: len(before)] == before  # what was recorded stays as it was
    ran = [json.loads(line)["probe_id"] for line in after[len(before) :]]
    assert set(ran) == {"fp32/eager/off", "fp32/sdpa/off", "bf16-amp/eager/off", "bf16-amp/sdpa/off"} - done
    assert len(ran) == len(set(ran))
    assert all(probe_id in proc.stdout for probe_id in ran)
    assert not any(f"] {probe_id} " in proc.stdout for probe_id in done)  # no progress line: not rerun
    assert [p["verdict"] for p in summary(out)["probes"]] == ["stable"] * 4


def test_resume_refuses_options_that_would_change_the_run(tmp_path):
    proc = run_main("grid", "--resume", tmp_path, "--steps", "5")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "nandoctor: error: --resume takes the recipe, axes, steps, baseline and run directory from DIR/run.json; "
        "drop --steps"
    ]


@pytest.mark.slow
def test_cache_reuses_an_identical_probe_and_reruns_a_changed_one(tmp_path, cli):
    env = {"NANDOCTOR_CACHE_DIR": str(tmp_path / "cache")}
    one = (
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager",
        "--axis",
        "compile=off",
        "--steps",
        "3",
        "--jobs",
        "2",
        "--cache",
    )
    first = cli("grid", *one, "--out", tmp_path / "first", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "cache: 0 probe(s) reused" in first.stdout

    second = cli("grid", *one, "--out", tmp_path / "second", env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"cache: 1 probe(s) reused from {tmp_path / 'cache' / 'probes.jsonl'}" in second.stdout
    reused = record_list(tmp_path / "second")[0]
    original = record_list(tmp_path / "first")[0]
    assert reused["cached_from"] == str(tmp_path / "first")
    assert reused["steps"] == original["steps"] and reused["fingerprint"] == original["fingerprint"]
    assert not (tmp_path / "second" / "probes").exists()  # nothing was spawned

    changed = cli("grid", *one, "--set", "optimizer.lr=2e-3", "--out", tmp_path / "changed", env=env)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "cache: 0 probe(s) reused" in changed.stdout


@pytest.mark.slow
def test_cache_reruns_a_probe_whose_data_file_was_edited(tmp_path, cli):
    # one core, so one thread: a probe that gave up threads to the other test worker's load is never cached
    env = {"NANDOCTOR_CACHE_DIR": str(tmp_path / "cache")}
    rows = tmp_path / "rows.jsonl"  # pre-tokenized rows: tiny-llama has no tokenizer to read text with
    rows.write_text("".join(json.dumps({"input_ids": [10 + (i + r) % 80 for i in range(40)]}) + "\n" for r in range(8)))
    one = (
        *("--axis", "dtype=fp32", "--axis", "attn=eager", "--axis", "compile=off", "--steps", "3", "--cache"),
        *("--set", "data.source=file", "--set", f"data.path={rows}", "--set", "retime_rounds=0"),
    )
    first = cli("grid", *one, "--out", tmp_path / "first", env=env, single_core=True)
    assert first.returncode == 0 and "cache: 0 probe(s) reused" in first.stdout, first.stdout + first.stderr
    again = cli("grid", *one, "--out", tmp_path / "again", env=env, single_core=True)
    assert "cache: 1 probe(s) reused" in again.stdout, again.stdout + again.stderr

    rows.write_text(rows.read_text().replace("[10, ", "[11, ", 1))  # same size
    edited = cli("grid", *one, "--out", tmp_path / "edited", env=env, single_core=True)
    assert edited.returncode == 0, edited.stdout + edited.stderr
    assert "cache: 0 probe(s) reused" in edited.stdout
