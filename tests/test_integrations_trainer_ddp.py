"""NandoctorCallback in a real 2-rank transformers Trainer run under DDP (torchrun, gloo, CPU) on the
tiny Llama: every rank judges the loss its own step trains on, the ranks stop together, one report.
The run is tests/watch_fits.py's, made once per session with the other watched 2-rank fits.

(On a CPU the Trainer runs `fsdp=...` as DDP: accelerate's MULTI_CPU wraps DistributedDataParallel and
is_fsdp_enabled stays False, so a Trainer FSDP2 run needs GPUs; the FSDP2 watch is tested under
Lightning, test_integrations_fsdp2.py.)"""

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exploding(watch_fits):
    """AdamW at lr=30 for up to 20 steps: the grad-norm explodes within a few steps on both ranks."""
    return watch_fits["trainer-ddp-lr30"]


def test_each_rank_judges_its_own_mean_token_loss_not_its_share_of_the_global_one(exploding):
    """With average_tokens_across_devices the model's output on each rank is its summed token loss over
    both ranks' tokens: about half the loss. The callback judges the loss the rank trains on (the
    Trainer multiplies by the process count), so a fresh model's step 0 sits near ln(vocab), and the
    'initial loss near ln(vocab)' check does not fail on every rank."""
    ranks = exploding.ranks
    assert exploding.returncode == 0, exploding.log[-3000:]
    assert ranks[0]["wrapped"] == ranks[1]["wrapped"] == "DistributedDataParallel" and ranks[0]["world_size"] == 2
    for r in (0, 1):
        assert abs(ranks[r]["losses"][0] - ranks[r]["ln_vocab"]) < 0.2, ranks[r]["losses"]
    assert ranks[0]["losses"][0] != ranks[1]["losses"][0]  # each rank's own shard of the batch
    assert "initial loss near ln(vocab)" not in exploding.stderr


def test_an_exploding_trainer_ddp_run_stops_both_ranks_at_the_same_step_with_one_report(exploding):
    out, ranks, stderr = exploding.out, exploding.ranks, exploding.stderr
    assert ranks[0]["failure"] == "diverged" and ranks[0]["failed_at"] < 19
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
    assert ranks[0]["judged"] == ranks[1]["judged"]
    assert [ranks[0]["report_dir"], ranks[1]["report_dir"]] == [str(out / "nandoctor"), None] and ranks[1][
        "stopped_by"
    ] == 0
    probes = json.loads((out / "nandoctor" / "summary.json").read_text())["probes"]
    assert len(probes) == 1 and probes[0]["verdict"] == "diverged"
    assert stderr.count("nandoctor: watching ") == 1 and "on 2 ranks" in stderr
    assert stderr.count("Training stopped.") == 1 and stderr.count("nandoctor: watched ") == 1
