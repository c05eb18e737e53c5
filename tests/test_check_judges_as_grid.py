"""`check` and `grid` give one verdict on one configuration: a check fails exactly where the grid's verdict
is a failure. The faulty setup: both MLPs' down_proj x1e5 (inputs x3e-3, so the forward fits fp16), whose
backward overflows fp16 at every scale from 65536 down to 2048, so fp16-amp's GradScaler skips every step
and the optimizer never steps; bf16-amp (8-bit exponent, no scaler) trains the same checkpoint."""

from __future__ import annotations

import json

import pytest
from checkpoints import save_llama
from conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    d = tmp_path_factory.mktemp("check-as-grid")
    ckpt = save_llama(d / "ckpt", mlp_scale={0: (3e-3, 1e5), 1: (3e-3, 1e5)})
    proc = run_cli(
        "grid",
        *("--model", ckpt, "--axis", "dtype=fp16-amp,bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off"),
        *("--steps", "2", "--set", "retime_rounds=0", "--out", d / "grid"),
    )
    probes = {p["probe_id"]: p for p in json.loads((d / "grid" / "summary.json").read_text())["probes"]}
    return ckpt, proc, probes, d


def check(ckpt, dtype, out):
    return run_cli("check", "--model", ckpt, "--dtype", dtype, "--steps", "2", "--out", out)


def test_a_gradscaler_that_skipped_every_step_fails_check_as_grid_calls_it_nonfinite(overflowing):
    ckpt, grid, probes, d = overflowing
    fp16 = probes["fp16-amp/sdpa/off"]
    assert fp16["verdict"] == "nonfinite", fp16["reason"]
    assert fp16["reason"].startswith("GradScaler skipped every one of the 2 steps")
    proc = check(ckpt, "fp16-amp", d / "check-fp16")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "check fp16-amp/sdpa/off on ckpt: FAIL" in proc.stdout
    assert f"FAIL verdict: nonfinite: {fp16['reason']}" in proc.stdout
    assert "FAIL no skipped step beyond GradScaler calibration: every one of the 2 steps skipped" in proc.stdout
    # a nan grad-norm is never called finite
    for line in proc.stdout.splitlines():
        assert not ("finite" in line.split(":")[0].replace("non-finite", "") and "nan" in line), line
    assert "step 0's overflowing gradients skipped by the GradScaler: grad-norm nan at scale 65536" in proc.stdout


def test_a_configuration_the_grid_calls_stable_passes_check(overflowing):
    ckpt, grid, probes, d = overflowing
    bf16 = probes["bf16-amp/sdpa/off"]
    assert bf16["verdict"] == "stable", bf16["reason"]
    proc = check(ckpt, "bf16-amp", d / "check-bf16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ok   verdict: stable: {bf16['reason']}" in proc.stdout
    assert "check bf16-amp/sdpa/off on ckpt: PASS" in proc.stdout
