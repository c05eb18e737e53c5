"""Parallel probes end to end: real 2-rank gloo probes of tiny-llama (CUDA hidden) for every parallel
row, the one-process probe of the same global batch as their exact reference, a reduction that sums
caught by the step-0 gradient agreement, and a rank that segfaults or hangs ending the probe as one
record with no process left behind."""

import re

import psutil
import pytest
from checkpoints import save_custom_llama
from conftest import records, run_cli, summary

pytestmark = pytest.mark.slow  # end to end: real probe processes, two ranks each

PARALLELS = ("ddp", "ddp-bf16-hook", "fsdp2", "fsdp2-reduce-low")

RANK_CRASHING_CODE = '''
import ctypes, time
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM


class RankCrashingLlamaConfig(LlamaConfig):
    model_type = "rankcrashing-llama"


class RankCrashingLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code that brings down rank 1 of a parallel probe: under eager attention it reads
    address 0 (a real SIGSEGV), under sdpa it sleeps forever; rank 0 and one-process probes train."""
    config_class = RankCrashingLlamaConfig

    def forward(self, *args, **kwargs):
        if dist.is_initialized() and dist.get_rank() == 1:
            if self.config._attn_implementation == "eager":
                ctypes.string_at(0)
            time.sleep(3600)
        return super().forward(*args, **kwargs)
'''


def probes(run_dir) -> dict:
    return {p["probe_id"]: p for p in summary(run_dir)["probes"]}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """fp32 and bf16-amp, each in one process and under every parallel row (eager attention, 3 steps)."""
    out = tmp_path_factory.mktemp("parallel") / "run"
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp32,bf16-amp",
        "--axis",
        "attn=eager",
        "--axis",
        "parallel=none," + ",".join(PARALLELS),
        "--steps",
        "3",
        "--world-size",
        "2",
        "--set",
        "forensics_steps=0",
        "--set",
        "retime_rounds=0",
        "--out",
        out,
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_every_parallel_row_trains_two_gloo_ranks_stably(grid):
    got = probes(grid)
    for dtype in ("fp32", "bf16-amp"):
        for parallel in PARALLELS:
            probe = got[f"{dtype}/eager/off/{parallel}"]
            expect = (
                "unsupported"
                if (dtype, parallel) in (("fp32", "ddp-bf16-hook"), ("fp32", "fsdp2-reduce-low"))
                else "stable"
            )
            assert probe["verdict"] == expect, (probe["probe_id"], probe["reason"])
            if expect == "stable":
                assert probe["parallel"]["world_size"] == 2 and probe["parallel"]["backend"] == "gloo"
                assert [r["exit"] for r in probe["parallel"]["ranks"]] == [0, 0]
                assert all(r["peak_memory_bytes"] > 0 for r in probe["parallel"]["ranks"])


def test_a_combination_that_makes_no_sense_is_unsupported_with_the_reason_and_never_spawned(grid):
    got, recs = probes(grid), records(grid)
    assert "bf16 compress hook" in got["fp32/eager/off/ddp-bf16-hook"]["reason"]
    assert "is fsdp2 there" in got["fp32/eager/off/fsdp2-reduce-low"]["reason"]
    assert recs["fp32/eager/off/ddp-bf16-hook"]["wall_s"] is None  # no process ran


def test_step0_gradients_match_the_one_process_gradient_of_the_same_batch(grid):
    for probe_id, record in records(grid).items():
        if record["status"] != "ok" or record["cell"].get("parallel") is None:
            continue
        got = record["parallel"]["grad_agreement"]
        assert abs(got["norm_ratio"] - 1) < 1e-3, probe_id
        # fp32 reduces exactly up to summation order; bf16 compute and reduction round at 2^-8
        assert got["max_rel_error"] < (1e-5 if record["cell"]["dtype"] == "fp32" else 0.05), (probe_id, got)


