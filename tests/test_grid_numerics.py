"""End to end through the CLI: real tiny models, real autocast / GradScaler / AdamW, real failures."""

import math
import re

import pytest
from conftest import record_list, records, strict_json, summary, verdicts

pytestmark = pytest.mark.slow  # end to end: real probe processes


@pytest.fixture(scope="module")
def precision_run(tmp_path_factory):
    """fp32, fp16-pure and bf16-pure on tiny-llama at a small learning rate."""
    from conftest import run_cli

    out = tmp_path_factory.mktemp("run") / "precision"
    proc = run_cli(
        "grid",
        "--axis",
        "dtype=fp32,fp16-pure,bf16-pure",
        "--axis",
        "attn=eager",
        "--axis",
        "compile=off",
        "--set",
        "optimizer.lr=2e-5",
        "--steps",
        "16",
        "--out",
        out,
    )
    assert proc.returncode == 0, (
        proc.stderr
    )  # 0: fp32 is stable, and the half cells' failures are verdicts, not crashes
    return out, proc


def test_fp16_pure_adamw_eps_1e8_is_nonfinite_at_step_1(precision_run):
    out, _ = precision_run
    probe = next(p for p in summary(out)["probes"] if p["probe_id"] == "fp16-pure/eager/off")
    # eps=1e-8 rounds to 0 in fp16, so AdamW divides by sqrt(v)=0 wherever v underflowed: inf weights
    assert probe["verdict"] == "nonfinite"
    assert probe["step"] == 1


def test_bf16_pure_at_small_lr_is_drift_not_stable(precision_run):
    out, _ = precision_run
    probe = next(p for p in summary(out)["probes"] if p["probe_id"] == "bf16-pure/eager/off")
    assert probe["verdict"] == "drift", probe["reason"]
    assert "fp32 reference" in probe["reason"]


def test_fp32_reference_is_stable_and_ranked_first(precision_run):
    out, proc = precision_run
    s = summary(out)
    assert s["ranking"] == ["fp32/eager/off"]
    assert s["recommended"] == "fp32/eager/off"
    assert proc.returncode == 0  # a stable config exists, nothing crashed: numeric failures are findings


def test_every_probe_is_in_results_jsonl_with_its_curve(precision_run):
    out, _ = precision_run
    records = record_list(out)
    assert {r["probe_id"] for r in records} == {"fp32/eager/off", "fp16-pure/eager/off", "bf16-pure/eager/off"}
    ref = next(r for r in records if r["probe_id"] == "fp32/eager/off")
    assert len(ref["steps"]) == 16
    assert all(set(s) >= {"loss", "grad_norm", "skipped", "scale", "time_s", "tokens_per_s"} for s in ref["steps"])
    assert ref["peak_memory_bytes"] > 0 and ref["env"]["torch"]
    fp16 = next(r for r in records if r["probe_id"] == "fp16-pure/eager/off")
    assert fp16["stopped_early"] and len(fp16["steps"]) == 2  # early exit at the first non-finite step


def test_every_json_file_of_a_nonfinite_run_is_strict(precision_run):
    """The fp16-pure probe's loss went non-finite in a real child: every JSON file of the run parses with
    a strict parser, the non-finite loss written as the string float() reads back."""
    out, _ = precision_run
    files = [p for p in out.rglob("*") if p.suffix in (".json", ".jsonl")]
    assert {"results.jsonl", "run.json", "summary.json"} <= {p.name for p in files}
    for path in files:
        for text in path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]:
            strict_json(text)
    fp16 = records(out)["fp16-pure/eager/off"]
    assert fp16["steps"][-1]["loss"] in ("NaN", "Infinity", "-Infinity") and not math.isfinite(
        float(fp16["steps"][-1]["loss"])
    )


def test_reports_are_written_and_agree(precision_run):
    out, _ = precision_run
    md = (out / "report.md").read_text()
    assert "Recommended: fp32/eager/off" in md and "architecture-twin" in md
    assert "| fp16-pure/eager/off | nonfinite" in md
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 6
    # self-contained: nothing is fetched (the rules' evidence may name public URLs as text)
    assert (
        "<script" not in html and "<link" not in html and not re.search(r"""(src\s*=\s*["']?|url\()\s*https?:""", html)
    )
    junit = (out / "junit.xml").read_text()
    assert 'tests="3"' in junit and 'failures="2"' in junit


def test_grid_report_has_the_doctor_section_for_its_cells(precision_run):
    out, _ = precision_run
    findings = {f["id"]: f["cells"] for f in summary(out)["doctor"]["findings"]}
    assert findings["fp16-adamw-eps-below-smallest-normal"] == ["fp16-pure/eager/off"]
    assert findings["bf16-weights-without-fp32-master"] == ["bf16-pure/eager/off"]
    md = (out / "report.md").read_text()
    assert "## Doctor" in md and "fp16-adamw-eps-below-smallest-normal" in md


def test_large_mlp_weights_overflow_fp16_amp_at_step_0(large_mlp_grid):
    v = verdicts(large_mlp_grid)
    assert v["fp16-amp/sdpa/off"] == "nonfinite"
    probe = next(p for p in summary(large_mlp_grid)["probes"] if p["probe_id"] == "fp16-amp/sdpa/off")
    assert probe["step"] == 0 and "loss" in probe["reason"]


def test_large_mlp_weights_stay_stable_in_bf16_amp_and_fp32(large_mlp_grid):
    v = verdicts(large_mlp_grid)
    assert v["bf16-amp/sdpa/off"] == "stable"
    assert v["fp32/sdpa/off"] == "stable"
    assert v["fp32/eager/off"] == "stable"  # the reference is always probed


def test_local_checkpoint_report_says_real_weights_were_used(large_mlp_grid):
    md = (large_mlp_grid / "report.md").read_text()
    assert "local-weights" in md and "real weights from" in md


def test_gpt2_runs_through_the_same_path(tmp_path, cli):
    out = tmp_path / "gpt2"
    proc = cli(
        "grid",
        "--model",
        "gpt2",
        "--scale",
        "probe",
        "--axis",
        "dtype=fp32",
        "--axis",
        "attn=eager,sdpa",
        "--axis",
        "compile=off",
        "--steps",
        "4",
        "--set",
        "retime_rounds=0",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = summary(out)
    assert s["model"]["model_type"] == "gpt2" and s["model"]["scale"] == "probe"
    assert s["model"]["shape"]["vocab"] == 50257
    assert {p["verdict"] for p in s["probes"]} == {"stable"}
