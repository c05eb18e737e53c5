"""NandoctorCallback in a real 2-rank Lightning FSDP2 fit (ModelParallelStrategy with fully_shard per
decoder layer, torchrun, gloo, CPU) on the tiny Llama: every rank judges its own shards, the ranks stop
together, one report; a rank whose watch is off leaves the run training. The fits are
tests/watch_fits.py's, made once per session with the other watched 2-rank fits."""

import json

import pytest

pytestmark = pytest.mark.slow


def test_an_exploding_fsdp2_run_is_judged_on_every_rank_and_stops_them_together_with_one_report(watch_fits):
    fit = watch_fits["fsdp2-lr30"]  # AdamW at lr=30 for up to 20 steps
    ranks = fit.ranks
    assert fit.returncode == 0, fit.log[-3000:]
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == ["DTensor"]  # the watch saw FSDP2's sharded parameters
    assert ranks[0]["failure"] is not None and ranks[0]["failed_at"] < 19
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
    assert ranks[0]["judged"] == ranks[1]["judged"]
    assert (
        ranks[0]["losses"] != ranks[1]["losses"] and ranks[0]["grad_norms"] != ranks[1]["grad_norms"]
    )  # its own rows, its own shards
    assert [ranks[0]["report_dir"], ranks[1]["report_dir"]] == [str(fit.out / "nandoctor"), None]
    probes = json.loads((fit.out / "nandoctor" / "summary.json").read_text())["probes"]
    assert len(probes) == 1 and probes[0]["verdict"] == ranks[0]["failure"]
    assert fit.stderr.count("Training stopped.") == 1 and fit.stderr.count("nandoctor: watched ") == 1


def test_a_rank_whose_watch_is_off_leaves_an_fsdp2_run_training_and_stops_with_the_others(watch_fits):
    """Reading the whole gradient's norm of a DTensor is a collective: a rank whose watch is off never
    joins it (this run aborted with a gloo collective mismatch before the watch read shards)."""
    fit = watch_fits["fsdp2-lr30-rank1-off"]  # the same, with rank 1's watch switched off before training
    ranks = fit.ranks
    assert fit.returncode == 0, fit.log[-3000:]
    assert ranks[1]["judged"] == [] and "this rank's watch is off" in ranks[1]["off"]
    assert ranks[0]["failure"] is not None and ranks[1]["stopped_by"] == 0
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
