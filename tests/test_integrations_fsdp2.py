"""NandoctorCallback in a real 2-rank Lightning FSDP2 fit (ModelParallelStrategy with fully_shard per
decoder layer, torchrun, gloo, CPU) on the tiny Llama: every rank judges its own shards, the ranks stop
together, one report; a rank whose watch is off leaves the run training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent


def fsdp2_fit(out: Path, lr: float, steps: int, off_rank: int | None = None):
    """torchrun of tests/fsdp2_watch_fit.py with 2 ranks; returns (the finished process, {rank: its record})."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TESTS / "fsdp2_watch_fit.py"),
        str(out),
        str(lr),
        str(steps),
    ] + ([str(off_rank)] if off_rank is not None else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    return done, {
        r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()
    }


def test_an_exploding_fsdp2_run_is_judged_on_every_rank_and_stops_them_together_with_one_report(tmp_path):
    done, ranks = fsdp2_fit(tmp_path, 30.0, 20)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == ["DTensor"]  # the watch saw FSDP2's sharded parameters
    assert ranks[0]["failure"] is not None and ranks[0]["failed_at"] < 19
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
    assert ranks[0]["judged"] == ranks[1]["judged"]
    assert (
        ranks[0]["losses"] != ranks[1]["losses"] and ranks[0]["grad_norms"] != ranks[1]["grad_norms"]
    )  # its own rows, its own shards
    assert [ranks[0]["report_dir"], ranks[1]["report_dir"]] == [str(tmp_path / "nandoctor"), None]
    probes = json.loads((tmp_path / "nandoctor" / "summary.json").read_text())["probes"]
    assert len(probes) == 1 and probes[0]["verdict"] == ranks[0]["failure"]
    assert done.stderr.count("Training stopped.") == 1 and done.stderr.count("nandoctor: watched ") == 1


def test_a_rank_whose_watch_is_off_leaves_an_fsdp2_run_training_and_stops_with_the_others(tmp_path):
    """Reading the whole gradient's norm of a DTensor is a collective: a rank whose watch is off never
    joins it (this run aborted with a gloo collective mismatch before the watch read shards)."""
    done, ranks = fsdp2_fit(tmp_path, 30.0, 20, off_rank=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ranks[1]["judged"] == [] and "this rank's watch is off" in ranks[1]["off"]
    assert ranks[0]["failure"] is not None and ranks[1]["stopped_by"] == 0
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["failed_at"] + 1
