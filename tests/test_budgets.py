"""A probe's budgets follow one another: build_timeout_s for imports and the model build, then
timeout_s for the timed steps, counted from the end of the build (then the replay's own). A slow
build does not eat the steps' budget; a build that never ends is a timeout that says it was the build."""

import pytest
from checkpoints import save_custom_llama
from conftest import records, run_cli, summary

SLOW_BUILD_CODE = '''
import time
from transformers import LlamaConfig, LlamaForCausalLM


class SlowBuildLlamaConfig(LlamaConfig):
    model_type = "slowbuild-llama"


class SlowBuildLlamaForCausalLM(LlamaForCausalLM):
    """Modeling code with a slow build: the probe's build ends with model.train(), which here never
    returns under eager attention and takes 5 s more under sdpa; planning never calls it, and the
    training steps are ordinary."""
    config_class = SlowBuildLlamaConfig

    def train(self, mode=True):
        if mode and not getattr(self, "slept", False):
            self.slept = True
            time.sleep(3600 if self.config._attn_implementation == "eager" else 5)
        return super().train(mode)
'''


@pytest.mark.slow
def test_a_slow_build_keeps_the_steps_budget_and_a_build_that_never_ends_is_a_build_timeout(tmp_path):
    ckpt = save_custom_llama(tmp_path / "ckpt", "slow_build_llama", "SlowBuild", SLOW_BUILD_CODE)
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
        "compile=off",
        "--steps",
        "2",
        "--jobs",
        "2",
        "--set",
        "timeout_s=4",
        "--set",
        "build_timeout_s=12",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the hung build is a harness failure
    recs = records(out)
    got = {p["probe_id"]: p for p in summary(out)["probes"]}
    # its 5 s build is longer than the steps' 4 s budget: under one budget from spawn it would time out
    slow = recs["fp32/sdpa/off"]
    assert got["fp32/sdpa/off"]["verdict"] == "stable" and slow["build_s"] >= 5 > slow["timeout_s"] == 4
    assert len(slow["steps"]) == 2 and slow["timed_out_in"] is None
    hung = recs["fp32/eager/off"]
    assert got["fp32/eager/off"]["verdict"] == "timeout" and hung["timed_out_in"] == "build"
    assert "model not built within build_timeout_s=12" in got["fp32/eager/off"]["reason"]
    assert hung["steps"] == [] and 12 <= hung["wall_s"] < 3600  # killed by the runner, not ended by its sleep
