"""bisect --objective grpo names the precision factor: bf16-amp's rollouts are off-policy (their mean
|dlogp| bounds a 4096-token completion's importance ratio beyond TRL's cap, Thresholds.off_policy) where
fp16-amp's, with the attention and compile pinned alike, are not. End to end through the CLI on
tiny-llama: real probes that sample with generate() and train GRPO steps, fp16 emulated on a CPU (kept to
2 steps of the default 2 prompts x 4 generations x 16 tokens)."""

import json

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow  # end to end: real probe processes


def test_bisect_names_dtype_for_bf16_rollouts_against_an_fp16_baseline(tmp_path):
    out = tmp_path / "bisect"
    proc = run_cli(
        "bisect",
        "--objective",
        "grpo",
        "--bad",
        "dtype=bf16-amp,attn=sdpa,compile=off",
        "--good",
        "dtype=fp16-amp,attn=sdpa,compile=off",
        "--steps",
        "2",
        "--reruns",
        "0",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "bisect.json").read_text())
    verdicts = {step["outcome"]: step["verdicts"] for step in result["path"]}
    assert result["status"] == "bisected" and [c["factors"] for c in result["culprits"]] == [["dtype"]]
    assert verdicts == {"fail": ["off-policy"], "pass": ["stable"]}
    assert result["recommended"]["dtype"] == "fp16-amp"
    assert "Culprit (single factor): dtype=bf16-amp -> off-policy" in proc.stdout
