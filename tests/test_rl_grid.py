"""A GRPO grid end to end on tiny-llama: every probe samples completions through generate() with a KV
cache, trains on them through the probe's own loop, and records the rollout-training mismatch, which
orders fp32 < fp16-amp < bf16-amp with bf16 well above fp16 (docs/rl.md); report.md, report.html and
summary.json show it per probe."""

import json

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
        # auto on a CPU: generate() stands in for vLLM, and the record says so
        assert m["engine_why"] == "generate() stands in for vLLM: vLLM runs on a CUDA GPU; this probe runs on cpu"
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
    assert "Rollout engine: `generate`, attention sdpa (generate() stands in for vLLM: " in section
    for probe_id, r in records.items():
        row = next(line for line in section.splitlines() if line.startswith(f"| {probe_id} "))
        assert format(r["rollout_mismatch"]["logp_diff_mean"], ".2e") in row


def test_summary_json_carries_each_grpo_probes_mismatch_as_recorded(run):
    records, out = run
    probes = {p["probe_id"]: p for p in json.loads((out / "summary.json").read_text())["probes"]}
    for probe_id, r in records.items():
        assert probes[probe_id]["rollout_mismatch"] == r["rollout_mismatch"], probe_id


def test_report_html_shows_the_mismatch_per_cell_and_a_chart_along_the_completion(run):
    import xml.etree.ElementTree as ET

    records, out = run
    html = (out / "report.html").read_text()
    section = html.split("<h2>RL: rollout vs training log-probs</h2>")[1].split("<h2>")[0]
    for probe_id, r in records.items():
        row = next(tr for tr in section.split("<tr>") if f"<td>{probe_id}</td>" in tr)
        assert f"<td>{r['rollout_mismatch']['logp_diff_mean']:.2e}</td>" in row
    svg = ET.fromstring(section[section.index("<svg") : section.index("</svg>") + 6])
    ns = "{http://www.w3.org/2000/svg}"
    curves = {line.find(f"{ns}title").text: line.get("points").split() for line in svg.iter(f"{ns}polyline")}
    for probe_id, r in records.items():
        drawn = [y for y in r["rollout_mismatch"]["per_position"] if y > 0]  # log axis: a 0 is not drawn
        assert len(curves[probe_id]) == len(drawn) and len(drawn) > 1, probe_id


def test_an_fp32_lm_head_lowers_bf16s_mismatch(run, tmp_path):
    """rollout.lm_head_fp32 on bf16-amp, the same seed and steps as the module's run: measured on this
    CPU, mean |dlogp| 7.5e-4 -> 5.4e-4 and max 3.9e-3 -> 2.6e-3 (seeds 1 and 2: 6.1e-4 -> 5.7e-4,
    7.8e-4 -> 6.0e-4; the max 3.9e-3 -> 2.1e-3 and 4.0e-3 -> 2.4e-3). The head's rounding is part of
    bf16's mismatch, not all of it."""
    from conftest import run_cli

    records, _ = run
    out = tmp_path / "head"
    proc = run_cli(
        *("grid", "--objective", "grpo", "--axis", "dtype=bf16-amp", "--axis", "attn=sdpa", "--axis", "compile=off"),
        *("--steps", "2", "--set", "retime_rounds=0", "--set", "forensics_steps=0"),
        *("--set", "rollout.lm_head_fp32=true", "--out", out),
        on_cpu=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = next(r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines()) if "bf16" in r["probe_id"])
    bf16 = records["bf16-amp/sdpa/off"]["rollout_mismatch"]
    m = head["rollout_mismatch"]
    assert m["sequences"] == bf16["sequences"] and m["logp_diff_mean"] < bf16["logp_diff_mean"]
    assert m["logp_diff_max"] < bf16["logp_diff_max"]


def test_a_mixture_of_experts_records_where_rollout_and_training_route_apart(tmp_path):
    """Issue 47: for a mixture of experts, the share of completion tokens whose top-k experts differ between
    the rollout (KV-cache decode) and the training forward, per layer. On a random-init tiny Qwen3-MoE, fp32
    routes both paths alike; bf16-amp's figures are there for every layer, and report.md shows the column."""
    from checkpoints import tiny_qwen3_moe
    from conftest import run_cli

    ckpt = tmp_path / "moe"
    tiny_qwen3_moe().save_pretrained(ckpt)
    out = tmp_path / "run"
    proc = run_cli(
        "grid",
        *("--model", ckpt, "--objective", "grpo", "--axis", "dtype=fp32,bf16-amp", "--axis", "attn=sdpa"),
        *("--axis", "compile=off", "--steps", "2", "--set", "retime_rounds=0", "--set", "forensics_steps=0"),
        "--out",
        out,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    figures = {k: r["rollout_mismatch"]["expert_disagreement"] for k, r in records(out).items()}
    assert figures["fp32/sdpa/off"]["per_layer"] == [0.0, 0.0]
    bf16 = figures["bf16-amp/sdpa/off"]["per_layer"]
    assert len(bf16) == 2 and all(0.0 <= s <= 1.0 for s in bf16)
    assert "experts differ (worst layer)" in (out / "report.md").read_text()


def test_the_samplers_filters_alone_never_flip_a_verdict(run, tmp_path):
    """rollout.top_k=5 and rollout.top_p=0.9 choose other tokens, but both log-probs are taken before the
    filters: each cell's verdict is the module run's (fp32 and fp16-amp stable, bf16-amp off-policy)."""
    from conftest import run_cli

    default_records, default = run
    out = tmp_path / "filtered"
    proc = run_cli(
        *("grid", "--objective", "grpo", "--axis", "dtype=fp32,fp16-amp,bf16-amp", "--axis", "attn=sdpa"),
        *("--axis", "compile=off", "--steps", "2", "--set", "retime_rounds=0", "--set", "forensics_steps=0"),
        *("--set", "rollout.top_k=5", "--set", "rollout.top_p=0.9", "--out", out),
        on_cpu=True,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr

    def verdicts(folder):
        return {p["probe_id"]: p["verdict"] for p in json.loads((folder / "summary.json").read_text())["probes"]}

    filtered = records(out)
    assert verdicts(out) == verdicts(default) and set(CELLS) <= set(verdicts(out))
    assert verdicts(out)["bf16-amp/sdpa/off"] == "off-policy" and verdicts(out)["fp32/sdpa/off"] == "stable"
    for cell in CELLS:  # other tokens were sampled: the figures are the filtered run's own
        assert filtered[cell]["rollout_mismatch"] != default_records[cell]["rollout_mismatch"], cell
