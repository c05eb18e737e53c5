"""A GRPO grid end to end on tiny-llama: every probe samples completions through generate() with a KV
cache, trains on them through the probe's own loop, and records the rollout-training mismatch, which
orders fp32 < fp16-amp < bf16-amp with bf16 well above fp16 (docs/rl.md)."""

import pytest
from conftest import records

pytestmark = pytest.mark.slow  # end to end: real probe processes

CELLS = ("fp32/sdpa/off", "fp16-amp/sdpa/off", "bf16-amp/sdpa/off")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import run_cli

    out = tmp_path_factory.mktemp("rl") / "run"
    proc = run_cli(
        "grid",
        "--objective",
        "grpo",
        "--axis",
        "dtype=fp32,fp16-amp,bf16-amp",
        "--axis",
        "attn=sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "2",
        "--set",
        "retime_rounds=0",
        "--set",
        "forensics_steps=0",
        "--out",
        out,
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return records(out), out


def test_every_grpo_probe_records_the_mismatch_of_its_rollouts(run):
    records, _ = run
    assert set(CELLS) <= set(records)
    for probe_id, r in records.items():
        m = r["rollout_mismatch"]
        assert r["status"] == "ok" and m["engine"] == "generate" and m["steps"] == 2, probe_id
        assert m["sequences"] == 2 * 2 * 4 and m["tokens"] > 0  # 2 steps x 2 prompts x 4 generations
        assert m["ratio"]["min"] <= m["ratio"]["p10"] <= m["ratio"]["median"] <= m["ratio"]["p90"] <= m["ratio"]["max"]
        assert m["masked_share"] == 0.0 and m["k3_kl"] >= 0.0
        for step in r["steps"]:
            assert 0.0 <= step["reward"] <= 1.0 and step["entropy"] > 0 and step["batch"] == "rollout"


def test_bf16_rollouts_are_further_from_training_than_fp16_which_are_further_than_fp32(run):
    records, _ = run
    fp32, fp16, bf16 = (records[c]["rollout_mismatch"]["logp_diff_mean"] for c in CELLS)
    assert fp32 < 1e-6 < fp16 < bf16
    assert bf16 >= 3 * fp16, (fp16, bf16)


def test_the_fp16_grpo_step_goes_through_the_grad_scaler(run):
    records, _ = run
    assert all(s["scale"] for s in records["fp16-amp/sdpa/off"]["steps"])
    assert all(s["scale"] is None for s in records["bf16-amp/sdpa/off"]["steps"])


def test_report_md_shows_each_probes_mismatch_as_measured(run):
    records, out = run
    report = (out / "report.md").read_text()
    section = report.split("## RL: rollout vs training log-probs")[1].split("\n## ")[0]
    assert "`generate`" in section
    for probe_id, r in records.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {probe_id} "))
        assert format(r["rollout_mismatch"]["logp_diff_mean"], ".2e") in row