def test_master_weights_and_reduce_dtype_are_read_from_the_wrapped_model(grid):
    recs = records(grid)
    for dtype in ("fp32", "bf16-amp"):
        assert recs[f"{dtype}/eager/off/fsdp2"]["parallel"]["master_dtype"] == ["float32"]  # the fp32 shards
        assert recs[f"{dtype}/eager/off/fsdp2"]["parallel"]["reduce_dtype"] == ["float32"]
        assert recs[f"{dtype}/eager/off/ddp"]["parallel"]["reduce_dtype"] == ["float32"]
    assert recs["bf16-amp/eager/off/fsdp2-reduce-low"]["parallel"]["reduce_dtype"] == ["bfloat16"]
    assert recs["bf16-amp/eager/off/ddp-bf16-hook"]["parallel"]["reduce_dtype"] == ["bfloat16"]


def test_the_one_process_probe_is_the_exact_reference_and_the_report_shows_it(grid):
    got = probes(grid)
    assert got["fp32/eager/off/ddp"]["parallel"]["exact_fidelity"] < 1e-5  # same batch, same init, fp32
    assert got["bf16-amp/eager/off/fsdp2"]["parallel"]["exact_fidelity"] < 1e-3
    report = (grid / "report.md").read_text()
    section = report.split("## Parallel probes", 1)[1]
    assert "bf16-amp/eager/off/fsdp2-reduce-low" in section and "bfloat16" in section and "loss vs 1-process" in section


def test_a_reduction_that_sums_is_caught_by_the_gradient_agreement(tmp_path):
    """FSDP2 over gloo (pytorch#162338 reported it summing); grad_reduce=sum makes it sum for sure."""
    proc = run_cli(
        "check",
        "--dtype",
        "fp32",
        "--attn",
        "eager",
        "--parallel",
        "fsdp2",
        "--steps",
        "2",
        "--set",
        "grad_reduce=sum",
        "--set",
        "forensics_steps=0",
        "--out",
        tmp_path / "run",
        on_cpu=True,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "FAIL step-0 gradients match one process: gradients are 2.00x the single-process ones: "
        "the reduction sums instead of averaging (world size 2)" in proc.stdout
    )
    assert probes(tmp_path / "run")["fp32/eager/off/fsdp2"]["verdict"] == "grad-mismatch"


def _pids(run_dir, probe_id: str) -> list[int]:
    """The launcher's and the ranks' pids, as the launcher logged them."""
    from nandoctor.run.task import probe_dir

    line = re.search(
        r"nandoctor launch: pid (\d+), cpu ranks (.*)", (probe_dir(run_dir, probe_id) / "log.txt").read_text()
    )
    return [int(line.group(1))] + [int(p) for p in re.findall(r"=pid (\d+)", line.group(2))]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_rank_that_segfaults_or_hangs_ends_the_probe_as_one_record_with_no_process_left(tmp_path):
    ckpt = save_custom_llama(tmp_path / "ckpt", "rank_crashing_llama", "RankCrashing", RANK_CRASHING_CODE)
    out = tmp_path / "run"
    proc = run_cli(
        "grid",
        "--model",
        ckpt,
        "--trust-remote-code",
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager,sdpa",
        "--axis",
        "parallel=ddp",
        "--steps",
        "2",
        "--set",
        "timeout_s=6",
        "--set",
        "build_timeout_s=120",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
        on_cpu=True,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a crash and a timeout are harness failures
    recs, got = records(out), probes(out)
    assert len(recs) == 3  # the fp32/eager reference, and one record per parallel probe
    crashed = recs["fp32/eager/off/ddp"]
    assert got["fp32/eager/off/ddp"]["verdict"] == "crash"
    assert "SIGSEGV (segmentation fault) on rank 1 of 2" in got["fp32/eager/off/ddp"]["reason"]
    assert crashed["failed_rank"] == 1 and crashed["ranks"][1]["signal"] == "SIGSEGV"
    assert crashed["ranks"][0]["exit"] != 0  # killed by the launcher, or ended by its lost peer first
    assert "rank 1 ended (SIGSEGV)" in crashed["log_tail"]
    hung = recs["fp32/sdpa/off/ddp"]
    assert got["fp32/sdpa/off/ddp"]["verdict"] == "timeout" and hung["timed_out_in"] == "steps"
    for probe_id in ("fp32/eager/off/ddp", "fp32/sdpa/off/ddp"):
        assert all(_gone(pid) for pid in _pids(out, probe_id)), probe_id
