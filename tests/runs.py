"""Real runs that several test files read, each made once per session (pytest loads this module as a
plugin from conftest.py). A run costs a fresh interpreter, a warm worker and real probes: tests that
need the same run share it instead of repeating it. Readers never change a run directory in place;
a test that cuts or resumes a run works on its own copy."""

from __future__ import annotations

import pytest
from checkpoints import LARGE_MLP, save_llama
from conftest import run_cli


@pytest.fixture(scope="session")
def large_mlp_checkpoint(tmp_path_factory):
    """tiny-llama with layer 1's MLP scaled so its down_proj output passes fp16's 65504 in step 0."""
    return save_llama(tmp_path_factory.mktemp("large-mlp") / "ckpt", mlp_scale=LARGE_MLP)


@pytest.fixture(scope="session")
def large_mlp_grid(large_mlp_checkpoint, tmp_path_factory):
    """The large-MLP checkpoint in fp32, bf16-amp and fp16-amp with sdpa, 8 steps (plus the fp32/eager
    reference): fp16-amp overflows in step 0's forward and is replayed with hooks, the others train."""
    out = tmp_path_factory.mktemp("large-mlp-grid") / "run"
    proc = run_cli(
        "grid",
        "--model",
        large_mlp_checkpoint,
        "--axis",
        "dtype=fp32,bf16-amp,fp16-amp",
        "--axis",
        "attn=sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "8",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def fp32_check(tmp_path_factory):
    """`nandoctor check --dtype fp32 --attn eager` on tiny-llama, as a CI job runs it (with
    $GITHUB_STEP_SUMMARY set); returns (run directory, CompletedProcess, the step summary file)."""
    base = tmp_path_factory.mktemp("fp32-check")
    step_summary = base / "step_summary.md"
    proc = run_cli(
        "check",
        "--dtype",
        "fp32",
        "--attn",
        "eager",
        "--out",
        base / "run",
        env={"GITHUB_STEP_SUMMARY": str(step_summary)},
    )
    return base / "run", proc, step_summary


@pytest.fixture(scope="session")
def fp16_pure_bisect(tmp_path_factory):
    """`nandoctor bisect --bad attn=sdpa,dtype=fp16-pure` on tiny-llama, 3 steps, no reruns: fp16-pure's
    AdamW eps (0 in fp16) is the single culprit. Returns (run directory, CompletedProcess)."""
    out = tmp_path_factory.mktemp("fp16-pure-bisect") / "run"
    proc = run_cli(
        "bisect", "--bad", "attn=sdpa,dtype=fp16-pure", "--steps", "3", "--reruns", "0", "--jobs", "2", "--out", out,
        on_cpu=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


@pytest.fixture(scope="session")
def watch_fits(tmp_path_factory):
    """The watched 2-rank fits of tests/watch_fits.py (Lightning DDP and FSDP2, the transformers Trainer
    under DDP), all in one torchrun launch: {fit name: Fit}."""
    from watch_fits import launch

    return launch(tmp_path_factory.mktemp("watch-fits"))
