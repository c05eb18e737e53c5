"""NandoctorCallback in a real 2-rank Lightning DDP fit (torchrun, gloo, CPU) on the tiny Llama:
every rank judges, the ranks stop together, one report and one summary line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent


def ddp_fit(out: Path, lr: float, steps: int, off_rank: int | None = None):
    """torchrun of tests/ddp_watch_fit.py with 2 ranks; returns (the finished process, {rank: its record})."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TESTS / "ddp_watch_fit.py"),
        str(out),
        str(lr),
        str(steps),
    ] + ([str(off_rank)] if off_rank is not None else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    return done, {
        r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()
    }


@pytest.fixture(scope="module")
def exploding(tmp_path_factory):
    """AdamW at lr=30: the loss explodes within a few steps on both ranks."""
    out = tmp_path_factory.mktemp("ddp-lr30")
    return out, *ddp_fit(out, 30.0, 20)


@pytest.fixture(scope="module")
def healthy_with_rank1_off(tmp_path_factory):
    """lr=1e-3 for 4 steps, with rank 1's watch switched off before training (as an internal error does)."""
    out = tmp_path_factory.mktemp("ddp-healthy")
    return out, *ddp_fit(out, 1e-3, 4, off_rank=1)


def test_an_exploding_ddp_run_stops_every_rank_at_the_same_step(exploding):
    _, done, ranks = exploding
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(ranks) == {0, 1}
    assert ranks[0]["failure"] is not None and ranks[0]["failed_at"] < 19
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
    assert ranks[0]["judged"] == ranks[1]["judged"]  # each rank judged its own loss at every step
    assert ranks[0]["losses"] != ranks[1]["losses"]  # on its own shard of the batch


def test_an_exploding_ddp_run_writes_one_report_from_the_lowest_failing_rank(exploding):
    out, done, ranks = exploding
    assert [ranks[0]["report_dir"], ranks[1]["report_dir"]] == [str(out / "nandoctor"), None]
    assert ranks[1]["stopped_by"] == 0
    probes = json.loads((out / "nandoctor" / "summary.json").read_text())["probes"]
    assert len(probes) == 1 and probes[0]["verdict"] == ranks[0]["failure"]
    assert done.stderr.count("Training stopped.") == 1 and done.stderr.count("nandoctor: watched ") == 1


def test_a_healthy_ddp_run_with_one_watch_off_trains_to_the_end_on_both_ranks(healthy_with_rank1_off):
    out, done, ranks = healthy_with_rank1_off
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    assert ranks[0]["judged"] == [0, 1, 2, 3] and ranks[0]["failure"] is None and ranks[0]["off"] is None
    assert ranks[1]["judged"] == [] and "this rank's watch is off" in ranks[1]["off"]
    assert not (out / "nandoctor").exists()


def test_a_healthy_ddp_run_ends_with_one_summary_line_from_rank_0(healthy_with_rank1_off):
    _, done, _ = healthy_with_rank1_off
    summary = [line for line in done.stderr.splitlines() if line.startswith("nandoctor: watched ")]
    assert len(summary) == 1 and "watched 4 steps of fp32/sdpa/off on 2 ranks: stable" in summary[0]
    assert done.stderr.count("nandoctor: watching ") == 1
