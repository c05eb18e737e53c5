"""Issue 47's compile cause shown a configuration it fails and one it passes: the rollout engine never
compiles, so a trainer compiled with inductor scores the rollout's tokens with other kernels. With the
eager attention kernel on both paths (rollout.attn=eager), bf16-amp uncompiled scores them bit for bit
on this CPU (mean |dlogp| 0.0); inductor's fused kernels, which keep their intermediates in fp32 where
the eager ops round each to bf16, put it at 8.0e-4, past the off-policy bound (docs/rl.md). One bisection
between the two cells, one inductor compile (seconds once inductor's cache under the nandoctor cache
directory holds its graphs)."""

import pytest
from conftest import assert_only_bad_is_off_policy, cpu_bisect

pytestmark = pytest.mark.slow  # real models sample and score; the bisection spawns probe processes

GOOD, BAD = "bf16-amp/eager/off", "bf16-amp/eager/inductor"


@pytest.fixture(scope="module")
def bisected(tmp_path_factory):
    """bisect --objective grpo from bf16-amp/eager/off to bf16-amp/eager/inductor against an eager
    engine: (the finished process, bisect.json, {probe_id: record}, {probe_id: summary probe})."""
    return cpu_bisect(
        tmp_path_factory.mktemp("rl-compile") / "bisect",
        *("--objective", "grpo", "--steps", "2", "--set", "forensics_steps=0", "--set", "rollout.attn=eager"),
        *("--good", "dtype=bf16-amp,attn=eager,compile=off", "--bad", "dtype=bf16-amp,attn=eager,compile=inductor"),
        *("--reruns", "0"),
    )


def test_an_inductor_compiled_trainer_is_off_policy_where_the_uncompiled_one_is_not(bisected):
    """The same tokens, sampled by the same eager engine: only the trainer's compile differs, and the
    compiled one's figure is past the bound the verdict names, the uncompiled one's inside it."""
    _, _, records, probes = bisected
    compiled, eager = records[BAD], records[GOOD]
    assert compiled["compile_s"] is not None and eager["compile_s"] is None
    assert_only_bad_is_off_policy(records, probes, GOOD, BAD, "eager")


def test_bisect_names_compile_when_only_the_trainer_is_compiled(bisected):
    proc, result, _, _ = bisected
    verdicts = {step["outcome"]: step["verdicts"] for step in result["path"]}
    assert result["status"] == "bisected" and [c["factors"] for c in result["culprits"]] == [["compile"]]
    assert verdicts == {"fail": ["off-policy"], "pass": ["stable"]}
    assert "Culprit (single factor): compile=inductor -> off-policy" in proc.stdout
