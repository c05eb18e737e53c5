"""What a random-init twin cannot show, said where a user meets the verdict: a half-precision check on a
twin carries the caveat that trained activations are larger (check's output and the report), and the
families whose trained weights overflow fp16 (Gemma 3, Qwen3: public reports in knowledge/rules.yaml)
are a finding in doctor and grid for their recipes."""

import json

import pytest
from conftest import run_cli

FP16_ARGS = {"fp16": True, "bf16": False, "torch_compile": False}


@pytest.mark.slow  # a probe through the CLI
def test_a_half_precision_check_on_a_twin_says_what_the_twin_cannot_show(tmp_path):
    out = tmp_path / "check"
    proc = run_cli(
        "check", "--model", "tiny-llama", "--dtype", "bf16-amp", "--attn", "sdpa", "--steps", "1", "--out", out
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    note = next(x for x in proc.stdout.splitlines() if x.startswith("  note "))
    assert "(bf16-amp/sdpa/off) are measured on a random-init twin" in note and "65504" in note
    assert "Twin: the half-precision verdicts (bf16-amp/sdpa/off)" in (out / "report.md").read_text()


def test_doctor_names_the_fp16_overflow_of_gemma3_and_qwen3_recipes(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps(FP16_ARGS))

    def found(model):
        proc = run_cli("doctor", "--json", "--model", model, "--trainer-args", args)
        return {f["id"]: f for f in json.loads(proc.stdout)["findings"]}

    for model in ("gemma-3-4b", "qwen3-8b", "qwen3-30b-a3b"):
        finding = found(model)["fp16-overflow-on-trained-weights"]
        assert "65504" in finding["why"] and any("36822" in e for e in finding["evidence"]), model
    assert "fp16-overflow-on-trained-weights" not in found("llama-3.2-3b")
