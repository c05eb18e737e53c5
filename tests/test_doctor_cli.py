"""`nandoctor doctor` end to end, and a real crash diagnosed in report.md."""

import json

import pytest
from checkpoints import save_llama, save_tokenizer
from conftest import summary

from nandoctor.doctor import exit_code, run_doctor
from nandoctor.errors import NandoctorError
from nandoctor.recipes import resolve_model
from nandoctor.report.doctor import render_doctor_text

FP16_ARGS = {"fp16": True, "bf16": False, "adam_epsilon": 1e-8, "logging_nan_inf_filter": False, "torch_compile": False}


@pytest.mark.slow
def test_doctor_reports_this_machine_cleanly(cli):
    """On a CPU-only machine: no NVML, CPU SDPA backends, no findings. On a GPU host: the GPU facts."""
    proc = cli("doctor", "--json")
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert proc.returncode == exit_code(report), proc.stderr  # 1 only for a setup finding of severity error
    env = report["environment"]
    assert set(env["packages"]) == {"flash_attn", "transformer_engine", "torchao", "bitsandbytes", "schedulefree"}
    assert env["cpu_count"] >= 1 and env["ram_bytes"] > 0
    if env["gpus"]:
        gpu = env["gpus"][0]
        assert env["device"] == "cuda" and env["cuda"] and gpu["memory_bytes"] > 0 and gpu["name"]
        rows = report["capabilities"]
        assert len(rows) == len(env["gpus"]) and rows[0]["capability"] == gpu["capability"]
        assert rows[0]["native"]["fp32"] is True and rows[0]["architecture"]
        assert report["sdpa_backends"]["math"] is True
        assert report["sdpa_backends"]["flash"] == (float(gpu["capability"]) >= 8.0 and env["flash_sdpa"] is not False)
        return
    assert proc.returncode == 0, proc.stderr
    assert env["nvml"]["available"] is False and env["nvml"]["reason"]
    assert report["sdpa_backends"] == {"math": True, "flash": True, "efficient": False, "cudnn": False}
    assert report["capabilities"] == [] and report["findings"] == []
    text = render_doctor_text(report)
    assert "NVML" in text and "not available" in text and "Findings: 0 (no known issue applies)" in text


@pytest.mark.slow
def test_trainer_args_fp16_with_a_bf16_loaded_model_is_an_error(cli, tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps(FP16_ARGS))
    proc = cli("doctor", "--json", "--model", "tiny-llama", "--set", "model.dtype_on_load=bf16", "--trainer-args", args)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["setup"]["cells"] == ["fp16-amp/sdpa/off"]
    assert report["findings"][0]["id"] == "bf16-weights-with-fp16-grad-scaler"
    assert "https://github.com/pytorch/pytorch/issues/127176" in report["findings"][0]["evidence"]


def test_trainer_args_fp16_with_an_fp32_loaded_model_is_clean(tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps(FP16_ARGS))
    report = run_doctor(resolve_model("tiny-llama"), str(args))
    assert report["findings"] == [] and exit_code(report) == 0


def test_checkpoint_tokenizer_with_pad_id_0_is_found(tmp_path):
    ckpt = save_tokenizer(save_llama(tmp_path / "ckpt", vocab_size=10), pad_token="!")
    report = run_doctor(resolve_model(str(ckpt)), axes={"dtype": ["fp32"], "attn": ["sdpa"]})
    assert report["setup"]["tokenizer"] == str(ckpt)
    assert [f["id"] for f in report["findings"]] == ["pad-token-is-id-0"]
    assert exit_code(report) == 0  # a warning, not an error


def test_bad_trainer_args_file_is_a_user_error(tmp_path):
    bad = tmp_path / "args.json"
    bad.write_text("{not json")
    with pytest.raises(NandoctorError, match="not valid JSON"):
        run_doctor(None, str(bad))


@pytest.mark.slow
def test_fp16_weights_crash_carries_its_diagnosis_into_report_md(cli, tmp_path):
    out = tmp_path / "run"
    proc = cli("check", "--dtype", "fp16-amp", "--attn", "eager", "--set", "model.dtype_on_load=fp16", "--out", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a real crash inside GradScaler.unscale_
    (probe,) = summary(out)["probes"]
    assert probe["verdict"] == "crash"
    assert probe["reason"].startswith("ValueError: Attempting to unscale FP16 gradients.")
    md = (out / "report.md").read_text()
    assert "known issue unscale-fp16-gradients" in md and "Fix: load the model in fp32 for fp16-amp" in md
    # the doctor section predicted it before the probe ran
    assert "## Doctor" in md and "fp16-weights-with-grad-scaler" in md
    findings = {f["id"]: f for f in summary(out)["doctor"]["findings"]}
    assert findings["fp16-weights-with-grad-scaler"]["cells"] == ["fp16-amp/eager/off"]
    assert "fp16-weights-with-grad-scaler" in (out / "report.html").read_text()
