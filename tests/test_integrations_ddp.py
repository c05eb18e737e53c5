"""NandoctorCallback in a real 2-rank Lightning DDP fit (torchrun, gloo, CPU) on the tiny Llama:
every rank judges, the ranks stop together, one report and one summary line. The fits are
tests/watch_fits.py's, made once per session with the other watched 2-rank fits."""

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exploding(watch_fits):
    """AdamW at lr=30: the loss explodes within a few steps on both ranks."""
    return watch_fits["ddp-lr30"]


@pytest.fixture(scope="module")
def healthy_with_rank1_off(watch_fits):
    """lr=1e-3 for 4 steps, with rank 1's watch switched off before training (as an internal error does)."""
    return watch_fits["ddp-healthy-rank1-off"]


def test_an_exploding_ddp_run_stops_every_rank_at_the_same_step(exploding):
    ranks = exploding.ranks
    assert exploding.returncode == 0, exploding.log[-3000:]
    assert set(ranks) == {0, 1}
    assert ranks[0]["failure"] is not None and ranks[0]["failed_at"] < 19
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
    assert ranks[0]["judged"] == ranks[1]["judged"]  # each rank judged its own loss at every step
    assert ranks[0]["losses"] != ranks[1]["losses"]  # on its own shard of the batch


def test_an_exploding_ddp_run_writes_one_report_from_the_lowest_failing_rank(exploding):
    out, ranks, stderr = exploding.out, exploding.ranks, exploding.stderr
    assert [ranks[0]["report_dir"], ranks[1]["report_dir"]] == [str(out / "nandoctor"), None]
    assert ranks[1]["stopped_by"] == 0
    probes = json.loads((out / "nandoctor" / "summary.json").read_text())["probes"]
    assert len(probes) == 1 and probes[0]["verdict"] == ranks[0]["failure"]
    assert stderr.count("Training stopped.") == 1 and stderr.count("nandoctor: watched ") == 1


def test_a_healthy_ddp_run_with_one_watch_off_trains_to_the_end_on_both_ranks(healthy_with_rank1_off):
    out, ranks = healthy_with_rank1_off.out, healthy_with_rank1_off.ranks
    assert healthy_with_rank1_off.returncode == 0, healthy_with_rank1_off.log[-3000:]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    assert ranks[0]["judged"] == [0, 1, 2, 3] and ranks[0]["failure"] is None and ranks[0]["off"] is None
    assert ranks[1]["judged"] == [] and "this rank's watch is off" in ranks[1]["off"]
    assert not (out / "nandoctor").exists()


def test_a_healthy_ddp_run_ends_with_one_summary_line_from_rank_0(healthy_with_rank1_off):
    stderr = healthy_with_rank1_off.stderr
    summary = [line for line in stderr.splitlines() if line.startswith("nandoctor: watched ")]
    assert len(summary) == 1 and "watched 4 steps of fp32/sdpa/off on 2 ranks: stable" in summary[0]
    assert stderr.count("nandoctor: watching ") == 1
